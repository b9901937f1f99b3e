"""`python -m analysis calibrate <sweep dirs>`: fit the time model's few efficiency factors to measured runs.

Each finished run's config is predicted again (train.planner.perf) and its predicted seconds split
into three groups, the pipeline bubble shared among them as the stage time is:
- compute: the GEMMs, the attention core and recomputation;
- memory: pointwise ops, gradient accumulation, the optimizer step, offload;
- communication: TP, PP and DP transfers.

A least-squares fit of measured = f_compute x compute + f_memory x memory + f_comm x communication,
each run's residual relative to its measured time (the error the fit is judged by; runs of one sweep
differ in length by orders of magnitude, and in seconds the longest set the factors alone)
(factors kept non-negative; a group no run exercises is left at 1; a group driven to 0 makes the fit
unusable: it says so, and the exit status is 1) says how far each part of the model
is from this site, e.g. f_compute = 1.3: GEMMs ran 30% slower than predicted, so
hardware.gemm_efficiency / 1.3 predicts them. It prints the factors, each run's predicted, fitted
and measured seconds, and the mean absolute error before and after. Learning from what was
measured is the point; fitting on one sweep and checking on another is how to trust it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from omegaconf.errors import OmegaConfBaseException

from analysis.records import AnalysisError, read_records, sweep_labels
from conf.schema import to_run_config
from train.contract import EXIT_USAGE, RESULT_FILE, unwritable
from train.planner.perf import UnknownHardwareFigure, predict_time

GROUPS: dict[str, tuple[str, ...]] = {
    "compute": ("gemm", "attention", "recompute", "framework"),
    "memory": ("memory_bound", "grad_accumulation", "optimizer", "offload"),
    "communication": ("tp_comm", "pp_comm", "dp_comm"),
}
"""The factors fitted, and the parts of train.planner.perf.PARTS each scales."""


@dataclass(frozen=True)
class Point:
    """One measured run: its predicted seconds per group and its measured seconds per iteration."""

    run_dir: str
    label: str
    """The run's model and layout."""
    groups: dict[str, float]
    measured: float
    where: str
    """The run's directory as the table shows it: below its sweep, whose name leads when there are several."""

    @property
    def predicted(self) -> float:
        return sum(self.groups.values())


@dataclass(frozen=True)
class Fit:
    """Factors per group and the points they were fitted to."""

    factors: dict[str, float]
    points: list[Point]
    clipped: tuple[str, ...] = ()
    """Groups the runs exercise whose least-squares factor came out negative, held at 0: the fit
    then says that part takes no time, which no hardware does (and gemm_efficiency / 0 is no
    efficiency). Such factors are not to be applied; main exits 1."""

    def fitted(self, p: Point) -> float:
        return sum(self.factors[g] * v for g, v in p.groups.items())

    def mae(self, *, fitted: bool) -> float:
        return statistics.mean(abs((self.fitted(p) if fitted else p.predicted) / p.measured - 1) for p in self.points)


STEP_PARTS = ("dp_comm", "optimizer", "offload")
"""Parts paid once per step, outside the pipeline's stage times."""


def _groups(parts: dict[str, float]) -> dict[str, float]:
    groups = {g: sum(parts.get(k, 0.0) for k in keys) for g, keys in GROUPS.items()}
    # The bubble is idle slots of whole stage times: shared as a stage spends, the parts paid once
    # per step left out of the shares.
    in_stage = {g: sum(parts.get(k, 0.0) for k in keys if k not in STEP_PARTS) for g, keys in GROUPS.items()}
    total = sum(in_stage.values())
    if total > 0:
        for g in groups:
            groups[g] += parts.get("bubble", 0.0) * in_stage[g] / total
    return groups


def points(sweep_dirs: Sequence[Path]) -> tuple[list[Point], list[str]]:
    """The finished, timed runs of the sweeps, predicted; and why others were left out."""
    out: list[Point] = []
    skipped: list[str] = []
    # One line per reason, not per record: a CPU sweep's every record gave the same 400-character line.
    unpredicted: dict[str, list[Path]] = {}
    # Runs of one layout repeat across and within sweeps: the directory tells their rows apart.
    several = len(sweep_dirs) > 1
    for sweep, sweep_label in zip(sweep_dirs, sweep_labels(sweep_dirs), strict=True):
        if not sweep.exists():
            raise AnalysisError(f"sweep directory {sweep} does not exist")
        if not sweep.is_dir():
            raise AnalysisError(f"{sweep} is not a directory: give sweep directories")
        # The analysis' own reader: what it cannot read is skipped with the warning it gives there.
        for record in read_records(sweep, skipped):
            path = sweep / record["run_dir"] / RESULT_FILE
            measured = record.get("sec_per_iter")
            if record.get("status") != "ok" or not isinstance(measured, int | float) or not measured > 0:
                continue
            if not isinstance(record.get("config"), dict):
                skipped.append(f"{path}: the record has no config; ignored")
                continue
            try:
                run = to_run_config(record["config"])
                world = record.get("world")
                dp = int((world.get("dp") if isinstance(world, dict) else None) or 1)
                parts = predict_time(run.model, run.parallelism, run.hardware, dp=dp).parts
            except (UnknownHardwareFigure, OmegaConfBaseException, ValueError, TypeError, KeyError) as exc:
                # omegaconf's messages run over several lines (key, type, value): the first says it.
                unpredicted.setdefault(str(exc).partition("\n")[0], []).append(path)
                continue
            p = run.parallelism
            label = f"{run.model.name} dp{dp} tp{p.tp} pp{p.pp} mbs{p.micro_batch_size} {p.recompute.value}"
            # What else a layout search varies: without it, runs with and without SP read alike.
            label += " sp" * p.sequence_parallel + f" v{p.virtual_stages}" * (p.virtual_stages > 1)
            label += f" zero{p.zero_stage}" * (p.zero_stage > 0)
            where = record["run_dir"]
            if several:
                where = sweep_label if where == "." else f"{sweep_label}/{where}"
            out.append(Point(str(path.parent), label, _groups(parts), float(measured), where))
    for why, paths in unpredicted.items():
        more = f" and {len(paths) - 1} other record(s)" if len(paths) > 1 else ""
        skipped.append(f"{paths[0]}{more}: the record's config cannot be predicted ({why}); ignored")
    return out, skipped


def fit(data: list[Point]) -> Fit:
    """Least squares of the relative error (fitted / measured - 1) over the groups; factors clipped positive,
    unused groups at 1. Relative, not seconds: the fit is judged by the relative error it prints (Fit.mae),
    and runs of one sweep differ in length by orders of magnitude; fitted in seconds, the longest runs set
    the factors alone, and a CPU sweep printed a fitted error worse than the prediction's (66.8% as
    predicted, 100.1% fitted)."""
    if not data:
        raise AnalysisError("no finished run with a measured sec/it and a prediction: nothing to fit")
    used = [g for g in GROUPS if any(p.groups[g] > 0 for p in data)]
    # Each run's row divided by its measured time: the residuals are then its relative errors.
    y = np.ones(len(data))
    weight = np.array([1.0 / p.measured for p in data])
    if np.linalg.matrix_rank(np.array([[p.groups[g] for g in used] for p in data])) < len(used):
        raise AnalysisError(
            f"{len(data)} runs cannot separate the {len(used)} factors ({', '.join(used)}): measure layouts "
            "that differ in how much they compute, move through memory and communicate"
        )
    # Non-negative least squares by elimination: a group whose factor comes out negative is
    # dropped (its factor 0) and the others are fitted again without it.
    factors = dict.fromkeys(GROUPS, 1.0)
    clipped: list[str] = []
    while used:
        a = np.array([[p.groups[g] for g in used] for p in data]) * weight[:, None]
        solution, *_ = np.linalg.lstsq(a, y, rcond=None)
        if (solution >= 0).all():
            factors.update({g: float(f) for g, f in zip(used, solution, strict=True)})
            break
        dropped = used[int(np.argmin(solution))]
        factors[dropped] = 0.0
        clipped.append(dropped)
        used = [g for g in used if g != dropped]
    return Fit(factors, data, tuple(clipped))


def format_fit(result: Fit) -> str:
    """The factors, every run's predicted / fitted / measured seconds, and the errors."""
    lines = ["factors (measured / predicted, per group): " + ", ".join(f"{g} {f:.3g}" for g, f in result.factors.items())]
    width = max(len(p.label) for p in result.points)
    lines.append(f"{'run':<{width}}  {'pred s/it':>10}  {'fitted':>10}  {'measured':>10}  {'error':>7}  {'fitted':>7}  dir")
    for p in sorted(result.points, key=lambda p: p.measured):
        fitted = result.fitted(p)
        lines.append(
            f"{p.label:<{width}}  {p.predicted:10.4g}  {fitted:10.4g}  {p.measured:10.4g}  "
            f"{p.predicted / p.measured - 1:+7.1%}  {fitted / p.measured - 1:+7.1%}  {p.where}"
        )
    lines.append(
        f"mean absolute error: {result.mae(fitted=False):.1%} as predicted, {result.mae(fitted=True):.1%} fitted "
        f"({len(result.points)} runs, {len(result.factors)} factors: check them on a sweep they were not fitted to)"
    )
    if result.clipped:
        names = ", ".join(result.clipped)
        lines.append(
            f"not usable: the least-squares fit made {names} negative, held at 0 (that part taking no time): "
            f"these {len(result.points)} runs do not tell the groups apart; do not apply these factors, "
            "measure layouts that differ more in how much they compute, move through memory and communicate"
        )
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis calibrate", description=__doc__.split("\n")[0])
    parser.add_argument("sweeps", nargs="+", type=Path, help="sweep directories with finished runs")
    parser.add_argument("--json", type=Path, default=None, help="also write the factors and points here")
    args = parser.parse_args(argv)
    if args.json is not None and (why := unwritable(args.json.parent)) is not None:
        # Before the fit, which can take a while: not after printing it, with the file never written.
        print(f"error: --json {args.json}: cannot write there ({why})", file=sys.stderr)
        return EXIT_USAGE
    try:
        data, skipped = points(args.sweeps)
        # Before the fit: when nothing is left to fit, what was skipped says why.
        for why in skipped:
            print(f"warning: {why}", file=sys.stderr)
        result = fit(data)
    except AnalysisError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(format_fit(result))
    if args.json is not None:
        payload = {"factors": result.factors, "clipped": list(result.clipped), "mae_predicted": result.mae(fitted=False),
                   "mae_fitted": result.mae(fitted=True),
                   "points": [{"run_dir": p.run_dir, "groups": p.groups, "measured": p.measured} for p in data]}  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
    usable = not result.clipped and all(math.isfinite(f) for f in result.factors.values())
    return 0 if usable else 1


__all__ = ["GROUPS", "Fit", "Point", "fit", "format_fit", "main", "points"]

if __name__ == "__main__":  # `python -m analysis.calibrate`, as `python -m analysis calibrate`
    sys.exit(main(sys.argv[1:]))
