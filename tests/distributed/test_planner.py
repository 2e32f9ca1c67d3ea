"""Pipeline planner: hand-computed schedules, partition, validation, timeline views."""

from __future__ import annotations

import itertools

import pytest

from bdh_train.distributed.planner import (
    PipelineEvent,
    PipelinePlan,
    StageAssignment,
    build_pipeline_plan,
    plot_timeline,
    render_timeline,
    split_microbatch_ranges,
)
from bdh_train.errors import ConfigError

# (tick, physical stage, "F"/"B", microbatch, virtual stage)
Row = tuple[int, int, str, int, int]


def rows(plan: PipelinePlan) -> list[Row]:
    return [
        (
            e.tick,
            e.physical_stage,
            "F" if e.kind == "forward" else "B",
            e.microbatch_id,
            e.virtual_stage_id,
        )
        for e in plan.events
    ]


def check_invariants(plan: PipelinePlan) -> None:
    """What any valid schedule satisfies, whatever its priority rule."""
    total_virtual = plan.total_virtual_stages
    done: dict[tuple[str, int, int], int] = {}
    for e in plan.events:
        task = (e.kind, e.microbatch_id, e.virtual_stage_id)
        assert task not in done, f"{task} scheduled twice"
        done[task] = e.tick
    expected = {
        (k, mb, v)
        for k in ("forward", "backward")
        for mb in range(plan.microbatches)
        for v in range(total_virtual)
    }
    assert set(done) == expected
    for e in plan.events:
        assert e.physical_stage == e.virtual_stage_id % plan.stage_count
        mb, v = e.microbatch_id, e.virtual_stage_id
        if e.kind == "forward" and v > 0:
            assert done[("forward", mb, v - 1)] < e.tick
        if e.kind == "backward":
            assert done[("forward", mb, v)] < e.tick
            if v < total_virtual - 1:
                assert done[("backward", mb, v + 1)] < e.tick
    slots = [(e.tick, e.physical_stage) for e in plan.events]
    assert len(slots) == len(set(slots)), "a stage ran two tasks in one tick"
    assert slots == sorted(slots), "events not in (tick, stage) order"
    assert plan.total_ticks == plan.events[-1].tick + 1
    for s in range(plan.stage_count):
        busy = sum(1 for e in plan.events if e.physical_stage == s)
        assert plan.busy_ticks[s] == busy
        assert plan.idle_ticks[s] == plan.total_ticks - busy
    assert plan.bubble_fraction == pytest.approx(
        sum(plan.idle_ticks) / (plan.total_ticks * plan.stage_count)
    )


# --- hand-computed schedules -------------------------------------------------------------


def test_gpipe_2_stages_2_microbatches() -> None:
    # t2: stage 1 has F1 and B0 ready; GPipe prefers the forward, so B0 waits until t3.
    plan = build_pipeline_plan(2, 2, 1, 2, "gpipe")
    # fmt: off
    assert rows(plan) == [
        (0, 0, "F", 0, 0),
        (1, 0, "F", 1, 0), (1, 1, "F", 0, 1),
        (2, 1, "F", 1, 1),
        (3, 1, "B", 0, 1),
        (4, 0, "B", 0, 0), (4, 1, "B", 1, 1),
        (5, 0, "B", 1, 0),
    ]
    # fmt: on
    assert plan.total_ticks == 6
    assert plan.busy_ticks == (4, 4)
    assert plan.idle_ticks == (2, 2)
    assert plan.bubble_fraction == pytest.approx(4 / 12)
    check_invariants(plan)


def test_interleaved_2_stages_2_microbatches() -> None:
    # t2: stage 1 has F1 and B0 ready; 1F1B prefers the backward, so B0 runs at t2.
    plan = build_pipeline_plan(2, 2, 1, 2, "interleaved_1f1b")
    # fmt: off
    assert rows(plan) == [
        (0, 0, "F", 0, 0),
        (1, 0, "F", 1, 0), (1, 1, "F", 0, 1),
        (2, 1, "B", 0, 1),
        (3, 0, "B", 0, 0), (3, 1, "F", 1, 1),
        (4, 1, "B", 1, 1),
        (5, 0, "B", 1, 0),
    ]
    # fmt: on
    assert plan.total_ticks == 6
    assert plan.bubble_fraction == pytest.approx(4 / 12)
    check_invariants(plan)


def test_1f1b_is_interleaved_with_one_virtual_stage() -> None:
    a = build_pipeline_plan(6, 3, 1, 5, "1f1b")
    b = build_pipeline_plan(6, 3, 1, 5, "interleaved_1f1b")
    assert a.events == b.events
    assert a.schedule == "1f1b"


def test_interleaved_2_stages_2_virtual_4_microbatches() -> None:
    # Virtual stages: v0 -> stage 0 local 0, v1 -> stage 1 local 0,
    #                 v2 -> stage 0 local 1, v3 -> stage 1 local 1.
    # Derivation, tick by tick (ready sets as of the start of the tick):
    #  t0 s0: F(m,0) all ready -> F0.0.                    s1: nothing.
    #  t1 s0: F1.0 (lowest mb).                            s1: F0.1.
    #  t2 s0: F0.2 (mb 0) beats F2.0.                      s1: F1.1.
    #  t3 s0: F1.2 beats F2.0.                             s1: F0.3.
    #  t4 s0: no backward ready (B0.2 needs B0.3) -> F2.0. s1: B0.3 (backward first).
    #  t5 s0: B0.2.                                        s1: F1.3 (1,1,3) beats F2.1 (2,0,1).
    #  t6 s0: B0.0 needs B0.1 -> F3.0.                     s1: B0.1 (mb 0) beats B1.3.
    #  t7 s0: B0.0.                                        s1: B1.3.
    #  t8 s0: B1.2.                                        s1: F2.1 beats F3.1.
    #  t9 s0: B1.0 needs B1.1 -> F2.2.                     s1: B1.1.
    #  t10 s0: B1.0.                                       s1: F2.3 (2,1,3) beats F3.1 (3,0,1).
    #  t11 s0: B2.2 needs B2.3, F3.2 needs F3.1 -> idle.   s1: B2.3.
    #  t12 s0: B2.2.                                       s1: F3.1.
    #  t13 s0: F3.2.                                       s1: B2.1.
    #  t14 s0: B2.0.                                       s1: F3.3.
    #  t15..t18: the tail B3.3, B3.2, B3.1, B3.0 alternates between the stages.
    plan = build_pipeline_plan(4, 2, 2, 4, "interleaved_1f1b")
    # fmt: off
    assert rows(plan) == [
        (0, 0, "F", 0, 0),
        (1, 0, "F", 1, 0), (1, 1, "F", 0, 1),
        (2, 0, "F", 0, 2), (2, 1, "F", 1, 1),
        (3, 0, "F", 1, 2), (3, 1, "F", 0, 3),
        (4, 0, "F", 2, 0), (4, 1, "B", 0, 3),
        (5, 0, "B", 0, 2), (5, 1, "F", 1, 3),
        (6, 0, "F", 3, 0), (6, 1, "B", 0, 1),
        (7, 0, "B", 0, 0), (7, 1, "B", 1, 3),
        (8, 0, "B", 1, 2), (8, 1, "F", 2, 1),
        (9, 0, "F", 2, 2), (9, 1, "B", 1, 1),
        (10, 0, "B", 1, 0), (10, 1, "F", 2, 3),
        (11, 1, "B", 2, 3),
        (12, 0, "B", 2, 2), (12, 1, "F", 3, 1),
        (13, 0, "F", 3, 2), (13, 1, "B", 2, 1),
        (14, 0, "B", 2, 0), (14, 1, "F", 3, 3),
        (15, 1, "B", 3, 3),
        (16, 0, "B", 3, 2),
        (17, 1, "B", 3, 1),
        (18, 0, "B", 3, 0),
    ]
    # fmt: on
    assert plan.total_ticks == 19
    assert plan.busy_ticks == (16, 16)
    assert plan.idle_ticks == (3, 3)
    assert plan.bubble_fraction == pytest.approx(6 / 38)
    check_invariants(plan)


@pytest.mark.parametrize(
    ("stages", "virtual", "mbs", "schedule"),
    [
        (s, v, m, sched)
        for s, v, m, sched in itertools.product(
            (1, 2, 3, 4), (1, 2, 3), (1, 2, 3, 4, 7), ("gpipe", "interleaved_1f1b")
        )
        if v <= s and (sched == "gpipe" or m >= s)
    ],
)
def test_invariants_over_a_grid(stages: int, virtual: int, mbs: int, schedule: str) -> None:
    plan = build_pipeline_plan(12, stages, virtual, mbs, schedule)
    check_invariants(plan)


def test_gpipe_runs_every_forward_before_any_backward_per_stage() -> None:
    plan = build_pipeline_plan(8, 4, 1, 6, "gpipe")
    for s in range(plan.stage_count):
        kinds = [e.kind for e in plan.events if e.physical_stage == s]
        assert kinds == sorted(kinds, key=lambda k: k == "backward")


def test_gpipe_with_virtual_stages_fills_forward_gaps_with_ready_backwards() -> None:
    # The priority is per stage and per tick: when no forward is ready yet (its input is still
    # upstream), a ready backward runs rather than leaving the stage idle.
    plan = build_pipeline_plan(8, 4, 2, 6, "gpipe")
    check_invariants(plan)
    # Stage 3 at tick 13: F4.7 still waits for F4.6, so the ready B0.7 runs.
    assert [
        (e.kind, e.microbatch_id, e.virtual_stage_id)
        for e in plan.events
        if e.physical_stage == 3 and 13 <= e.tick <= 16
    ] == [("backward", 0, 7), ("backward", 1, 7), ("forward", 4, 7), ("forward", 5, 7)]
    forward_tick = {
        (e.microbatch_id, e.virtual_stage_id): e.tick for e in plan.events if e.kind == "forward"
    }
    for b in (e for e in plan.events if e.kind == "backward"):
        for (mb, v), tick in forward_tick.items():
            if v % plan.stage_count == b.physical_stage and tick > b.tick:
                # That forward was not ready when the backward ran: its input came later.
                assert v > 0 and forward_tick[(mb, v - 1)] >= b.tick


def test_single_stage_has_no_bubble() -> None:
    plan = build_pipeline_plan(3, 1, 1, 3, "gpipe")
    assert plan.total_ticks == 6
    assert plan.bubble_fraction == 0.0
    assert [(e.kind[0], e.microbatch_id) for e in plan.events] == [
        ("f", 0),
        ("f", 1),
        ("f", 2),
        ("b", 0),
        ("b", 1),
        ("b", 2),
    ]


# --- partition ---------------------------------------------------------------------------


def test_partition_five_layers_over_two_stages() -> None:
    plan = build_pipeline_plan(5, 2)
    assert plan.assignments == (
        StageAssignment(0, 0, 0, range(0, 3)),
        StageAssignment(1, 1, 0, range(3, 5)),
    )


def test_partition_with_virtual_stages() -> None:
    # 10 layers over 2 ranks x 2 virtual = 4 virtual stages: sizes 3, 3, 2, 2.
    plan = build_pipeline_plan(10, 2, 2, 2, "interleaved_1f1b")
    assert [a.layer_range for a in plan.assignments] == [
        range(0, 3),
        range(3, 6),
        range(6, 8),
        range(8, 10),
    ]
    assert plan.assignment(2) == StageAssignment(2, 0, 1, range(6, 8))
    assert plan.assignments_for_rank(0) == (
        StageAssignment(0, 0, 0, range(0, 3)),
        StageAssignment(2, 0, 1, range(6, 8)),
    )
    assert [a.virtual_stage_id for a in plan.assignments_for_rank(1)] == [1, 3]
    with pytest.raises(IndexError):
        plan.assignment(4)
    with pytest.raises(IndexError):
        plan.assignments_for_rank(2)


@pytest.mark.parametrize(("n_layer", "total"), [(4, 4), (7, 3), (12, 6), (13, 4)])
def test_partition_covers_every_layer_once(n_layer: int, total: int) -> None:
    plan = build_pipeline_plan(n_layer, total)
    layers = [i for a in plan.assignments for i in a.layer_range]
    assert layers == list(range(n_layer))
    sizes = [len(a.layer_range) for a in plan.assignments]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


def test_forward_events_are_the_forwards_in_order() -> None:
    plan = build_pipeline_plan(4, 2, 1, 4, "interleaved_1f1b")
    forwards = plan.forward_events()
    assert all(isinstance(e, PipelineEvent) and e.kind == "forward" for e in forwards)
    assert list(forwards) == [e for e in plan.events if e.kind == "forward"]


# --- split_microbatch_ranges -------------------------------------------------------------


def test_split_microbatch_ranges() -> None:
    assert split_microbatch_ranges(10, 3) == [range(0, 4), range(4, 7), range(7, 10)]
    assert split_microbatch_ranges(4, 4) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    assert split_microbatch_ranges(5, 1) == [range(0, 5)]
    assert split_microbatch_ranges(8, 2) == [range(0, 4), range(4, 8)]


def test_split_microbatch_ranges_errors() -> None:
    with pytest.raises(ConfigError, match=r"parallel\.microbatches.*") as info:
        split_microbatch_ranges(3, 4)
    assert "batch size 3" in str(info.value)
    with pytest.raises(ConfigError, match=r"parallel\.microbatches"):
        split_microbatch_ranges(3, 0)


# --- validation --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(n_layer=0, stage_count=1), "model.n_layer"),
        (dict(n_layer=4, stage_count=0), "parallel.pipeline_stages"),
        (dict(n_layer=4, stage_count=True), "parallel.pipeline_stages"),
        (
            dict(n_layer=4, stage_count=2, virtual_stages_per_rank=0),
            "parallel.virtual_stages_per_rank",
        ),
        (
            dict(
                n_layer=8,
                stage_count=2,
                virtual_stages_per_rank=3,
                microbatches=2,
                schedule="interleaved_1f1b",
            ),
            "parallel.virtual_stages_per_rank",
        ),
        (dict(n_layer=4, stage_count=2, microbatches=0), "parallel.microbatches"),
        (dict(n_layer=4, stage_count=2, microbatches=2, schedule="pipedream"), "parallel.schedule"),
        (
            dict(n_layer=4, stage_count=2, microbatches=1, schedule="interleaved_1f1b"),
            "parallel.microbatches",
        ),
        (dict(n_layer=4, stage_count=3, microbatches=2, schedule="1f1b"), "parallel.microbatches"),
        (
            dict(
                n_layer=8, stage_count=2, virtual_stages_per_rank=2, microbatches=2, schedule="1f1b"
            ),
            "parallel.virtual_stages_per_rank",
        ),
        (dict(n_layer=3, stage_count=4, microbatches=4), "model.n_layer"),
        (
            dict(
                n_layer=3,
                stage_count=2,
                virtual_stages_per_rank=2,
                microbatches=2,
                schedule="interleaved_1f1b",
            ),
            "model.n_layer",
        ),
    ],
)
def test_invalid_arguments_name_their_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_pipeline_plan(**kwargs)
    assert str(info.value).startswith(field), str(info.value)


def test_unknown_schedule_suggests_the_nearest() -> None:
    with pytest.raises(ConfigError, match="did you mean 'interleaved_1f1b'"):
        build_pipeline_plan(4, 2, 1, 2, "interleaved_1fb1")


def test_gpipe_allows_fewer_microbatches_than_stages() -> None:
    plan = build_pipeline_plan(4, 4, 1, 1, "gpipe")
    assert plan.total_ticks == 8
    assert plan.bubble_fraction == pytest.approx(24 / 32)


# --- timeline views ----------------------------------------------------------------------

GPIPE_2x4 = """\
tick     0  1  2  3  4  5  6  7  8  9
stage 0  F0 F1 F2 F3 .  .  B0 B1 B2 B3
stage 1  .  F0 F1 F2 F3 B0 B1 B2 B3 .
total ticks: 10, bubble fraction: 0.200
"""


def test_render_timeline_golden_gpipe() -> None:
    assert render_timeline(build_pipeline_plan(4, 2, 1, 4, "gpipe")) == GPIPE_2x4


def test_render_timeline_labels_virtual_stages() -> None:
    text = render_timeline(build_pipeline_plan(4, 2, 2, 4, "interleaved_1f1b"))
    lines = text.splitlines()
    assert lines[1].split()[:4] == ["stage", "0", "F0.0", "F1.0"]
    assert lines[2].split()[:5] == ["stage", "1", ".", "F0.1", "F1.1"]
    assert lines[-1] == "total ticks: 19, bubble fraction: 0.158"


def test_plot_timeline_writes_png(tmp_path) -> None:
    out = tmp_path / "sub" / "timeline.png"
    written = plot_timeline(build_pipeline_plan(4, 2, 2, 4, "interleaved_1f1b"), out)
    assert written == out
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000
    assert [p.name for p in out.parent.iterdir()] == ["timeline.png"]  # no temp file left
