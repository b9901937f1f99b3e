"""Validation rules: a property test against plain arithmetic, one broken rule at a time, and messages."""

from __future__ import annotations

import dataclasses
import itertools
import math
import pickle
import re
from enum import Enum
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conf import hardware_options
from conf.schema import (
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
)
from train.planner.layout import Layout
from train.planner.memory import estimate_memory, usable_bytes
from train.planner.rules import (
    RULES,
    InfeasibleConfig,
    Violation,
    advise,
    device_mismatch,
    divisors,
    rule_problem,
    validate,
)

CONF_DIR = Path(__file__).resolve().parents[3] / "conf"
PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PER_RULE = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# A small valid base: 4 heads of 8, 4 layers, one 8-device node that has every peak.
BASE_MODEL = ModelConfig(
    name="t", num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=100,
    make_vocab_size_divisible_by=8,
)
BASE_PAR = ParallelismConfig(tp=1, pp=1, micro_batch_size=1, global_batch_size=4, precision=Precision.bf16)
BASE_HW = HardwareConfig(
    name="toy", device_type="cuda", peak_tflops_bf16=100.0, peak_tflops_fp16=100.0, peak_tflops_fp32=50.0,
    memory_gib=80.0, memory_reserve_gib=0.0, devices_per_node=8,
)


def make_run(
    model: dict | None = None, par: dict | None = None, hw: dict | None = None, training: dict | None = None,
    cluster: dict | None = None,
) -> RunConfig:
    return RunConfig(
        model=dataclasses.replace(BASE_MODEL, **(model or {})),
        parallelism=dataclasses.replace(BASE_PAR, **(par or {})),
        hardware=dataclasses.replace(BASE_HW, **(hw or {})),
        training=TrainingConfig(**(training or {})),
        cluster=ClusterConfig(**(cluster or {})),
    )


def compose_run(*overrides: str) -> RunConfig:
    from hydra import compose, initialize_config_dir

    from conf.schema import to_run_config

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_run_config(compose("config", overrides=list(overrides)))


# --------------------------------------------------------------------------------------
# The reference: every rule in plain arithmetic, independent of train.planner.rules.


def _pos(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _fused_step(p: ParallelismConfig, hw: HardwareConfig) -> bool:
    """Whether the step is a fused Adam: DeepSpeed's FusedAdam on a GPU and torch's AdamW on a CPU
    (train.ds_config), offloaded or not on the device; the native engine's as par.optimizer says."""
    if p.engine == Engine.deepspeed:
        return hw.device_type != "cpu" or p.offload != Offload.none
    return p.optimizer != OptimizerImpl.torch


def broken_rules(run: RunConfig, world_size: int | None) -> set[str]:
    """Every rule the run breaks, by direct arithmetic (no cascade suppression)."""
    m, p, hw, tr = run.model, run.parallelism, run.hardware, run.training
    broken: set[str] = set()
    # A run takes steps, logs every log_interval of them, measures at least one after its warm-up,
    # and reaches its peak learning rate.
    steps_ok = _pos(tr.train_iters) and _pos(tr.log_interval)
    if not steps_ok:
        broken.add("train_iters")
    if tr.warmup_iters < 0 or tr.lr_warmup_iters < 0 or (
        steps_ok and (tr.warmup_iters >= tr.train_iters or tr.lr_warmup_iters > tr.train_iters)
    ):
        broken.add("warmup_iters")
    # The optimizer's and checkpointer's numbers: a positive learning rate and collective timeout,
    # no negative decay, clip or save interval, a seed numpy and torch both take.
    if (not tr.lr > 0 or not tr.weight_decay >= 0 or not tr.grad_clip >= 0 or tr.save_interval < 0
            or not 0 <= tr.seed < 2**64 or not tr.collective_timeout_s > 0 or not all(map(math.isfinite, (tr.lr, tr.weight_decay, tr.grad_clip,
                                                                              tr.collective_timeout_s)))):  # fmt: skip
        broken.add("training_values")
    # A traced iteration is one the run takes: from 1 to train_iters.
    if any(not _pos(s) or (_pos(tr.train_iters) and s > tr.train_iters) for s in tr.profile_steps):
        broken.add("training_values")
    # Rules on fields that positivity does not cover hold or break whatever the sizes are.
    if not (_pos(m.vocab_size) and _pos(m.make_vocab_size_divisible_by)) or m.vocab_size == 1:
        broken.add("vocab_padding")
    elif _pos(p.tp):
        multiple = m.make_vocab_size_divisible_by * p.tp
        if math.ceil(m.vocab_size / multiple) * multiple % p.tp:
            broken.add("vocab_padding")
    if p.zero_stage not in (0, 1, 2, 3):
        broken.add("zero_stage")
    if (p.offload == Offload.params and p.zero_stage != 3) or (p.offload == Offload.optimizer and p.zero_stage < 1):
        broken.add("offload_requires_zero")
    # Engines: DeepSpeed is wired for data and tensor parallelism (no pipeline) and refuses fp16 on
    # its CPU accelerator; the native engine has ZeRO-1 and no offload.
    deepspeed = p.engine == Engine.deepspeed
    if deepspeed and _pos(p.pp) and p.pp > 1:
        broken.add("deepspeed_no_pipeline")
    if deepspeed and run.training.save_interval > 0:
        broken.add("deepspeed_checkpoint")
    if deepspeed and p.precision == Precision.fp16 and hw.device_type == "cpu":
        broken.add("deepspeed_fp16_on_cpu")
    if p.optimizer == OptimizerImpl.apex and hw.device_type != "cuda":
        broken.add("apex_needs_cuda")
    if not deepspeed and p.zero_stage in (2, 3):
        broken.add("native_zero_stage")
    if not deepspeed and p.offload != Offload.none:
        broken.add("native_offload")
    # Sequence parallelism splits the tokens over TP, in the native engine's DTensor TP only.
    if deepspeed and p.sequence_parallel:
        broken.add("sequence_parallel_native_only")
    # The interleaved schedule is the native engine's.
    if deepspeed and _pos(p.virtual_stages) and p.virtual_stages > 1:
        broken.add("virtual_stages_native_only")
    peak = {"bf16": hw.peak_tflops_bf16, "fp16": hw.peak_tflops_fp16, "fp32": hw.peak_tflops_fp32}[p.precision]
    if peak is None and not hw.peak_measured:
        broken.add("precision_supported")
    # A device's figures: efficiencies are shares of a datasheet figure, sizes and rates positive.
    shares = (hw.gemm_efficiency, hw.memory_bw_efficiency, hw.intra_node_comm_efficiency, hw.inter_node_comm_efficiency)
    rates = (hw.peak_tflops_bf16, hw.peak_tflops_fp16, hw.peak_tflops_fp32, hw.num_sms, hw.intra_node_bw_gbs,
             hw.inter_node_bw_gbs, hw.memory_bw_gbs, hw.host_link_bw_gbs)  # fmt: skip
    costs = (hw.memory_reserve_gib, hw.process_overhead_gib, hw.comm_buffer_gib, hw.comm_buffer_pair_gib,
             hw.comm_latency_us, hw.kernel_overhead_us)  # fmt: skip
    if (not all(0 < x <= 1 for x in shares) or not all(x is None or x > 0 for x in rates)
            or not all(x >= 0 for x in costs) or not hw.memory_gib > 0 or not 0 <= hw.allocator_fragmentation < 1
            or hw.memory_reserve_gib >= hw.memory_gib
            or not (hw.attention_efficiency is None or 0 < hw.attention_efficiency <= 1)):
        broken.add("hardware_figures")
    if hw.device_pattern is not None:
        try:
            re.compile(hw.device_pattern)
        except re.error:
            broken.add("hardware_figures")
    c = run.cluster
    if (min(c.time_limit_min, c.cpus_per_task, c.array_parallelism) < 1 or c.max_retries < 0
            or (c.mem_per_node_gb is not None and c.mem_per_node_gb < 1)):
        broken.add("cluster_settings")

    mbs = p.micro_batch_size
    ints = {"layers": m.num_layers, "hidden": m.hidden_size, "heads": m.num_attention_heads,
            "seq": m.seq_length, "tp": p.tp, "pp": p.pp, "vs": p.virtual_stages, "gbs": p.global_batch_size,
            "dpn": hw.devices_per_node, "ffn": m.ffn_hidden_size, "dp": p.dp, "world": world_size}
    if not isinstance(mbs, str):
        ints["mbs"] = mbs
    bad = {k for k, v in ints.items() if v is not None and not _pos(v)}
    if bad:
        broken.add("positive")
    if isinstance(mbs, str) and mbs != "auto":
        broken.add("micro_batch_size")

    def ok(*names: str) -> bool:  # each divisibility rule needs its own fields to be positive
        return not bad.intersection(names)

    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    if ok("hidden", "heads") and m.hidden_size % m.num_attention_heads:
        broken.add("hidden_divisible_by_heads")
    if ok("heads", "tp") and m.num_attention_heads % p.tp:
        broken.add("heads_divisible_by_tp")
    if ok("hidden", "tp") and m.hidden_size % p.tp:
        broken.add("hidden_divisible_by_tp")
    if ok("hidden", "ffn", "tp") and ffn % p.tp:
        broken.add("ffn_divisible_by_tp")
    if ok("layers", "pp") and m.num_layers % p.pp:
        broken.add("layers_divisible_by_pp")
    if ok("tp") and p.sequence_parallel and p.tp == 1:
        broken.add("sequence_parallel_needs_tp")
    if ok("seq", "tp") and p.sequence_parallel and m.seq_length % p.tp:
        broken.add("seq_divisible_by_tp")
    # Virtual stages interleave chunks of a pipeline of 2 or more ranks, each chunk whole layers.
    interleaved = ok("pp", "vs") and p.virtual_stages > 1
    if interleaved and p.pp == 1:
        broken.add("virtual_stages_need_pp")
    if interleaved and ok("layers") and p.pp > 1 and m.num_layers % p.pp == 0 and m.num_layers % (p.pp * p.virtual_stages):
        broken.add("layers_divisible_by_virtual_stages")
    dp: int | None = None
    if not ok("tp", "pp", "dp", "world"):
        pass  # no dp to speak of
    elif world_size is None:
        dp = p.dp or 1
    elif p.dp is not None:
        dp = p.dp if p.dp * p.tp * p.pp == world_size else None
        if dp is None:
            broken.add("world_size")
    else:
        dp = world_size // (p.tp * p.pp) if world_size % (p.tp * p.pp) == 0 else None
        if dp is None:
            broken.add("world_size")
    # A run larger than one node fills whole nodes.
    devices = None if dp is None else dp * p.tp * p.pp
    if devices is not None and ok("dpn") and devices > hw.devices_per_node and devices % hw.devices_per_node:
        broken.add("whole_nodes")
    if mbs == "auto" and dp is not None and not bad and not {"vocab_padding", "hardware_figures"} & broken \
            and p.zero_stage in (0, 1, 2, 3) and p.pp <= m.num_layers:
        # The largest size up to 128 that splits the global batch and fits, by direct estimate; where no
        # size splits it (gbs not a multiple of dp), the batch rule says so at any size.
        fused = _fused_step(p, hw)
        fitting = [c for c in range(1, 129) if p.global_batch_size % (c * dp) == 0
                   and estimate_memory(m, dataclasses.replace(p, micro_batch_size=c), dp=dp, hardware=hw,
                                       fused_optimizer=fused).needed <= usable_bytes(hw)]
        if p.global_batch_size % dp:
            fitting = [1]
        if not fitting:
            broken.add("micro_batch_auto")
            return broken
        p = dataclasses.replace(p, micro_batch_size=max(fitting))
    if isinstance(p.micro_batch_size, str):
        return broken  # no size to check the batch and memory rules at
    if dp is not None and ok("mbs", "gbs"):
        step = p.micro_batch_size * dp
        if p.global_batch_size % step:
            broken.add("global_batch_divisible")
        ramp = p.rampup_batch_size
        if ramp is not None:
            if len(ramp) != 3 or any(not isinstance(v, int) or v < 0 for v in ramp):
                broken.add("rampup_batch_size")
            else:
                start, incr, samples = ramp
                if (start <= 0 or incr <= 0 or start % step or incr % step or start >= p.global_batch_size
                        or (p.global_batch_size - start) % incr or samples == 0):
                    broken.add("rampup_batch_size")
        # Megatron's interleaved schedule: every step's micro-batches in whole groups of pp.
        if interleaved and p.pp > 1:
            batches = {p.global_batch_size}
            if ramp is not None and len(ramp) == 3 and all(_pos(v) for v in ramp[:2]):
                batches |= {ramp[0], ramp[1]}
            if any(b % step == 0 and b % (step * p.pp) for b in batches):
                broken.add("interleaved_micro_batches")
    if bad or "hardware_figures" in broken:
        return broken  # the memory estimate needs every size positive and the device's figures sane
    if dp is not None and p.zero_stage in (0, 1, 2, 3) and "vocab_padding" not in broken:
        fused = _fused_step(p, hw)
        if estimate_memory(m, p, dp=dp, hardware=hw, fused_optimizer=fused).needed > usable_bytes(hw):
            broken.add("memory")
    return broken


# --------------------------------------------------------------------------------------
# (a) Whatever validate accepts satisfies every rule; whatever it reports is really broken.


@st.composite
def any_config(draw: st.DrawFn) -> tuple[RunConfig, int | None]:
    model = ModelConfig(
        name="h",
        num_layers=draw(st.integers(1, 8)),
        hidden_size=draw(st.integers(1, 48)),
        num_attention_heads=draw(st.integers(1, 8)),
        ffn_hidden_size=draw(st.none() | st.integers(1, 64)),
        seq_length=draw(st.integers(1, 8)),
        vocab_size=draw(st.integers(1, 300)),
        make_vocab_size_divisible_by=draw(st.integers(1, 16)),
    )
    ramp = draw(st.none() | st.lists(st.integers(0, 32), min_size=3, max_size=3))
    zero = draw(st.integers(0, 3))
    par = ParallelismConfig(
        tp=draw(st.sampled_from([1, 1, 2, 3, 4, 8])),
        pp=draw(st.integers(1, 4)),
        dp=draw(st.none() | st.integers(1, 4)),
        micro_batch_size=draw(st.integers(1, 4)),
        global_batch_size=draw(st.integers(1, 32)),
        rampup_batch_size=ramp,
        zero_stage=zero,
        offload=draw(st.sampled_from(list(Offload))),
        recompute=draw(st.sampled_from(list(Recompute))),
        precision=draw(st.sampled_from(list(Precision))),
        engine=draw(st.sampled_from(list(Engine))),
        sequence_parallel=draw(st.booleans()),
        virtual_stages=draw(st.sampled_from([0, 1, 1, 2, 3])),
    )
    peaks = st.none() | st.just(100.0)
    hw = HardwareConfig(
        name="hw",
        device_type=draw(st.sampled_from(["cpu", "cuda"])),
        peak_tflops_bf16=draw(peaks),
        peak_tflops_fp16=draw(peaks),
        peak_tflops_fp32=draw(peaks),
        peak_measured=draw(st.booleans()),
        # Tiny capacities exercise the memory rule on these tiny models.
        memory_gib=draw(st.sampled_from([0.0005, 0.002, 80.0])),
        memory_reserve_gib=0.0,
        devices_per_node=draw(st.sampled_from([1, 2, 4, 6, 8])),
    )
    training = TrainingConfig(
        train_iters=draw(st.integers(-1, 12)),
        warmup_iters=draw(st.integers(-1, 12)),
        lr_warmup_iters=draw(st.integers(-1, 16)),
        log_interval=draw(st.integers(0, 3)),
    )
    world = draw(st.none() | st.integers(1, 64))
    return RunConfig(model=model, parallelism=par, hardware=hw, training=training), world


@st.composite
def near_valid_config(draw: st.DrawFn) -> tuple[RunConfig, int | None]:
    """Mostly valid configs: each value follows the rules, but about one in six is drawn freely.

    Uniform draws (any_config) almost never pass every rule, so this is what exercises "accepted".
    """

    def pick(valid: st.SearchStrategy, wild: st.SearchStrategy) -> object:
        return draw(wild) if draw(st.integers(0, 5)) == 0 else draw(valid)

    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.integers(1, 3))
    heads = pick(st.builds(lambda k: tp * k, st.integers(1, 3)), st.integers(1, 8))
    assert isinstance(heads, int)
    dp = draw(st.integers(1, 3))
    mbs = draw(st.integers(1, 3))
    step = mbs * dp
    # DeepSpeed runs tp = pp = 1 only; the native engine has ZeRO 0-1 and no offload.
    engine = pick(st.sampled_from(list(Engine)) if tp == pp == 1 else st.just(Engine.native),
                  st.sampled_from(list(Engine)))
    deepspeed = engine == Engine.deepspeed
    zero = pick(st.integers(0, 3 if deepspeed else 1), st.integers(-1, 4))
    precision = draw(st.sampled_from(list(Precision)))
    sp = pick(st.booleans() if tp > 1 and not deepspeed else st.just(False), st.booleans())
    seq = st.builds(lambda k: tp * k, st.integers(1, 4)) if sp else st.integers(1, 8)
    chunks = pick(st.sampled_from([1, 2]) if pp > 1 and not deepspeed else st.just(1), st.integers(0, 3))
    assert isinstance(chunks, int)
    group = step * pp if chunks > 1 else step  # interleaving takes micro-batches in groups of pp
    model = ModelConfig(
        name="n",
        num_layers=pick(st.builds(lambda j: pp * max(chunks, 1) * j, st.integers(1, 3)), st.integers(0, 8)),  # type: ignore[arg-type]
        hidden_size=pick(st.builds(lambda d: heads * d, st.integers(1, 4)), st.integers(1, 40)),  # type: ignore[arg-type]
        num_attention_heads=heads,
        ffn_hidden_size=pick(st.none() | st.builds(lambda n: tp * n, st.integers(1, 8)), st.integers(0, 40)),  # type: ignore[arg-type]
        seq_length=pick(seq, st.integers(1, 8)),  # type: ignore[arg-type]
        vocab_size=pick(st.integers(1, 200), st.integers(-1, 200)),  # type: ignore[arg-type]
        make_vocab_size_divisible_by=pick(st.sampled_from([1, 8, 64]), st.integers(-1, 8)),  # type: ignore[arg-type]
    )
    gbs = pick(st.builds(lambda k: group * k, st.integers(1, 6)), st.integers(1, 40))
    assert isinstance(gbs, int)
    ramp = pick(
        st.none() | st.builds(lambda a, n: [group * a, group, n], st.integers(1, 1), st.integers(0, 99)),
        st.none() | st.lists(st.integers(0, 12), min_size=2, max_size=4),
    )
    offload_ok = [Offload.none] + ([Offload.optimizer] if deepspeed and zero in (1, 2, 3) else []) + (
        [Offload.params] if deepspeed and zero == 3 else [])
    par = ParallelismConfig(
        tp=tp,
        pp=pp,
        dp=draw(st.sampled_from([None, dp])),
        micro_batch_size=mbs,
        global_batch_size=gbs,
        rampup_batch_size=ramp,  # type: ignore[arg-type]
        zero_stage=zero,  # type: ignore[arg-type]
        offload=pick(st.sampled_from(offload_ok), st.sampled_from(list(Offload))),  # type: ignore[arg-type]
        recompute=draw(st.sampled_from(list(Recompute))),
        precision=precision,
        engine=engine,  # type: ignore[arg-type]
        sequence_parallel=sp,  # type: ignore[arg-type]
        virtual_stages=chunks,
    )
    measured = draw(st.booleans())
    devices = ["cuda"] if deepspeed and precision == Precision.fp16 else ["cpu", "cuda"]
    peak_here = pick(st.just(100.0), st.none())
    hw = HardwareConfig(
        name="hw",
        device_type=pick(st.sampled_from(devices), st.sampled_from(["cpu", "cuda"])),  # type: ignore[arg-type]
        peak_tflops_bf16=peak_here if precision == Precision.bf16 else draw(st.none() | st.just(1.0)),  # type: ignore[arg-type]
        peak_tflops_fp16=peak_here if precision == Precision.fp16 else draw(st.none() | st.just(1.0)),  # type: ignore[arg-type]
        peak_tflops_fp32=peak_here if precision == Precision.fp32 else draw(st.none() | st.just(1.0)),  # type: ignore[arg-type]
        peak_measured=measured,
        memory_gib=pick(st.just(80.0), st.sampled_from([1e-5, 1e-4, 0.002])),  # type: ignore[arg-type]
        memory_reserve_gib=0.0,
        devices_per_node=pick(st.sampled_from([tp, 2 * tp, 8]), st.integers(1, 8)),  # type: ignore[arg-type]
    )
    iters = draw(st.integers(1, 12))
    training = TrainingConfig(
        train_iters=iters,
        warmup_iters=pick(st.integers(0, iters - 1), st.integers(-1, 14)),  # type: ignore[arg-type]
        lr_warmup_iters=pick(st.integers(0, iters), st.integers(-1, 16)),  # type: ignore[arg-type]
    )
    world = pick(st.sampled_from([None, dp * tp * pp]), st.integers(1, 40))
    return RunConfig(model=model, parallelism=par, hardware=hw, training=training), world  # type: ignore[return-value]


@PROPERTY
@given(st.one_of(any_config(), near_valid_config()))
def test_accepted_configs_satisfy_every_rule_and_reports_are_real(case: tuple[RunConfig, int | None]) -> None:
    run, world = case
    violations = validate(run, world_size=world)
    reference = broken_rules(run, world)
    reported = [v.rule for v in violations]
    if not violations:
        assert reference == set(), f"validate accepted a config that breaks {reference}"
    # No false alarm: each reported rule is broken by the arithmetic too.
    assert set(reported) <= reference
    # One violation per rule, in the documented order.
    assert len(reported) == len(set(reported))
    assert reported == sorted(reported, key=RULES.index)
    for v in violations:
        assert "; " not in v.message  # the planner's CSV joins reasons with it
        assert "\n" not in v.message


@PROPERTY
@given(st.one_of(any_config(), near_valid_config()))
def test_validate_is_deterministic(case: tuple[RunConfig, int | None]) -> None:
    run, world = case
    assert validate(run, world_size=world) == validate(run, world_size=world)


# --------------------------------------------------------------------------------------
# (b) Break exactly one rule; the report names that rule and the fields' values.


@st.composite
def tp_split_model(draw: st.DrawFn, tp: int) -> dict:
    """Model fields whose heads, hidden and ffn all split over tp."""
    heads = tp * draw(st.integers(1, 2))
    return {"num_attention_heads": heads, "hidden_size": heads * draw(st.integers(1, 4)),
            "ffn_hidden_size": tp * draw(st.integers(1, 8))}


@st.composite
def break_one(draw: st.DrawFn, rule: str) -> tuple[RunConfig, int | None, set[str]]:
    """A config that breaks `rule` (and, where arithmetic forces it, only its unavoidable partner)."""
    model: dict = {}
    par: dict = {}
    hw: dict = {}
    training: dict = {}
    cluster: dict = {}
    world: int | None = None
    expected = {rule}
    if rule == "positive":
        field, value = draw(st.sampled_from([
            ("model.num_layers", 0), ("model.hidden_size", -32), ("model.num_attention_heads", 0),
            ("model.seq_length", 0), ("model.ffn_hidden_size", 0), ("parallelism.tp", 0), ("parallelism.pp", -1),
            ("parallelism.dp", 0), ("parallelism.micro_batch_size", 0), ("parallelism.virtual_stages", 0), ("parallelism.global_batch_size", 0),
            ("hardware.devices_per_node", 0), ("world_size", 0),
        ]))
        group, name = field.split(".") if "." in field else ("", field)
        target = {"model": model, "parallelism": par, "hardware": hw}.get(group)
        if target is None:
            world = value
        else:
            target[name] = value
    elif rule == "hidden_divisible_by_heads":
        heads = draw(st.integers(2, 8))
        model = {"num_attention_heads": heads,
                 "hidden_size": heads * draw(st.integers(1, 6)) + draw(st.integers(1, heads - 1))}
    elif rule == "heads_divisible_by_tp":
        tp = draw(st.sampled_from([2, 4, 8]))
        heads = tp * draw(st.integers(0, 2)) + draw(st.integers(1, tp - 1))
        model = {"num_attention_heads": heads, "hidden_size": heads * tp * draw(st.integers(1, 3)),
                 "ffn_hidden_size": tp * draw(st.integers(1, 8))}
        par = {"tp": tp}
    elif rule == "hidden_divisible_by_tp":
        # heads % tp == 0 and hidden % heads == 0 imply hidden % tp == 0, so hidden % tp can only
        # break together with hidden % heads.
        tp = draw(st.sampled_from([2, 4]))
        heads = tp * draw(st.integers(1, 2))
        model = {"num_attention_heads": heads,
                 "hidden_size": heads * draw(st.integers(1, 4)) + draw(st.integers(1, tp - 1)),
                 "ffn_hidden_size": tp * draw(st.integers(1, 8))}
        par = {"tp": tp}
        expected = {rule, "hidden_divisible_by_heads"}
    elif rule == "ffn_divisible_by_tp":
        tp = draw(st.sampled_from([2, 4, 8]))
        model = draw(tp_split_model(tp))
        model["ffn_hidden_size"] = tp * draw(st.integers(0, 4)) + draw(st.integers(1, tp - 1))
        par = {"tp": tp}
    elif rule == "sequence_parallel_needs_tp":
        par = {"sequence_parallel": True, "tp": 1}
    elif rule == "seq_divisible_by_tp":
        tp = draw(st.sampled_from([2, 4]))
        model = draw(tp_split_model(tp))
        model["seq_length"] = tp * draw(st.integers(0, 3)) + draw(st.integers(1, tp - 1))
        par = {"tp": tp, "sequence_parallel": True}
    elif rule == "virtual_stages_need_pp":
        par = {"virtual_stages": draw(st.integers(2, 4)), "pp": 1}
    elif rule == "layers_divisible_by_virtual_stages":
        # pp 2 splits the layers, two chunks per rank do not: an odd number of layers per rank.
        model = {"num_layers": 2 * (2 * draw(st.integers(0, 3)) + 1)}
        par = {"pp": 2, "virtual_stages": 2}
    elif rule == "interleaved_micro_batches":
        if draw(st.booleans()):  # an odd number of micro-batches for two ranks
            par = {"pp": 2, "virtual_stages": 2, "global_batch_size": 2 * draw(st.integers(0, 3)) + 1}
        else:  # the ramp-up's increment of one micro-batch
            par = {"pp": 2, "virtual_stages": 2, "global_batch_size": 4, "rampup_batch_size": [2, 1, 8]}
    elif rule == "vocab_padding":
        field = draw(st.sampled_from(["vocab_size", "make_vocab_size_divisible_by"]))
        # A vocabulary of one id leaves the synthetic data none to draw (the last is [MASK]).
        model = {field: draw(st.integers(-4, 1 if field == "vocab_size" else 0))}
    elif rule == "layers_divisible_by_pp":
        pp = draw(st.integers(2, 8))
        model = {"num_layers": pp * draw(st.integers(0, 3)) + draw(st.integers(1, pp - 1))}
        par = {"pp": pp}
    elif rule == "whole_nodes":
        # More devices than a node holds, not a multiple of it (tp and pp kept at 1: only dp grows).
        dpn = draw(st.sampled_from([2, 4, 8]))
        dp = draw(st.integers(dpn + 1, 4 * dpn).filter(lambda d: d % dpn != 0))
        par = {"dp": dp, "global_batch_size": dp}
        hw = {"devices_per_node": dpn}
    elif rule == "train_iters":
        training = draw(st.sampled_from([{"train_iters": 0}, {"train_iters": -3}, {"log_interval": 0}]))
    elif rule == "training_values":
        training = draw(st.sampled_from([
            {"lr": -1.0}, {"lr": 0.0}, {"lr": float("nan")}, {"weight_decay": -0.1}, {"grad_clip": -1.0},
            {"grad_clip": float("inf")}, {"save_interval": -1}, {"collective_timeout_s": 0.0},
            {"lr": -3e-4, "weight_decay": -0.01}, {"profile_steps": [0]}, {"profile_steps": [2, -1]},
            {"train_iters": 10, "profile_steps": [9, 11]}, {"seed": -5}, {"seed": 2**64},
        ]))
    elif rule == "hardware_figures":
        hw = draw(st.sampled_from([
            {"gemm_efficiency": 2.0}, {"gemm_efficiency": -1.0}, {"memory_bw_efficiency": 0.0},
            {"inter_node_comm_efficiency": 1.5}, {"memory_bw_gbs": 0.0}, {"intra_node_bw_gbs": -300.0},
            {"allocator_fragmentation": 1.0}, {"comm_latency_us": -5.0}, {"kernel_overhead_us": float("nan")},
            {"device_pattern": "A100("}, {"attention_efficiency": 0.0}, {"attention_efficiency": 1.2},
        ]))
    elif rule == "cluster_settings":
        cluster = draw(st.sampled_from([
            {"time_limit_min": 0}, {"time_limit_min": -5}, {"cpus_per_task": 0}, {"max_retries": -1},
            {"array_parallelism": 0}, {"mem_per_node_gb": 0},
        ]))
    elif rule == "warmup_iters":
        iters = draw(st.integers(1, 20))
        training = draw(st.sampled_from([
            {"train_iters": iters, "warmup_iters": iters + draw(st.integers(0, 5))},
            {"train_iters": iters, "warmup_iters": 0, "lr_warmup_iters": iters + draw(st.integers(1, 5))},
            {"train_iters": iters, "warmup_iters": iters, "lr_warmup_iters": iters + 1},
            {"warmup_iters": -1},
            {"lr_warmup_iters": -2},
        ]))
    elif rule == "world_size":
        if draw(st.booleans()):  # dp derived: the world is not a multiple of tp x pp
            pp = draw(st.sampled_from([2, 4]))
            par = {"pp": pp}
            world = draw(st.integers(1, 32).filter(lambda w: w % pp != 0))
        else:  # dp explicit and disagreeing with the world
            pp, dp = draw(st.sampled_from([1, 2])), draw(st.integers(1, 4))
            par = {"pp": pp, "dp": dp}
            world = draw(st.integers(1, 32).filter(lambda w: w != dp * pp))
    elif rule == "global_batch_divisible":
        dp, mbs = draw(st.integers(1, 4)), draw(st.integers(1, 4))
        world = dp
        par = {"micro_batch_size": mbs,
               "global_batch_size": draw(st.integers(1, 64).filter(lambda g: g % (mbs * dp) != 0))}
    elif rule == "rampup_batch_size":
        dp, mbs = draw(st.integers(1, 4)), draw(st.integers(1, 2))
        step = dp * mbs
        world = dp
        kind = draw(st.sampled_from(["start", "increment", "landing", "length", "nothing", "no samples"]))
        gbs = step * draw(st.integers(4, 8))
        if kind == "nothing":  # Megatron divides by the increments, none here
            ramp = [gbs, step, 100]
        elif kind == "no samples":
            ramp = [step, step, 0]
        elif kind == "start" and step > 1:
            ramp = [step + draw(st.integers(1, step - 1)), step, 100]
        elif kind == "increment" and step > 1:
            ramp = [step, step + draw(st.integers(1, step - 1)), 100]
        elif kind == "length":
            ramp = [step, step]
        else:  # (global - start) not a multiple of increment
            gbs = step * 5
            ramp = [step, 3 * step, 100]
        par = {"micro_batch_size": mbs, "global_batch_size": gbs, "rampup_batch_size": ramp}
    elif rule == "zero_stage":
        par = {"zero_stage": draw(st.sampled_from([-1, 4, 7]))}
    elif rule == "offload_requires_zero":
        # On DeepSpeed: the native engine would reject any offload (and stage 2) besides.
        par = draw(st.sampled_from([
            {"offload": Offload.params, "zero_stage": 0}, {"offload": Offload.params, "zero_stage": 1},
            {"offload": Offload.params, "zero_stage": 2}, {"offload": Offload.optimizer, "zero_stage": 0},
        ]))
        par["engine"] = Engine.deepspeed
    elif rule == "deepspeed_no_pipeline":
        tp, pp = draw(st.sampled_from([(1, 2), (1, 4), (2, 2), (4, 4)]))
        par = {"engine": Engine.deepspeed, "tp": tp, "pp": pp}
    elif rule == "deepspeed_checkpoint":
        par = {"engine": Engine.deepspeed, "zero_stage": draw(st.integers(0, 3))}
        training = {"save_interval": draw(st.integers(1, 1000))}
    elif rule == "deepspeed_fp16_on_cpu":
        par = {"engine": Engine.deepspeed, "precision": Precision.fp16, "zero_stage": draw(st.integers(0, 3))}
        hw = {"device_type": "cpu"}
    elif rule == "native_zero_stage":
        par = {"zero_stage": draw(st.sampled_from([2, 3]))}
    elif rule == "native_offload":
        par = {"offload": Offload.optimizer, "zero_stage": 1}
    elif rule == "sequence_parallel_native_only":
        par = {"engine": Engine.deepspeed, "tp": 2, "sequence_parallel": True, "zero_stage": draw(st.integers(0, 3))}
    elif rule == "virtual_stages_native_only":
        # DeepSpeed runs no pipeline here, so there is none to interleave either.
        par = {"engine": Engine.deepspeed, "virtual_stages": 2, "zero_stage": draw(st.integers(0, 3))}
        expected = {rule, "virtual_stages_need_pp"}
    elif rule == "precision_supported":
        precision = draw(st.sampled_from(list(Precision)))
        par = {"precision": precision}
        hw = {f"peak_tflops_{precision.value}": None}
    elif rule == "apex_needs_cuda":
        par = {"optimizer": OptimizerImpl.apex, "engine": draw(st.sampled_from(list(Engine)))}
        hw = {"device_type": draw(st.sampled_from(["cpu", "mps"]))}
    elif rule == "memory":
        hw = {"memory_gib": draw(st.sampled_from([1e-5, 1e-4]))}
    elif rule == "micro_batch_size":
        par = {"micro_batch_size": draw(st.sampled_from(["big", "8", "Auto", "max"]))}
    elif rule == "micro_batch_auto":
        # Too little memory for even one sample (a global batch no size splits is global_batch_divisible's).
        hw = {"memory_gib": draw(st.sampled_from([1e-5, 1e-4]))}
        par = {"micro_batch_size": "auto"}
    else:
        raise AssertionError(rule)
    return make_run(model, par, hw, training, cluster), world, expected


def _render(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, Enum):
        return str(value.value)
    return str(value)


# Derived quantities in Violation.fields that are not config fields written as name=value.
_DERIVED = {"predicted_gib", "usable_gib", "padded_vocab_size"}


@pytest.mark.parametrize("rule", RULES)
@PER_RULE
@given(data=st.data())
def test_breaking_one_rule_reports_that_rule_with_its_fields(rule: str, data: st.DataObject) -> None:
    run, world, expected = data.draw(break_one(rule))
    assert broken_rules(run, world) >= expected  # the construction really breaks it
    violations = validate(run, world_size=world)
    assert {v.rule for v in violations} == expected, [v.message for v in violations]
    for v in violations:
        assert v.fields, v
        for name, value in v.fields.items():
            if name not in _DERIVED:
                # hardware_figures quotes what it lists (a device_pattern may hold spaces and commas).
                shown = repr(value) if name == "hardware.device_pattern" else _render(value)
                assert f"{name}={shown}" in v.message, (name, value, v.message)


def test_valid_base_config_passes() -> None:
    assert validate(make_run()) == []
    assert broken_rules(make_run(), None) == set()


# --------------------------------------------------------------------------------------
# Messages: the alternatives they offer are right.


def _one(run: RunConfig, world_size: int | None = None) -> Violation:
    violations = validate(run, world_size=world_size)
    assert len(violations) == 1, [v.message for v in violations]
    return violations[0]


def _listed(message: str, label: str) -> list[int]:
    match = re.search(re.escape(label) + r"[^:]*: (\d+(?:, \d+)*)", message)
    assert match, (label, message)
    return [int(x) for x in match.group(1).split(",")]


def test_tp_not_dividing_heads_lists_valid_tp() -> None:
    violations = validate(make_run({"num_attention_heads": 16, "hidden_size": 1024}, {"tp": 3}, {"devices_per_node": 24}))
    # 3 divides neither the hidden size nor the MLP either; the heads rule is the first of them.
    assert [x.rule for x in violations] == ["heads_divisible_by_tp", "hidden_divisible_by_tp", "ffn_divisible_by_tp"]
    v = violations[0]
    assert v.fields == {"parallelism.tp": 3, "model.num_attention_heads": 16}
    assert "parallelism.tp=3 does not divide model.num_attention_heads=16" in v.message
    assert "whole heads" in v.message
    assert "Valid tp for this model: 1, 2, 4, 8, 16." in v.message


def test_valid_tp_also_respects_the_ffn_width() -> None:
    # ffn 24 = 2^3 x 3: tp 16 divides heads and hidden but not the MLP.
    v = _one(make_run({"num_attention_heads": 16, "hidden_size": 64, "ffn_hidden_size": 24}, {"tp": 16},
                      {"devices_per_node": 16}))
    assert v.rule == "ffn_divisible_by_tp"
    assert _listed(v.message, "Valid tp for this model") == [1, 2, 4, 8]


def test_layers_not_divisible_by_pp_lists_divisors() -> None:
    v = _one(make_run({"num_layers": 96}, {"pp": 5}))
    assert v.rule == "layers_divisible_by_pp"
    assert _listed(v.message, "Valid pp for this model") == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96]


def test_hidden_not_divisible_by_heads_lists_heads_and_hidden_sizes() -> None:
    v = _one(make_run({"hidden_size": 100, "num_attention_heads": 8}))
    assert v.rule == "hidden_divisible_by_heads"
    heads = _listed(v.message, "Valid num_attention_heads")
    assert heads and all(100 % a == 0 for a in heads)
    hiddens = _listed(v.message, "or hidden_size for 8 heads")
    assert hiddens == [88, 96, 104, 112]


def test_a_step_count_below_one_gives_an_example_of_the_field_it_names() -> None:
    # log_interval=0 was told "e.g. train_iters=10", a field it had not set.
    v = _one(make_run(training={"log_interval": 0}))
    assert v.rule == "train_iters" and v.message.endswith("(e.g. training.log_interval=10).")
    v = _one(make_run(training={"train_iters": 0}))
    assert v.message.endswith("(e.g. training.train_iters=10).")


def test_warmups_longer_than_the_run() -> None:
    # Timing warm-up: at least one measured iteration must remain.
    v = _one(make_run(training={"train_iters": 5, "warmup_iters": 5}))
    assert v.rule == "warmup_iters" and "Use warmup_iters at most 4, or train_iters at least 6." in v.message
    # Learning-rate warm-up: it may end on the last step (the peak is reached), not after it.
    assert validate(make_run(training={"train_iters": 5, "warmup_iters": 1, "lr_warmup_iters": 5})) == []
    v = _one(make_run(training={"train_iters": 5, "warmup_iters": 1, "lr_warmup_iters": 8}))
    assert v.rule == "warmup_iters" and v.fields == {"training.lr_warmup_iters": 8, "training.train_iters": 5}
    assert "never reaches training.lr" in v.message
    assert "Use lr_warmup_iters at most 5, or train_iters at least 8." in v.message
    # Both at once: one violation of the one rule, saying both.
    v = _one(make_run(training={"train_iters": 5, "warmup_iters": 6, "lr_warmup_iters": 9}))
    assert "warmup_iters at most 4" in v.message and "lr_warmup_iters at most 5" in v.message


def test_world_size_not_multiple_of_model_parallel() -> None:
    v = _one(make_run({"num_layers": 10}, {"pp": 5, "global_batch_size": 16}), world_size=48)
    assert v.rule == "world_size"
    assert "world size must be a multiple of tp x pp = 5" in v.message.lower()
    assert _listed(v.message, "nearest") == [45, 50]


def test_whole_nodes_lists_only_dp_a_run_can_take_and_answers_at_once_for_any_dp() -> None:
    # dp=12 on nodes of 8 with a global batch of 48 in micro-batches of 4: 5, 7 and 16 fill whole nodes
    # too, but leave the batch undivided (global_batch_divisible refused each of them).
    v = _one(make_run(par={"dp": 12, "micro_batch_size": 4, "global_batch_size": 48}))
    assert v.rule == "whole_nodes" and "global_batch_size=48 with micro_batch_size=4" in v.message
    listed = _listed(v.message, "Valid dp with tp x pp = 1")
    assert listed == [1, 2, 3, 4, 6]
    assert all(not validate(make_run(par={"dp": d, "micro_batch_size": 4, "global_batch_size": 48})) for d in listed)
    # With tp x pp = 6 on nodes of 8: one node holds dp 1; whole nodes take multiples of 4.
    v = _one(make_run({"num_layers": 12}, {"dp": 3, "tp": 2, "pp": 3, "micro_batch_size": 1, "global_batch_size": 96}))
    assert _listed(v.message, "Valid dp") == [1, 4, 8, 12, 16, 24]
    # A dp of 10^20 was searched for fitting values up to 4 x dp (analysis.calc devices=... ran for ever).
    huge = 10**20 + 1
    (v,) = [v for v in validate(make_run(par={"dp": huge, "global_batch_size": huge})) if v.rule == "whole_nodes"]
    assert all(d <= 8 or d % 8 == 0 for d in _listed(v.message, "Valid dp"))


def test_layers_divisible_by_pp_offers_only_pipelines_that_keep_the_virtual_stages() -> None:
    # pp=2 of 5 layers with virtual_stages=2 was told "Valid pp for this model: 1, 5": pp=1 breaks
    # virtual_stages_need_pp, pp=5 layers_divisible_by_virtual_stages.
    v = next(v for v in validate(make_run({"num_layers": 5}, {"pp": 2, "virtual_stages": 2}))
             if v.rule == "layers_divisible_by_pp")  # fmt: skip
    assert v.message.endswith("No pp splits them into virtual_stages=2 chunks per rank: with virtual_stages=1, "
                              "valid pp for this model: 1, 5.")  # fmt: skip
    v = next(v for v in validate(make_run({"num_layers": 12}, {"pp": 5, "virtual_stages": 2}))
             if v.rule == "layers_divisible_by_pp")  # fmt: skip
    listed = _listed(v.message, "Valid pp with parallelism.virtual_stages=2")
    assert listed == [2, 3, 6]
    layer_rules = {"layers_divisible_by_pp", "virtual_stages_need_pp", "layers_divisible_by_virtual_stages"}
    for pp in listed:
        broken = {v.rule for v in validate(make_run({"num_layers": 12}, {"pp": pp, "virtual_stages": 2}))}
        assert not broken & layer_rules, (pp, broken)


def test_world_size_disagreeing_with_explicit_dp_lists_valid_dp() -> None:
    v = _one(make_run(par={"dp": 3, "pp": 2}), world_size=16)
    assert v.rule == "world_size"
    assert "Valid dp for world_size=16: 8" in v.message


def test_global_batch_lists_nearby_batches_and_micro_batches() -> None:
    v = _one(make_run(par={"micro_batch_size": 4, "global_batch_size": 10}))
    assert v.rule == "global_batch_divisible"
    assert _listed(v.message, "Valid global_batch_size near 10") == [4, 8, 12, 16]
    micro = _listed(v.message, "Valid micro_batch_size")
    assert micro == [1, 2, 5, 10]
    assert all(10 % m == 0 for m in micro)


def test_global_batch_not_multiple_of_dp_says_no_micro_batch_works() -> None:
    v = _one(make_run(par={"micro_batch_size": 1, "global_batch_size": 10}), world_size=4)
    assert v.fields["parallelism.dp"] == 4
    assert "No micro_batch_size works" in v.message
    assert all(g % 4 == 0 for g in _listed(v.message, "Valid global_batch_size near 10"))


def test_tp_outside_a_node_runs_with_a_note_listing_tp_within_the_node() -> None:
    # Clusters of one-device nodes only have TP over the network: it is allowed, with a warning.
    run = make_run({"num_attention_heads": 16, "hidden_size": 256}, {"tp": 16, "global_batch_size": 1})
    assert validate(run) == []
    (v,) = advise(run)
    assert v.rule == "tp_across_nodes"
    assert "parallelism.tp=16 exceeds hardware.devices_per_node=8" in v.message
    assert _listed(v.message, "tp that keeps every group on one node on toy") == [1, 2, 4, 8]
    assert advise(make_run(par={"tp": 2})) == []


def test_bf16_on_v100_is_rejected_with_fp16_and_fp32() -> None:
    run = compose_run("hardware=v100_32gb", "parallelism.precision=bf16")
    v = _one(run)
    assert v.rule == "precision_supported"
    assert "parallelism.precision=bf16" in v.message and "v100_32gb" in v.message
    assert "Valid precision on v100_32gb: fp16, fp32." in v.message
    assert validate(compose_run("hardware=v100_32gb", "parallelism.precision=fp16")) == []


def test_measured_peaks_accept_any_precision() -> None:
    for precision in Precision:
        run = make_run(par={"precision": precision},
                       hw={"peak_measured": True, "peak_tflops_bf16": None, "peak_tflops_fp16": None,
                           "peak_tflops_fp32": None})
        assert validate(run) == []


def test_offload_messages() -> None:
    ds = {"engine": Engine.deepspeed}
    v = _one(make_run(par={**ds, "offload": Offload.params, "zero_stage": 2}))
    assert "parallelism.offload=params requires ZeRO stage 3" in v.message
    assert validate(make_run(par={**ds, "offload": Offload.params, "zero_stage": 3})) == []
    assert validate(make_run(par={**ds, "offload": Offload.optimizer, "zero_stage": 1})) == []


def test_sequence_parallel_rules_list_tp_that_split_the_tokens() -> None:
    # BASE_MODEL: 4 heads, hidden 32, ffn 128, seq 8.
    v = _one(make_run(par={"sequence_parallel": True}))
    assert v.rule == "sequence_parallel_needs_tp" and "tp in 2, 4" in v.message
    v = _one(make_run(model={"seq_length": 6}, par={"tp": 4, "sequence_parallel": True}))
    assert v.rule == "seq_divisible_by_tp"
    assert "Valid tp with sequence parallel for this model: 2" in v.message and "seq_length 4, 8" in v.message
    assert validate(make_run(model={"seq_length": 6}, par={"tp": 2, "sequence_parallel": True})) == []
    v = _one(make_run(par={"engine": Engine.deepspeed, "tp": 2, "sequence_parallel": True}))
    assert v.rule == "sequence_parallel_native_only" and "Use engine=native with sequence_parallel=true" in v.message


def test_virtual_stage_rules_list_what_would_interleave() -> None:
    # BASE_MODEL: 4 layers; gbs 4 at mbs 1: 4 micro-batches.
    v = _one(make_run(par={"virtual_stages": 2}))
    assert v.rule == "virtual_stages_need_pp" and "or pp of 2 or more" in v.message
    v = _one(make_run(model={"num_layers": 6}, par={"pp": 2, "virtual_stages": 2}))
    assert v.rule == "layers_divisible_by_virtual_stages"
    assert "Valid for pp=2: virtual_stages in 3" in v.message and "num_layers 4, 8" in v.message
    assert validate(make_run(model={"num_layers": 6}, par={"pp": 2, "virtual_stages": 3})) == []
    v = _one(make_run(par={"pp": 2, "virtual_stages": 2, "global_batch_size": 6}), world_size=4)
    assert v.rule == "interleaved_micro_batches" and v.fields["parallelism.dp"] == 2
    assert "multiple of micro_batch_size x dp x pp = 4, e.g. 4, 8" in v.message
    assert validate(make_run(par={"pp": 2, "virtual_stages": 2, "global_batch_size": 8}), world_size=4) == []
    both = {v.rule: v for v in validate(make_run(par={"virtual_stages": 2, "engine": Engine.deepspeed}))}
    assert set(both) == {"virtual_stages_need_pp", "virtual_stages_native_only"}
    assert "Use engine=native with virtual_stages > 1" in both["virtual_stages_native_only"].message


def test_engine_rules_name_the_engine_that_can_run_it() -> None:
    v = _one(make_run(par={"engine": Engine.deepspeed, "pp": 2}))
    assert v.rule == "deepspeed_no_pipeline"
    assert "Use pp=1 with engine=deepspeed (any tp), or engine=native for pp > 1" in v.message
    assert validate(make_run(par={"engine": Engine.deepspeed, "tp": 2})) == []
    v = _one(make_run(par={"engine": Engine.deepspeed}, training={"save_interval": 50}))
    assert v.rule == "deepspeed_checkpoint" and "Use training.save_interval=0 with engine=deepspeed" in v.message
    assert validate(make_run(training={"save_interval": 50})) == []  # the native engine checkpoints
    v = _one(make_run(par={"engine": Engine.deepspeed, "precision": Precision.fp16}, hw={"device_type": "cpu"}))
    assert v.rule == "deepspeed_fp16_on_cpu" and "bf16, fp32" in v.message
    assert validate(make_run(par={"engine": Engine.deepspeed, "precision": Precision.fp16},
                             hw={"device_type": "cuda"})) == []
    v = _one(make_run(par={"zero_stage": 3}))
    assert v.rule == "native_zero_stage"
    assert "native engine implements ZeRO-1" in v.message
    assert "use engine=deepspeed for stages 2-3" in v.message.lower()
    v = _one(make_run(par={"offload": Offload.optimizer, "zero_stage": 1}))
    assert v.rule == "native_offload" and "engine=deepspeed" in v.message
    # Everything DeepSpeed runs today: every stage, with data parallelism.
    for zero in (0, 1, 2, 3):
        assert validate(make_run(par={"engine": Engine.deepspeed, "zero_stage": zero}), world_size=4) == []


def test_zero_stage_out_of_range_lists_stages() -> None:
    v = _one(make_run(par={"zero_stage": 4}))
    assert v.rule == "zero_stage"
    assert "Valid zero_stage: 0" in v.message and "3 (and parameters)" in v.message


def test_rampup_follows_bloom_notes() -> None:
    # Seed 001: "if the rampup steps are in increments of 32 with DP=4 highest MBS is 8", and
    # the 48-node row "48 | 200B | 12 | 8 | 4 | 1 | 2040" is excluded by the ramp-up (32 % 12 != 0).
    def bloom(dp: int, mbs: int, gbs: int) -> list[Violation]:
        run = make_run({"num_layers": 8}, {"micro_batch_size": mbs, "global_batch_size": gbs,
                                           "rampup_batch_size": [32, 32, 6_000_000]})
        return [v for v in validate(run, world_size=dp) if v.rule == "rampup_batch_size"]

    assert bloom(dp=4, mbs=8, gbs=2048) == []
    assert bloom(dp=8, mbs=4, gbs=2048) == []
    too_big = bloom(dp=4, mbs=16, gbs=2048)
    assert len(too_big) == 1
    assert "start 32 is not a multiple of micro_batch_size x dp = 64" in too_big[0].message
    dp12 = bloom(dp=12, mbs=1, gbs=2040)
    assert len(dp12) == 1 and "increment 32 is not a multiple of micro_batch_size x dp = 12" in dp12[0].message


def test_rampup_needs_three_values_and_exact_landing() -> None:
    v = _one(make_run(par={"rampup_batch_size": [4, 4]}))
    assert "three non-negative integers" in v.message
    assert validate(make_run(par={"global_batch_size": 10, "micro_batch_size": 1, "rampup_batch_size": [2, 4, 100]})) == []
    v = _one(make_run(par={"global_batch_size": 12, "micro_batch_size": 1, "rampup_batch_size": [2, 4, 100]}))
    assert "global_batch_size - start = 12 - 2 = 10 is not a multiple of increment 4" in v.message


def test_auto_on_a_global_batch_no_size_splits_names_the_batch_rule() -> None:
    # It said "no candidate micro_batch_size divides ...: free memory with a larger tp or pp", where no
    # size and no memory could help.
    v = _one(make_run(par={"micro_batch_size": "auto", "global_batch_size": 6}), world_size=4)
    assert v.rule == "global_batch_divisible" and "Valid global_batch_size near 6: 4, 8, 12, 16." in v.message


def test_apex_is_refused_off_cuda_naming_the_optimizers_that_run_there() -> None:
    # It was refused only by `python -m train`, on the machine: the dry run planned it ok.
    v = _one(make_run(par={"optimizer": OptimizerImpl.apex}, hw={"device_type": "cpu"}))
    assert v.rule == "apex_needs_cuda" and v.message.endswith("Valid optimizer on cpu: auto, torch_fused, torch.")
    assert validate(make_run(par={"optimizer": OptimizerImpl.apex})) == []  # on CUDA it is the user's to ask


def test_a_ramp_that_ramps_nothing_is_refused_as_megatron_would_fail_on_it() -> None:
    # [4, 4, 0] and a start at the global batch ran without a ramp (the record still said the ramp asked);
    # Megatron divides by the ramp samples per increment and by the increments.
    for ramp, words in (([4, 4, 0], "ramp samples 0 ramps over no samples"),
                        ([16, 4, 100], "start 16 is global_batch_size=16, so there is nothing to ramp")):  # fmt: skip
        v = _one(make_run(par={"global_batch_size": 16, "micro_batch_size": 4, "rampup_batch_size": ramp}))
        assert v.rule == "rampup_batch_size" and words in v.message, v.message
        assert "e.g. [4, 4, " in v.message and "start in 4, 8, 12 with increment 4" in v.message
    # A start far above the global batch still gets starts to choose from.
    v = _one(make_run(par={"global_batch_size": 16, "micro_batch_size": 1, "rampup_batch_size": [100, 1, 1000]}))
    assert "start in 10, 11, 12, 13, 14, 15 with increment 1" in v.message, v.message
    # One micro-batch per replica: nothing smaller to start from.
    v = _one(make_run(par={"global_batch_size": 4, "micro_batch_size": 4, "rampup_batch_size": [4, 4, 100]}))
    assert "no smaller batch to start from" in v.message


def test_memory_violation_reports_gib_and_fixes_that_fit() -> None:
    # BLOOM 181B on 384 A100s with pp=2 and micro-batch 4: far over 80 GB.
    run = compose_run("model=bloom_181b_l72_h14336", "hardware=a100_80gb", "parallelism=megatron_3d",
                      "parallelism.pp=2", "parallelism.global_batch_size=2304", "parallelism.micro_batch_size=4")
    v = _one(run, world_size=384)
    assert v.rule == "memory"
    predicted, usable = v.fields["predicted_gib"], v.fields["usable_gib"]
    assert isinstance(predicted, float) and isinstance(usable, float)
    assert predicted > usable == pytest.approx(79.15, abs=0.01)
    assert f"Predicted memory {predicted:.2f} GiB" in v.message and f"usable {usable:.2f} GiB" in v.message
    for knob in ("tp or pp", "zero_stage", "recompute", "micro_batch_size"):
        assert knob in v.message
    fixes = re.findall(r"parallelism\.(\w+)=(\w+)", v.message.split("alone would fit")[1])
    assert fixes, v.message
    # Each fix keeps dp, so check it with dp explicit rather than with the world size.
    keep_dp = dataclasses.replace(run.parallelism, dp=24)
    for key, value in fixes:
        fixed = type(getattr(keep_dp, key))(value)
        changed = dataclasses.replace(run, parallelism=dataclasses.replace(keep_dp, **{key: fixed}))
        # ... and is one the (native) engine can run: no ZeRO-2/3 advice.
        assert not {x.rule for x in validate(changed)} & {"memory", "native_zero_stage"}, (key, value)


def test_memory_fixes_break_no_rule_the_layout_keeps() -> None:
    # Interleaved stages, sequence parallelism and odd sequence lengths: a fix such as pp=40 for
    # virtual_stages=2 (40 layers in 80 chunks) was advised, and refused once taken.
    base = compose_run("model=gpt_13b", "hardware=a100_40gb", "parallelism.global_batch_size=96", "parallelism.dp=2")
    advised = 0
    for tp, pp, v, sp, mbs, seq in itertools.product((1, 2), (1, 2, 4), (1, 2), (False, True), (4, 8), (2048, 1002)):
        par = dataclasses.replace(base.parallelism, tp=tp, pp=pp, virtual_stages=v, sequence_parallel=sp and tp > 1,
                                  micro_batch_size=mbs)  # fmt: skip
        run = dataclasses.replace(base, parallelism=par, model=dataclasses.replace(base.model, seq_length=seq))
        violations = validate(run)
        memory = [x for x in violations if x.rule == "memory"]
        if not memory or "alone would fit" not in memory[0].message:
            continue
        kept = {x.rule for x in violations}
        for key, value in re.findall(r"parallelism\.(\w+)=(\w+)", memory[0].message.split("alone would fit")[1]):
            advised += 1
            fixed = dataclasses.replace(par, **{key: type(getattr(par, key))(value)})
            broken = {x.rule for x in validate(dataclasses.replace(run, parallelism=fixed))}
            assert "memory" not in broken and broken <= kept, (tp, pp, v, sp, mbs, seq, key, value, broken - kept)
    assert advised > 50


def test_a_deepspeed_layout_is_advised_a_larger_tp_never_a_pipeline() -> None:
    # DeepSpeed runs any tp (deepspeed_no_pipeline's own words), yet its advice offered none, and its text
    # offered pp, which it refuses.
    base = compose_run("model=gpt_2.7b", "hardware=a100_40gb", "parallelism.global_batch_size=96",
                       "parallelism.dp=2", "parallelism.engine=deepspeed", "parallelism.micro_batch_size=4")  # fmt: skip
    v = _one(base)
    assert v.rule == "memory" and "Larger tp, a higher zero_stage" in v.message and " pp" not in v.message.split(". ", 1)[1]
    fixes = dict(re.findall(r"parallelism\.(\w+)=(\w+)", v.message.split("alone would fit")[1]))
    assert "tp" in fixes and "pp" not in fixes, v.message
    fixed = dataclasses.replace(base.parallelism, tp=int(fixes["tp"]))
    assert validate(dataclasses.replace(base, parallelism=fixed)) == []
    # micro_batch_size=auto's advice alike.
    auto = dataclasses.replace(base, parallelism=dataclasses.replace(base.parallelism, micro_batch_size="auto"),
                               hardware=dataclasses.replace(base.hardware, memory_gib=1.0))  # fmt: skip
    (none_fits,) = [x for x in validate(auto) if x.rule == "micro_batch_auto"]
    assert "free memory with a larger tp, a higher zero_stage" in none_fits.message


def test_memory_fixes_on_a_fixed_world_keep_it_and_break_no_rule() -> None:
    # analysis.calc's devices or a launcher's world: a fix that kept dp (tp=2 with dp=2 on 4 devices)
    # needed more devices than there are. Each fix (a degree, with dp where the user set it) runs there.
    base = compose_run("model=gpt_2.7b", "hardware=a100_40gb", "parallelism.global_batch_size=96")
    advised = 0
    for tp, pp, v, sp, mbs, dp_given in itertools.product((1, 2), (1, 2), (1, 2), (False, True), (4, 8), (False, True)):
        par = dataclasses.replace(base.parallelism, tp=tp, pp=pp, virtual_stages=v, sequence_parallel=sp and tp > 1,
                                  micro_batch_size=mbs, dp=8 // (tp * pp) if dp_given else None)  # fmt: skip
        run = dataclasses.replace(base, parallelism=par)
        violations = validate(run, world_size=8, world_fixed=True)
        memory = [x for x in violations if x.rule == "memory"]
        if not memory or "alone would fit" not in memory[0].message:
            continue
        assert "(the world of 8 devices kept," in memory[0].message
        kept = {x.rule for x in violations}
        for fix in memory[0].message.split("): ", 1)[1].rstrip(".").split(", "):
            advised += 1
            change = dict(re.findall(r"parallelism\.(\w+)=(\w+)", fix))
            assert ("dp" in change) == (dp_given and bool({"tp", "pp"} & change.keys())), fix
            values: dict[str, Any] = {k: type(getattr(par, k) or 1)(value) for k, value in change.items()}
            fixed = dataclasses.replace(par, **values)
            broken = {x.rule for x in validate(dataclasses.replace(run, parallelism=fixed), world_size=8, world_fixed=True)}
            assert "memory" not in broken and broken <= kept, (tp, pp, v, sp, mbs, dp_given, fix, broken - kept)
    assert advised > 20
    with pytest.raises(ValueError, match="needs the world_size"):
        validate(base, world_fixed=True)


def test_gpt3_on_one_gpu_has_no_single_fix() -> None:
    run = compose_run("model=gpt3_175b", "hardware=a100_80gb", "parallelism=megatron_3d", "parallelism.tp=1")
    v = _one(run, world_size=1)
    assert v.rule == "memory"
    assert "No single change" in v.message


def test_shipped_default_layouts_are_valid() -> None:
    assert validate(compose_run()) == []
    assert validate(compose_run("model=gpt_1.3b", "hardware=a100_80gb", "parallelism=megatron_3d"),
                    world_size=8) == []


# --------------------------------------------------------------------------------------
# InfeasibleConfig and dp


def test_infeasible_config_is_one_paragraph_with_every_violation() -> None:
    run = compose_run("hardware=v100_32gb", "parallelism.precision=bf16", "parallelism.tp=3",
                      "parallelism.zero_stage=5")
    violations = validate(run)
    assert len(violations) >= 3
    error = InfeasibleConfig(violations)
    text = str(error)
    assert isinstance(error, ValueError)
    assert "\n" not in text
    assert f"{len(violations)} problems" in text
    for v in violations:
        assert v.message in text
    copy = pickle.loads(pickle.dumps(error))
    assert str(copy) == text and copy.violations == violations
    # Each violation's words come back out of the paragraph, by rule (a summary by rule shows only
    # its own problem), and out of a one-violation paragraph too.
    assert [rule_problem(text, v.rule) for v in violations] == [v.message for v in violations]
    assert rule_problem(str(InfeasibleConfig(violations[-1:])), violations[-1].rule) == violations[-1].message
    assert rule_problem(text, "no_such_rule") is None


def test_resolve_dp() -> None:
    assert Layout.of(ParallelismConfig(tp=2, pp=4), None).dp == 1
    assert Layout.of(ParallelismConfig(tp=2, pp=4), 64).dp == 8
    assert Layout.of(ParallelismConfig(tp=2, pp=4, dp=3), None).dp == 3
    assert Layout.of(ParallelismConfig(tp=2, pp=4, dp=3), 24).dp == 3
    with pytest.raises(ValueError, match="multiple of tp x pp"):
        Layout.of(ParallelismConfig(tp=2, pp=4), 12)
    with pytest.raises(ValueError, match="does not equal"):
        Layout.of(ParallelismConfig(tp=2, pp=4, dp=3), 16)


def test_divisors() -> None:
    assert divisors(1) == [1]
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert divisors(49) == [1, 7, 49]
    assert divisors(0) == []


# ----------------------------------------------------------------------------- the device a run found


# What torch.cuda reports (get_device_name, total_memory in GiB) for the devices conf/hardware
# describes; the H100's is the one tests/bench/results/gpu recorded (85,017,493,504 bytes).
DEVICES = {
    "NVIDIA H100 80GB HBM3": (85017493504 / 2**30, {"h100_sxm"}),
    "NVIDIA H100 PCIe": (79.2, {"h100_pcie"}),
    "NVIDIA A100-SXM4-80GB": (79.15, {"a100_80gb", "a100_80gb_jean_zay"}),
    "NVIDIA A100-SXM4-40GB": (39.39, {"a100_40gb"}),
    "NVIDIA H200": (139.8, {"h200"}),
    "Tesla V100-SXM2-32GB": (31.74, {"v100_32gb"}),
}


def test_each_gpu_is_described_by_its_own_hardware_configs_only() -> None:
    options = hardware_options()
    for device, (memory, own) in DEVICES.items():
        fits = {name for name, hw in options.items()
                if device_mismatch(hw, device_name=device, memory_gib=memory) is None and hw.device_type == "cuda"}
        assert fits == own, device


def test_another_device_than_the_config_says_is_named_with_the_configs_that_fit() -> None:
    options = hardware_options()
    a100 = options["a100_80gb"]
    # An H100 run under hardware=a100_80gb: MFU against 312 TFLOP/s instead of 989, without a word.
    text = device_mismatch(a100, device_name="NVIDIA H100 80GB HBM3", memory_gib=79.18, options=options)
    assert text is not None
    assert text.startswith("hardware=a100_80gb does not describe this device: the device is 'NVIDIA H100 80GB HBM3'")
    assert "hardware.device_pattern='A100'" in text and text.endswith("choose hardware=h100_sxm")
    # The name fits, the memory does not: an A100 of 40 GB (or a MIG slice) under the 80 GB config.
    small = device_mismatch(a100, device_name="NVIDIA A100-SXM4-40GB", memory_gib=39.39, options=options)
    assert small is not None and "the device has 39.39 GiB, hardware.memory_gib=79.15" in small
    assert "device_pattern" not in small and small.endswith("choose hardware=a100_40gb")
    mig = device_mismatch(a100, device_name="NVIDIA A100-SXM4-80GB MIG 2g.20gb", memory_gib=19.62, options=options)
    assert mig is not None and "a hardware config of this device (conf/hardware/*.yaml)" in mig
    # A CPU config on another CPU: the A64FX's on this x86 machine.
    epyc = "cpu: AMD EPYC 7B13 64-Core Processor x 2 threads"
    cpu = device_mismatch(options["a64fx"], device_name=epyc, memory_gib=None, options=options)
    assert cpu is not None and "'A64FX|aarch64' does not match" in cpu
    assert device_mismatch(options["a64fx"], device_name="cpu: aarch64 x 48 threads", memory_gib=None) is None
    # Nothing to tell by: no pattern (the generic cpu config), no name, no memory.
    assert device_mismatch(options["cpu"], device_name=epyc, memory_gib=None) is None
    assert device_mismatch(a100, device_name=None, memory_gib=None) is None
    # Within 5%: the configs give the allocator's usable memory, the device reports a little less.
    assert device_mismatch(options["h100_sxm"], device_name="NVIDIA H100 80GB HBM3", memory_gib=79.18) is None


def test_a_device_pattern_that_is_no_regular_expression_is_refused() -> None:
    run = RunConfig(hardware=HardwareConfig(device_pattern="A100("))
    (v,) = [v for v in validate(run) if v.rule == "hardware_figures"]
    assert "hardware.device_pattern='A100('" in str(v) and "regular expression" in str(v)


def test_a_hardware_figure_out_of_range_is_told_its_own_range_only() -> None:
    # hardware.memory_gib=-1 was told the range of every figure (efficiencies, fragmentation, reserves...).
    def message(**hw: object) -> str:
        (v,) = [v for v in validate(make_run(hw=hw)) if v.rule == "hardware_figures"]
        return v.message

    memory = message(memory_gib=-1.0)
    assert memory.startswith("hardware.memory_gib=-1.0: out of range for hardware ")
    assert "memory_gib, peaks, SM counts and bandwidths are positive" in memory
    assert "efficiencies" not in memory and "reserves" not in memory and "device_pattern" not in memory
    # Sane alone, nothing left together: it was the memory rule's "exceeds the usable -1.50 GiB".
    reserve = message(memory_gib=0.5, memory_reserve_gib=2.0)
    assert reserve.startswith("hardware.memory_gib=0.5, hardware.memory_reserve_gib=2.0: out of range for hardware ")
    assert "memory_reserve_gib is less than memory_gib" in reserve and "positive" not in reserve
    both = message(gemm_efficiency=2.0, comm_latency_us=-1.0)
    assert "are shares of a datasheet figure, above 0 and at most 1; reserves, overheads and latencies are 0" in both
    assert "allocator_fragmentation is" not in both and "positive" not in both
