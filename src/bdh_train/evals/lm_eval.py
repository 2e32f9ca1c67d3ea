"""The lm-evaluation-harness backend: model `bdh` (`pip install bdh-train[eval]`).

    python -m bdh_train.evals.lm_eval --model bdh --model_args checkpoint=RUN --tasks wikitext

runs lm-eval's own command line with `bdh` registered (lm-eval 0.4 finds models only in its
own registry and loads no plugins, so a plain `lm_eval --model bdh` does not know it). From
Python, importing this module registers it for `lm_eval.simple_evaluate(model="bdh",
model_args="checkpoint=RUN")`, or pass a `BDHLM` instance as the model. Nothing else in the
package imports this module, so lm-eval is needed only here.

model_args: `checkpoint` (a run directory, checkpoint or ternary export: `load_run`),
`device` ('auto', 'cpu', 'cuda', 'cuda:N'; lm-eval's default cuda:0 is 'auto' where there is
no such GPU), `batch_size` (rows scored together), `rolling` ('state' or
'windows', below), `max_length` (the disjoint windows' length, a positive integer; default:
the run's training.block_size), `max_gen_toks` (default of generate_until). A `batch_size` or
`device` in model_args wins over lm-eval's own --batch_size and --device.

`loglikelihood_rolling` with rolling='state' (the default) reads each document once with the
state carried from chunk to chunk: a document of any length costs O(length) and every token
is predicted from the whole document before it. rolling='windows' is lm-eval's usual
reading, disjoint windows of `max_length` tokens each read from a fresh state (what a model
with a context of that length sees), so the two can be compared. A document is predicted
after the token that parts documents in training (the end-of-document id, else a newline:
`document_separator`), which is also the context of a request whose context is empty.
Requests are scored in batches, longest first, padded on the right (`evals.scoring`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import lm_eval.models  # noqa: F401 (lm-eval's own models: its registry must not start empty)
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import model_registry
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string

from bdh_train.data.encode import document_separator
from bdh_train.data.tokenizer import Tokenizer
from bdh_train.errors import BDHTrainError, ConfigError, DataError
from bdh_train.evals.scoring import score_continuations, text_model
from bdh_train.model.bdh import BDH
from bdh_train.model.sampling import stream_generate_batch
from bdh_train.model.summary import SummaryEvents
from bdh_train.shared.loading import encode_text, load_run

MODEL_NAME = "bdh"
ROLLING_MODES = ("state", "windows")
"""How loglikelihood_rolling reads a long document: with the state carried through all of it,
or in lm-eval's disjoint windows of max_length tokens."""
DEFAULT_BATCH_SIZE = 16
DEFAULT_MAX_GEN_TOKS = 256


class BDHLM(TemplateLM):
    """A bdh-train model for lm-evaluation-harness: loglikelihood, loglikelihood_rolling
    (state carried, or disjoint windows) and generate_until (greedy unless do_sample)."""

    def __init__(
        self,
        checkpoint: str | None = None,
        device: str | None = None,
        batch_size: int | str | None = None,
        rolling: str = "state",
        max_length: int | None = None,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        model: BDH | None = None,
        tokenizer: Tokenizer | None = None,
        summary_events: SummaryEvents | None = None,
        **unused: Any,
    ) -> None:
        super().__init__()
        max_length = None if max_length is None else _whole("max_length", max_length, 1)
        max_gen_toks = _whole("max_gen_toks", max_gen_toks, 0)
        unknown = sorted(k for k, v in unused.items() if v is not None and k != "max_batch_size")
        if unknown:
            raise ConfigError(
                f"model_args {unknown} are not options of the bdh model; it takes checkpoint, "
                "device, batch_size, rolling, max_length, max_gen_toks"
            )
        if rolling not in ROLLING_MODES:
            raise ConfigError(f"rolling must be one of {ROLLING_MODES}, got {rolling!r}")
        if (checkpoint is None) == (model is None):
            raise ConfigError("give the bdh model either checkpoint=RUN or a loaded model")
        self._batch_size = _batch_size(batch_size)
        if model is None:
            assert checkpoint is not None
            model, tokenizer, cfg = load_run(checkpoint, _device(device), finite=True)
            if max_length is None:
                max_length = cfg.training.block_size
            if model.config.summary_memory.write_gate:
                summary_events = cfg.data.summary_trigger()
        self.model = model.eval()
        self.tok = text_model(model, tokenizer, checkpoint or "the model")
        self.separator = [int(i) for i in document_separator(self.tok)]
        if rolling == "windows" and max_length is None:
            raise ConfigError("rolling='windows' needs max_length (the windows' length)")
        self.rolling = rolling
        self._max_length = max_length
        self.max_gen_toks = max_gen_toks
        self.events = summary_events
        self.checkpoint = checkpoint

    # ---------------------------------------------------------------- what lm-eval asks
    @classmethod
    def create_from_arg_string(
        cls, arg_string: str, additional_config: dict[str, Any] | None = None
    ) -> BDHLM:
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(
        cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None
    ) -> BDHLM:
        """The model of `arg_dict` (model_args); lm-eval's additions (its batch_size,
        max_batch_size and device, defaults included) fill only what model_args leave out."""
        added = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**{**added, **arg_dict})

    @property
    def eot_token_id(self) -> int:
        return self.separator[-1]

    @property
    def max_length(self) -> int:
        """The disjoint windows' length (rolling='windows'); 0 when none was given."""
        return int(self._max_length or 0)

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return self.model.embed.weight.device

    @property
    def tokenizer_name(self) -> str:
        return f"{self.tok.kind}-{self.tok.fingerprint()[:12]}"

    def get_model_info(self) -> dict[str, Any]:
        return {"checkpoint": self.checkpoint, "rolling": self.rolling}

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kw) -> list[int]:
        return encode_text(self.tok, string, "an lm-eval request")

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tok.decode(list(tokens))

    # ---------------------------------------------------------------- scoring
    def _score(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        return score_continuations(self.model, pairs, self.batch_size, self.events)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kw):
        results = self._score([(list(ctx), list(cont)) for _, ctx, cont in requests])
        for (key, _, _), result in zip(requests, results, strict=True):
            self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        _refuse_empty_tasks(requests)
        pairs: list[tuple[list[int], list[int]]] = []
        owner: list[int] = []
        for index, (string,) in enumerate(req.args for req in requests):
            tokens = self.tok_encode(string)
            if self.rolling == "state":
                windows = [(self.separator, tokens)] if tokens else []
            else:
                rolled = get_rolling_token_windows(tokens, self.eot_token_id, self.max_length, 1)
                windows = [make_disjoint_window(w) for w in rolled]
            pairs.extend(windows)
            owner.extend([index] * len(windows))
        totals = [0.0] * len(requests)
        for index, (log_prob, _) in zip(owner, self._score(pairs), strict=True):
            totals[index] += log_prob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ---------------------------------------------------------------- generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = [""] * len(requests)
        groups: dict[str, list[int]] = {}
        for index, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(index)
        for indices in groups.values():
            kwargs = dict(requests[indices[0]].args[1])
            indices.sort(key=lambda i: -len(requests[i].args[0]))
            for first in range(0, len(indices), self.batch_size):
                batch = indices[first : first + self.batch_size]
                texts = self._generate([requests[i].args[0] for i in batch], kwargs)
                for i, text in zip(batch, texts, strict=True):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out

    def _generate(self, contexts: Sequence[str], kwargs: dict[str, Any]) -> list[str]:
        """Each context continued until one of kwargs['until'] appears (the text before it),
        the end-of-document id, or max_gen_toks tokens."""
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        limit = _whole("the task's max_gen_toks", kwargs.get("max_gen_toks", self.max_gen_toks), 0)
        sample = bool(kwargs.get("do_sample", False))
        temperature = (
            _number("the task's temperature", kwargs.get("temperature", 1.0), 0.0)
            if sample
            else 0.0
        )
        prompts = [self.tok_encode(c) or self.separator for c in contexts]
        stops = [] if self.tok.eot_id is None else [self.tok.eot_id]
        generator = torch.Generator(self.device).manual_seed(0)
        new: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        if limit > 0:
            stream = stream_generate_batch(
                self.model, prompts, limit, temperature, None, generator, stops,
                summary_events=self.events,
            )  # fmt: skip
            for step in stream:
                for row, token in enumerate(step.tolist()):
                    if done[row]:
                        continue
                    done[row] = token in stops
                    if not done[row]:
                        new[row].append(token)
                        done[row] = any(u in self.tok_decode(new[row]) for u in until)
                if all(done):  # the stream is dropped unfinished: no further step runs
                    break
        return [_cut(self.tok_decode(ids), until) for ids in new]


def _batch_size(value: int | str | None) -> int:
    """model_args' batch_size: a positive integer; lm-eval's 'auto' (and 'auto:N', which
    searches sizes for Hugging Face models) is DEFAULT_BATCH_SIZE."""
    size = str(DEFAULT_BATCH_SIZE if value is None else value)
    if size.startswith("auto"):
        return DEFAULT_BATCH_SIZE
    if size.isdigit() and int(size) >= 1:
        return int(size)
    raise ConfigError(
        f"batch_size must be a positive integer or 'auto' (= {DEFAULT_BATCH_SIZE}), got {value!r}"
    )


def _whole(name: str, value: Any, minimum: int) -> int:
    """`value` (an int, or its digits as model_args' text gives them) as an integer of at
    least `minimum`; else a ConfigError naming `name`."""
    text = str(value).strip()
    digits = text.removeprefix("-")
    whole = not isinstance(value, bool) and digits.isdigit() and len(digits) <= 18
    if whole and int(text) >= minimum:
        return int(text)
    least = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
    raise ConfigError(f"{name} must be {least}, got {value!r}")


def _number(name: str, value: Any, minimum: float) -> float:
    """`value` as a finite float of at least `minimum`; else a ConfigError naming `name`."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if isinstance(value, bool) or not minimum <= number < float("inf"):
        raise ConfigError(f"{name} must be a number of at least {minimum:g}, got {value!r}")
    return number


def _refuse_empty_tasks(requests: Sequence[Any]) -> None:
    """A task whose every document is empty has no bytes or words to divide its
    log-likelihood by (lm-eval would divide by zero): a DataError naming it."""
    empty: dict[str, bool] = {}
    for req in requests:
        name = getattr(req, "task_name", None)
        task = "the task" if name is None else f"task {name!r}"
        empty[task] = empty.get(task, True) and not req.args[0]
    for task, all_empty in empty.items():
        if all_empty:
            raise DataError(
                f"every document of {task} is empty: there is nothing to score (its "
                "perplexity and bits per byte would divide by zero bytes)"
            )


def _device(name: str | None) -> str:
    """The device to load on: lm-eval's command line asks for cuda:0 unless told otherwise,
    which (as lm-eval's own hf model does) means 'auto' on a machine without that GPU."""
    if name is None:
        return "auto"
    name = str(name)
    index = name.removeprefix("cuda:")
    if index != name and index.isdigit() and int(index) >= torch.cuda.device_count():
        return "auto"
    return name


def _cut(text: str, until: Sequence[str]) -> str:
    """`text` up to the first of `until` it holds."""
    ends = [text.find(u) for u in until if u and u in text]
    return text[: min(ends)] if ends else text


# A lazy entry: run as `python -m bdh_train.evals.lm_eval`, this file is __main__, and lm-eval
# imports the class from bdh_train.evals.lm_eval when the model is asked for.
model_registry.register(MODEL_NAME, target="bdh_train.evals.lm_eval:BDHLM")


def main(argv: Sequence[str] | None = None) -> int:
    """lm-eval's command line (`lm_eval run ...`) with the `bdh` model registered; a
    bdh-train refusal (a bad checkpoint, a model without a text tokenizer, a bad model_arg)
    is one `error:` line and exit status 2."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *(sys.argv[1:] if argv is None else argv)]
    try:
        cli_evaluate()
    except BDHTrainError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
