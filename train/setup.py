"""Everything the loop needs before its first step: device, process group, model, engine, data, peak.

`setup` builds this rank's part of the model and the engine that steps it:

    device, process group            train.distributed (gloo on CPU, nccl on CUDA)
    model                            train.model, seeded as the one-process model
    micro_batch_size=auto            the planner's size, then a measured probe (train.mbs_probe)
    parallelism                      train.parallel: pipeline stage, then TP, then DP (ParallelState)
    engine                           native (optimizer, ZeRO-1, loss scaler) or DeepSpeed
    data, peak                       train.data, train.calibrate or the hardware's datasheet figure

The layout was judged by train.planner.rules before any worker started; what is checked here are
runtime invariants (the stages together hold every layer), which fail as bugs, not as user errors.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from conf import hardware_options
from conf.schema import Engine, Precision, RunConfig, is_auto_micro_batch
from train import distributed, memory, parallel
from train.calibrate import cached_peak
from train.data import MemmapTokens, TokenSource, make_source
from train.dp import GradSync
from train.ds_config import deepspeed_config, write_deepspeed_config
from train.engine import DeepSpeedEngine, NativeEngine
from train.init import initialize
from train.model import LossSum, build_model, lm_loss_sum, num_layers
from train.optim import build_optimizer
from train.paths import wraps_around
from train.pipeline import StageLinks
from train.planner import flops, rules
from train.planner.layout import Layout, Rank
from train.planner.memory import estimated_memory, usable_bytes
from train.planner.sizes import total_params

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from train.engine import Engine as EngineType
    from train.trainer import Progress


class MicroBatchLoss:
    """The pipeline schedule's loss_fn: one micro-batch's share of the step's loss.

    The divisor (the global batch's labelled tokens) is set per step. The schedule also calls it
    once on placeholder tensors to infer shapes, so the step's losses come from the schedule's
    `losses` list, not from here.
    """

    def __init__(self, scaler: torch.amp.GradScaler, loss_sum: LossSum = lm_loss_sum) -> None:
        self.scaler = scaler
        self.loss_sum = loss_sum
        self.normalizer = 1

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(self.loss_sum(logits, labels) / self.normalizer)


@dataclass(frozen=True)
class ParallelState:
    """This rank's parallel machinery; all None (and dp size 1) on one process."""

    dp: GradSync = field(default_factory=lambda: GradSync([], group=None, size=1, rank=0, shard=False))
    tp_group: torch.distributed.ProcessGroup | None = None
    pp_group: torch.distributed.ProcessGroup | None = None
    tie_group: torch.distributed.ProcessGroup | None = None
    stage: parallel.PipelineStageModule | None = None
    loss_fn: MicroBatchLoss | None = None
    mesh: Any = None
    """The (pp, dp, tp) DeviceMesh."""
    loss_sum: LossSum = lm_loss_sum
    """Summed cross-entropy of the logits the model returns (vocab-parallel under TP)."""
    links: StageLinks | None = None
    """This stage's place in the pipeline (None when pp = 1)."""
    device: torch.device | None = None


@dataclass(frozen=True)
class Setup:
    """What train() builds before the first step."""

    device: torch.device
    engine: EngineType
    source: TokenSource


def setup(run: RunConfig, *, rank: Rank, progress: Progress) -> Setup:
    """Device, process group, this rank's part of the model (built on the meta device, split and
    sharded before anything is allocated), engine, data and peak."""
    par, tr = run.parallelism, run.training
    # Threads first: the device's label names the thread count the run computes with.
    if (threads := distributed.cpu_threads(os.environ)) is not None:
        torch.set_num_threads(threads)
    device = setup_device(run, progress)
    check_device(run, device, progress, lead=rank.lead)
    launch = distributed.launch_from_env(os.environ)
    mesh = None
    if launch is not None:
        with distributed.rendezvous_output_held():
            distributed.init_process_group(launch, device_type=device.type, timeout_s=tr.collective_timeout_s)
            mesh = distributed.build_mesh(device.type, pp=rank.layout.pp, dp=rank.layout.dp, tp=rank.layout.tp)
    baseline = memory.process_baseline_bytes(device)  # before the model: what the process itself holds
    progress.params = total_params(run.model, rank.layout.tp)
    run, model = _sized_model(run, rank=rank, device=device, mesh=mesh, progress=progress)
    source = token_source(run, lead=rank.lead, progress=progress)
    resolve_peak(run, device, progress)
    probe = memory.MemoryProbe(rank.global_rank, rank.coords.pp, memory.predict_rank(run, rank), baseline)
    progress.memory = probe
    if par.engine == Engine.deepspeed:
        progress.memory_not_measured = (
            "engine=deepspeed: model states and activations are DeepSpeed's own tensors; only the peak is measured"
        )
        return Setup(device, _deepspeed_engine(run, model, rank=rank, progress=progress, mesh=mesh), source)
    # Its overflow decision is agreed over all ranks (parallel.GlobalGradScaler): all skip together.
    scaler = parallel.GlobalGradScaler(device.type, enabled=par.precision == Precision.fp16)
    # Only a last pipeline stage scales a loss, but every stage unscales its gradients (by the same
    # scale: all stages start equal and train_step keeps their overflow decisions equal).
    scaler.scale(torch.zeros((), device=device))
    optimizer, progress.optimizer = build_optimizer(
        model, impl=par.optimizer, lr=tr.lr, weight_decay=tr.weight_decay, device_type=device.type
    )
    state = ParallelState()
    if mesh is not None:
        groups = [(g["params"], float(g["weight_decay"])) for g in optimizer.param_groups]
        state = parallel_state(model, mesh=mesh, device=device, scaler=scaler, groups=groups, zero=par.zero_stage == 1)
    held = _layers_held(model, state.pp_group)
    if held != run.model.num_layers:
        raise AssertionError(f"the pipeline stages hold {held} layers, the config asks for {run.model.num_layers}")
    if rank.layout.tp > 1:
        parallel.separate_dtensor_groups(optimizer)
    if state.dp.shard:
        optimizer = parallel.apply_zero1(optimizer, sync=state.dp)
        progress.optimizer = f"{progress.optimizer}+ZeRO-1"
    stage = state.stage
    if device.type == "cpu":
        probe.baseline = memory.process_baseline_bytes(device, held=memory.model_state_bytes(model, optimizer).weights)
    probe.activations = memory.measure_stage_activations(
        model, run=run, device=device, loss_sum=state.loss_sum,
        first=stage is None or stage.is_first, last=stage is None or stage.is_last,
    )
    return Setup(device, NativeEngine(model, optimizer, scaler, state, run, device), source)


def _sized_model(
    run: RunConfig, *, rank: Rank, device: torch.device, mesh: DeviceMesh | None, progress: Progress
) -> tuple[RunConfig, nn.Module]:
    """This rank's model (either engine's build) and the run with micro_batch_size=auto settled
    (choose_micro_batch): probed on the built model where it is whole, else the planner's size, taken
    before the build, which reads it (zero.Init's DeepSpeed config)."""
    if is_auto_micro_batch(run.parallelism) and not builds_whole_model(run, rank.layout):
        run = choose_micro_batch(run, None, rank=rank, progress=progress, device=device)
    if run.parallelism.engine == Engine.deepspeed:
        model = build_deepspeed_model(run, rank=rank, device=device, mesh=mesh)
    else:
        model = build_stage(run, rank=rank, device=device, mesh=mesh)
    if is_auto_micro_batch(run.parallelism):
        run = choose_micro_batch(run, model, rank=rank, progress=progress, device=device)
    return run, model


def build_stage(run: RunConfig, *, rank: Rank, device: torch.device, mesh: DeviceMesh | None) -> nn.Module:
    """This rank's pipeline stage, TP-sharded, with only its own parameters allocated and filled.

    The model is built on the meta device (shapes, no storage), cut to this rank's stage and
    sharded; then the stage's shards are allocated (`to_empty`) and filled by train.init, with the
    values the one-process model has at the same places. A rank never holds more than its share."""
    model = build_model(run.model, recompute=run.parallelism.recompute, device="meta", tp=rank.layout.tp)
    stage: nn.Module = model
    if mesh is not None:
        stage = parallel.split_for_pipeline(model, pp_mesh=mesh["pp"], virtual_stages=run.parallelism.virtual_stages)
        parallel.apply_tp(stage, tp_mesh=mesh["tp"], sequence_parallel=run.parallelism.sequence_parallel)
    stage.to_empty(device=device)
    initialize(stage, seed=run.training.seed, num_layers=run.model.num_layers)
    return stage


def parallel_state(
    stage: nn.Module,
    *,
    mesh: DeviceMesh,
    device: torch.device,
    scaler: torch.amp.GradScaler,
    groups: list[tuple[list[nn.Parameter], float]],
    zero: bool,
) -> ParallelState:
    """The DP gradient reduction (over the optimizer's `groups`; ZeRO-1's slices with `zero`), groups,
    tied-embedding pair and pipeline loss of `stage`."""
    assert isinstance(stage, parallel.PipelineStageModule)
    dp = parallel.apply_dp(stage, dp_mesh=mesh["dp"], groups=groups, zero=zero)
    tie_group = parallel.embedding_tie_group(mesh)
    loss_sum = parallel.lm_loss_fn(stage)
    pipelined = mesh["pp"].size() > 1
    loss_fn = MicroBatchLoss(scaler, loss_sum) if pipelined else None
    sub = {d: (mesh[d].get_group() if mesh[d].size() > 1 else None) for d in ("tp", "pp")}
    links = StageLinks(stage.stage, stage.num_stages, mesh["pp"].get_group()) if pipelined else None
    return ParallelState(
        dp, sub["tp"], sub["pp"], tie_group, stage, loss_fn, mesh, loss_sum=loss_sum, links=links, device=device
    )


def build_deepspeed_model(
    run: RunConfig, *, rank: Rank, device: torch.device, mesh: DeviceMesh | None
) -> nn.Module:
    """The model DeepSpeed will wrap. ZeRO-3 without TP builds it under deepspeed.zero.Init, so each
    rank only ever holds its partition (and one module's parameters while they are filled); else it
    is built on the meta device and, with TP, sharded on plain tensors (ZeRO flattens them) before
    anything is allocated; DeepSpeed partitions the shards when it starts."""
    par = run.parallelism
    if par.zero_stage == 3 and rank.layout.tp == 1:
        from train.ds_engine import build_under_zero_init

        return build_under_zero_init(run, dp=rank.layout.dp, device=device)
    model = build_model(run.model, recompute=par.recompute, device="meta", tp=rank.layout.tp)
    if rank.layout.tp > 1:
        assert mesh is not None
        parallel.apply_tp_plain(model, tp_group=mesh["tp"].get_group())
    model.to_empty(device=device)
    parallel.mark_tensor_parallel(model)  # again: to_empty made the parameters anew
    initialize(model, seed=run.training.seed, num_layers=run.model.num_layers)
    return model


def _deepspeed_engine(
    run: RunConfig, model: nn.Module, *, rank: Rank, progress: Progress, mesh: DeviceMesh | None
) -> DeepSpeedEngine:
    """The DeepSpeed engine replaces the DP synchroniser, the optimizer, ZeRO and the loss scaler; its
    config comes from the run (train.ds_config) and is recorded beside result.json."""
    from train.ds_engine import ModelParallelUnit, build_deepspeed_engine

    layout = rank.layout
    ds_cfg = deepspeed_config(run, dp=layout.dp)
    if rank.lead and progress.run_dir is not None:
        progress.deepspeed_config = str(write_deepspeed_config(ds_cfg, progress.run_dir))
    state, mpu = ParallelState(), None
    if layout.tp > 1:
        # Megatron-DeepSpeed's split: our TP on plain tensors, DeepSpeed told the groups (mpu).
        assert mesh is not None
        tp_group, dp_group = mesh["tp"].get_group(), mesh["dp"].get_group()
        mpu = ModelParallelUnit(tp_group=tp_group, dp_group=dp_group)
        state = ParallelState(tp_group=tp_group, mesh=mesh, loss_sum=parallel.lm_loss_fn(model))
    engine, progress.optimizer = build_deepspeed_engine(model, ds_config=ds_cfg, mpu=mpu)
    # The engine's optimizer (a ZeRO wrapper from stage 1 on) exposes its inner optimizer's
    # param_groups, so train.optim.set_lr drives DeepSpeed's update as it drives torch's.
    return DeepSpeedEngine(
        engine, engine.optimizer, state, run, layout, progress, profile_at=_deepspeed_profile_iteration(run, progress)
    )


def _deepspeed_profile_iteration(run: RunConfig, progress: Progress) -> int | None:
    """The iteration training.deepspeed_flops_profile profiles (warmup_iters + 1), or None."""
    tr = run.training
    if not tr.deepspeed_flops_profile:
        return None
    if tr.warmup_iters + 1 > tr.train_iters:
        progress.warnings.append(
            f"training.deepspeed_flops_profile: iteration warmup_iters + 1 = {tr.warmup_iters + 1} is past "
            f"train_iters={tr.train_iters}; not run"
        )
        return None
    return tr.warmup_iters + 1


def _layers_held(model: nn.Module, pp_group: torch.distributed.ProcessGroup | None) -> int:
    """Blocks held by all pipeline stages together (by this rank's stage alone when pp = 1)."""
    held = torch.tensor(num_layers(model))  # type: ignore[arg-type]
    if pp_group is not None:
        torch.distributed.all_reduce(held, group=pp_group)
    return int(held)


# ---------------------------------------------------------------------------------------------
# Device and peak.


class DeviceUnavailable(RuntimeError):
    """The hardware config's device is not on this machine: the user's choice, said in one line."""


def setup_device(run: RunConfig, progress: Progress) -> torch.device:
    if run.hardware.device_type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailable(
                f"hardware={run.hardware.name} needs CUDA, and no CUDA device is visible here: run on a GPU node, "
                "or choose a CPU hardware config (hardware=cpu)"
            )
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
        # The configs' fp32 peaks are TF32 tensor-core peaks; run fp32 matmuls the same way.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        progress.device_name = torch.cuda.get_device_name(device)
        progress.max_mem_source = "torch.cuda.max_memory_allocated"
    else:
        device = torch.device(run.hardware.device_type)
        progress.device_name = _cpu_name()
        progress.max_mem_source = "peak RSS of the process (getrusage)"
    return device


def check_device(run: RunConfig, device: torch.device, progress: Progress, *, lead: bool) -> str | None:
    """The warning, kept in progress.warnings and printed by the lead rank, when the device found is not
    the one run.hardware describes (train.planner.rules.device_mismatch); None when it is."""
    memory_gib = torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else None
    progress.device_memory_gib = memory_gib
    if rules.device_mismatch(run.hardware, device_name=progress.device_name, memory_gib=memory_gib) is None:
        return None
    # Only now the other configs, to name the one that describes this device.
    warning = rules.device_mismatch(
        run.hardware, device_name=progress.device_name, memory_gib=memory_gib, options=hardware_options()
    )
    if warning is not None:
        progress.warnings.append(warning)
        if lead:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
    return warning


def token_source(run: RunConfig, *, lead: bool, progress: Progress) -> TokenSource:
    """The run's samples (train.data.make_source). A token file holding fewer samples than the run reads
    is read from its start again: the lead rank says so once, and the record keeps it."""
    tr = run.training
    source = make_source(run.model, seed=tr.seed, data_path=tr.data_path, data_dtype=tr.data_dtype)
    if isinstance(source, MemmapTokens) and (wraps := wraps_around(source, run)) is not None:
        progress.warnings.append(wraps)
        if lead:
            print(f"warning: {wraps}", file=sys.stderr, flush=True)
    return source


def resolve_peak(run: RunConfig, device: torch.device, progress: Progress) -> None:
    """progress.peak_tflops and peak_source ('measured' | 'datasheet'; None when unknown), once: the
    log lines and the record use this one figure. A measured peak is this host's cached calibration
    (train.calibrate), kept with its spread in progress.peak_calibration."""
    if run.hardware.peak_measured:
        calibration, warning = cached_peak(device, run.parallelism.precision)
        progress.peak_tflops, progress.peak_source = calibration.tflops, "measured"
        progress.peak_calibration = calibration.to_dict()
        if warning is not None:
            progress.warnings.append(warning)
        return
    progress.peak_tflops = flops.peak_tflops(run.hardware, run.parallelism.precision)
    progress.peak_source = "datasheet" if progress.peak_tflops is not None else None


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"cpu: {line.partition(':')[2].strip()} x {torch.get_num_threads()} threads"
    return f"cpu: {platform.processor() or platform.machine()} x {torch.get_num_threads()} threads"


# ---------------------------------------------------------------------------------------------
# micro_batch_size=auto in the job.


def builds_whole_model(run: RunConfig, layout: Layout) -> bool:
    """Whether this rank builds the whole model, which micro_batch_size=auto's probe steps on its own:
    not with tp or pp > 1 (its share needs its peers for a step), nor under ZeRO-3 without TP
    (deepspeed.zero.Init partitions each parameter as it is made; only DeepSpeed's engine gathers them)."""
    zero_init = run.parallelism.engine == Engine.deepspeed and run.parallelism.zero_stage == 3 and layout.tp == 1
    return layout.model_parallel == 1 and not zero_init


def choose_micro_batch(
    run: RunConfig, model: nn.Module | None, *, rank: Rank, progress: Progress, device: torch.device
) -> RunConfig:
    """micro_batch_size=auto in the job: the planner's prediction, then a measured probe, agreed by all ranks.

    The probe (train.mbs_probe.auto_micro_batch) runs one forward/backward of this rank's freshly
    built model per size, from the prediction down, with no collective: an OOM (CUDA's, or the
    CPU allocator's) rules a size out. Where the rank does not build the whole model
    (builds_whole_model: tp or pp > 1, ZeRO-3's zero.Init; `model` None before such a build) the
    prediction is taken unprobed. Every rank then takes the smallest size any rank found (one MIN
    all-reduce), the record's `micro_batch` says what was chosen and why, and the returned run
    (also progress.run) carries the size. Raises torch.OutOfMemoryError when no size fits.
    """
    from train.mbs_probe import ProbeAttempt, auto_micro_batch, largest_fitting_micro_batch

    layout = rank.layout
    predicted: int | None
    probed: tuple[ProbeAttempt, ...] = ()
    if model is None or not builds_whole_model(run, layout):
        predicted, reason = largest_fitting_micro_batch(run, dp=layout.dp)
        found = predicted
        how = (
            "the planner's prediction, not probed (the probe needs the whole model on one rank: tp = pp = 1, "
            "and no ZeRO-3 partitioning as it is built)"
        )
    else:
        limit = probe_memory_limit(run, device, dp=layout.dp)
        reserve = probe_reserve_bytes(run, device, dp=layout.dp)

        def step(size: int) -> object:
            return probe_step(model, run, size, device=device, limit_bytes=limit, reserve_bytes=reserve)

        choice = auto_micro_batch(run, dp=layout.dp, step_fn=step)
        predicted, reason, probed, found = choice.predicted, choice.reason, choice.probe, choice.micro_batch_size
        memory = "a simulated limit of the usable memory" if limit is not None else "the device's memory"
        how = f"the largest size, from the planner's prediction down, whose probe step fit in {memory}"
    agreed = torch.tensor(found or 0, device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
    chosen = int(agreed)
    if chosen != (found or 0):
        how += f"; {chosen} is the smallest any rank found ({found} here)"
    progress.micro_batch = {
        "requested": "auto",
        "chosen": chosen or None,
        "predicted": predicted,
        "probed": [asdict(a) for a in probed],
        "reason": f"{how}. Planner: {reason}",
    }
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the probe's cached blocks are not the run's
        torch.cuda.reset_peak_memory_stats(device)
    if chosen < 1:
        raise torch.OutOfMemoryError(f"parallelism.micro_batch_size=auto: no micro-batch size fits ({progress.micro_batch})")
    if rank.lead:
        print(f"micro_batch_size=auto -> {chosen} ({how})", flush=True)
    progress.run = replace(run, parallelism=replace(run.parallelism, micro_batch_size=chosen))
    return progress.run


def probe_reserve_bytes(run: RunConfig, device: torch.device, *, dp: int) -> float:
    """Bytes a GPU probe holds beside its step: the optimizer and master states the planner expects,
    which the run allocates at its first step and holds through every later one: without them the
    probe judged a size by less memory than its run holds (Adam's two fp32 moments, 10.5 GB at
    gpt_1.3b). 0 on a CPU, whose simulated limit subtracts them already (probe_memory_limit)."""
    if device.type != "cuda":
        return 0.0
    states = estimated_memory(run.model, replace(run.parallelism, micro_batch_size=1), dp, run.hardware)
    return states.optimizer + states.master


def probe_memory_limit(run: RunConfig, device: torch.device, *, dp: int) -> float | None:
    """Bytes the probe step may allocate: None on CUDA (the device's own OOM decides); on CPU, the
    usable hardware.memory_gib minus the weights and optimizer states the planner expects, enforced
    by train.mbs_probe.simulated_memory_limit (the step's own tensors, gradients included, count)."""
    if device.type == "cuda":
        return None
    states = estimated_memory(run.model, replace(run.parallelism, micro_batch_size=1), dp, run.hardware)
    held = states.weights + states.optimizer + states.master + states.overhead
    return max(usable_bytes(run.hardware) - held, 0.0)


def probe_step(
    model: nn.Module, run: RunConfig, size: int, *, device: torch.device, limit_bytes: float | None,
    reserve_bytes: float = 0.0,
) -> int | None:
    """One local forward/backward of `model` on `size` synthetic samples (no collective), with
    `reserve_bytes` allocated beside it; the peak bytes the simulated limit counted (None without a
    limit). The gradients are dropped after."""
    from train.loop import autocast
    from train.mbs_probe import simulated_memory_limit

    m = run.model
    # A private generator: the probe must not shift the run's random stream.
    gen = torch.Generator().manual_seed(run.training.seed)
    tokens = torch.randint(0, m.vocab_size, (size, m.seq_length), generator=gen).to(device)
    limit = simulated_memory_limit(limit_bytes) if limit_bytes is not None else contextlib.nullcontext(None)
    # On a GPU the device's own OOM decides, so the optimizer states the run will hold beside the
    # step (not allocated yet: the optimizer is built after the probe) hold their bytes here.
    held = torch.empty(int(reserve_bytes), dtype=torch.uint8, device=device) if reserve_bytes else None
    try:
        with limit as peak:
            with autocast(run, device):
                logits = model(tokens)
            loss = lm_loss_sum(logits, tokens)
            del logits  # as train.loop.forward_backward: no backward needs them
            loss.backward()
            return None if peak is None else int(peak())
    finally:
        del held
        model.zero_grad(set_to_none=True)

