#!/usr/bin/env bash
# The GPU benchmarks in one go (about 7 minutes on one CUDA device), each part time-boxed:
#   (0)   the fast paths against a float64 reference on the device (check_device.py), and the
#         trainer end to end there: train with TBPTT, checkpoint, resume, generate
#   (i)   executor calibration: dense (whole, and in row panels) vs chunked/C vs the official
#         masked form, alternating in one process (bench_calibration.py; CUDA keeps no panels
#         until this measures them); the mixer's hand-written backward vs autograd,
#         with and without alibi's decay (bench_chunked_backward.py); heads-major projections
#         vs the contiguous layout (bench_layout.py); then bdh-train ('auto') vs the official
#         model with memory (bench_official.py)
#   (ii)  compiled (compile_layers / torch.compile) vs eager
#   (iii) bf16 autocast
#   (iv)  generation: the fast decoder vs the generic recurrent step (bench_generate.py)
# Usage: benchmarks/gpu.sh OUT_DIR         (or OUT=DIR benchmarks/gpu.sh)
#        benchmarks/gpu.sh --smoke OUT_DIR   (or BDH_GPU_SMOKE=1): tiny sizes on the CPU, to
#        check the script end to end on a machine without a GPU.
# Needs only python3 (or .venv/bin/python, or $PYTHON) with torch and the package's
# dependencies; src/ is put on PYTHONPATH, so the package need not be installed.
# The tables go to stdout and to OUT_DIR/gpu-bench-<UTC time>.txt.
set -u -o pipefail

smoke=${BDH_GPU_SMOKE:-0}
out_dir=${OUT:-}
for arg in "$@"; do
    case "$arg" in
        --smoke) smoke=1 ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        -*) echo "error: unknown option $arg (expected --smoke or an output directory)" >&2; exit 2 ;;
        *) out_dir=$arg ;;
    esac
done

repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo" || exit 2
if [ -z "$out_dir" ]; then
    echo "error: no output directory: give it as the first argument or in \$OUT" >&2
    exit 2
fi
python=${PYTHON:-}
if [ -z "$python" ]; then
    if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

if ! mkdir -p "$out_dir"; then
    echo "error: cannot create the output directory $out_dir" >&2
    exit 2
fi
out_file="$out_dir/gpu-bench-$(date -u +%Y%m%dT%H%M%SZ).txt"

if [ "$smoke" = 1 ]; then
    device=cpu
    grid=(--configs a --grid 64x2 --steps 1)
    calibration=(--device cpu --rounds 1 a:128:2:naive,dense,dense/32,chunked/64)
    mixer=(--device cpu --rounds 1)
    layout=(--device cpu --grid a:64x2 --rounds 1)
    compile_grid=()
    gen=(--device cpu --tokens 80 --generic-tokens 80 --batch-tokens 8)
    part_s=${BDH_GPU_SMOKE_LIMIT:-240}
else
    if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
        echo "error: no CUDA device: torch.cuda.is_available() is False on this machine" \
            "(torch $("$python" -c 'import torch; print(torch.__version__)' 2>/dev/null))." \
            "Run benchmarks/gpu.sh --smoke (or BDH_GPU_SMOKE=1) for a tiny CPU run." >&2
        exit 2
    fi
    device=cuda
    if ! missing=$("$python" -c 'import bdh_train.trainer' 2>&1 | tail -1); then
        echo "error: the package does not import with $python: $missing. Install its" \
            "dependencies (pip install -e .), or carry the missing ones as wheels." >&2
        exit 2
    fi
    grid=(--configs a,b --grid 512x8,2048x8,8192x4 --steps 3)
    calibration=(--device cuda --rounds 3)
    mixer=(--device cuda --rounds 4)
    layout=(--device cuda --grid a:2048x8,b:512x4 --rounds 3)
    compile_grid=(--grid 2048x8)  # one shape: each new shape compiles again
    gen=(--device cuda --generic-tokens 1088 --batch-tokens 512)
    part_s=0  # each part's own limit below
fi

failures=0
# part TITLE SECONDS COMMAND...: run COMMAND under `timeout`, its output to stdout and the file
part() {
    local title=$1 limit=$2
    shift 2
    [ "$part_s" -gt 0 ] && limit=$part_s
    {
        echo
        echo "=== $title (limit ${limit} s): $*"
    } | tee -a "$out_file"
    local started=$SECONDS
    timeout --kill-after=15 "$limit" "$@" 2>&1 | tee -a "$out_file"
    local rc=${PIPESTATUS[0]}
    local took=$((SECONDS - started))
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        echo "=== $title: TIMED OUT after ${limit} s" | tee -a "$out_file"
        failures=$((failures + 1))
    elif [ "$rc" != 0 ]; then
        echo "=== $title: FAILED (exit $rc) after ${took} s" | tee -a "$out_file"
        failures=$((failures + 1))
    else
        echo "=== $title: done in ${took} s" | tee -a "$out_file"
    fi
}

bench=(benchmarks/bench_official.py --device "$device" "${grid[@]}")
{
    echo "benchmarks/gpu.sh $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    [ "$smoke" = 1 ] && echo "SMOKE RUN: tiny sizes on the CPU; the figures mean nothing"
} | tee "$out_file"

# limits add up to 590 s; memory (fresh processes) only at T=2048 B=8
part "(0) fast paths vs float64 on the device" 60 "$python" benchmarks/check_device.py \
    --device "$device"
run_dir=$(mktemp -d)
trap 'rm -rf "$run_dir"' EXIT
# One command line for `timeout`: the paths hold no spaces (mktemp, the interpreter's path).
cli="$python -m bdh_train"
train="train --run-dir $run_dir/run --set training.device=$device"
for setting in block_size=128 batch_size=8 tbptt_chunk_size=48 log_every=10 eval_every=20 \
    checkpoint_every=20; do
    train="$train --set training.$setting"
done
part "(0) the trainer on the device" 90 bash -c "set -e
    $cli $train --set training.max_steps=20
    $cli $train --resume --set training.max_steps=40
    $cli generate --checkpoint $run_dir/run --prompt 'The ' --max-new-tokens 64"
part "(i) executor calibration" 100 "$python" benchmarks/bench_calibration.py "${calibration[@]}"
part "(i) the mixer's backward" 30 "$python" benchmarks/bench_chunked_backward.py "${mixer[@]}"
part "(i) heads-major vs contiguous" 30 "$python" benchmarks/bench_layout.py "${layout[@]}"
part "(i) bdh-train auto vs official" 100 "$python" "${bench[@]}" --executor auto \
    --memory 2048x8
part "(ii) compiled" 100 "$python" "${bench[@]}" --configs a "${compile_grid[@]}" --compile layer \
    --memory none
part "(iii) bf16 autocast" 40 "$python" "${bench[@]}" --dtype bf16 --memory none
part "(iv) generation" 40 "$python" benchmarks/bench_generate.py "${gen[@]}"

echo | tee -a "$out_file"
echo "gpu.sh: $failures part(s) failed or timed out; output in $out_file" | tee -a "$out_file"
[ "$failures" = 0 ]
