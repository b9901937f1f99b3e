"""Feasibility rules of a run's layout: the one place that judges whether a config can run.

`validate` returns one `Violation` per broken rule, in a stable order, each with a message
that names the fields and values involved, says why the rule exists, and lists values that
would work. Every entry point asks it, and only it: `python -m train` (with the real world
size, before any worker starts), the dry run (`hydra/launcher=plan`), the Slurm and local
launchers (before anything is submitted) and `python -m launchers sbatch`. All of them show a
violation as `[rule] message`, so a config refused in one place is refused, with the same
words, in every other; the trainer keeps only true runtime invariants of its own. The
messages are written for the person who will edit the config, and never contain "; " (the
planner's CSV joins reasons with it).

`advise` returns `Advisory` notes for layouts that run but are probably not what the user
wants (a TP group spanning nodes): the dry run prints them, the trainer records them.

Rules that need a value another rule rejected (a zero tp, a dp that the world size cannot
give) are not evaluated: one mistake yields one message, not a cascade.

Torch-free: the launcher runs this on login nodes.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from conf.schema import (
    AUTO_MICRO_BATCH,
    ClusterConfig,
    Engine,
    HardwareConfig,
    ModelConfig,
    Offload,
    OptimizerImpl,
    ParallelismConfig,
    Precision,
    Recompute,
    RunConfig,
    TrainingConfig,
    requested_micro_batch,
)
from train.planner.calibration import load_calibration
from train.planner.layout import Layout, LayoutError
from train.planner.memory import estimated_memory, estimated_variants, predicts_oom, usable_bytes
from train.planner.micro_batch import resolve_micro_batch
from train.planner.sizes import padded_vocab_size

GIB = 2**30

# Rule identifiers, in the order `validate` reports them.
RULES: tuple[str, ...] = (
    "positive",
    "train_iters",
    "warmup_iters",
    "training_values",
    "hardware_figures",
    "cluster_settings",
    "micro_batch_size",
    "hidden_divisible_by_heads",
    "heads_divisible_by_tp",
    "hidden_divisible_by_tp",
    "ffn_divisible_by_tp",
    "sequence_parallel_needs_tp",
    "seq_divisible_by_tp",
    "vocab_padding",
    "layers_divisible_by_pp",
    "virtual_stages_need_pp",
    "layers_divisible_by_virtual_stages",
    "world_size",
    "whole_nodes",
    "global_batch_divisible",
    "rampup_batch_size",
    "interleaved_micro_batches",
    "zero_stage",
    "offload_requires_zero",
    "deepspeed_no_pipeline",
    "deepspeed_checkpoint",
    "deepspeed_fp16_on_cpu",
    "native_zero_stage",
    "native_offload",
    "sequence_parallel_native_only",
    "virtual_stages_native_only",
    "precision_supported",
    "apex_needs_cuda",
    "micro_batch_auto",
    "memory",
)

# How many alternatives a message lists at most; the ones nearest the rejected value win.
_MAX_ALTERNATIVES = 12


# Advisory identifiers (a layout that runs, with a caveat), in the order `advise` reports them.
ADVISORIES: tuple[str, ...] = ("tp_across_nodes", "ignored_option", "calibration_ranks_per_node")


@dataclass(frozen=True)
class Violation:
    """One broken rule: its identifier, the offending fields with their values, and advice."""

    rule: str
    fields: dict[str, object]
    message: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.message}"


@dataclass(frozen=True)
class Advisory:
    """A layout that runs but costs something the user may not intend: identifier, fields, why."""

    rule: str
    fields: dict[str, object]
    message: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.message}"


def reason_rule(reason: str) -> str:
    """The rule a Violation's or Advisory's text names ('[memory] Predicted ...' -> 'memory'); '' for none.

    plan.csv keeps reasons as text (train.contract.PlanRow): this reads the rule back from it.
    """
    if reason.startswith("["):
        end = reason.find("]")
        if end > 1:
            return reason[1:end]
    return ""


class InfeasibleConfig(ValueError):
    """A run that cannot start; str() is one paragraph listing every violation."""

    def __init__(self, violations: Sequence[Violation]) -> None:
        self.violations: list[Violation] = list(violations)
        super().__init__(self._paragraph())

    def _paragraph(self) -> str:
        n = len(self.violations)
        if n == 0:
            return "infeasible config (no violation recorded)"
        if n == 1:
            return f"infeasible config: {self.violations[0]}"
        listed = " ".join(f"({i}) {v}" for i, v in enumerate(self.violations, start=1))
        return f"infeasible config, {n} problems: {listed}"

    def __str__(self) -> str:
        return self._paragraph()

    # A launcher pickles the exception across processes; rebuild it from the violations,
    # not from the formatted paragraph that Exception.args would otherwise hold.
    def __reduce__(self) -> tuple[type[InfeasibleConfig], tuple[list[Violation]]]:
        return (type(self), (self.violations,))


def rule_problem(paragraph: str, rule: str) -> str | None:
    """The words of `rule`'s violation in an InfeasibleConfig paragraph (as a manifest or plan.csv
    keeps it), without the rule's name; None when the paragraph does not name that rule. A summary by
    rule shows its example's problem with that rule, not the example's other ones too."""
    start = paragraph.find(f"[{rule}] ")
    if start < 0:
        return None
    start += len(rule) + 3
    after = _NEXT_PROBLEM.search(paragraph, start)
    return paragraph[start : after.start() if after else len(paragraph)].strip()


_NEXT_PROBLEM = re.compile(r" \(\d+\) \[[a-z0-9_]+\] ")
"""Where the next violation of a paragraph of several starts: ' (k) [rule] ' (InfeasibleConfig)."""


# --------------------------------------------------------------------------------------
# Small arithmetic helpers


def _is_pos_int(value: object) -> bool:
    # bool is an int subclass, and True would otherwise pass as tp=1.
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_nonneg_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending ([] for n <= 0)."""
    if n <= 0:
        return []
    small, large = [], []
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
    return small + large[::-1]


def _nearest(values: Iterable[int], target: int, count: int = _MAX_ALTERNATIVES) -> list[int]:
    """The `count` values closest to target (ties to the smaller), returned ascending."""
    chosen = sorted(set(values), key=lambda v: (abs(v - target), v))[:count]
    return sorted(chosen)


def _fmt(values: Sequence[int]) -> str:
    return ", ".join(str(v) for v in values)


def _multiples_near(value: int, step: int, count: int = 4) -> list[int]:
    """The `count` positive multiples of step nearest to value (value itself excluded), ascending."""
    below = value // step
    candidates = [k * step for k in range(max(1, below - count), below + count + 1)]
    return _nearest([c for c in candidates if c != value], value, count)


def valid_tp(model: ModelConfig) -> list[int]:
    """TP degrees the model's shapes allow: common divisors of heads, hidden and FFN widths.

    The padded vocabulary always splits evenly (it is padded to a multiple of tp), so it
    adds no constraint here.
    """
    return divisors(math.gcd(model.num_attention_heads, model.hidden_size, model.ffn))


def valid_pp(model: ModelConfig) -> list[int]:
    """Pipeline degrees that give every stage the same whole number of layers."""
    return divisors(model.num_layers)


# --------------------------------------------------------------------------------------
# The rules. Each returns a Violation or None; `validate` runs them in RULES order.


def _listed(bad: dict[str, object]) -> str:
    """'a.b=1, c.d=None': the offending fields as a message names them."""
    return ", ".join(f"{name}={v!r}" for name, v in bad.items())


def _when_any(rule: str, bad: dict[str, object], why: str) -> Violation | None:
    """The violation of `rule` by the fields in `bad` ('a=1, b=2: why'); None when there are none."""
    return Violation(rule, bad, f"{_listed(bad)}: {why}") if bad else None


def _check_positive(run: RunConfig, world_size: int | None) -> tuple[Violation | None, set[str]]:
    m, p, hw = run.model, run.parallelism, run.hardware
    values: dict[str, object] = {
        "model.num_layers": m.num_layers,
        "model.hidden_size": m.hidden_size,
        "model.num_attention_heads": m.num_attention_heads,
        "model.seq_length": m.seq_length,
        "parallelism.tp": p.tp,
        "parallelism.pp": p.pp,
        "parallelism.virtual_stages": p.virtual_stages,
        "parallelism.global_batch_size": p.global_batch_size,
        "hardware.devices_per_node": hw.devices_per_node,
    }
    # A string micro-batch is 'auto' (resolved by validate) or the micro_batch_size rule's business.
    if not isinstance(requested_micro_batch(p), str):
        values["parallelism.micro_batch_size"] = p.micro_batch_size
    # Optional fields are checked only when given: None means "derive it".
    if m.ffn_hidden_size is not None:
        values["model.ffn_hidden_size"] = m.ffn_hidden_size
    if p.dp is not None:
        values["parallelism.dp"] = p.dp
    if world_size is not None:
        values["world_size"] = world_size
    bad = {name: v for name, v in values.items() if not _is_pos_int(v)}
    if not bad:
        return None, set()
    listed = _listed(bad)
    verb = "is" if len(bad) == 1 else "are"
    message = (
        f"{listed} {verb} not a positive integer (sizes, parallel degrees and batch sizes count "
        f"whole layers, devices and samples). Use an integer of at least 1."
    )
    return Violation("positive", bad, message), set(bad)


def _tp_alternatives(model: ModelConfig, tp: int) -> str:
    return (
        "tp must be one of the divisors common to the heads, hidden and FFN widths. "
        f"Valid tp for this model: {_fmt(_nearest(valid_tp(model), tp))}."
    )


def _check_hidden_heads(m: ModelConfig) -> Violation | None:
    h, a = m.hidden_size, m.num_attention_heads
    if h % a == 0:
        return None
    heads = _nearest(divisors(h), a, 8)
    hiddens = _multiples_near(h, a)
    return Violation(
        "hidden_divisible_by_heads",
        {"model.hidden_size": h, "model.num_attention_heads": a},
        f"model.hidden_size={h} is not a multiple of model.num_attention_heads={a} (every head needs the "
        f"same whole head dimension). Valid num_attention_heads for hidden_size={h}: {_fmt(heads)}, "
        f"or hidden_size for {a} heads: {_fmt(hiddens)}.",
    )


def _check_heads_tp(m: ModelConfig, tp: int) -> Violation | None:
    if m.num_attention_heads % tp == 0:
        return None
    return Violation(
        "heads_divisible_by_tp",
        {"parallelism.tp": tp, "model.num_attention_heads": m.num_attention_heads},
        f"parallelism.tp={tp} does not divide model.num_attention_heads={m.num_attention_heads} "
        f"(each TP rank must hold whole heads). {_tp_alternatives(m, tp)}",
    )


def _check_hidden_tp(m: ModelConfig, tp: int) -> Violation | None:
    if m.hidden_size % tp == 0:
        return None
    return Violation(
        "hidden_divisible_by_tp",
        {"parallelism.tp": tp, "model.hidden_size": m.hidden_size},
        f"parallelism.tp={tp} does not divide model.hidden_size={m.hidden_size} (each TP rank holds an "
        f"equal slice of the attention output and MLP weights along the hidden dimension). "
        f"{_tp_alternatives(m, tp)}",
    )


def _check_ffn_tp(m: ModelConfig, tp: int) -> Violation | None:
    if m.ffn % tp == 0:
        return None
    shown = f"{m.ffn}" if m.ffn_hidden_size is not None else f"{m.ffn} (4 x hidden_size)"
    return Violation(
        "ffn_divisible_by_tp",
        {"parallelism.tp": tp, "model.ffn_hidden_size": m.ffn},
        f"parallelism.tp={tp} does not divide model.ffn_hidden_size={shown} (each TP rank holds an equal "
        f"slice of the MLP's inner width). {_tp_alternatives(m, tp)}",
    )


def _sequence_parallel_tps(m: ModelConfig) -> list[int]:
    """TP degrees above 1 that split this model's heads, widths and tokens."""
    return [t for t in valid_tp(m) if t > 1 and m.seq_length % t == 0]


def _check_sequence_parallel_tp(m: ModelConfig, par: ParallelismConfig) -> Violation | None:
    if not par.sequence_parallel or par.tp > 1:
        return None
    tps = _sequence_parallel_tps(m)
    listed = f"tp in {_fmt(_nearest(tps, 2))}" if tps else "a tp above 1 (none splits this model)"
    return Violation(
        "sequence_parallel_needs_tp",
        {"parallelism.sequence_parallel": True, "parallelism.tp": par.tp},
        f"parallelism.sequence_parallel=true with parallelism.tp={par.tp}: sequence parallelism splits the "
        f"tokens between the matmuls over the tensor-parallel ranks, and one rank has no one to split "
        f"them with. Use sequence_parallel=false with tp=1, or {listed}.",
    )


def _check_seq_tp(m: ModelConfig, par: ParallelismConfig) -> Violation | None:
    if not par.sequence_parallel or par.tp == 1 or m.seq_length % par.tp == 0:
        return None
    tps = _sequence_parallel_tps(m)
    listed = _fmt(_nearest(tps, par.tp)) if tps else "none"
    return Violation(
        "seq_divisible_by_tp",
        {"parallelism.tp": par.tp, "model.seq_length": m.seq_length, "parallelism.sequence_parallel": True},
        f"parallelism.sequence_parallel=true with parallelism.tp={par.tp}, which does not divide "
        f"model.seq_length={m.seq_length} (each TP rank holds an equal share of the tokens between the "
        f"matmuls). Valid tp with sequence parallel for this model: {listed}, or seq_length "
        f"{_fmt(_multiples_near(m.seq_length, par.tp))}, or sequence_parallel=false.",
    )


def _check_vocab(m: ModelConfig, tp: int | None) -> Violation | None:
    problems: list[str] = []
    fields: dict[str, object] = {}
    if not _is_pos_int(m.vocab_size):
        problems.append(f"model.vocab_size={m.vocab_size!r} must be a positive integer")
        fields["model.vocab_size"] = m.vocab_size
    elif m.vocab_size < 2:
        # The synthetic data draws ids below the last one, BERT's [MASK]: one id leaves none to draw.
        problems.append(f"model.vocab_size={m.vocab_size} must be at least 2 (the last id is reserved as [MASK])")
        fields["model.vocab_size"] = m.vocab_size
    if not _is_pos_int(m.make_vocab_size_divisible_by):
        problems.append(
            f"model.make_vocab_size_divisible_by={m.make_vocab_size_divisible_by!r} must be a positive "
            f"integer (the vocabulary is padded to a multiple of it times tp)"
        )
        fields["model.make_vocab_size_divisible_by"] = m.make_vocab_size_divisible_by
    if not problems and tp is not None:
        padded = padded_vocab_size(m, tp)
        # Holds by construction of the padding; checked because the embedding split relies on it.
        if padded % tp:
            problems.append(f"the padded vocabulary {padded} does not split over parallelism.tp={tp}")
            fields.update({"parallelism.tp": tp, "padded_vocab_size": padded})
    if not problems:
        return None
    return Violation(
        "vocab_padding",
        fields,
        f"Vocabulary padding: {', and '.join(problems)}. Typical values: make_vocab_size_divisible_by=128 "
        f"with the tokenizer's vocab_size.",
    )


def _check_layers_pp(m: ModelConfig, pp: int, virtual_stages: int = 1) -> Violation | None:
    if m.num_layers % pp == 0:
        return None
    valid = f"Valid pp for this model: {_fmt(_nearest(valid_pp(m), pp))}."
    if isinstance(virtual_stages, int) and virtual_stages > 1:
        # Only a pipeline of whole chunks keeps the interleaving: pp 1 or a pp the chunks do not divide broke
        # virtual_stages_need_pp or layers_divisible_by_virtual_stages in their turn.
        chunked = [p for p in valid_pp(m) if p > 1 and m.num_layers % (p * virtual_stages) == 0]
        valid = (
            f"Valid pp with parallelism.virtual_stages={virtual_stages}: {_fmt(_nearest(chunked, pp))}."
            if chunked
            else f"No pp splits them into virtual_stages={virtual_stages} chunks per rank: with virtual_stages=1, "
            f"{valid[0].lower()}{valid[1:]}"
        )
    return Violation(
        "layers_divisible_by_pp",
        {"parallelism.pp": pp, "model.num_layers": m.num_layers},
        f"model.num_layers={m.num_layers} is not a multiple of parallelism.pp={pp} (each pipeline stage "
        f"holds the same whole number of layers). {valid}",
    )


def _check_virtual_stages_pp(par: ParallelismConfig) -> Violation | None:
    if par.virtual_stages == 1 or par.pp > 1:
        return None
    return Violation(
        "virtual_stages_need_pp",
        {"parallelism.virtual_stages": par.virtual_stages, "parallelism.pp": par.pp},
        f"parallelism.virtual_stages={par.virtual_stages} with parallelism.pp={par.pp}: virtual stages "
        f"interleave model chunks over the ranks of a pipeline, and one stage has no pipeline to "
        f"interleave. Use virtual_stages=1 with pp=1, or pp of 2 or more.",
    )


def _check_layers_virtual_stages(m: ModelConfig, par: ParallelismConfig) -> Violation | None:
    v, pp = par.virtual_stages, par.pp
    chunks = pp * v
    if v == 1 or pp == 1 or m.num_layers % pp or m.num_layers % chunks == 0:
        return None
    per_rank = m.num_layers // pp
    valid_v = [d for d in divisors(per_rank) if d > 1]
    listed = f"virtual_stages in {_fmt(_nearest(valid_v, v))}" if valid_v else "none above 1"
    return Violation(
        "layers_divisible_by_virtual_stages",
        {"model.num_layers": m.num_layers, "parallelism.pp": pp, "parallelism.virtual_stages": v},
        f"model.num_layers={m.num_layers} is not a multiple of parallelism.pp={pp} x "
        f"parallelism.virtual_stages={v} = {chunks} (every model chunk holds the same whole number of layers). Valid for "
        f"pp={pp}: {listed}, or virtual_stages=1, or num_layers {_fmt(_multiples_near(m.num_layers, chunks))}.",
    )


def _advise_tp_nodes(m: ModelConfig, hw: HardwareConfig, tp: int) -> Advisory | None:
    dpn = hw.devices_per_node
    # A TP group is tp consecutive ranks; it stays on one node only if tp divides the node.
    if dpn % tp == 0:
        return None
    fits = sorted(set(valid_tp(m)) & set(divisors(dpn)))
    if tp > dpn:
        why = f"parallelism.tp={tp} exceeds hardware.devices_per_node={dpn} of {hw.name}"
    else:
        why = (
            f"parallelism.tp={tp} does not divide hardware.devices_per_node={dpn} of {hw.name}, so some "
            f"TP groups straddle two nodes"
        )
    # Allowed: clusters of one-device nodes (CPU clusters, some GPU sites) only have TP over the
    # network. It is slow where nodes have fast local links, hence the note.
    return Advisory(
        "tp_across_nodes",
        {"parallelism.tp": tp, "hardware.devices_per_node": dpn},
        f"{why}: its all-reduces, two per layer and micro-batch each way, cross the network instead "
        f"of the node's own links. It runs; tp that keeps every group on one node on {hw.name}: "
        f"{_fmt(fits)}.",
    )


def _check_training(tr: TrainingConfig) -> list[Violation]:
    out: list[Violation] = []
    steps: dict[str, object] = {"training.train_iters": tr.train_iters, "training.log_interval": tr.log_interval}
    bad = {k: v for k, v in steps.items() if not _is_pos_int(v)}
    if bad:
        listed = _listed(bad)
        out.append(
            Violation(
                "train_iters",
                bad,
                f"{listed}: a run takes at least one optimizer step and logs every log_interval of them. "
                f"Use training.train_iters and training.log_interval of 1 or more (e.g. "
                f"{', '.join(f'{k}=10' for k in bad)}).",
            )
        )
    warm: dict[str, object] = {"training.warmup_iters": tr.warmup_iters, "training.lr_warmup_iters": tr.lr_warmup_iters}
    negative = {k: v for k, v in warm.items() if not _is_nonneg_int(v)}
    if negative:
        listed = _listed(negative)
        out.append(
            Violation("warmup_iters", negative, f"{listed}: a warm-up is 0 or more iterations. Use 0 for none.")
        )
    elif not bad:
        longer = _warmups_longer_than_the_run(tr)
        if longer is not None:
            out.append(longer)
    return out


def _check_training_values(tr: TrainingConfig) -> Violation | None:
    """The optimizer's and the checkpointer's numbers within what they can mean: torch.optim would
    refuse a negative learning rate only once the workers have built the model (a traceback), and
    take a negative weight decay or clip silently."""
    bad: dict[str, object] = {}
    rules: list[str] = []
    if not (_number(tr.lr) and tr.lr > 0):
        bad["training.lr"] = tr.lr
        rules.append("training.lr is the peak learning rate, a finite number above 0 (e.g. 3e-4)")
    if not (_number(tr.weight_decay) and tr.weight_decay >= 0):
        bad["training.weight_decay"] = tr.weight_decay
        rules.append("training.weight_decay is AdamW's decoupled decay, 0 (none) or more (e.g. 0.01)")
    if not (_number(tr.grad_clip) and tr.grad_clip >= 0):
        bad["training.grad_clip"] = tr.grad_clip
        rules.append("training.grad_clip is a gradient-norm bound, 0 (no clipping) or more (e.g. 1.0)")
    if not _is_nonneg_int(tr.save_interval):
        bad["training.save_interval"] = tr.save_interval
        rules.append("training.save_interval counts iterations between checkpoints, 0 (none) or more")
    if not (_is_nonneg_int(tr.seed) and tr.seed < 2**64):
        # numpy's generator (synthetic data) takes no negative seed, torch's none of 2**64 or more:
        # either failed with a traceback once the run had started its record and W&B.
        bad["training.seed"] = tr.seed
        rules.append("training.seed seeds torch's and numpy's generators, a whole number from 0 to 2**64-1 (e.g. 1234)")
    if not (_number(tr.collective_timeout_s) and tr.collective_timeout_s > 0):
        bad["training.collective_timeout_s"] = tr.collective_timeout_s
        rules.append("training.collective_timeout_s is a time in seconds above 0 (e.g. 300)")
    # Found here, not by the profiler after the model is built (a traceback from every rank for 0),
    # and not silently never traced (an iteration past the run's end).
    last = tr.train_iters if _is_pos_int(tr.train_iters) else None
    if any(not _is_pos_int(s) or (last is not None and s > last) for s in tr.profile_steps):
        bad["training.profile_steps"] = list(tr.profile_steps)
        rules.append(
            "training.profile_steps names iterations to trace, each from 1 (the first) to training.train_iters"
            f"{f'={last}' if last is not None else ''} (e.g. [3,4]), or [] for none"
        )
    if not bad:
        return None
    return Violation("training_values", bad, f"{_listed(bad)}: {'; '.join(rules)}.")


_FRACTIONS = ("gemm_efficiency", "memory_bw_efficiency", "intra_node_comm_efficiency", "inter_node_comm_efficiency")
_FRACTIONS_IF_SET = ("attention_efficiency",)
_POSITIVE_IF_SET = ("peak_tflops_bf16", "peak_tflops_fp16", "peak_tflops_fp32", "num_sms", "intra_node_bw_gbs",
                    "inter_node_bw_gbs", "memory_bw_gbs", "host_link_bw_gbs")  # fmt: skip
_NON_NEGATIVE = ("memory_reserve_gib", "process_overhead_gib", "comm_buffer_gib", "comm_buffer_pair_gib",
                 "comm_latency_us", "kernel_overhead_us")  # fmt: skip


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@functools.lru_cache(maxsize=256)
def _check_hardware(hw: HardwareConfig) -> Violation | None:
    """A device's figures within what they can physically be: every memory and time figure the
    planner derives from them (an efficiency of 2 gave a predicted MFU of 144%, one of -1 a
    negative step time ranked first) is only as sane as they are."""
    bad: dict[str, object] = {}
    broken: dict[str, None] = {}  # the ranges broken, in _HARDWARE_RANGES order: only theirs are said

    def out_of(kind: str, name: str, value: object) -> None:
        bad[f"hardware.{name}"] = value
        broken[kind] = None

    for name in _FRACTIONS:
        if not (_number(v := getattr(hw, name)) and 0 < v <= 1):
            out_of("share", name, v)
    for name in _FRACTIONS_IF_SET:
        if (v := getattr(hw, name)) is not None and not (_number(v) and 0 < v <= 1):
            out_of("share", name, v)
    if not (_number(hw.allocator_fragmentation) and 0 <= hw.allocator_fragmentation < 1):
        out_of("fragmentation", "allocator_fragmentation", hw.allocator_fragmentation)
    if not (_number(hw.memory_gib) and hw.memory_gib > 0):
        out_of("positive", "memory_gib", hw.memory_gib)
    for name in _POSITIVE_IF_SET:
        if (v := getattr(hw, name)) is not None and not (_number(v) and v > 0):
            out_of("positive", name, v)
    for name in _NON_NEGATIVE:
        if not (_number(v := getattr(hw, name)) and v >= 0):
            out_of("non_negative", name, v)
    if hw.device_pattern is not None and _pattern(hw.device_pattern) is None:
        out_of("pattern", "device_pattern", hw.device_pattern)
    # Both sane alone, but nothing left to use: the memory rule then said "exceeds the usable -1.50 GiB"
    # and advised devices with more memory.
    if ("hardware.memory_gib" not in bad and _number(hw.memory_reserve_gib) and hw.memory_reserve_gib >= 0
            and hw.memory_reserve_gib >= hw.memory_gib):  # fmt: skip
        out_of("reserve", "memory_gib", hw.memory_gib)
        bad["hardware.memory_reserve_gib"] = hw.memory_reserve_gib
    ranges = "; ".join(_HARDWARE_RANGES[kind] for kind in _HARDWARE_RANGES if kind in broken)
    return _when_any(
        "hardware_figures",
        bad,
        f"out of range for hardware '{hw.name}': {ranges}. See conf/hardware/*.yaml for sourced values.",
    )


_HARDWARE_RANGES = {
    "share": f"efficiencies ({', '.join(_FRACTIONS)}, and {', '.join(_FRACTIONS_IF_SET)} unless null) are "
    "shares of a datasheet figure, above 0 and at most 1",
    "fragmentation": "allocator_fragmentation is a share from 0 up to, not including, 1",
    "positive": "memory_gib, peaks, SM counts and bandwidths are positive (or, but for memory_gib, null: unknown)",
    "non_negative": "reserves, overheads and latencies are 0 or more",
    "reserve": "memory_reserve_gib is less than memory_gib: the rest is what a rank can use",
    "pattern": "device_pattern is a Python regular expression (or null)",
}
"""What each range of _check_hardware's figures is, in the words its refusal gives the ones broken."""


def _pattern(text: str) -> re.Pattern[str] | None:
    try:
        return re.compile(text, re.IGNORECASE)
    except (re.error, TypeError):
        return None


DEVICE_MEMORY_TOLERANCE = 0.05
"""How far the memory a device reports may be from hardware.memory_gib (fraction of it): the configs
give what the allocator can use (an H100 80GB reports 79.18 GiB against h100_sxm's 79.65), while an
A100 of 40 against 80 GB, or a MIG slice, is off by half or more."""


def device_mismatch(
    hw: HardwareConfig,
    *,
    device_name: str | None,
    memory_gib: float | None,
    options: Mapping[str, HardwareConfig] | None = None,
) -> str | None:
    """Why the device a run found is not the one `hw` describes, or None (it is, or nothing tells).

    A run on another device than its hardware config's still trains, but every figure read against
    the config is wrong without a word: MFU against another peak, the planner's memory verdict against
    another capacity, the time model's prediction. `device_name`: torch's CUDA name, or the trainer's
    "cpu: <model name> x N threads"; `memory_gib`: what the device reports (None on a CPU). `options`:
    the hardware configs to suggest from (conf/hardware/*.yaml), those that describe the device."""
    found: list[str] = []
    pattern = _pattern(hw.device_pattern) if hw.device_pattern else None
    if pattern is not None and device_name and not pattern.search(device_name):
        found.append(f"the device is {device_name!r}, which hardware.device_pattern={hw.device_pattern!r} does not match")
    if memory_gib is not None and abs(memory_gib - hw.memory_gib) > DEVICE_MEMORY_TOLERANCE * hw.memory_gib:
        found.append(f"the device has {memory_gib:.2f} GiB, hardware.memory_gib={hw.memory_gib:g} (more than "
                     f"{DEVICE_MEMORY_TOLERANCE:.0%} apart)")  # fmt: skip
    if not found:
        return None
    fits = sorted(
        name for name, o in (options or {}).items()
        if name != hw.name and o.device_type == hw.device_type and o.device_pattern
        and device_name and (p := _pattern(o.device_pattern)) is not None and p.search(device_name)
        and (memory_gib is None or abs(memory_gib - o.memory_gib) <= DEVICE_MEMORY_TOLERANCE * o.memory_gib)
    )  # fmt: skip
    hint = f"hardware={' or hardware='.join(fits)}" if fits else "a hardware config of this device (conf/hardware/*.yaml)"
    return (f"hardware={hw.name} does not describe this device: {'; '.join(found)}. MFU, the memory checks and the "
            f"time model read hardware={hw.name}'s figures; choose {hint}")  # fmt: skip


def _check_cluster(c: ClusterConfig) -> Violation | None:
    """Slurm settings sbatch would take and then misread: a --time of -5 is accepted, 0 means no
    limit at all, a --cpus-per-task of 0 fails with words that do not name the field."""
    bad: dict[str, object] = {}
    for name, least in (("time_limit_min", 1), ("cpus_per_task", 1), ("array_parallelism", 1), ("max_retries", 0)):
        v = getattr(c, name)
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= least):
            bad[f"cluster.{name}"] = v
    if c.mem_per_node_gb is not None and not _is_pos_int(c.mem_per_node_gb):
        bad["cluster.mem_per_node_gb"] = c.mem_per_node_gb
    return _when_any(
        "cluster_settings",
        bad,
        "not a setting a job can run with. time_limit_min (minutes), cpus_per_task, array_parallelism "
        "and mem_per_node_gb (GB, or null: the site's default) are whole numbers of at least 1, max_retries "
        "(requeues) 0 or more.",
    )


def _warmups_longer_than_the_run(tr: TrainingConfig) -> Violation | None:
    # Both warm-ups in one violation: one rule, `warmup_iters`, and one report per rule.
    fields: dict[str, object] = {}
    problems: list[str] = []
    if tr.warmup_iters >= tr.train_iters:
        fields["training.warmup_iters"] = tr.warmup_iters
        problems.append(
            f"training.warmup_iters={tr.warmup_iters} is not below training.train_iters={tr.train_iters}: "
            f"the warm-up iterations are left out of sec/it, TFLOPs and MFU, so no iteration would be "
            f"measured. Use warmup_iters at most {tr.train_iters - 1}, or train_iters at least "
            f"{tr.warmup_iters + 1}."
        )
    if tr.lr_warmup_iters > tr.train_iters:
        fields["training.lr_warmup_iters"] = tr.lr_warmup_iters
        problems.append(
            f"training.lr_warmup_iters={tr.lr_warmup_iters} is longer than training.train_iters={tr.train_iters}: "
            f"the learning rate would still be rising when the run ends, so it never reaches training.lr "
            f"and its decay never starts (Megatron-LM refuses such a schedule too). Use lr_warmup_iters at "
            f"most {tr.train_iters}, or train_iters at least {tr.lr_warmup_iters}."
        )
    if not problems:
        return None
    return Violation("warmup_iters", {**fields, "training.train_iters": tr.train_iters}, " ".join(problems))


def _check_world(par: ParallelismConfig, world_size: int) -> Violation | None:
    tp, pp = par.tp, par.pp
    mp = tp * pp
    fits = world_size % mp == 0
    fix = (
        f"Valid dp for world_size={world_size}: {world_size // mp} (or dp=null to derive it)."
        if fits
        else f"World size must be a multiple of tp x pp = {mp} (nearest: {_fmt(_multiples_near(world_size, mp, 2))})."
    )
    if par.dp is not None:
        if par.dp * mp == world_size:
            return None
        return Violation(
            "world_size",
            {"world_size": world_size, "parallelism.dp": par.dp, "parallelism.tp": tp, "parallelism.pp": pp},
            f"world_size={world_size} does not equal parallelism.dp={par.dp} x parallelism.tp={tp} x "
            f"parallelism.pp={pp} = {par.dp * mp} (every device holds exactly one rank). {fix}",
        )
    if fits:
        return None
    return Violation(
        "world_size",
        {"world_size": world_size, "parallelism.tp": tp, "parallelism.pp": pp},
        f"world_size={world_size} is not a multiple of parallelism.tp={tp} x parallelism.pp={pp} = {mp}, so "
        f"no whole data-parallel degree fits. {fix}",
    )


_FACTOR_LIMIT = 10**12
"""Largest number whose divisors the rules list (trial division up to its square root: a million steps)."""


def _check_whole_nodes(layout: Layout, hw: HardwareConfig, par: ParallelismConfig | None = None) -> Violation | None:
    dpn = hw.devices_per_node
    if layout.fills_whole_nodes(dpn):
        return None
    mp = layout.model_parallel
    # The dp that fill whole nodes: those within one node, and the multiples of dpn / gcd(tp x pp, dpn).
    # Counted near the given dp, not searched up to it (a dp of 10^20 would take for ever).
    step = dpn // math.gcd(mp, dpn)
    k = layout.dp // step
    fitting = set(range(1, dpn // mp + 1)) | {j * step for j in range(max(1, k - 8), k + 9)}
    batch = ""
    mbs = requested_micro_batch(par) if par is not None else None
    gbs = par.global_batch_size if par is not None else None
    if isinstance(mbs, int) and isinstance(gbs, int) and _is_pos_int(mbs) and _is_pos_int(gbs) and gbs % mbs == 0:
        # Only those a run can take: a dp that leaves the global batch undivided breaks global_batch_divisible.
        # They divide gbs / mbs: its divisors that fill whole nodes, wherever they lie (a batch too large
        # to factor quickly keeps the near ones).
        steps = gbs // mbs
        pool = divisors(steps) if steps <= _FACTOR_LIMIT else fitting
        split = {d for d in pool if steps % d == 0 and Layout(d, layout.tp, layout.pp).fills_whole_nodes(dpn)}
        if split:
            fitting = split
            batch = f" and global_batch_size={gbs} with micro_batch_size={mbs}"
    return Violation(
        "whole_nodes",
        {
            "parallelism.dp": layout.dp,
            "parallelism.tp": layout.tp,
            "parallelism.pp": layout.pp,
            "hardware.devices_per_node": dpn,
        },
        f"parallelism.dp={layout.dp} x parallelism.tp={layout.tp} x parallelism.pp={layout.pp} = "
        f"{layout.world_size} devices do not fill whole nodes of hardware.devices_per_node={dpn} of "
        f"{hw.name} (a job gets the same number of devices on every node, and a run larger than one node "
        f"needs all of each). Valid dp with tp x pp = {mp}{batch}: {_fmt(_nearest(fitting, layout.dp, 6))}.",
    )


def _check_global_batch(par: ParallelismConfig, dp: int) -> Violation | None:
    mbs, gbs = par.mbs, par.global_batch_size
    step = mbs * dp
    if gbs % step == 0:
        return None
    if gbs % dp == 0:
        mbs_alt = _nearest(divisors(gbs // dp), mbs, 8)
        mbs_text = f"Valid micro_batch_size for global_batch_size={gbs} and dp={dp}: {_fmt(mbs_alt)}."
    else:
        mbs_text = f"No micro_batch_size works while global_batch_size={gbs} is not a multiple of dp={dp}."
    return Violation(
        "global_batch_divisible",
        {"parallelism.global_batch_size": gbs, "parallelism.micro_batch_size": mbs, "parallelism.dp": dp},
        f"parallelism.global_batch_size={gbs} is not a multiple of parallelism.micro_batch_size={mbs} x "
        f"parallelism.dp={dp} = {step} (every replica runs the same whole number of micro-batches per step). "
        f"Valid global_batch_size near {gbs}: {_fmt(_multiples_near(gbs, step))}. {mbs_text}",
    )


def _check_rampup(par: ParallelismConfig, dp: int) -> Violation | None:
    ramp = par.rampup_batch_size
    if ramp is None:
        return None
    field = "parallelism.rampup_batch_size"
    shown = list(ramp) if isinstance(ramp, (list, tuple)) else ramp
    if not isinstance(ramp, (list, tuple)) or len(ramp) != 3 or not all(_is_nonneg_int(v) for v in ramp):
        return Violation(
            "rampup_batch_size",
            {field: shown},
            f"{field}={shown!r} must be three non-negative integers [start, increment, ramp samples], "
            f"e.g. [{par.mbs * dp}, {par.mbs * dp}, 1000000], or null for no ramp-up.",
        )
    start, incr, samples = (int(v) for v in ramp)
    gbs = par.global_batch_size
    step = par.mbs * dp
    problems: list[str] = []
    # Megatron's ramp-up: every intermediate global batch (start + k x increment) must split
    # into whole micro-batches on every replica, and the ramp must land exactly on the target.
    if start <= 0:
        problems.append(f"start {start} must be positive")
    elif start % step:
        problems.append(f"start {start} is not a multiple of micro_batch_size x dp = {step}")
    if incr <= 0:
        problems.append(f"increment {incr} must be positive")
    elif incr % step:
        problems.append(f"increment {incr} is not a multiple of micro_batch_size x dp = {step}")
    # A ramp that ramps nothing: Megatron divides the ramp samples by the increments (none when start
    # is the global batch) and the samples consumed by the ramp samples per increment (0), and fails.
    if start > gbs:
        problems.append(f"start {start} exceeds global_batch_size={gbs}")
    elif start == gbs:
        problems.append(f"start {start} is global_batch_size={gbs}, so there is nothing to ramp")
    elif incr > 0 and (gbs - start) % incr:
        problems.append(f"global_batch_size - start = {gbs} - {start} = {gbs - start} is not a multiple of increment {incr}")
    if samples == 0:
        problems.append("ramp samples 0 ramps over no samples")
    if not problems:
        return None
    samples = samples or 1_000_000
    if gbs % step == 0 and gbs > step:
        # A neighbourhood of the given start, not every multiple up to a global batch of millions; each
        # below the global batch.
        k = min(max(1, start // step), gbs // step - 1)
        starts = [j * step for j in range(max(1, k - 6), min(gbs // step - 1, k + 6) + 1)]
        suggestion = (
            f"Valid start and increment are multiples of {step} below global_batch_size that keep "
            f"(global_batch_size - start) a multiple of the increment, with ramp samples above 0, e.g. "
            f"[{step}, {step}, {samples}] or start in {_fmt(_nearest(starts, start, 6))} with increment {step}. "
            "Or null for no ramp-up."
        )
    elif gbs % step == 0:
        suggestion = (f"global_batch_size={gbs} is one micro-batch per replica: no smaller batch to start from. "
                      "Use null for no ramp-up, or a larger global_batch_size.")  # fmt: skip
    else:
        suggestion = f"First make global_batch_size={gbs} a multiple of micro_batch_size x dp = {step}."
    return Violation(
        "rampup_batch_size",
        {
            field: shown,
            "parallelism.global_batch_size": gbs,
            "parallelism.micro_batch_size": par.mbs,
            "parallelism.dp": dp,
        },
        f"{field}={shown} breaks the batch ramp-up rules for parallelism.global_batch_size={gbs}, "
        f"parallelism.micro_batch_size={par.mbs} and parallelism.dp={dp}: "
        f"{', and '.join(problems)}. {suggestion}",
    )


def batch_violations(par: ParallelismConfig, dp: int) -> list[Violation]:
    """The batch rules at `par`'s micro-batch size on `dp` replicas: whole micro-batches per replica
    for the global batch and every ramp-up batch, in groups of pp under the interleaved schedule
    (train.planner.micro_batch keeps `auto` to the sizes that meet them)."""
    found = (_check_global_batch(par, dp), _check_rampup(par, dp), _check_interleaved_micro_batches(par, dp))
    return [v for v in found if v is not None]


def _check_interleaved_micro_batches(par: ParallelismConfig, dp: int) -> Violation | None:
    """Megatron's interleaved schedule runs the micro-batches in groups of pp per chunk: every step's
    micro-batch count (the ramp-up's too) must be a multiple of pp."""
    if par.virtual_stages == 1 or par.pp == 1:
        return None
    step = par.mbs * dp
    group = step * par.pp
    batches = {par.global_batch_size}
    ramp = par.rampup_batch_size
    if isinstance(ramp, (list, tuple)) and len(ramp) == 3 and all(_is_pos_int(x) for x in ramp[:2]):
        batches.update({int(ramp[0]), int(ramp[1])})  # every ramp batch is start + k x increment
    bad = sorted(b for b in batches if b % step == 0 and b % group)
    if not bad:
        return None
    fields: dict[str, object] = {
        "parallelism.global_batch_size": par.global_batch_size, "parallelism.micro_batch_size": par.mbs,
        "parallelism.dp": dp, "parallelism.pp": par.pp, "parallelism.virtual_stages": par.virtual_stages,
    }  # fmt: skip
    which = "it"
    if par.global_batch_size not in bad:
        shown = list(ramp) if isinstance(ramp, (list, tuple)) else ramp
        fields["parallelism.rampup_batch_size"] = shown
        which = f"parallelism.rampup_batch_size={shown} (its {_fmt(bad)})"
    return Violation(
        "interleaved_micro_batches",
        fields,
        f"parallelism.virtual_stages={par.virtual_stages} runs Megatron's interleaved schedule, which takes "
        f"the micro-batches in groups of parallelism.pp={par.pp}, and with "
        f"parallelism.global_batch_size={par.global_batch_size}, parallelism.micro_batch_size={par.mbs} and "
        f"parallelism.dp={dp} {which} gives a micro-batch count per replica (batch / (micro_batch_size x dp) = "
        f"batch / {step}) that is not a multiple of pp. Use a global_batch_size (and ramp-up start and "
        f"increment) that is a multiple of micro_batch_size x dp x pp = {group}, e.g. "
        f"{_fmt(_multiples_near(par.global_batch_size, group))}, or virtual_stages=1.",
    )


def _zero_ok(z: object) -> bool:
    return isinstance(z, int) and not isinstance(z, bool) and 0 <= z <= 3


def _check_zero(par: ParallelismConfig) -> Violation | None:
    if _zero_ok(par.zero_stage):
        return None
    return Violation(
        "zero_stage",
        {"parallelism.zero_stage": par.zero_stage},
        f"parallelism.zero_stage={par.zero_stage!r} is not a ZeRO stage. Valid zero_stage: 0 (none), "
        f"1 (shard optimizer states), 2 (and gradients), 3 (and parameters).",
    )


def _check_offload(par: ParallelismConfig) -> Violation | None:
    z = par.zero_stage
    if par.offload == Offload.params and z != 3:
        why = "only ZeRO-3 partitions the parameters, so only it can page them to host memory"
        need = "3"
    elif par.offload == Offload.optimizer and z < 1:
        why = "optimizer states are offloaded per ZeRO partition, which stage 0 does not have"
        need = "1, 2 or 3"
    else:
        return None
    offload = Offload(par.offload).value
    return Violation(
        "offload_requires_zero",
        {"parallelism.offload": offload, "parallelism.zero_stage": z},
        f"parallelism.offload={offload} requires ZeRO stage {need} but parallelism.zero_stage={z} ({why}). "
        f"Valid combinations: offload=none with any stage, offload=optimizer with zero_stage 1-3, "
        f"offload=params with zero_stage=3.",
    )


def _check_deepspeed_layout(par: ParallelismConfig) -> Violation | None:
    if par.engine != Engine.deepspeed or par.pp == 1:
        return None
    return Violation(
        "deepspeed_no_pipeline",
        {"parallelism.engine": "deepspeed", "parallelism.pp": par.pp},
        f"parallelism.engine=deepspeed with parallelism.pp={par.pp}: megasweep hands DeepSpeed data and "
        f"tensor parallelism (ZeRO over dp, Megatron's groups for tp) but no pipeline (DeepSpeed's "
        f"PipelineEngine needs a PipelineModule, which is not wired). Use pp=1 with engine=deepspeed "
        f"(any tp), or engine=native for pp > 1.",
    )


def _check_deepspeed_checkpoint(par: ParallelismConfig, training: TrainingConfig) -> Violation | None:
    if par.engine != Engine.deepspeed or training.save_interval <= 0:
        return None
    return Violation(
        "deepspeed_checkpoint",
        {"parallelism.engine": "deepspeed", "training.save_interval": training.save_interval},
        f"parallelism.engine=deepspeed with training.save_interval={training.save_interval}: megasweep "
        f"saves torch state dicts, not DeepSpeed's partitioned ZeRO states, so a DeepSpeed run cannot "
        f"checkpoint (nor resume after a requeue). Use training.save_interval=0 with engine=deepspeed, "
        f"or engine=native to checkpoint.",
    )


def _check_deepspeed_fp16(par: ParallelismConfig, hw: HardwareConfig) -> Violation | None:
    if par.engine != Engine.deepspeed or par.precision != Precision.fp16 or hw.device_type != "cpu":
        return None
    return Violation(
        "deepspeed_fp16_on_cpu",
        {"parallelism.engine": "deepspeed", "parallelism.precision": "fp16", "hardware.device_type": "cpu"},
        "parallelism.engine=deepspeed with parallelism.precision=fp16 on hardware.device_type=cpu: "
        "DeepSpeed's CPU accelerator refuses fp16 training. Valid precision with engine=deepspeed on "
        "cpu: bf16, fp32 (or engine=native for fp16).",
    )


def _check_native_zero(par: ParallelismConfig) -> Violation | None:
    if par.engine != Engine.native or par.zero_stage not in (2, 3):
        return None
    return Violation(
        "native_zero_stage",
        {"parallelism.engine": "native", "parallelism.zero_stage": par.zero_stage},
        f"parallelism.zero_stage={par.zero_stage} with parallelism.engine=native: the native engine "
        f"implements ZeRO-1 (sharded optimizer states) only. Use engine=deepspeed for stages 2-3, or "
        f"zero_stage 0 or 1 with engine=native.",
    )


def _check_native_offload(par: ParallelismConfig) -> Violation | None:
    if par.engine != Engine.native or par.offload == Offload.none:
        return None
    offload = Offload(par.offload).value
    return Violation(
        "native_offload",
        {"parallelism.engine": "native", "parallelism.offload": offload},
        f"parallelism.offload={offload} with parallelism.engine=native: the native engine keeps every "
        f"state on the device (offload is DeepSpeed's). Use engine=deepspeed to offload, or offload=none "
        f"with engine=native.",
    )


def _check_sequence_parallel_engine(par: ParallelismConfig) -> Violation | None:
    if not par.sequence_parallel or par.engine != Engine.deepspeed:
        return None
    return Violation(
        "sequence_parallel_native_only",
        {"parallelism.engine": "deepspeed", "parallelism.sequence_parallel": True},
        "parallelism.sequence_parallel=true with parallelism.engine=deepspeed: the DeepSpeed engine's "
        "tensor parallelism (plain tensors and explicit all-reduces, train.parallel.apply_tp_plain) has "
        "no sequence-parallel split. Use engine=native with sequence_parallel=true, or "
        "sequence_parallel=false with engine=deepspeed.",
    )


def _check_virtual_stages_engine(par: ParallelismConfig) -> Violation | None:
    if par.virtual_stages == 1 or par.engine != Engine.deepspeed:
        return None
    return Violation(
        "virtual_stages_native_only",
        {"parallelism.engine": "deepspeed", "parallelism.virtual_stages": par.virtual_stages},
        f"parallelism.virtual_stages={par.virtual_stages} with parallelism.engine=deepspeed: the interleaved "
        f"schedule is the native engine's (train.pipeline), and DeepSpeed runs no pipeline here. Use "
        f"engine=native with virtual_stages > 1, or virtual_stages=1 with engine=deepspeed.",
    )


def _peak(hw: HardwareConfig, precision: Precision) -> float | None:
    peak: float | None = getattr(hw, f"peak_tflops_{precision.value}")
    return peak


def _check_precision(par: ParallelismConfig, hw: HardwareConfig) -> Violation | None:
    try:
        precision = Precision(par.precision)
    except ValueError:
        return Violation(
            "precision_supported",
            {"parallelism.precision": par.precision},
            f"parallelism.precision={par.precision!r} is not a known precision. Valid precision: "
            f"{', '.join(p.value for p in Precision)}.",
        )
    # Measured peaks come from a calibration at run time, so any precision torch can run is fine.
    if hw.peak_measured or _peak(hw, precision) is not None:
        return None
    supported = [p.value for p in Precision if _peak(hw, p) is not None]
    alternatives = (
        f"Valid precision on {hw.name}: {', '.join(supported)}."
        if supported
        else f"No precision has a known peak on {hw.name}: give one, or set hardware.peak_measured=true."
    )
    return Violation(
        "precision_supported",
        {"parallelism.precision": precision.value, f"hardware.peak_tflops_{precision.value}": None},
        f"parallelism.precision={precision.value} is not supported by {hw.name} "
        f"(hardware.peak_tflops_{precision.value}=null: the device has no dense {precision.value} "
        f"matmul peak). {alternatives}",
    )


def _check_apex(par: ParallelismConfig, hw: HardwareConfig) -> Violation | None:
    # Judged from the config alone, so the dry run refuses it too: a CPU sweep's apex configs were
    # planned ok, then each run refused them.
    if par.optimizer != OptimizerImpl.apex or hw.device_type == "cuda":
        return None
    valid = ", ".join(o.value for o in OptimizerImpl if o != OptimizerImpl.apex)
    return Violation(
        "apex_needs_cuda",
        {"parallelism.optimizer": "apex", "hardware.device_type": hw.device_type},
        f"parallelism.optimizer=apex with hardware.device_type={hw.device_type}: apex FusedAdam runs on CUDA "
        f"devices only. Valid optimizer on {hw.device_type}: {valid}.",
    )


def _memory_fixes(
    m: ModelConfig, par: ParallelismConfig, hw: HardwareConfig, dp: int, world: int | None = None
) -> list[str]:
    """The mildest single change of each memory knob that makes the estimate fit, dp kept (or, given
    `world`, that many devices kept: a larger tp or pp then takes its devices from dp), and that breaks
    no rule the layout keeps.

    Knobs: larger tp (within a node), larger pp, higher ZeRO stage, more recompute, smaller micro-batch.
    """

    estimate = estimated_variants(m, par, dp, hw)
    broken = _knob_rules_broken(m, par, hw, dp)

    def fits(**change: Any) -> bool:
        return not predicts_oom(estimate(**change), hw)

    def keeps_rules(key: str, value: Any) -> bool:
        # A fix the user takes must not be refused by another rule (interleaving, SP, batch, nodes).
        changed = replace(par, **{key: value})
        return _knob_rules_broken(m, changed, hw, dp) <= broken

    def first(key: str, candidates: Sequence[object]) -> None:
        # Each knob's last candidate is its most memory-saving one: when even that does not fit,
        # skip the scan (a sweep's infeasible rows would otherwise cost a dozen estimates each).
        if not candidates or not fits(**{key: candidates[-1]}):
            return
        for value in candidates:
            if keeps_rules(key, value) and fits(**{key: value}):
                shown = value.value if isinstance(value, Enum) else value
                fixes.append(f"parallelism.{key}={shown}")
                return

    def first_on_world(key: str, candidates: Sequence[int], world: int) -> None:
        # The devices are given (a measured run's, an allocation's): the degree comes out of dp, so
        # the estimate and the rules see the smaller dp, and a dp the user set changes with it.
        for value in candidates:
            changed = replace(par, tp=value) if key == "tp" else replace(par, pp=value)
            new_dp, rest = divmod(world, changed.tp * changed.pp)
            if rest or new_dp < 1:
                continue
            if par.dp is not None:
                changed = replace(changed, dp=new_dp)
            if (_knob_rules_broken(m, changed, hw, new_dp) <= broken
                    and not predicts_oom(estimated_memory(m, changed, new_dp, hw), hw)):  # fmt: skip
                fixes.append(f"parallelism.{key}={value}" + (f" parallelism.dp={new_dp}" if par.dp is not None else ""))
                return

    fixes: list[str] = []
    # Only changes the engine can run: DeepSpeed runs no pipeline here (rule deepspeed_no_pipeline; any
    # tp), native ZeRO stops at 1.
    deepspeed = par.engine == Engine.deepspeed
    tps = [t for t in valid_tp(m) if t > par.tp and hw.devices_per_node % t == 0]
    pps = [] if deepspeed else [p for p in valid_pp(m) if p > par.pp]
    if world is None:
        first("tp", tps)
        first("pp", pps)
    else:
        first_on_world("tp", tps, world)
        first_on_world("pp", pps, world)
    first("zero_stage", list(range(par.zero_stage + 1, 4 if deepspeed else 2)))
    order = [Recompute.none, Recompute.selective, Recompute.full]
    first("recompute", order[order.index(Recompute(par.recompute)) + 1 :])
    # Divisors of the current micro-batch keep global_batch_size divisible.
    first("micro_batch_size", [d for d in reversed(divisors(par.mbs)) if d < par.mbs])
    return fixes


def _knob_rules_broken(m: ModelConfig, par: ParallelismConfig, hw: HardwareConfig, dp: int) -> set[str]:
    """The rules a memory fix's single change can break, of those its candidates do not keep already
    (valid_tp, valid_pp and the engine's ZeRO stages do): each broken one's name."""
    checks = (
        _check_seq_tp(m, par),
        _check_layers_virtual_stages(m, par),
        _check_interleaved_micro_batches(par, dp),
        _check_global_batch(par, dp),
        _check_rampup(par, dp),
        _check_whole_nodes(Layout(dp, par.tp, par.pp), hw, par),
    )
    return {v.rule for v in checks if v is not None}


def _check_memory(
    m: ModelConfig, par: ParallelismConfig, hw: HardwareConfig, dp: int, world: int | None = None
) -> Violation | None:
    estimate = estimated_memory(m, par, dp, hw)
    if not predicts_oom(estimate, hw):
        return None
    usable = usable_bytes(hw) / GIB
    fixes = _memory_fixes(m, par, hw, dp, world)
    kept = f"dp={dp} kept" if world is None else f"the world of {world} device{'s' * (world != 1)} kept"
    split = _splits(par)
    if fixes:
        advice = f"Each of these changes alone would fit ({kept}, overrides as Hydra takes them): {', '.join(fixes)}."
    else:
        advice = (
            f"No single change of a larger {split}, a higher zero_stage, more recompute or a smaller "
            "micro_batch_size fits: combine them, or use devices with more memory."
        )
    recompute = Recompute(par.recompute).value
    return Violation(
        "memory",
        {
            "predicted_gib": round(estimate.needed / GIB, 2),
            "usable_gib": round(usable, 2),
            "parallelism.tp": par.tp,
            "parallelism.pp": par.pp,
            "parallelism.dp": dp,
            "parallelism.zero_stage": par.zero_stage,
            "parallelism.recompute": recompute,
            "parallelism.micro_batch_size": par.mbs,
            "hardware.memory_gib": hw.memory_gib,
        },
        f"Predicted memory {estimate.needed / GIB:.2f} GiB per device (worst pipeline stage: {estimate.stage}) "
        f"exceeds the usable {usable:.2f} GiB of {hw.name} (hardware.memory_gib={hw.memory_gib} minus "
        f"hardware.memory_reserve_gib={hw.memory_reserve_gib}) with parallelism.tp={par.tp}, "
        f"parallelism.pp={par.pp}, parallelism.dp={dp}, parallelism.zero_stage={par.zero_stage}, "
        f"parallelism.recompute={recompute}, parallelism.micro_batch_size={par.mbs}. "
        f"Larger {split}, a higher zero_stage, recompute or a smaller micro_batch_size reduce it. {advice}",
    )


def _check_micro_batch_string(par: ParallelismConfig) -> Violation | None:
    value = requested_micro_batch(par)
    if not isinstance(value, str) or value == AUTO_MICRO_BATCH:
        return None
    return Violation(
        "micro_batch_size",
        {"parallelism.micro_batch_size": value},
        f"parallelism.micro_batch_size={value} is neither a number of samples nor auto (the only word it "
        f"takes: the largest size predicted to fit). Use a positive integer (unquoted in YAML) or auto.",
    )


def _splits(par: ParallelismConfig) -> str:
    """The degrees that split a model across devices on par's engine: DeepSpeed runs no pipeline here."""
    return "tp" if par.engine == Engine.deepspeed else "tp or pp"


def _check_micro_batch_auto(run: RunConfig, dp: int) -> tuple[RunConfig, Violation | None]:
    """(run with `auto` replaced by the planner's largest fitting size, None), or (run, why none fits)."""
    gbs = run.parallelism.global_batch_size
    if isinstance(gbs, int) and gbs >= 1 and gbs % dp:
        # No size splits it, whatever memory there is: the batch rule (global_batch_divisible) says so,
        # with the global batches that would split, at any size.
        return replace(run, parallelism=replace(run.parallelism, micro_batch_size=1)), None
    try:
        resolved, _ = resolve_micro_batch(run, dp=dp)
    except ValueError as exc:
        return run, Violation(
            "micro_batch_auto",
            {"parallelism.micro_batch_size": AUTO_MICRO_BATCH, "parallelism.dp": dp},
            f"{exc} (with parallelism.dp={dp}). Give an explicit micro_batch_size, or free memory with "
            f"a larger {_splits(run.parallelism)}, a higher zero_stage or recompute.",
        )
    return resolved, None


def _auto_sane(run: RunConfig) -> bool:
    # `auto` runs the memory rule's estimate, so it needs the shapes that rule needs.
    m, par = run.model, run.parallelism
    return _zero_ok(par.zero_stage) and par.pp <= m.num_layers and _vocab_ok(m) and _known_precision(par)


def resolve_auto_micro_batch(run: RunConfig, *, world_size: int | None = None) -> RunConfig:
    """`run` with micro_batch_size=auto replaced by the size `validate` checks it at; `run` unchanged
    when the size is an int, or when `validate` reports why `auto` cannot be resolved."""
    par = run.parallelism
    if requested_micro_batch(par) != AUTO_MICRO_BATCH:
        return run
    positive, _ = _check_positive(run, world_size)
    if positive is not None or not _auto_sane(run):
        return run
    try:
        dp = Layout.of(par, world_size).dp
    except LayoutError:
        return run
    return _check_micro_batch_auto(run, dp)[0]


def validate(run: RunConfig, *, world_size: int | None = None, world_fixed: bool = False) -> list[Violation]:
    """Every rule the run breaks, in RULES order; [] means the layout can start.

    world_size None means "not known yet": dp is then parallelism.dp, or 1 when that is null.
    world_fixed: world_size is given, not the layout's choice (a measured run's devices, a launcher's
    world), so the memory rule's advice keeps it rather than dp.
    micro_batch_size=auto is first replaced by the planner's largest fitting size
    (train.planner.micro_batch.resolve_micro_batch), and the rules check that size; when none fits, the
    `micro_batch_auto` rule says why and the batch and memory rules are not evaluated.
    """
    if world_fixed and world_size is None:
        raise ValueError("validate(world_fixed=True) needs the world_size it keeps")
    m, hw = run.model, run.hardware
    out: list[Violation | None] = []
    positive, bad = _check_positive(run, world_size)
    out.append(positive)
    out.append(_check_micro_batch_string(run.parallelism))
    if isinstance(requested_micro_batch(run.parallelism), str):
        bad.add("parallelism.micro_batch_size")  # until `auto` is resolved below
    par = run.parallelism

    def ok(*names: str) -> bool:
        return not bad.intersection(names)

    model_ok = ok("model.num_layers", "model.hidden_size", "model.num_attention_heads", "model.ffn_hidden_size")
    tp_ok = ok("parallelism.tp")
    if ok("model.hidden_size", "model.num_attention_heads"):
        out.append(_check_hidden_heads(m))
    if model_ok and tp_ok:
        out += [_check_heads_tp(m, par.tp), _check_hidden_tp(m, par.tp), _check_ffn_tp(m, par.tp)]
    if tp_ok:
        out.append(_check_sequence_parallel_tp(m, par))
    if tp_ok and ok("model.seq_length"):
        out.append(_check_seq_tp(m, par))
    out.append(_check_vocab(m, par.tp if tp_ok else None))
    if ok("model.num_layers", "parallelism.pp"):
        out.append(_check_layers_pp(m, par.pp, par.virtual_stages))
    if ok("parallelism.pp", "parallelism.virtual_stages"):
        out.append(_check_virtual_stages_pp(par))
        if ok("model.num_layers"):
            out.append(_check_layers_virtual_stages(m, par))
    out += _check_training(run.training)
    out.append(_check_training_values(run.training))
    hardware_bad = _check_hardware(hw)
    out += [hardware_bad, _check_cluster(run.cluster)]

    # dp is known when the world size (if any) agrees with the layout.
    dp: int | None = None
    if ok("parallelism.tp", "parallelism.pp", "parallelism.dp", "world_size"):
        if world_size is not None:
            world = _check_world(par, world_size)
            out.append(world)
            if world is None:
                dp = Layout.of(par, world_size).dp
        else:
            dp = Layout.of(par, None).dp
        if dp is not None and ok("hardware.devices_per_node"):
            out.append(_check_whole_nodes(Layout(dp, par.tp, par.pp), hw, par))
    if (requested_micro_batch(par) == AUTO_MICRO_BATCH and dp is not None and positive is None
            and hardware_bad is None and _auto_sane(run)):  # fmt: skip
        run, auto = _check_micro_batch_auto(run, dp)
        out.append(auto)
        if auto is None:
            par = run.parallelism
            bad.discard("parallelism.micro_batch_size")
    batch_ok = dp is not None and ok("parallelism.micro_batch_size", "parallelism.global_batch_size")
    if batch_ok:
        assert dp is not None
        out += [_check_global_batch(par, dp), _check_rampup(par, dp)]
        if ok("parallelism.pp", "parallelism.virtual_stages"):
            out.append(_check_interleaved_micro_batches(par, dp))

    zero = _check_zero(par)
    out.append(zero)
    if zero is None:
        out.append(_check_offload(par))
    if tp_ok and ok("parallelism.pp"):
        out.append(_check_deepspeed_layout(par))
    out.append(_check_deepspeed_checkpoint(par, run.training))
    out.append(_check_deepspeed_fp16(par, hw))
    out += [_check_native_zero(par), _check_native_offload(par), _check_sequence_parallel_engine(par)]
    if ok("parallelism.virtual_stages"):
        out.append(_check_virtual_stages_engine(par))
    out.append(_check_precision(par, hw))
    out.append(_check_apex(par, hw))

    # The estimate needs sane shapes and a known dp; structural problems are reported first.
    if (batch_ok and positive is None and zero is None and hardware_bad is None and par.pp <= m.num_layers
            and _vocab_ok(m) and _known_precision(par)):  # fmt: skip
        assert dp is not None
        out.append(_check_memory(m, par, hw, dp, world_size if world_fixed else None))
    # Rules are evaluated in dependency order; reports come in RULES order.
    return sorted((v for v in out if v is not None), key=lambda v: RULES.index(v.rule))


def advise(run: RunConfig) -> list[Advisory]:
    """Notes on a layout that runs (validate found nothing) but has a cost the user may not intend."""
    m, par, hw = run.model, run.parallelism, run.hardware
    notes: list[Advisory | None] = []
    if _is_pos_int(par.tp) and _is_pos_int(hw.devices_per_node):
        notes.append(_advise_tp_nodes(m, hw, par.tp))
    if run.training.deepspeed_flops_profile and par.engine != Engine.deepspeed:
        notes.append(
            Advisory(
                "ignored_option",
                {"training.deepspeed_flops_profile": True, "parallelism.engine": Engine(par.engine).value},
                "training.deepspeed_flops_profile=true applies to engine=deepspeed only; it is ignored with "
                f"parallelism.engine={Engine(par.engine).value}. training.flop_check=true cross-checks the "
                "FLOPs with torch's FlopCounterMode on any engine.",
            )
        )
    if par.offload != Offload.none and hw.device_type == "cpu":
        offload = Offload(par.offload).value
        notes.append(
            Advisory(
                "ignored_option",
                {"parallelism.offload": offload, "hardware.device_type": "cpu"},
                f"parallelism.offload={offload} on hardware.device_type=cpu moves ZeRO's states to the host, "
                "which is this device: it saves no memory (the memory figures count them here) and adds copies.",
            )
        )
    notes.append(_advise_calibration_ranks(hw))
    return [n for n in notes if n is not None]


def _advise_calibration_ranks(hw: HardwareConfig) -> Advisory | None:
    """A CPU calibration measured with fewer or more ranks a node than hardware.devices_per_node: a CPU
    rank's speed is its share of the host's cores, which the calibration measured with its own count, so
    the time model priced 8 ranks a node (cpu.yaml's default) at the speed 2 measured (0.65 s/it predicted
    where the same file with devices_per_node=2 gave 1.21), and a search ranked impossible nodes first.
    A GPU's speed does not depend on its neighbours': a file measured on one GPU serves 8-GPU nodes."""
    if hw.device_type != "cpu" or not hw.calibration or not _is_pos_int(hw.devices_per_node):
        return None
    try:
        measured = sorted({t.tasks_per_node for t in load_calibration(hw.calibration).nodes})
    except (ValueError, TypeError, KeyError):
        return None  # the time model says why it cannot read the file, for every row it prices
    if not measured or hw.devices_per_node in measured:
        return None
    counts = ", ".join(map(str, measured))
    return Advisory(
        "calibration_ranks_per_node",
        {"hardware.devices_per_node": hw.devices_per_node, "hardware.calibration": hw.calibration},
        f"hardware.devices_per_node={hw.devices_per_node} but hardware.calibration={hw.calibration!r} was measured "
        f"with {counts} rank(s) per node: a CPU rank's speed is its share of the node's cores, so the predicted "
        f"times price {hw.devices_per_node} ranks a node at the speed of {counts}. Set hardware.devices_per_node="
        f"{measured[0]} (the calibrated nodes), or calibrate with hardware.devices_per_node={hw.devices_per_node}.",
    )


def _vocab_ok(m: ModelConfig) -> bool:
    return _is_pos_int(m.vocab_size) and m.vocab_size >= 2 and _is_pos_int(m.make_vocab_size_divisible_by)


def _known_precision(par: ParallelismConfig) -> bool:
    return par.precision in {p.value for p in Precision}
