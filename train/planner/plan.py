"""One row per config: feasibility, size, memory, GEMM shape efficiency and FLOPs, before any run.

`plan_run` combines the arithmetic modules (sizes, rules, memory, shapes, flops) into a
`PlanRow` (train.contract, which also writes plan.csv for the analysis); `format_plan_table`
prints rows for the console. A sweep of thousands of layouts is planned in seconds: the expensive
parts (memory estimate, per-GEMM shape report) are memoised on their frozen arguments, and
layouts of one sweep share most of them.

Torch-free: the launcher plans on login nodes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TypeVar

from conf.schema import (
    HardwareConfig,
    ModelConfig,
    ParallelismConfig,
    Precision,
    Recompute,
    RunConfig,
    requested_micro_batch,
)
from train.contract import REASON_SEPARATOR, PlanRow, split_overrides
from train.planner.flops import hardware_flops_per_iteration, model_flops_per_iteration, peak_tflops
from train.planner.layout import shown_dp
from train.planner.memory import estimated_memory, usable_bytes
from train.planner.perf import TimePrediction, UnknownHardwareFigure, predict_time
from train.planner.rules import RULES, Violation, advise, reason_rule, resolve_auto_micro_batch, validate
from train.planner.shapes import shape_efficiency
from train.planner.sizes import total_params

T = TypeVar("T")

GIB = 2**30
NAN = float("nan")

def _is_pos_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _option(value: object) -> str:
    # The config may hold the enum or, for a value the rules refuse, the string as typed.
    return value.value if isinstance(value, Enum) else str(value)


@functools.lru_cache(maxsize=1 << 14)
def _quant_efficiency(model: ModelConfig, par: ParallelismConfig, hw: HardwareConfig) -> float:
    # The report's efficiency without its warnings and hidden-size advisor, which the row does not show.
    return shape_efficiency(model, par, hw)


@functools.lru_cache(maxsize=1 << 14)
def _flops(model: ModelConfig, global_batch_size: int, recompute: Recompute, tp: int) -> tuple[float, float]:
    return (
        model_flops_per_iteration(model, global_batch_size=global_batch_size, tp=tp),
        hardware_flops_per_iteration(model, global_batch_size=global_batch_size, recompute=recompute, tp=tp),
    )


@functools.lru_cache(maxsize=1 << 14)
def _prediction(model: ModelConfig, par: ParallelismConfig, hw: HardwareConfig, dp: int) -> TimePrediction | str:
    try:
        return predict_time(model, par, hw, dp=dp)
    except (UnknownHardwareFigure, ValueError) as exc:
        # A CPU's peak and bandwidth are measured, not known to the planner; an unreadable
        # calibration file leaves the row unpredicted too. The message says which.
        return str(exc)
    except (TypeError, KeyError, ZeroDivisionError) as exc:
        return f"the time model cannot read this config ({type(exc).__name__}: {exc})"


def time_prediction(model: ModelConfig, par: ParallelismConfig, hw: HardwareConfig, dp: int) -> TimePrediction | str:
    """The time model's prediction of `par` on `dp` replicas of `hw`, as the dry run makes it, or
    one line saying why there is none (a CPU's peak is measured at run time, a figure is unknown,
    the calibration file is unreadable). Memoised: layouts differing only in fields the time model
    does not read share one prediction, so a sweep (or an analysis) of thousands is cheap."""
    mbs = requested_micro_batch(par)
    if isinstance(mbs, str):
        return f"parallelism.micro_batch_size={mbs!r} was never resolved to a size, which the time model needs"
    key = ParallelismConfig(
        tp=par.tp, pp=par.pp, micro_batch_size=mbs, global_batch_size=par.global_batch_size,
        zero_stage=par.zero_stage, offload=par.offload, recompute=par.recompute, precision=par.precision,
        engine=par.engine, sequence_parallel=par.sequence_parallel, virtual_stages=par.virtual_stages,
    )  # fmt: skip
    return _prediction(model, key, hw, dp)


def _predicted(
    model: ModelConfig, par: ParallelismConfig, hw: HardwareConfig, dp: int, model_flops: float, devices: int
) -> tuple[float, float, float, str]:
    """(seconds per iteration, model TFLOP/s per device, MFU, why none) the time model predicts; NaN
    and the reason when it cannot."""
    prediction = time_prediction(model, par, hw, dp)
    if isinstance(prediction, str):
        return NAN, NAN, NAN, prediction
    if not devices:
        return NAN, NAN, NAN, "no device to run on"
    tflops = model_flops / (prediction.sec_per_iter * devices) / 1e12
    peak = peak_tflops(hw, Precision(par.precision))
    return prediction.sec_per_iter, tflops, tflops / peak if peak else NAN, ""


def _shape_key(par: ParallelismConfig) -> ParallelismConfig:
    # The per-rank GEMM shapes depend on tp, the micro-batch and the precision (alignment) only;
    # keeping just those lets every layout of a sweep that shares them share one report.
    return ParallelismConfig(tp=par.tp, micro_batch_size=par.mbs, precision=par.precision)


def plan_run(
    run: RunConfig, *, world_size: int | None = None, world_fixed: bool = False, overrides: str = ""
) -> PlanRow:
    """The plan of one config on world_size devices (None: dp from the config, or 1); world_fixed: those
    devices are given (hydra.launcher.world_size, a search's node count), so a fix's advice keeps them
    (validate).

    micro_batch_size=auto is planned at the size validation resolves it to (the row shows it).
    """
    run = resolve_auto_micro_batch(run, world_size=world_size)
    m, par, hw = run.model, run.parallelism, run.hardware
    violations: list[Violation] = validate(run, world_size=world_size, world_fixed=world_fixed)
    rules = {v.rule for v in violations}
    dp = shown_dp(par, world_size)
    # An `auto` that found no size (or a bad string) leaves nothing to estimate memory or shapes for.
    mbs = requested_micro_batch(par)
    sized = not isinstance(mbs, str)
    # Positive sizes, a paddable vocabulary and a known precision are what every figure below needs.
    known_precision = par.precision in {p.value for p in Precision}
    sane = known_precision and not rules & {"positive", "vocab_padding"}
    if world_size is not None and _is_pos_int(world_size):
        devices = world_size
    elif sane:
        devices = dp * par.tp * par.pp
    else:
        devices = 0
    per_node = hw.devices_per_node if _is_pos_int(hw.devices_per_node) else 1
    shapes_ok = sane and not rules & {
        "hidden_divisible_by_heads",
        "heads_divisible_by_tp",
        "hidden_divisible_by_tp",
        "ffn_divisible_by_tp",
    }

    mem_gib = NAN
    if sized and sane and not rules & {"world_size", "zero_stage"} and par.pp <= m.num_layers:
        mem_gib = estimated_memory(m, par, dp, hw).needed / GIB
    quant = _quant_efficiency(m, _shape_key(par), hw) if shapes_ok and sized else NAN
    # The model's FLOPs need whole heads but not a valid TP split (tp only pads the vocabulary).
    flops = (NAN, NAN)
    if sane and "hidden_divisible_by_heads" not in rules:
        flops = _flops(m, par.global_batch_size, Recompute(par.recompute), par.tp)
    predicted = (NAN, NAN, NAN, "")
    if not violations:
        predicted = _predicted(m, par, hw, dp, flops[0], devices)
    return PlanRow(
        feasible=not violations,
        reasons=[str(v) for v in violations],
        warnings=[str(a) for a in advise(run)] if not violations else [],
        model=m.name,
        hardware=hw.name,
        nodes=math.ceil(devices / per_node),
        devices=devices,
        dp=dp,
        tp=par.tp,
        pp=par.pp,
        virtual_stages=par.virtual_stages,
        sequence_parallel=bool(par.sequence_parallel),
        recompute=_option(par.recompute),
        zero_stage=par.zero_stage,
        offload=_option(par.offload),
        precision=_option(par.precision),
        engine=_option(par.engine),
        micro_batch_size=mbs if isinstance(mbs, int) else 0,
        global_batch_size=par.global_batch_size,
        params=total_params(m, par.tp if _is_pos_int(par.tp) else 1) if sane else 0,
        mem_gib=mem_gib,
        mem_capacity_gib=usable_bytes(hw) / GIB,
        quant_efficiency=quant,
        model_flops_per_iter=flops[0],
        hardware_flops_per_iter=flops[1],
        pred_sec_per_iter=predicted[0],
        pred_tflops=predicted[1],
        pred_mfu=predicted[2],
        overrides=overrides,
        pred_note=predicted[3],
        seq_length=m.seq_length,
    )


WorkKey = tuple[str, tuple[str, ...], int, int]
"""train.planner.plan.work_key's value: model name, its field overrides, global batch, sequence length."""


def work_key(row: PlanRow) -> WorkKey:
    """What makes two rows the same work, whose layouts are ranked against each other: the model (its
    name and the overrides that change its fields: model.kind=bert of gpt_350m is another model), the
    global batch (samples) and the sequence length (tokens)."""
    return (row.model, model_changes(row.overrides), row.global_batch_size, row.seq_length)


@functools.lru_cache(maxsize=4096)
def model_changes(overrides: str) -> tuple[str, ...]:
    """The overrides (PlanRow.overrides) that change a field of the model group's choice, as typed,
    without `model.` ('kind=bert'), sorted (typed in another order, the same model is the same work);
    model.seq_length has its own column and key part. A sweep repeats the same few override strings per
    model, hence the cache."""
    changes = []
    for item in split_overrides(overrides):
        key, sep, value = item.lstrip("+~").partition("=")
        if key.startswith("model.") and key != "model.seq_length":
            changes.append(f"{key.removeprefix('model.')}{sep}{value}")
    return tuple(sorted(changes))


def model_cell(row: PlanRow) -> str:
    """The model as the tables name it: its name, and the fields its overrides change, which make it
    another model ('gpt_350m(kind=bert)'), so that rows ranked apart read apart."""
    changes = model_changes(row.overrides)
    return f"{row.model}({','.join(changes)})" if changes else row.model


def rank_predictions(rows: Sequence[PlanRow]) -> list[PlanRow]:
    """The rows in their order, each feasible predicted one ranked (pred_rank, 1 = fastest) among
    the rows that do the same work (work_key): the same model, global batch and sequence length (a longer
    sequence is more work per sample, and its layouts were ranked among the shorter one's)."""
    groups: dict[WorkKey, list[int]] = {}
    for i, row in enumerate(rows):
        if row.feasible and math.isfinite(row.pred_sec_per_iter):
            groups.setdefault(work_key(row), []).append(i)
    ranks = dict.fromkeys(range(len(rows)), 0)
    for members in groups.values():
        for rank, i in enumerate(sorted(members, key=lambda i: rows[i].pred_sec_per_iter), start=1):
            ranks[i] = rank
    # A row whose rank stays is kept as it is: copying 10,000 rows is a tenth of a second.
    return [row if row.pred_rank == ranks[i] else dataclasses.replace(row, pred_rank=ranks[i]) for i, row in enumerate(rows)]


def table_order(rows: Sequence[PlanRow]) -> list[PlanRow]:
    """Feasible rows first, fastest predicted first (unpredicted after), then the infeasible ones."""
    def key(row: PlanRow) -> tuple[int, float]:
        t = row.pred_sec_per_iter
        return (0 if row.feasible else 1, t if math.isfinite(t) else math.inf)

    return sorted(rows, key=key)


@dataclass(frozen=True)
class RuleCount:
    """How many infeasible configs break one rule, with the first of them as an example."""

    rule: str
    """Rule identifier (train.planner.rules.RULES)."""
    configs: int
    """Infeasible configs breaking it (configs)."""
    example: PlanRow
    """The first such config, in the rows' order."""

    @property
    def message(self) -> str:
        """The example's reason for this rule, without the '[rule] ' prefix."""
        text = next(r for r in self.example.reasons if reason_rule(r) == self.rule)
        return text[len(self.rule) + 3:] if text.startswith(f"[{self.rule}] ") else text


def infeasible_by_rule(rows: Sequence[PlanRow]) -> list[RuleCount]:
    """Per broken rule, the infeasible rows breaking it: most common first, ties in RULES order.

    A row breaking two rules counts under both, so the counts can add up to more than the rows.
    """
    broken = ((row, [reason_rule(r) for r in row.reasons]) for row in rows if not row.feasible)
    return [RuleCount(rule, n, example) for rule, n, example in count_by_rule(broken)]


def count_by_rule(items: Iterable[tuple[T, Iterable[str]]]) -> list[tuple[str, int, T]]:
    """(rule, items breaking it, the first of them) for the (item, rules it breaks) given: most
    common first, ties in RULES order; a rule named twice for one item (two offending fields)
    counts once."""
    counts: dict[str, int] = {}
    examples: dict[str, T] = {}
    for item, rules in items:
        for rule in dict.fromkeys(rules):
            counts[rule] = counts.get(rule, 0) + 1
            examples.setdefault(rule, item)
    order = {rule: i for i, rule in enumerate(RULES)}
    ranked = sorted(counts, key=lambda rule: (-counts[rule], order.get(rule, len(order)), rule))
    return [(rule, counts[rule], examples[rule]) for rule in ranked]


def rule_example(rule: str, configs: int, index: int, overrides: Sequence[str], problem: str) -> str:
    """One rule's part of a summary of infeasible configs: '[rule] N config(s), e.g. config I (its
    overrides): its problem with that rule'; the Slurm and local launchers' skipped-config lines and Hydra's
    basic launcher's refusal say it alike."""
    return f"[{rule}] {configs} config(s), e.g. config {index} ({' '.join(overrides) or 'no overrides'}): {problem}"


# --------------------------------------------------------------------------------------
# Console table


def format_params(n: int) -> str:
    """Parameter count with a unit, as papers write it: 124M, 1.3B, 175B, 1.1T."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            value = n / scale
            return f"{value:.0f}{unit}" if value >= 100 else f"{value:.3g}{unit}"
    return str(n)


def _num(value: float, spec: str) -> str:
    return "-" if math.isnan(value) else format(value, spec)


_TABLE_COLUMNS: tuple[tuple[str, str], ...] = (
    # (header, alignment): numbers right-aligned so magnitudes line up.
    ("status", "<"),
    ("model", "<"),
    ("hw", "<"),
    ("nodes", ">"),
    ("DP", ">"),
    ("TP", ">"),
    ("PP", ">"),
    ("VPP", ">"),
    ("SP", ">"),
    ("MBS", ">"),
    ("GBS", ">"),
    ("seq", ">"),
    ("recompute", ">"),
    ("ZeRO", ">"),
    ("offload", ">"),
    ("prec", ">"),
    ("engine", ">"),
    ("params", ">"),
    ("mem GiB / cap", ">"),
    ("quant eff %", ">"),
    ("PFLOP/iter", ">"),
    ("pred s/it", ">"),
    ("pred MFU %", ">"),
    ("rank", ">"),
    ("reasons", "<"),
)
_SHOWN_WHEN_VARYING = frozenset({"seq", "offload", "prec", "engine"})
"""Columns shown only when the rows differ in them: rarely swept, and the table is wide already
(a sequence length swept makes rows of a model look alike, each ranked among its own length's).
The layout columns (SP, recompute, ZeRO) are always shown, as the search's table shows them."""


def _table_cells(row: PlanRow) -> list[str]:
    return [
        "ok" if row.feasible else "INFEASIBLE",
        model_cell(row),
        row.hardware,
        str(row.nodes),
        str(row.dp),
        str(row.tp),
        str(row.pp),
        str(row.virtual_stages) if row.virtual_stages > 1 else "-",
        "yes" if row.sequence_parallel else "-",
        str(row.micro_batch_size),
        str(row.global_batch_size),
        str(row.seq_length) if row.seq_length else "-",
        row.recompute,
        str(row.zero_stage),
        row.offload,
        row.precision,
        row.engine,
        format_params(row.params),
        f"{_num(row.mem_gib, '.1f')} / {row.mem_capacity_gib:.1f}",
        _num(100 * row.quant_efficiency, ".1f"),
        _num(row.model_flops_per_iter / 1e15, ".3g"),
        _num(row.pred_sec_per_iter, ".4g"),
        _num(100 * row.pred_mfu, ".1f"),
        str(row.pred_rank) if row.pred_rank else "-",
        REASON_SEPARATOR.join(row.reasons or row.warnings),
    ]


def format_plan_table(rows: Sequence[PlanRow]) -> str:
    """Fixed-width table of rows, one line each under a header; reasons come last, unpadded.

    Every layout option is shown: SP, recompute and ZeRO always, the sequence length, offload,
    precision and engine when the rows do not all share them. Other overrides are in plan.csv's
    `overrides`."""
    body = [_table_cells(r) for r in rows]
    shown = [
        i for i, (header, _) in enumerate(_TABLE_COLUMNS)
        if header not in _SHOWN_WHEN_VARYING or len({line[i] for line in body}) > 1
    ]
    cells = [[_TABLE_COLUMNS[i][0] for i in shown]] + [[line[i] for i in shown] for line in body]
    aligns = [_TABLE_COLUMNS[i][1] for i in shown]
    widths = [max(len(line[i]) for line in cells) for i in range(len(shown) - 1)]
    lines = []
    for line in cells:
        # The last column (reasons) has no width: it is free text and is left unpadded.
        padded = [format(line[i], f"{aligns[i]}{w}") for i, w in enumerate(widths)]
        lines.append("  ".join(padded + [line[-1]]).rstrip())
    return "\n".join(lines)


__all__ = [
    "RuleCount",
    "format_params",
    "format_plan_table",
    "infeasible_by_rule",
    "plan_run",
    "rank_predictions",
    "table_order",
    "time_prediction",
    "work_key",
    "WorkKey",
    "model_cell",
    "model_changes",
]
