"""Pipeline planner: the layer partition, the tick-by-tick schedule, its metrics and timeline
views, for a pipeline shape that `config.ParallelConfig` checks.

The plan is pure data computed ahead of time, so the train step can replay `plan.events` in
order on one process (same numbers as a real pipeline) and the bubble of a schedule can be
inspected or plotted before anything is launched.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from bdh_train import checks
from bdh_train.distributed.config import ParallelConfig
from bdh_train.errors import ConfigError
from bdh_train.utils import atomic_write

EventKind = Literal["forward", "backward"]
FORWARD: EventKind = "forward"
BACKWARD: EventKind = "backward"


@dataclass(frozen=True)
class StageAssignment:
    """Which contiguous layers one virtual stage owns and which rank runs it."""

    virtual_stage_id: int
    physical_stage: int
    local_index: int
    layer_range: range


@dataclass(frozen=True)
class PipelineEvent:
    """One task run by one physical stage in one tick."""

    tick: int
    physical_stage: int
    kind: EventKind
    microbatch_id: int
    virtual_stage_id: int


@dataclass(frozen=True)
class PipelinePlan:
    """A validated partition plus its simulated schedule and the resulting utilisation."""

    n_layer: int
    stage_count: int
    virtual_stages_per_rank: int
    microbatches: int
    schedule: str
    assignments: tuple[StageAssignment, ...]
    events: tuple[PipelineEvent, ...]
    total_ticks: int
    busy_ticks: tuple[int, ...]

    @property
    def total_virtual_stages(self) -> int:
        return self.stage_count * self.virtual_stages_per_rank

    @property
    def idle_ticks(self) -> tuple[int, ...]:
        """Ticks each physical stage spends waiting: the pipeline bubble, per stage."""
        return tuple(self.total_ticks - busy for busy in self.busy_ticks)

    @property
    def bubble_fraction(self) -> float:
        """idle / (ticks · stages): the share of stage-ticks a schedule wastes."""
        slots = self.total_ticks * self.stage_count
        return sum(self.idle_ticks) / slots if slots else 0.0

    def assignment(self, virtual_stage_id: int) -> StageAssignment:
        if not 0 <= virtual_stage_id < len(self.assignments):
            raise IndexError(
                f"virtual stage {virtual_stage_id} out of range [0, {len(self.assignments)})"
            )
        return self.assignments[virtual_stage_id]

    def assignments_for_rank(self, rank: int) -> tuple[StageAssignment, ...]:
        """The virtual stages rank `rank` hosts, in local-index order."""
        if not 0 <= rank < self.stage_count:
            raise IndexError(f"rank {rank} out of range [0, {self.stage_count})")
        return tuple(a for a in self.assignments if a.physical_stage == rank)

    def forward_events(self) -> tuple[PipelineEvent, ...]:
        """Forwards in schedule order: what a single-process train step replays."""
        return tuple(e for e in self.events if e.kind == FORWARD)


def _partition(n_layer: int, stage_count: int, total_virtual: int) -> tuple[StageAssignment, ...]:
    base, extra = divmod(n_layer, total_virtual)
    out: list[StageAssignment] = []
    start = 0
    for v in range(total_virtual):
        size = base + (1 if v < extra else 0)
        layers = range(start, start + size)
        out.append(StageAssignment(v, v % stage_count, v // stage_count, layers))
        start += size
    return tuple(out)


# A task is (kind, microbatch, virtual stage).
_Task = tuple[EventKind, int, int]


def _priority(schedule: str, stage_count: int) -> Callable[[_Task], tuple[int, ...]]:
    """Sort key among one stage's ready tasks; the lowest runs this tick."""
    if schedule == "gpipe":

        def key(task: _Task) -> tuple[int, ...]:
            kind, mb, v = task
            return (0, mb, v) if kind == FORWARD else (1, mb, -v)

    else:

        def key(task: _Task) -> tuple[int, ...]:
            kind, mb, v = task
            local = v // stage_count
            return (1, mb, local, v) if kind == FORWARD else (0, mb, -local, -v)

    return key


def _simulate(
    stage_count: int, total_virtual: int, microbatches: int, schedule: str
) -> tuple[PipelineEvent, ...]:
    """Simulate the schedule: one ready task per stage per tick, results visible next tick."""
    key = _priority(schedule, stage_count)
    last = total_virtual - 1
    ready: list[set[_Task]] = [set() for _ in range(stage_count)]
    for mb in range(microbatches):
        ready[0].add((FORWARD, mb, 0))
    remaining = 2 * microbatches * total_virtual
    events: list[PipelineEvent] = []
    tick = 0
    while remaining:
        finished: list[_Task] = []
        for stage in range(stage_count):
            if not ready[stage]:
                continue
            task = min(ready[stage], key=key)
            ready[stage].remove(task)
            kind, mb, v = task
            events.append(PipelineEvent(tick, stage, kind, mb, v))
            finished.append(task)
        if not finished:  # cannot happen for this DAG; guards against an endless loop
            raise RuntimeError(f"pipeline simulation stalled at tick {tick}")
        # Dependents become ready only after every stage has chosen, i.e. from the next tick.
        for kind, mb, v in finished:
            if kind == FORWARD:
                nxt: _Task = (FORWARD, mb, v + 1) if v < last else (BACKWARD, mb, last)
            elif v > 0:
                # Backward(mb, v) done implies Forward(mb, v - 1) done long ago.
                nxt = (BACKWARD, mb, v - 1)
            else:
                continue
            ready[nxt[2] % stage_count].add(nxt)
        remaining -= len(finished)
        tick += 1
    return tuple(events)


def build_pipeline_plan(
    n_layer: int,
    stage_count: int,
    virtual_stages_per_rank: int = 1,
    microbatches: int = 1,
    schedule: str = "gpipe",
) -> PipelinePlan:
    """Validate the pipeline shape, partition the layers and simulate the schedule."""
    checks.positive_int("model.n_layer", n_layer)
    shape = ParallelConfig(
        stage_count, virtual_stages_per_rank, microbatches, schedule, emulate=True
    ).validate()
    shape.check_model(n_layer)
    shape.check_fill()
    total_virtual = stage_count * virtual_stages_per_rank
    assignments = _partition(n_layer, stage_count, total_virtual)
    events = _simulate(stage_count, total_virtual, microbatches, schedule)
    total_ticks = events[-1].tick + 1
    busy = [0] * stage_count
    for event in events:
        busy[event.physical_stage] += 1
    return PipelinePlan(
        n_layer=n_layer,
        stage_count=stage_count,
        virtual_stages_per_rank=virtual_stages_per_rank,
        microbatches=microbatches,
        schedule=schedule,
        assignments=assignments,
        events=events,
        total_ticks=total_ticks,
        busy_ticks=tuple(busy),
    )


def split_microbatch_ranges(total: int, microbatches: int) -> list[range]:
    """Split `total` batch rows into contiguous microbatches; the first `total % m` get one more.

    Every microbatch must be non-empty, otherwise its loss weight |mb| / B would be zero and
    a pipeline slot would run on nothing.
    """
    checks.positive_int("parallel.microbatches", microbatches)
    if not checks.is_int(total) or total < microbatches:
        raise ConfigError(
            f"batch size {total!r} is smaller than parallel.microbatches = {microbatches}; "
            "every microbatch needs at least one sequence"
        )
    base, extra = divmod(total, microbatches)
    out: list[range] = []
    start = 0
    for i in range(microbatches):
        size = base + (1 if i < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def _label(plan: PipelinePlan, event: PipelineEvent) -> str:
    text = f"{'F' if event.kind == FORWARD else 'B'}{event.microbatch_id}"
    if plan.virtual_stages_per_rank > 1:
        text += f".{event.virtual_stage_id}"
    return text


def _grid(plan: PipelinePlan) -> list[list[PipelineEvent | None]]:
    grid: list[list[PipelineEvent | None]] = [
        [None] * plan.total_ticks for _ in range(plan.stage_count)
    ]
    for event in plan.events:
        grid[event.physical_stage][event.tick] = event
    return grid


def _summary(plan: PipelinePlan) -> str:
    return f"total ticks: {plan.total_ticks}, bubble fraction: {plan.bubble_fraction:.3f}"


def render_timeline(plan: PipelinePlan) -> str:
    """A text table (rows = physical stages, columns = ticks) for logs and terminals."""
    grid = _grid(plan)
    cells = [[_label(plan, e) if e else "." for e in row] for row in grid]
    header = [str(t) for t in range(plan.total_ticks)]
    width = max(len(c) for c in [*header, *(c for row in cells for c in row)])
    names = [f"stage {s}" for s in range(plan.stage_count)]
    name_width = max(len(n) for n in [*names, "tick"])

    def line(name: str, row: list[str]) -> str:
        return (name.ljust(name_width) + "  " + " ".join(c.ljust(width) for c in row)).rstrip()

    lines = [line("tick", header)]
    lines += [line(name, row) for name, row in zip(names, cells, strict=True)]
    lines.append(_summary(plan))
    return "\n".join(lines) + "\n"


def plot_timeline(plan: PipelinePlan, path: str | os.PathLike[str]) -> Path:
    """Draw the timeline as a PNG (written atomically) for reports and run directories."""
    # Figure + Agg canvas directly: no pyplot global state, no backend switching.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    colours = {FORWARD: "#4c9be8", BACKWARD: "#f28e2b"}
    fig = Figure(figsize=(max(4.0, 0.45 * plan.total_ticks + 1.5), 0.6 * plan.stage_count + 1.4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    fontsize = 7 if plan.virtual_stages_per_rank > 1 else 8
    for event in plan.events:
        ax.broken_barh(
            [(event.tick, 1.0)],
            (event.physical_stage - 0.4, 0.8),
            facecolors=colours[event.kind],
            edgecolors="black",
            linewidth=0.5,
        )
        ax.text(
            event.tick + 0.5,
            event.physical_stage,
            _label(plan, event),
            ha="center",
            va="center",
            fontsize=fontsize,
        )
    ax.set_xlim(0, plan.total_ticks)
    ax.set_ylim(plan.stage_count - 0.5, -0.5)
    ax.set_yticks(range(plan.stage_count))
    ax.set_yticklabels([f"stage {s}" for s in range(plan.stage_count)])
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("tick")
    ax.set_title(f"{plan.schedule}: {_summary(plan)}", fontsize=9)
    ax.legend(
        handles=[
            Patch(color=colours[FORWARD], label="forward"),
            Patch(color=colours[BACKWARD], label="backward"),
        ],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
    )
    fig.tight_layout()
    out = Path(path)
    with atomic_write(out, "wb") as handle:
        fig.savefig(handle, format="png", dpi=100)
    return out


def render_mesh(replicas: int, stages: int) -> str:
    """The data-parallel x pipeline process mesh as torchrun numbers its processes: rank =
    replica * stages + stage."""
    checks.positive_int("--data-parallel", replicas)
    checks.positive_int("--stages", stages)
    width = len(str(replicas * stages - 1))
    lines = [
        f"mesh: {replicas} data-parallel x {stages} pipeline stages = {replicas * stages} "
        f"processes (torchrun --nproc-per-node {replicas * stages}, or that many in all)"
    ]
    for replica in range(replicas):
        ranks = " ".join(f"{replica * stages + s:>{width}}" for s in range(stages))
        lines.append(f"  replica {replica}: ranks {ranks} (stages 0..{stages - 1})")
    return "\n".join(lines)
