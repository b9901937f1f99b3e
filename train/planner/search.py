"""Layout search: every dp x tp x pp x micro-batch x recompute x ZeRO layout (with and without
sequence parallelism where tp > 1, interleaved over search.virtual_stages chunks where the pipeline
allows it) the planner accepts on
the searched node counts, ranked by the time model (`hydra/sweeper=layouts`).

Each candidate is judged by `plan_run`, the same judge as the dry run and the trainer, so a layout
the search hands to a launcher is one that runs. Tens of thousands of candidates take seconds: the
planner memoises memory, shapes and predictions on their frozen arguments, and candidates share
most of them.

Torch-free: the sweeper runs on login nodes.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from conf.schema import Engine, ParallelismConfig, Recompute, RunConfig, SearchConfig
from train.contract import PlanRow, join_overrides
from train.planner.perf import predict_time
from train.planner.plan import plan_run, rank_predictions, time_prediction
from train.planner.rules import reason_rule


@dataclass(frozen=True)
class Candidate:
    """One layout of the search, planned."""

    run: RunConfig
    row: PlanRow
    overrides: tuple[str, ...]
    """The `parallelism.*` overrides that give this layout on the command line."""


@dataclass(frozen=True)
class SearchResult:
    """The ranked feasible layouts and what was rejected, by rule."""

    ranked: list[Candidate]
    """Feasible layouts with a prediction, fastest first."""
    unpredicted: list[Candidate]
    """Feasible layouts the time model cannot predict (a figure of the hardware is unknown)."""
    rejected: Counter[str]
    """Infeasible candidates per broken rule (a candidate counts once per rule it breaks)."""
    candidates: int
    seconds: float
    unpredictable: Counter[str] = dataclasses.field(default_factory=Counter)
    """Unpredicted layouts per reason the time model gave (a missing figure, an unusable calibration)."""
    examples: dict[str, str] = dataclasses.field(default_factory=dict)
    """Per broken rule, the first rejected candidate's overrides and reason, as the dry run shows them."""
    nodes: tuple[int, ...] = ()
    """The node counts searched, fewest first."""


def search_problems(search: SearchConfig) -> list[str]:
    """What is wrong with `search`, one sentence per option (field, value, rule, example); [] when
    nothing is. An empty list leaves nothing to try and a zero micro-batch divides by zero, so the
    sweeper refuses both before searching."""
    problems = []
    lists: tuple[tuple[str, list[int], bool, str, str], ...] = (
        # (option, values, each allowed, what they are, an example)
        ("nodes", search.nodes, all(n >= 1 for n in search.nodes), "positive node counts", "[1,2,4]"),
        ("micro_batch_sizes", search.micro_batch_sizes, all(b >= 1 for b in search.micro_batch_sizes),
         "positive micro-batch sizes (samples)", "[1,2,4,8]"),
        ("zero_stages", search.zero_stages, all(z in (0, 1, 2, 3) for z in search.zero_stages),
         "ZeRO stages 0, 1, 2 or 3", "[0,1]"),
        ("virtual_stages", search.virtual_stages, all(v >= 1 for v in search.virtual_stages),
         "positive chunk counts per pipeline rank (1: not interleaved)", "[1,2]"),
    )  # fmt: skip
    for name, values, allowed, what, example in lists:
        if not values or not allowed:
            problems.append(f"search.{name}={list(values)} must be a non-empty list of {what}, e.g. search.{name}={example}")
    if not search.recompute:
        problems.append(
            "search.recompute=[] must be a non-empty list of recompute modes (none, selective, full), "
            "e.g. search.recompute=[none,full]"
        )
    for name, count, what in (("top_k", search.top_k, "layouts launched"), ("show", search.show, "layouts printed")):
        if count < 0:
            problems.append(f"search.{name}={count} must be a count >= 0 of {what}, e.g. search.{name}=3")
    return problems


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(run: RunConfig, search: SearchConfig) -> Iterator[tuple[int, ParallelismConfig]]:
    """(devices, layout) of every combination the search tries, before the planner judges it."""
    per_node = max(1, run.hardware.devices_per_node)
    base = run.parallelism
    # Each value once, in the order given: search.nodes=[1,1] planned and launched every layout twice.
    for nodes in dict.fromkeys(search.nodes):
        devices = nodes * per_node
        for tp in _divisors(devices):
            for pp in _divisors(devices // tp):
                if pp > run.model.num_layers:
                    continue
                dp = devices // (tp * pp)
                for mbs in dict.fromkeys(search.micro_batch_sizes):
                    for recompute in dict.fromkeys(search.recompute):
                        for zero in dict.fromkeys(search.zero_stages):
                            if zero and dp == 1:
                                continue  # ZeRO over one replica is the same layout as no ZeRO
                            # Sequence parallel splits tokens over TP, in the native engine only.
                            sps = sorted(set(search.sequence_parallel)) if tp > 1 and zero < 2 else [False]
                            chunks = _virtual_stages(run, search, pp=pp, dp=dp, mbs=mbs) if zero < 2 else [1]
                            for sp in sps or [False]:
                                for v in chunks:
                                    yield devices, dataclasses.replace(
                                        base, tp=tp, pp=pp, dp=dp, micro_batch_size=mbs, recompute=Recompute(recompute),
                                        zero_stage=zero, engine=Engine.deepspeed if zero >= 2 else Engine.native,
                                        rampup_batch_size=None, sequence_parallel=sp, virtual_stages=v,
                                    )  # fmt: skip


def _virtual_stages(run: RunConfig, search: SearchConfig, *, pp: int, dp: int, mbs: int) -> list[int]:
    """The searched virtual-stage counts this pipeline can interleave (always 1): pp > 1, every chunk
    the same whole number of layers, and whole groups of pp micro-batches per step. The rules say the
    same; skipping here keeps the search from planning layouts that cannot run."""
    if pp == 1:
        return [1]
    m, rem = divmod(run.parallelism.global_batch_size, mbs * dp)
    return sorted(
        {1} | {v for v in search.virtual_stages if v > 1 and run.model.num_layers % (pp * v) == 0 and not rem and m % pp == 0}
    )


def layout_overrides(par: ParallelismConfig) -> tuple[str, ...]:
    """The command-line overrides that select `par`'s layout."""
    return (
        f"parallelism.dp={par.dp}",
        f"parallelism.tp={par.tp}",
        f"parallelism.pp={par.pp}",
        f"parallelism.micro_batch_size={par.micro_batch_size}",
        f"parallelism.recompute={Recompute(par.recompute).value}",
        f"parallelism.zero_stage={par.zero_stage}",
        f"parallelism.engine={Engine(par.engine).value}",
        f"parallelism.sequence_parallel={str(par.sequence_parallel).lower()}",
        f"parallelism.virtual_stages={par.virtual_stages}",
        "parallelism.rampup_batch_size=null",  # planned without ramp-up: launched without it
    )


def search_layouts(run: RunConfig, search: SearchConfig) -> SearchResult:
    """Plan every layout of the search and rank the feasible ones by predicted seconds per iteration."""
    tic = time.perf_counter()
    feasible: list[Candidate] = []
    rejected: Counter[str] = Counter()
    examples: dict[str, str] = {}
    count = 0
    for devices, par in layouts(run, search):
        count += 1
        candidate = dataclasses.replace(run, parallelism=par)
        overrides = layout_overrides(par)
        row = plan_run(candidate, world_size=devices, world_fixed=True, overrides=join_overrides(overrides))
        if row.feasible:
            feasible.append(Candidate(candidate, row, overrides))
            continue
        for reason in row.reasons:
            rule = reason_rule(reason)
            if rule not in examples:
                examples[rule] = f"{row.overrides}: {reason.removeprefix(f'[{rule}] ')}"
        # A rule named twice in one row (two offending fields) is one candidate.
        rejected.update({reason_rule(reason) for reason in row.reasons})
    rows = rank_predictions([c.row for c in feasible])
    feasible = [dataclasses.replace(c, row=r) for c, r in zip(feasible, rows, strict=True)]
    ranked = sorted((c for c in feasible if c.row.pred_rank), key=lambda c: c.row.pred_sec_per_iter)
    unpredicted, unpredictable = _unpredicted([c for c in feasible if not c.row.pred_rank])
    return SearchResult(
        ranked, unpredicted, rejected, count, time.perf_counter() - tic, unpredictable, examples,
        tuple(sorted(set(search.nodes))),
    )  # fmt: skip


def _unpredicted(candidates: list[Candidate]) -> tuple[list[Candidate], Counter[str]]:
    """The candidates with the time model's reason in their warnings (search.csv), and the reasons
    counted: without them a missing figure and an unreadable calibration file read the same."""
    out: list[Candidate] = []
    reasons: Counter[str] = Counter()
    for c in candidates:
        # Memoised: the prediction plan_run already asked for, this time kept as its reason.
        prediction = time_prediction(c.run.model, c.run.parallelism, c.run.hardware, c.row.dp)
        reason = prediction if isinstance(prediction, str) else "the time model predicted no finite time"
        reasons[reason] += 1
        out.append(dataclasses.replace(c, row=dataclasses.replace(c.row, warnings=[*c.row.warnings, f"[unpredicted] {reason}"])))
    return out, reasons


def top_layouts(result: SearchResult, search: SearchConfig) -> list[Candidate]:
    """The layouts the sweeper launches: the search.top_k fastest, or with search.top_k_per_node_count
    the top_k fastest of each node count, fewest nodes first. Ranked over every node count, the most
    nodes nearly always win (the same work on more devices), so without it a search over [1,2,4]
    measures the 4-node layouts alone."""
    if not search.top_k_per_node_count:
        return result.ranked[: search.top_k]
    by_nodes: dict[int, list[Candidate]] = {}
    for c in result.ranked:
        by_nodes.setdefault(c.row.nodes, []).append(c)
    return [c for nodes in sorted(by_nodes) for c in by_nodes[nodes][: search.top_k]]


def scaling_lines(result: SearchResult) -> list[str]:
    """The fastest layout of each node count searched, with its speed-up and scaling efficiency against
    the fastest on the fewest nodes that have one: what more nodes buy for the same work; a node count
    without a ranked layout says why. [] for a search of one node count."""
    fastest: dict[int, Candidate] = {}
    for c in result.ranked:  # fastest first: the first of each node count is its best
        fastest.setdefault(c.row.nodes, c)
    counts = sorted(set(result.nodes) | set(fastest))
    if len(counts) < 2 or not fastest:
        return []
    unpredicted = Counter(c.row.nodes for c in result.unpredicted)
    first = min(fastest)
    base = fastest[first].row
    lines = [f"fastest per node count (speed-up and scaling efficiency against the fastest on {first} node(s)):"]
    for nodes in counts:
        if nodes not in fastest:
            why = f"{unpredicted[nodes]:,} feasible, none predicted" if unpredicted[nodes] else "no feasible layout"
            lines.append(f"  {nodes} node(s): {why}")
            continue
        r = fastest[nodes].row
        mfu = "" if math.isnan(r.pred_mfu) else f", MFU {100 * r.pred_mfu:.1f}%"
        speedup = base.pred_sec_per_iter / r.pred_sec_per_iter
        vs = "" if nodes == first else f", x{speedup:.2f} ({100 * speedup * first / nodes:.0f}% efficiency)"
        lines.append(f"  {nodes} node(s): rank {r.pred_rank}, {r.pred_sec_per_iter:.4g} s/it{mfu}{vs}")
    return lines


def _breakdown(candidate: Candidate, top: int = 3) -> str:
    run, row = candidate.run, candidate.row
    parts = predict_time(run.model, run.parallelism, run.hardware, dp=row.dp).parts
    biggest = sorted(((v, k) for k, v in parts.items() if v > 0), reverse=True)[:top]
    return ", ".join(f"{k} {100 * v / row.pred_sec_per_iter:.0f}%" for v, k in biggest)


def format_search(result: SearchResult, show: int) -> str:
    """The `show` fastest layouts with time, memory and where the time goes, then the rejections."""
    header = ("rank", "nodes", "DP", "TP", "PP", "VPP", "SP", "MBS", "recompute", "ZeRO", "pred s/it", "pred MFU %",
              "mem GiB / cap", "where the time goes")  # fmt: skip
    lines = [header]
    for c in result.ranked[:show]:
        r, par = c.row, c.run.parallelism
        mfu = "-" if math.isnan(r.pred_mfu) else f"{100 * r.pred_mfu:.1f}"
        lines.append((
            str(r.pred_rank), str(r.nodes), str(r.dp), str(r.tp), str(r.pp),
            str(par.virtual_stages) if par.virtual_stages > 1 else "-", "yes" if par.sequence_parallel else "-",
            str(r.micro_batch_size),
            Recompute(par.recompute).value, str(par.zero_stage), f"{r.pred_sec_per_iter:.4g}", mfu,
            f"{r.mem_gib:.1f} / {r.mem_capacity_gib:.1f}", _breakdown(c),
        ))  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    text = ["  ".join([*(f"{cell:>{w}}" for cell, w in zip(line, widths, strict=False)), line[-1]]) for line in lines]
    first = result.ranked[0].row if result.ranked else None
    what = f"{first.model} on {first.hardware}, global batch {first.global_batch_size}" if first else "no layout"
    summary = [
        f"search: {result.candidates:,} layouts in {result.seconds:.2f} s: {len(result.ranked):,} feasible and "
        f"ranked ({what}), {len(result.unpredicted):,} feasible but unpredicted, "
        f"{result.candidates - len(result.ranked) - len(result.unpredicted):,} rejected",
    ]
    summary += scaling_lines(result)
    impossible = sum(1 for c in result.ranked if c.row.pred_mfu > 1)
    if impossible:
        # Above 100% no layout runs: the time model's figures (a calibration, a peak) are wrong.
        summary.append(
            f"warning: {impossible:,} ranked layouts predict an MFU above 100%, which no run reaches: "
            "check hardware.calibration and the hardware's peak_tflops_* before trusting this ranking"
        )
    for reason, n in result.unpredictable.most_common():
        summary.append(f"unpredicted ({n:,}): {reason}")
    if result.rejected:
        summary.append("rejected by rule: " + ", ".join(f"{rule or 'other'} {n:,}" for rule, n in result.rejected.most_common()))
        # One example per rule, as the dry run gives: a count alone does not say what to change.
        summary += [f"  [{rule or 'other'}] e.g. {result.examples[rule]}" for rule, _ in result.rejected.most_common()
                    if rule in result.examples]  # fmt: skip
    return "\n".join([*text, *summary])


__all__ = [
    "Candidate", "SearchResult", "format_search", "layout_overrides", "layouts", "scaling_lines", "search_layouts",
    "search_problems", "top_layouts",
]  # fmt: skip
