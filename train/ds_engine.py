"""DeepSpeed as a second training engine, on the same model, data and loss as the native one.

`build_deepspeed_engine` wraps the model built by train.model in a DeepSpeedEngine configured
by train.ds_config (the Hydra config is the only source); `deepspeed_train_step` runs one
global step through it. Everything else (data, LR schedule, logging, the record) stays the
trainer's, so a native and a DeepSpeed run of one layout differ only in the engine.

On CPU DeepSpeed needs its CPU accelerator, chosen by DS_ACCELERATOR=cpu before deepspeed is
first imported (`import_deepspeed` does that), and the gloo backend.

With tensor parallelism DeepSpeed is handed the model-parallel groups as Megatron-DeepSpeed does,
through an `mpu` (ModelParallelUnit): the model is split by train.parallel.apply_tp_plain (plain
tensors, since ZeRO flattens and partitions parameters and cannot take DTensors), ZeRO partitions
and reduces over the data-parallel group only, and the gradient norm is summed over TP for the
sharded parameters (marked tensor_model_parallel) and counted once for the replicated ones.
DeepSpeedCPUAdam, used by optimizer offload, is built with gcc on its first use on a machine (about
half a minute on 2 cores, without debug info: `build_cpu_ops_without_debug_info`; then cached in
~/.cache/torch_extensions); the shared-memory op deepspeed.comm would build on a CPU serves inference
only, and is skipped (`skip_shm_op`).

The module also carries the two places where DeepSpeed's own accounting is compared with
megasweep's: its flops profiler (`profile_deepspeed_step`) and its ZeRO model-state memory
estimators (`deepspeed_model_states_estimate`). Both import deepspeed lazily: importing it
costs seconds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conf.schema import ModelConfig, Offload, RunConfig
from train.contract import cpu_info_cache_path, write_json_atomic
from train.ds_config import deepspeed_config
from train.engine import StepResult
from train.init import initialize_module
from train.model import IGNORE_INDEX, LossSum, lm_loss_sum, model_class, set_recompute
from train.optim import param_groups
from train.planner.inventory import module_sizes, stage_params
from train.planner.sizes import total_params


@dataclass(frozen=True)
class ModelParallelUnit:
    """The `mpu` DeepSpeed asks for (Megatron's parallel_state interface) over this rank's groups.

    "Model parallel" is tensor parallel here (engine=deepspeed runs no pipeline). DeepSpeed reduces
    and partitions over the data-parallel group, and sums gradient norms over the model-parallel one.
    """

    tp_group: dist.ProcessGroup
    """This rank's tensor-parallel group (ranks holding the other shards of the same replica)."""
    dp_group: dist.ProcessGroup
    """This rank's data-parallel group (ranks holding the same shard of other replicas)."""

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self.tp_group

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank(self.tp_group)

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size(self.tp_group)

    def get_model_parallel_src_rank(self) -> int:
        return dist.get_global_rank(self.tp_group, 0)

    # Newer Megatron names for the same groups; DeepSpeed uses both spellings in places.
    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_src_rank = get_model_parallel_src_rank

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.dp_group

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self.dp_group)

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self.dp_group)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(dist.get_process_group_ranks(self.dp_group))


def import_deepspeed(device_type: str) -> ModuleType:
    """Import deepspeed with the accelerator for `device_type` ('cpu' or 'cuda').

    DeepSpeed picks its accelerator once, when first asked; on a CPU-only machine without the
    environment variable it can fall back to the wrong one, so the choice is made explicit.
    Raises RuntimeError when deepspeed was already set up for another accelerator.
    """
    if device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    remember_cpu_info()
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    if name != device_type:
        raise RuntimeError(
            f"DeepSpeed's accelerator is {name!r}, the run needs {device_type!r}: set "
            f"DS_ACCELERATOR={device_type} before deepspeed is first imported"
        )
    if device_type == "cpu":
        build_cpu_ops_without_debug_info()
    return deepspeed


def build_cpu_ops_without_debug_info() -> None:
    """Leave `-g` out of the compiler flags DeepSpeed builds its CPU ops with.

    DeepSpeed's CPU op builder passes -g to the ops that take its flags (CPU Adam among them), and
    the debug information of torch's headers is most of their build: CPU Adam's two sources took
    37 + 52 CPU-s with it and 26 + 28 without (gcc, this 2-core machine, 2026-11-28), and the larger
    alone bounds the build's wall time. gcc's -g changes no generated code (what -fcompare-debug
    checks), and nothing here reads the information. The flags are part of torch's build of an op,
    so every process that loads it must agree: every megasweep process imports DeepSpeed through
    import_deepspeed, which calls this; a DeepSpeed process outside megasweep, on the same machine
    and venv, builds the op again with -g, and megasweep's next load builds it again without.
    """
    from deepspeed.ops.op_builder.cpu.builder import CPUOpBuilder

    if getattr(CPUOpBuilder.cxx_args, "megasweep_without_debug_info", False):
        return
    with_debug_info = CPUOpBuilder.cxx_args

    def cxx_args(self: Any) -> list[str]:
        return [flag for flag in with_debug_info(self) if flag != "-g"]

    cxx_args.megasweep_without_debug_info = True  # type: ignore[attr-defined]
    CPUOpBuilder.cxx_args = cxx_args


CPU_IDENTITY_KEYS = frozenset(
    {"vendor_id", "model name", "flags", "Features", "CPU implementer", "CPU architecture", "CPU variant",
     "CPU part", "isa", "uarch", "cpu"}
)  # fmt: skip
"""/proc/cpuinfo's keys that name a CPU model and its instruction set (x86, Arm, RISC-V, POWER): what
py-cpuinfo's `arch` and `flags`, the fields DeepSpeed reads, are derived from."""


def cpu_identity(cpuinfo_text: str, machine: str) -> str | None:
    """A short hash of the CPU model and instruction set `cpuinfo_text` (/proc/cpuinfo) describes on a
    `machine` (platform.machine()); None when it names neither. Clock speeds and core numbering are
    left out, so every host with the same CPU model shares it."""
    lines = set()
    for line in cpuinfo_text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in CPU_IDENTITY_KEYS:
            lines.add(f"{key.strip()}: {value.strip()}")
    if not lines:
        return None
    return hashlib.sha256("\n".join([machine, *sorted(lines)]).encode()).hexdigest()[:16]


def remember_cpu_info() -> None:
    """Make py-cpuinfo's get_cpu_info answer once per CPU model, from megasweep's cache after the first.

    DeepSpeed asks it when an op is loaded, even one built long ago (the compiler flags -march and
    -D__AVX512__ are part of the op's build hash), and again when DeepSpeedCPUAdam is made: three
    times per process that uses DeepSpeedCPUAdam (optimizer offload). Each answer is a new
    Python process that times the clock with a one-second sleep (py-cpuinfo's CPUID.get_raw_hz), so
    a rank started 2.3 to 3.4 s later for the same unchanging answer. The answer is kept in the cache
    directory under the hash of /proc/cpuinfo's model and flag lines (`cpu_identity`), so a host
    with another CPU never reads it; its clock fields are the first asker's, which DeepSpeed does
    not read. Without /proc/cpuinfo the answer is kept in the process only (asked once per process).
    """
    try:
        import cpuinfo
    except ImportError:
        return
    if getattr(cpuinfo.get_cpu_info, "megasweep_cached", False):
        return
    ask = cpuinfo.get_cpu_info
    try:
        key = cpu_identity(Path("/proc/cpuinfo").read_text(), platform.machine())
    except OSError:
        key = None
    path = cpu_info_cache_path(key) if key else None
    answer: dict[str, Any] = {}

    def get_cpu_info() -> dict[str, Any]:
        if not answer:
            answer.update(_read_cpu_info(path) or {})
        if not answer:
            answer.update(ask())
            # py-cpuinfo answers {} when its process fails: nothing to keep, ask again next time.
            if answer and path is not None:
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    write_json_atomic(path, answer)
                except (OSError, TypeError, ValueError):
                    pass  # an unwritable cache costs the next process the same seconds, nothing else
        return dict(answer)

    setattr(get_cpu_info, "megasweep_cached", True)  # noqa: B010 (mypy: a function has no such attribute)
    cpuinfo.get_cpu_info = get_cpu_info


def _read_cpu_info(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("arch") and "flags" in data else None


def load_cpu_op(builder_name: str) -> None:
    """Load one of DeepSpeed's JIT-built CPU ops (its name: 'CPUAdamBuilder', say) so that
    DeepSpeed's own later load of it returns the loaded module.

    torch.utils.cpp_extension guards each op's build directory with a plain lock file, taken by
    every process that loads the op, even when nothing is built, and removed only by that process:
    one killed inside that window (scancel, a time limit, a failed rank's neighbours ended) leaves
    the file behind, and every later DeepSpeed process that loads the op waits on it for ever
    (CI, 2026-11-26: a ZeRO sweep's jobs waited until the test gave up). Here the load holds an
    flock on a file beside the directory first, which the kernel releases when its holder dies:
    whoever holds it and finds torch's lock file knows it was left by a process that died, and
    removes it. Processes that load the op outside megasweep do not take the flock.
    """
    import fcntl
    import sys

    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops import __compatible_ops__
    from torch.utils.cpp_extension import _get_build_directory

    builder = get_accelerator().create_op_builder(builder_name)
    if builder is None or not __compatible_ops__.get(builder.NAME, False):
        return  # DeepSpeed then runs without it, as it would have
    build_dir = _get_build_directory(builder.name, verbose=False)
    with open(f"{build_dir}.megasweep-lock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        stale = os.path.join(build_dir, "lock")
        if os.path.exists(stale):
            print(
                f"megasweep: removing {stale}, left by a process that died while loading "
                f"DeepSpeed's {builder.name} op (every later load would wait on it)",
                file=sys.stderr,
            )
            os.remove(stale)
        builder.load(verbose=False)


def _not_distutils(record: logging.LogRecord) -> bool:
    """False for a record that setuptools' distutils logged (its compiler commands)."""
    return not {"distutils", "_distutils"} & set(Path(record.pathname).parts)


def skip_shm_op() -> None:
    """Keep deepspeed.comm from building and loading its shared-memory op on a CPU.

    deepspeed.comm builds that op (with gcc, 38 s on this 2-core machine, 65 CPU-s) the first time a
    CPU process initialises it, and loads it in every one after, for `inference_all_reduce` alone: a
    training step's collectives go to torch.distributed (DeepSpeed's TorchBackend.all_reduce), and even
    inference uses the op only when LOCAL_SIZE names every rank as local, which nothing here sets. Marked
    incompatible, the op is neither built nor loaded, and deepspeed.comm runs as it does without it.
    """
    from deepspeed.accelerator import get_accelerator

    # DeepSpeed probes every op's compatibility on first access, compiling and linking test programs
    # through setuptools' distutils, which logs each compiler command at INFO: under Hydra's job logging
    # (root at INFO, to stdout) an engine=deepspeed run's console opened with two `gcc ...` lines. The
    # probe's result is all that is wanted here. Filtered at the root's handlers, as distutils logs on
    # loggers named after its modules, which vary by setuptools version.
    handlers = list(logging.getLogger().handlers)
    for handler in handlers:
        handler.addFilter(_not_distutils)
    try:
        from deepspeed.ops import __compatible_ops__
    finally:
        for handler in handlers:
            handler.removeFilter(_not_distutils)

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        __compatible_ops__[builder.NAME] = False


def _ensure_process_group(deepspeed: ModuleType, device_type: str) -> None:
    """DeepSpeed needs a process group even on one process; a launcher's group is used as is. Either
    way deepspeed.comm is set up on it here: zero.Init reads the world size from it before
    deepspeed.initialize would (without it, a world of one)."""
    backend = "gloo" if device_type == "cpu" else "nccl"
    if not torch.distributed.is_initialized():
        # One process without a launcher (tests, `python -m train` on a laptop): a world of one. Where
        # torchrun's variables name a larger one, DeepSpeed joins it from them.
        for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(key, value)
        if os.environ["WORLD_SIZE"] == "1":
            # No rendezvous: an in-process store, where a TCP one would bind a port looked up as free,
            # which another process may hold by then. DeepSpeed keeps a group it finds.
            torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
    if device_type == "cpu":
        skip_shm_op()
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)


def build_under_zero_init(run: RunConfig, *, dp: int, device: torch.device) -> nn.Module:
    """The model built under deepspeed.zero.Init (ZeRO-3, no TP): each parameter is partitioned over
    the DP ranks as its module is created, so no rank holds the whole model. Each module's own
    parameters are then gathered in turn, filled by train.init on rank 0 (the values of the
    one-process model) and partitioned again: at most one module's worth is ever whole."""
    deepspeed = import_deepspeed(device.type)
    _ensure_process_group(deepspeed, device.type)
    cfg = run.model
    with deepspeed.zero.Init(config_dict_or_path=deepspeed_config(run, dp=dp)):
        model = model_class(cfg)(cfg)
    set_recompute(model, run.parallelism.recompute)
    lead = torch.distributed.get_rank() == 0
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if not own:
            continue
        with deepspeed.zero.GatheredParameters(own, modifier_rank=0):
            if lead:
                initialize_module(module, prefix=name, seed=run.training.seed, num_layers=cfg.num_layers)
    return model


def build_deepspeed_engine(
    model: nn.Module, *, ds_config: dict[str, Any], mpu: Any = None
) -> tuple[Any, str]:
    """(DeepSpeedEngine, optimizer name) for `model` (already on its device) and `ds_config`.

    The optimizer is DeepSpeed's, built from ds_config["optimizer"] over train.optim's parameter
    groups (weight decay on matrices only, as the native engine), so ZeRO can partition and
    offload it. `mpu` (a ModelParallelUnit) carries the TP and DP groups when tp > 1, the model
    already split by train.parallel.apply_tp_plain; None means pure data parallelism over the world.
    """
    device_type = next(model.parameters()).device.type
    deepspeed = import_deepspeed(device_type)
    _ensure_process_group(deepspeed, device_type)
    if ds_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device") == "cpu":
        load_cpu_op("CPUAdamBuilder")  # DeepSpeedCPUAdam's op (see load_cpu_op)
    weight_decay = float(ds_config["optimizer"]["params"]["weight_decay"])
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=param_groups(model, weight_decay),
        config=ds_config,
        mpu=mpu,
    )
    return engine, optimizer_name(engine, ds_config)


def optimizer_name(engine: Any, ds_config: dict[str, Any]) -> str:
    """'deepspeed:<Adam class> ZeRO-<stage>[ offload <what>]', the record's `optimizer` field."""
    basic = engine.basic_optimizer if engine.basic_optimizer is not None else engine.optimizer
    cls = type(basic)
    module = cls.__module__.split(".")[0]
    name = f"{module}.{cls.__name__}" if module in ("torch", "deepspeed") else cls.__name__
    zero = ds_config.get("zero_optimization", {})
    offload = (
        Offload.params
        if "offload_param" in zero
        else Offload.optimizer
        if "offload_optimizer" in zero
        else Offload.none
    )
    suffix = "" if offload == Offload.none else f" offload {offload.value}"
    return f"deepspeed:{name} ZeRO-{int(zero.get('stage', 0))}{suffix}"



def deepspeed_train_step(
    engine: Any, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *, loss_sum: LossSum = lm_loss_sum
) -> StepResult:
    """One global step: forward/backward of every micro-batch of this rank, then the update.

    engine.backward divides each micro-batch's loss by gradient_accumulation_steps and the
    gradient reduction averages over the dp ranks. To make the gradient the one of the global
    batch's mean token loss (as the native engine's, including BERT's uneven mask counts), each
    micro-batch's loss is its token-loss sum times gas x dp over the global batch's labelled
    tokens. engine.step() after every micro-batch updates only at the accumulation boundary.
    `loss_sum` is the summed token loss of the logits the model returns (vocab-parallel under TP:
    train.parallel.lm_loss_fn).
    """
    gas = int(engine.gradient_accumulation_steps())
    if len(batches) != gas:
        raise ValueError(f"{len(batches)} micro-batches given, the engine accumulates {gas}")
    group = engine.data_parallel_group if torch.distributed.is_initialized() else None
    dp = torch.distributed.get_world_size(group) if group is not None else 1
    device = batches[0][0].device
    labelled = torch.tensor(
        float(sum(int((labels != IGNORE_INDEX).sum()) for _, labels in batches)), device=device
    )
    if group is not None:
        torch.distributed.all_reduce(labelled, group=group)
    scale = gas * dp / float(labelled)
    skipped_before = int(engine.skipped_steps)
    loss_scale = _loss_scale(engine)
    total = torch.zeros((), device=device)
    grad_norm: float | None = None
    for i, (tokens, labels) in enumerate(batches):
        # Said outright rather than left to DeepSpeed's micro-step counter: a batch ramp-up changes
        # the accumulation steps between steps, and the counter's boundaries would drift.
        engine.set_gradient_accumulation_boundary(i == gas - 1)
        micro_loss = loss_sum(engine(tokens), labels)
        engine.backward(micro_loss * scale)
        total += micro_loss.detach()
        if i == gas - 1 and engine.zero_optimization_stage() == 0:
            # Without ZeRO, DeepSpeed reports no norm unless it clips; the reduced gradients are
            # in .grad until the step below.
            mpu = getattr(engine, "mpu", None)
            grad_norm = _grad_norm(engine.module, tp_group=None if mpu is None else mpu.get_model_parallel_group())
        engine.step()
    if group is not None:
        torch.distributed.all_reduce(total, group=group)
    if grad_norm is None:
        reported = engine.get_global_grad_norm()
        grad_norm = math.nan if reported is None else float(reported)
    return StepResult(
        loss=float(total) / float(labelled),
        grad_norm=grad_norm,
        loss_scale=loss_scale,
        skipped=int(engine.skipped_steps) > skipped_before,
    )


def _grad_norm(module: nn.Module, *, tp_group: dist.ProcessGroup | None) -> float:
    """L2 norm of the (DP-reduced) gradients: TP shards summed over tp_group, replicas counted once."""
    sharded, replicated = torch.zeros(()), torch.zeros(())
    for p in module.parameters():
        if p.grad is None:
            continue
        sq = p.grad.detach().float().pow(2).sum().cpu()
        if getattr(p, "tensor_model_parallel", False):
            sharded += sq
        else:
            replicated += sq
    if tp_group is not None:
        device = next(module.parameters()).device
        sharded_on_device = sharded.to(device)
        dist.all_reduce(sharded_on_device, group=tp_group)
        sharded = sharded_on_device.cpu()
    return float((sharded + replicated).sqrt())


def _loss_scale(engine: Any) -> float:
    if not engine.fp16_enabled():
        return 1.0
    return float(getattr(engine.optimizer, "cur_scale", getattr(engine.optimizer, "loss_scale", 1.0)))


# ---------------------------------------------------------------------------------------------
# DeepSpeed's flops profiler.


@dataclass(frozen=True)
class FlopsProfile:
    """What DeepSpeed's flops profiler saw in one global step, for the record."""

    forward_flops: int
    """FLOPs of the step's forwards as the profiler counts them (all micro-batches of this rank)."""
    forward_macs: int
    """Multiply-accumulates of the same forwards."""
    params: int
    """Parameters the profiler counts on this rank (after ZeRO-3 partitioning: the local shard)."""
    forward_latency_s: float
    """Time inside the model's forward calls (summed over micro-batches)."""
    step_latency_s: float
    """Wall time of the whole step (forwards, backwards, update)."""
    convention: str = (
        "deepspeed flops profiler: forward only, module-level hooks and patched functionals; "
        "GEMM = 2 x MACs; no backward factor"
    )


def profile_deepspeed_step(
    engine: Any, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], *, loss_sum: LossSum = lm_loss_sum
) -> tuple[FlopsProfile, StepResult]:
    """Run one global step under DeepSpeed's flops profiler; (its figures, the step's result).

    Why its FLOPs are not train.planner.flops' model FLOPs (the record keeps both, labelled):

    * It counts the FORWARD only. Megatron's per-iteration figure (train.planner.flops) is forward +
      2 x forward for the backward (+ recomputed forwards for HFU). The profiler's printed
      per-step figure multiplies by 2 + recompute_fwd_factor only in its report, which this
      function does not use: multiply `forward_flops` by 3 to compare with model FLOPs.
    * It counts what passes through the functions it patches (F.linear, torch.matmul and
      Tensor.__matmul__, F.scaled_dot_product_attention, F.softmax, F.layer_norm, F.gelu,
      F.embedding, torch.add/mul...) while module hooks are active. GEMMs are 2 x MACs, like
      ours; but it also counts element-wise work (LayerNorm, GELU, softmax, bias adds via
      addmm), which Megatron's GEMM-only count leaves out, so it reads a few percent higher on
      a real shape and much higher on a toy one. Attention is counted only if it goes through a
      patched function: F.scaled_dot_product_attention is (as a full s x s product, with no
      causal halving, matching Megatron's convention); a fused kernel reached another way
      (a custom CUDA op, flash_attn's own function) counts 0.
    * Operators written as Python operators that are not patched (x + y, x * y on tensors)
      count 0, and the cross-entropy (a fused log_softmax + nll_loss) counts 0.
    * `params` is what the rank holds: with ZeRO-3 the local partition, not the model.
    """
    from deepspeed.profiling.flops_profiler import FlopsProfiler

    profiler = FlopsProfiler(engine.module, ds_engine=engine)
    start = time.perf_counter()
    profiler.start_profile()
    try:
        result = deepspeed_train_step(engine, batches, loss_sum=loss_sum)
        figures = FlopsProfile(
            forward_flops=int(profiler.get_total_flops()),
            forward_macs=int(profiler.get_total_macs()),
            params=int(profiler.get_total_params()),
            forward_latency_s=float(profiler.get_total_duration()),
            step_latency_s=time.perf_counter() - start,
        )
    finally:
        profiler.end_profile()
    return figures, result


# ---------------------------------------------------------------------------------------------
# DeepSpeed's ZeRO memory estimators, next to train.planner.memory's model states.


@dataclass(frozen=True)
class ModelStatesEstimate:
    """DeepSpeed's estimate of model-state bytes for one layout (per device and per node's CPU)."""

    device_bytes: int
    """Per GPU, as DeepSpeed estimates it (params, gradients, optimizer states; no activations)."""
    host_bytes: int
    """Per node's CPU memory (DeepSpeed applies its 1.5 additional_buffer_factor here only)."""
    total_params: int
    largest_layer_params: int


def largest_module_params(model: ModelConfig) -> int:
    """The largest module's own parameters (pp = tp = 1): what ZeRO-3 gathers at a time, and how
    DeepSpeed's all_live estimator counts `largest_layer_params` (train.planner.inventory)."""
    return max(module_sizes(stage_params(model, whole_model=True)))


def deepspeed_model_states_estimate(
    model: ModelConfig, *, zero_stage: int, dp: int, offload: Offload, devices_per_node: int = 8
) -> ModelStatesEstimate:
    """DeepSpeed's estimate_zero{2,3}_model_states_mem_needs for `model` on dp devices (tp = pp = 1).

    Stage 1 uses the stage-2 estimator (DeepSpeed has none for 1). How DeepSpeed counts, per
    parameter on one GPU, next to train.planner.memory (Ψ params, N = dp):

        stage 2, no offload:  2 + 18/N  (16-bit params; 16-bit + fp32 grads, fp32 params, moments
                              all sharded). Ours: 2 + 14/N resident plus the fp32 gradient
                              partition (4/N) as a step transient, so 2 + 18/N as well, plus one
                              largest module of 16-bit gradients as the reduce bucket.
        stage 2, offload:     2         (only the 16-bit params stay). Ours keeps the sharded
                              16-bit gradients too: 2 + 2/N, plus the bucket.
        stage 3, no offload:  18/N + 4 bytes x largest layer (the all-gathered working set).
                              Ours: 20/N (the 16-bit gradient counted in the shard) + 2 modules x
                              2 bytes x largest module gathered (the same 4 bytes x largest), +
                              2 bytes x largest module of gradients (the reduce bucket).
        stage 3, offload all: 4 bytes x largest layer only. Ours: 0 params, 2/N gradients, the
                              same 4 x largest gathered, plus the gradient bucket.

    So the two agree exactly up to (a) our reduce bucket, (b) 2/N at stage 3 without offload, and
    (c) under offload, the 16-bit gradient shard (2/N) that DeepSpeed moves to the host with the
    optimizer step and train.planner.memory keeps on the device. (c) makes train.planner.memory up to ~4.6x
    DeepSpeed's figure for offloaded ZeRO-3 (bloom_176b, dp 8: 61 vs 13 GiB of model states);
    tests/train/test_ds_engine.py asserts the decomposition exactly and the ratio in stated bands.

    DeepSpeed's 1.5 additional_buffer_factor multiplies only its CPU figure, never the GPU one.
    """
    import_deepspeed("cuda" if torch.cuda.is_available() else "cpu")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    params = total_params(model)
    largest = largest_module_params(model)
    per_node = min(dp, devices_per_node)
    if dp % per_node:
        raise ValueError(f"dp={dp} does not fill whole nodes of {devices_per_node} devices")
    nodes = dp // per_node
    offload = Offload(offload)
    if zero_stage in (1, 2):
        host, device = estimate_zero2_model_states_mem_needs(
            params, num_gpus_per_node=per_node, num_nodes=nodes, cpu_offload=offload != Offload.none
        )
    elif zero_stage == 3:
        host, device, _ = estimate_zero3_model_states_mem_needs(
            params,
            largest,
            num_gpus_per_node=per_node,
            num_nodes=nodes,
            cpu_offload=offload != Offload.none,
            cpu_offload_params=offload == Offload.params,
            zero_init=True,
        )
    else:
        raise ValueError(f"DeepSpeed's estimators cover ZeRO stages 1-3, not {zero_stage}")
    return ModelStatesEstimate(int(device), int(host), params, largest)
