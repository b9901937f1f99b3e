"""Dry-run launcher: plan every config of a sweep, submit and run none.

    python -m train -m model=gpt_1.3b,gpt_13b parallelism.tp=1,2,4,8 hydra/launcher=plan

prints the feasible configs, fastest predicted first (at most hydra.launcher.top of them, each
work's fastest in turn; parameters, predicted memory per device, GEMM quantization efficiency,
FLOPs and time per iteration), the
infeasible ones counted by the rule they break with one example each, and a summary line; plan.csv
in the sweep directory (hydra.sweep.dir) gets every row. The console stays a screenful however
many configs the sweep holds: the file is where all of them are. The feasible configs' token files
and checkpoint directories are checked here too, each distinct path once (train.paths): what a run
would refuse at its start is a warning on stderr, not a refusal, since the runs' nodes may see
file systems this machine does not.

A plan must take seconds for 10,000 configs, so configs come from the shared
FastComposer (at most one Hydra compose per distinct group choice, not per job) and the planner
is pure arithmetic. Hydra accepts launchers only from the `hydra_plugins` package: the
class it instantiates is a thin subclass in hydra_plugins/megasweep/plan_launcher.py.

Torch-free, like everything a launcher imports.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from hydra.core.utils import JobReturn, JobStatus
from hydra.errors import HydraException

from launchers.bulk import bulk_allocation
from launchers.compose import (
    FastComposer,
    SweepLauncher,
    is_megasweep_config,
    sweep_composer,
    usage_exits,
)
from launchers.submit import (
    check_output_dirs,
    merge_entries,
    refuse_empty_sweep,
    say_path_warnings,
    subdir_namer,
)
from launchers.sweepdir import UsageError
from train.contract import (
    PLAN_FILE,
    ManifestEntry,
    PlanRow,
    join_overrides,
    manifest_path,
    read_manifest,
    read_plan_csv,
    write_plan_csv,
)
from train.paths import PathWarnings
from train.planner.plan import (
    RuleCount,
    WorkKey,
    format_plan_table,
    infeasible_by_rule,
    plan_run,
    rank_predictions,
    table_order,
    work_key,
)

__all__ = [
    "PlanLauncher",
    "PlanSummary",
    "format_plan_report",
    "plan_sweep",
    "progress_printer",
    "shown_in_turn",
    "summarize",
]

DEFAULT_TOP = 30
"""Feasible rows the console shows by default: a screenful (rows)."""


@dataclass(frozen=True)
class PlanSummary:
    """Outcome of planning a batch of configs."""

    configs: int
    """Configs planned (configs)."""
    feasible: int
    """Configs with no violation (configs)."""
    infeasible: int
    """Configs with at least one violation (configs)."""
    compose_seconds: float
    """Time spent composing RunConfigs, by the sweeper's check and the launcher together (seconds)."""
    plan_seconds: float
    """Time spent in the planner (seconds)."""
    hydra_compositions: int
    """Full Hydra compositions: at most one per distinct choice of config groups; a choice that differs from
    a composed one only in schema groups' options is derived from it instead (compositions)."""
    by_rule: tuple[RuleCount, ...] = ()
    """The infeasible configs per broken rule, most common first (train.planner.plan.infeasible_by_rule)."""

    @property
    def seconds(self) -> float:
        """Composition plus planning (seconds)."""
        return self.compose_seconds + self.plan_seconds

    @property
    def configs_per_second(self) -> float:
        """Throughput of composition plus planning (configs/s); inf for an instantaneous batch."""
        return self.configs / self.seconds if self.seconds > 0 else float("inf")

    def line(self) -> str:
        """One-line human summary."""
        return (
            f"plan: {self.configs:,} configs: {self.feasible:,} feasible, {self.infeasible:,} infeasible; "
            f"{self.seconds:.2f} s ({self.configs_per_second:,.0f} configs/s): composing "
            f"{self.compose_seconds:.2f} s ({self.hydra_compositions} Hydra compositions), "
            f"planning {self.plan_seconds:.2f} s"
        )

    def rules_line(self) -> str:
        """'infeasible: 10 configs: [memory] 4, [heads_divisible_by_tp] 4, ...'; '' when all are feasible."""
        if not self.infeasible:
            return ""
        counts = ", ".join(f"[{c.rule or 'other'}] {c.configs:,}" for c in self.by_rule)
        several = " (a config can break several rules)" if sum(c.configs for c in self.by_rule) > self.infeasible else ""
        return f"infeasible: {self.infeasible:,} configs: {counts}{several}"


def summarize(rows: Sequence[PlanRow], composer: FastComposer, plan_seconds: float) -> PlanSummary:
    """Counts of feasible and infeasible rows, with the composer's and the planner's times."""
    feasible = sum(1 for r in rows if r.feasible)
    stats = composer.stats()
    return PlanSummary(
        configs=len(rows),
        feasible=feasible,
        infeasible=len(rows) - feasible,
        compose_seconds=stats.seconds,
        plan_seconds=plan_seconds,
        hydra_compositions=stats.bases,
        by_rule=tuple(infeasible_by_rule(rows)),
    )


def format_plan_report(rows: Sequence[PlanRow], summary: PlanSummary, *, top: int | None, csv_name: str) -> str:
    """What the console shows of a plan: `top` feasible rows (None: all), each work's fastest in turn
    (shown_in_turn), under a header, then the infeasible configs by rule with one example each. Its
    length depends on `top` and the number of rules, never on the number of configs."""
    feasible = table_order([r for r in rows if r.feasible])
    shown = shown_in_turn(feasible, len(feasible) if top is None else top)
    lines = []
    if shown:
        lines.append(format_plan_table(shown))
    if not feasible:
        lines.append("no feasible config")
    elif len(shown) < len(feasible):
        lines.append(_more_line(feasible, shown, csv_name))
    lines += _unpredicted_lines(feasible)
    if summary.infeasible:
        lines.append(summary.rules_line())
        for c in summary.by_rule:
            lines.append(f"  [{c.rule or 'other'}] e.g. {c.example.overrides or '(no overrides)'}: {c.message}")
    return "\n".join(lines)


def _by_work(rows: Sequence[PlanRow]) -> dict[WorkKey, list[int]]:
    """The indices of each work's rows (train.planner.plan.work_key), in their order; works by first
    appearance."""
    works: dict[WorkKey, list[int]] = {}
    for i, row in enumerate(rows):
        works.setdefault(work_key(row), []).append(i)
    return works


def shown_in_turn(feasible: Sequence[PlanRow], top: int) -> list[PlanRow]:
    """The `top` rows the console shows of feasible rows in table order: each work's fastest predicted
    in turn (every work's first, then every work's second, ...), then unpredicted ones in table order
    if places are left; listed work by work, in the order of the works' fastest rows.

    Ranks are per work (a 13B model's layouts are not slower versions of a 350M model's), so the `top`
    fastest of all were the small model's alone, and the table did not show the large one's best
    layout at all."""
    works = _by_work(feasible).values()
    predicted = [[i for i in rows if feasible[i].pred_rank > 0] for rows in works]
    taken: set[int] = set()
    for turn in itertools.zip_longest(*predicted):
        for i in turn:
            if i is not None and len(taken) < top:
                taken.add(i)
    # Unpredicted rows only where no predicted one is left: a '-' row never pushes out a prediction.
    unpredicted = (i for i in range(len(feasible)) if i not in taken)
    taken.update(itertools.islice(unpredicted, max(0, top - len(taken))))
    return [feasible[i] for rows in works for i in rows if i in taken]


def _more_line(feasible: Sequence[PlanRow], shown: Sequence[PlanRow], csv_name: str) -> str:
    """What the console says of the feasible rows it leaves out: how many, and which works it shows
    nothing of."""
    works = _by_work(feasible)
    line = f"... {len(feasible) - len(shown):,} more feasible config(s)"
    if len(works) == 1:
        line += ", slower or unpredicted,"
    else:
        unseen = len(works.keys() - {work_key(row) for row in shown})
        line += ", each slower than its work's shown ones or unpredicted"
        line += f" ({unseen} work(s) with none shown)," if unseen else ","
    return f"{line} in {csv_name} (hydra.launcher.top=N shows N, null all)"


SHOWN_NOTES = 3
"""Distinct reasons for feasible rows without a prediction shown on the console; the rest are in plan.csv."""


def _unpredicted_lines(feasible: Sequence[PlanRow]) -> list[str]:
    """Why the time model predicted nothing for some feasible rows (their pred columns are '-'): each
    distinct reason once, with how many rows it holds for and one of them."""
    by_note: dict[str, list[PlanRow]] = {}
    for row in feasible:
        if row.pred_note:
            by_note.setdefault(row.pred_note, []).append(row)
    if not by_note:
        return []
    count = sum(len(rows) for rows in by_note.values())
    lines = [f"not predicted: {count:,} feasible config(s) (pred_note in plan.csv says why for each)"]
    ranked = sorted(by_note.items(), key=lambda item: -len(item[1]))
    for note, rows in ranked[:SHOWN_NOTES]:
        lines.append(f"  {len(rows):,} config(s), e.g. {rows[0].overrides or '(no overrides)'}: {note}")
    if len(ranked) > SHOWN_NOTES:
        lines.append(f"  ... and {len(ranked) - SHOWN_NOTES} other reason(s)")
    return lines


def plan_sweep(
    composer: FastComposer,
    job_overrides: Sequence[Sequence[str]],
    *,
    world_size: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    paths: PathWarnings | None = None,
) -> tuple[list[PlanRow], float]:
    """Plan each job: compose its RunConfig, then `plan_run`; the row's `overrides` names the job.

    Returns the rows and the seconds spent in the planner. Composition errors propagate
    (ConfigCompositionException naming the override); `progress(done, total)` is called
    after each job. `paths` notes each feasible config's data and checkpoint paths, checked on this
    machine (train.paths).
    """
    rows: list[PlanRow] = []
    total = len(job_overrides)
    planning = 0.0
    with bulk_allocation():
        for done, overrides in enumerate(job_overrides, start=1):
            run = composer.run_config(overrides)
            tic = time.perf_counter()
            rows.append(plan_run(run, world_size=world_size, world_fixed=world_size is not None,
                                 overrides=join_overrides(overrides)))  # fmt: skip
            if paths is not None and rows[-1].feasible:
                paths.note(run)
            planning += time.perf_counter() - tic
            if progress is not None:
                progress(done, total)
    return rows, planning


def progress_printer(
    every: int, stream: TextIO, *, what: str = "plan", unit: str = "configs"
) -> Callable[[int, int], None] | None:
    """A progress callback writing `<what>: done/total <unit> (s)` every `every` items; None if every <= 0.

    Only batches longer than `every` get lines: a short one is over before anyone looks.
    """
    if every <= 0:
        return None
    tic = time.perf_counter()

    def report(done: int, total: int) -> None:
        if total > every and (done % every == 0 or done == total):
            stream.write(f"{what}: {done:,}/{total:,} {unit} ({time.perf_counter() - tic:.1f} s)\n")
            stream.flush()

    return report


class NothingFeasible(UsageError):
    """A dry run none of whose configs could run: the command exits 2, as the same launch with
    hydra/launcher=slurm or local would (launchers.submit.NothingSubmitted), after the table and
    plan.csv say why."""


class PlanLauncher(SweepLauncher):
    """Hydra launcher that plans each job instead of running it (`hydra/launcher=plan`).

    Options (hydra.launcher.*): world_size (devices each config is planned for; null: dp
    from the config, or 1), csv_name (file in the sweep directory), table (print the feasible
    rows and the infeasible ones by rule), top (feasible rows printed, each work's fastest in turn:
    shown_in_turn; null: all),
    progress_every (a stderr line every this many configs; 0: none), append (plan
    into a directory that holds a launched sweep, adding to its plan.csv; without it such a
    directory is refused: launchers.sweepdir). Exits non-zero (NothingFeasible) when no
    config of a launch is feasible, so that a script can stop before the real launch.
    """

    def __init__(
        self,
        world_size: int | None = None,
        csv_name: str = PLAN_FILE,
        table: bool = True,
        progress_every: int = 2000,
        append: bool = False,
        top: int | None = DEFAULT_TOP,
    ) -> None:
        super().__init__(append)
        self.world_size = world_size
        self.csv_name = csv_name
        self.table = table
        self.top = top
        self.progress_every = progress_every
        # Rows of every batch so far: a sweeper may launch in several batches, plan.csv has them all.
        self.rows: list[PlanRow] = []
        self.named: list[ManifestEntry] = []
        """Every batch's configs with their output directories (check_output_dirs)."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        # Planning keeps every row and estimate alive: no collector walks over them meanwhile. Under
        # any sweeper (Hydra's basic one too), a refusal of the input exits as bad input.
        with self.keeping_earlier_config(), bulk_allocation(), usage_exits():
            return self._launch(job_overrides, initial_job_idx)

    def _launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and self.hydra_context is not None
        top = self.top
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 0):
            # Here, not in __init__: Hydra reports a constructor's error as a failed run (exit 1).
            raise UsageError(
                f"hydra.launcher.top={top}: the plan table shows a whole number of feasible rows, 0 or more; "
                f"null shows them all"
            )
        world = self.world_size
        if world is not None and (isinstance(world, bool) or not isinstance(world, int) or world < 1):
            # Once, as an option: the rules would refuse every config for it, as if the configs were wrong.
            raise UsageError(
                f"hydra.launcher.world_size={world}: the devices each config is planned for are a whole number "
                "of at least 1; leave it out (null) to plan each config for dp x tp x pp devices. Nothing was "
                "planned or written."
            )
        if not is_megasweep_config(self.config):
            raise HydraException("hydra/launcher=plan plans megasweep configs (conf/config.yaml) only")
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        csv_file = sweep_dir / self.csv_name
        if self._first_index is None and self.append and csv_file.is_file():
            # Adding to a sweep: its earlier plan rows stay in the file (rewritten with the new ones, so a
            # row that does not read is refused here, not dropped).
            try:
                self.rows = read_plan_csv(csv_file)
            except (OSError, ValueError) as exc:
                raise UsageError(
                    f"hydra.launcher.append=true: the plan added to cannot be read ({exc}); nothing was planned or "
                    f"written. Mend or move {csv_file}, or plan into another directory (hydra.sweep.dir=...)."
                ) from None
        if self._first_index is None:  # a sweep's first batch; a later one is never empty
            refuse_empty_sweep(job_overrides)
        first = self.first_index(sweep_dir) + initial_job_idx
        composer = sweep_composer(self.hydra_context.config_loader, self.config)
        # Each config's output directory, named and checked as the slurm and local launchers do: against
        # the sweep added to and this sweep's earlier batches too.
        namer = subdir_namer(self.config, composer)
        self.named += [
            ManifestEntry(first + i, tuple(o), namer(first + i, o) if namer else str(first + i), "submitted")
            for i, o in enumerate(job_overrides)
        ]
        path = manifest_path(sweep_dir)
        check_output_dirs(merge_entries(read_manifest(path) if path.exists() else [], self.named))
        rows, plan_seconds = plan_sweep(
            composer,
            job_overrides,
            world_size=self.world_size,
            progress=progress_printer(self.progress_every, sys.stderr),
            paths=self.paths,
        )
        # Ranks compare every row planned so far: a later batch can hold a faster layout.
        self.rows = rank_predictions([*self.rows, *rows])
        rows = self.rows[len(self.rows) - len(rows):]
        csv_path = write_plan_csv(self.rows, csv_file)
        summary = summarize(rows, composer, plan_seconds)
        if self.table:
            print(format_plan_report(rows, summary, top=self.top, csv_name=self.csv_name))
        elif summary.infeasible:
            print(summary.rules_line())
        # Warnings, not refusals: the runs' nodes may see file systems this machine does not.
        say_path_warnings(self.paths)
        # A sweeper may launch in batches: later ones say which jobs they hold.
        jobs = f" (jobs {initial_job_idx}-{initial_job_idx + len(rows) - 1})" if initial_job_idx else ""
        print(f"{summary.line()}{jobs} -> {csv_path}", flush=True)
        if rows and not summary.feasible:
            raise NothingFeasible(
                f"Nothing would be submitted: all {len(rows)} configs are infeasible, by the rules above "
                f"(each config's reasons are in {csv_path}). Change the overrides those rules name and plan again."
            )
        task_name = str(self.config.hydra.job.name)
        return [
            JobReturn(
                overrides=list(overrides),
                task_name=task_name,
                status=JobStatus.COMPLETED,
                _return_value=row,
            )
            for overrides, row in zip(job_overrides, rows, strict=True)
        ]
