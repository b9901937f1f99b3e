"""Typed schema of every megasweep config group.

Each group (model, parallelism, hardware, cluster, logger, training) is one frozen
dataclass. The YAML files under conf/<group>/ hold only values; types, defaults and
units live here. Hydra composes YAML on top of these schemas (so an unknown key or a
value of the wrong type is rejected at composition time), and the entry points convert
the composed config to these dataclasses exactly once with `to_run_config`.

This module must import without torch: the launcher and the analysis use it on login
nodes where torch may be absent.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import types
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omegaconf import DictConfig, ListConfig, Node

# Hydra and OmegaConf are imported where a function needs them, not here: the analysis and the
# planner read these dataclasses without composing anything, and `import hydra` alone costs
# ~0.15 s of every `python -m analysis` start.


class ModelKind(str, Enum):
    """Architecture family: decoder-only causal LM or bidirectional masked LM."""

    gpt = "gpt"
    bert = "bert"


class Precision(str, Enum):
    """Numeric format of the matmuls and activations (weights' master copy stays fp32)."""

    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


class Recompute(str, Enum):
    """Activation recomputation (Korthikanti et al. 2022): none, attention core only, whole layer."""

    none = "none"
    selective = "selective"
    full = "full"


class Offload(str, Enum):
    """What ZeRO moves to host memory: nothing, optimizer states, or parameters too."""

    none = "none"
    optimizer = "optimizer"
    params = "params"


class Engine(str, Enum):
    """Training engine: megasweep's own torch.distributed code or DeepSpeed."""

    native = "native"
    deepspeed = "deepspeed"


class OptimizerImpl(str, Enum):
    """Adam implementation; `auto` picks apex FusedAdam on GPU, else torch fused, else foreach."""

    auto = "auto"
    apex = "apex"
    torch_fused = "torch_fused"
    torch = "torch"


class TokenDtype(str, Enum):
    """Width of the ids in a token file; `auto` is uint16 up to a vocabulary of 65536, else uint32."""

    auto = "auto"
    uint16 = "uint16"
    uint32 = "uint32"


AUTO_MICRO_BATCH = "auto"
"""The one string `parallelism.micro_batch_size` accepts: the entry points replace it by a size."""

# OmegaConf enforces an int or a string at composition; validation accepts only the string 'auto'.
MicroBatchSize = int | str


class WandbMode(str, Enum):
    """W&B client mode; `offline` writes a local run that `wandb sync` uploads later."""

    offline = "offline"
    online = "online"
    disabled = "disabled"


@dataclass(frozen=True)
class ModelConfig:
    """Transformer shape, with Megatron-LM's field names."""

    name: str = "tiny"
    """Label used in tables and W&B (e.g. 'gpt_1.3b')."""
    kind: ModelKind = ModelKind.gpt
    """Architecture family (gpt | bert)."""
    num_layers: int = 4
    """Number of transformer layers."""
    hidden_size: int = 256
    """Model width h (elements)."""
    num_attention_heads: int = 4
    """Attention heads per layer; hidden_size must divide evenly by it."""
    ffn_hidden_size: int | None = None
    """MLP inner width (elements); null means 4 x hidden_size."""
    seq_length: int = 256
    """Sequence length s (tokens per sample)."""
    vocab_size: int = 50257
    """Tokenizer vocabulary V before padding (tokens)."""
    make_vocab_size_divisible_by: int = 128
    """Pad V to a multiple of this times TP, as Megatron does (tokens)."""

    @property
    def ffn(self) -> int:
        """MLP inner width with the 4 x hidden default applied (elements)."""
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size


@dataclass(frozen=True)
class ParallelismConfig:
    """Layout of one run over devices, batch sizes, and memory-saving options."""

    tp: int = 1
    """Tensor-parallel degree (devices that split each layer's matrices)."""
    pp: int = 1
    """Pipeline-parallel degree (stages the layers are split into)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (chunks): >1 runs Megatron's interleaved 1F1B (Narayanan et al. 2021)."""
    dp: int | None = None
    """Data-parallel degree (model replicas); null means world size / (tp x pp)."""
    micro_batch_size: MicroBatchSize = 4
    """Samples per forward/backward on one replica (samples), or `auto`: the largest that fits (auto)."""
    global_batch_size: int = 8
    """Samples per optimizer step over all replicas (samples)."""
    rampup_batch_size: list[int] | None = None
    """Megatron batch ramp-up [start, increment, ramp samples]; null means no ramp-up."""
    zero_stage: int = 0
    """ZeRO stage 0-3: shard optimizer states (1), + gradients (2), + parameters (3) over DP."""
    offload: Offload = Offload.none
    """What ZeRO keeps in host memory (none | optimizer | params)."""
    recompute: Recompute = Recompute.none
    """Activation recomputation (none | selective | full)."""
    sequence_parallel: bool = False
    """Shard norms and residuals along the sequence over TP (Korthikanti et al. 2022); needs tp > 1."""
    precision: Precision = Precision.bf16
    """Compute precision (bf16 | fp16 | fp32)."""
    engine: Engine = Engine.native
    """Training engine (native | deepspeed)."""
    optimizer: OptimizerImpl = OptimizerImpl.auto
    """Adam implementation (auto | apex | torch_fused | torch)."""

    @property
    def mbs(self) -> int:
        """micro_batch_size as a number of samples, for arithmetic.

        'auto' is replaced by a size at the entry points (train.planner.micro_batch.resolve_micro_batch, called by
        validate, plan_run and the trainer); arithmetic reached before that is a bug, said loudly here.
        """
        if isinstance(self.micro_batch_size, str):
            raise ValueError(
                f"parallelism.micro_batch_size={self.micro_batch_size!r} is used before it was resolved "
                "to a size (train.planner.micro_batch.resolve_micro_batch)"
            )
        return self.micro_batch_size


def requested_micro_batch(par: ParallelismConfig) -> int | str:
    """parallelism.micro_batch_size as composed: an int, or 'auto' before the entry points resolve it."""
    return par.micro_batch_size


def is_auto_micro_batch(par: ParallelismConfig) -> bool:
    """Whether the micro-batch size is still `auto` (not yet resolved to a size)."""
    return requested_micro_batch(par) == AUTO_MICRO_BATCH


@dataclass(frozen=True)
class HardwareConfig:
    """One accelerator (or CPU node) type: dense peaks, memory, and interconnect."""

    name: str = "cpu"
    """Label used in tables and records."""
    device_type: str = "cpu"
    """torch device type the trainer uses (cuda | cpu)."""
    device_pattern: str | None = None
    """Regular expression (case-insensitive) the name of a device this config describes contains: torch's CUDA device name, or /proc/cpuinfo's model name; null: not checked."""
    peak_tflops_bf16: float | None = None
    """Dense bf16 peak per device (TFLOP/s); null if unknown or unsupported."""
    peak_tflops_fp16: float | None = None
    """Dense fp16 peak per device (TFLOP/s); null if unknown or unsupported."""
    peak_tflops_fp32: float | None = None
    """Dense fp32 matmul peak per device (TFLOP/s; TF32 tensor cores where the device has them)."""
    tf32: bool = False
    """True: fp32 matmuls run on the device's TF32 tensor cores (the trainer allows TF32), so peak_tflops_fp32 is TF32's peak."""
    peak_measured: bool = False
    """True: peaks are measured at run time by a short matmul calibration, labelled 'measured'."""
    num_sms: int | None = None
    """Streaming multiprocessors (GPU) or cores (CPU) that GEMM tiles are scheduled on."""
    memory_gib: float = 16.0
    """Memory per device (GiB)."""
    memory_reserve_gib: float = 0.0
    """Margin the planner keeps free on top of its modelled overheads (GiB)."""
    process_overhead_gib: float = 0.0
    """Memory a training process holds outside its tensors: CUDA context and kernels, or a CPU process's resident set (GiB)."""
    comm_buffer_gib: float = 0.0
    """Device buffers of one communicator of more than two ranks (GiB; NCCL, 0 for gloo)."""
    comm_buffer_pair_gib: float = 0.0
    """Device buffers of one two-rank communicator (GiB; NCCL, 0 for gloo)."""
    allocator_fragmentation: float = 0.0
    """Share of the memory a step allocates and frees that a caching allocator's fragmentation leaves unusable (fraction; GPUs)."""
    devices_per_node: int = 1
    """Devices (GPUs, or CPU sockets used as one device) per node."""
    intra_node_bw_gbs: float | None = None
    """Device-to-device bandwidth inside a node, one direction (GB/s)."""
    inter_node_bw_gbs: float | None = None
    """Network bandwidth per node, one direction (GB/s)."""
    memory_bw_gbs: float | None = None
    """Device memory (HBM) bandwidth from the datasheet (GB/s); null if unknown."""
    host_link_bw_gbs: float | None = None
    """Host-device link bandwidth per device, one direction (GB/s; PCIe), used by offload."""
    gemm_efficiency: float = 0.8
    """Share of the dense peak a large, well-shaped GEMM reaches (fraction; train.planner.perf)."""
    attention_efficiency: float | None = None
    """Share of the dense peak a fused attention kernel (FlashAttention under SDPA) reaches over its forward and backward (fraction); null: its two products priced as GEMMs."""
    memory_bw_efficiency: float = 0.9
    """Share of memory_bw_gbs a large streaming kernel reaches (fraction)."""
    intra_node_comm_efficiency: float = 0.75
    """Collective bus bandwidth over intra_node_bw_gbs for large messages (fraction)."""
    inter_node_comm_efficiency: float = 0.9
    """Collective bus bandwidth over a device's share of inter_node_bw_gbs for large messages (fraction)."""
    comm_latency_us: float = 5.0
    """Latency of one step of a ring collective or of one send/recv (microseconds)."""
    kernel_overhead_us: float = 5.0
    """Time a kernel costs beyond its work: launch and ramp (microseconds)."""
    calibration: str | None = None
    """Calibration file of `python -m launchers calibrate` the time model reads instead of the figures above (path)."""
    source: str = ""
    """URL of the datasheet the figures come from."""


@dataclass(frozen=True)
class ClusterConfig:
    """Slurm site settings used by the launchers."""

    name: str = "local"
    """Label of the site."""
    partition: str | None = None
    """Slurm partition (--partition); null uses the site default."""
    account: str | None = None
    """Slurm account to charge (--account)."""
    qos: str | None = None
    """Slurm quality of service (--qos)."""
    gres: str | None = None
    """Generic resources per node, e.g. 'gpu:8' (--gres); null requests none."""
    constraint: str | None = None
    """Node feature constraint (--constraint)."""
    exclusive: bool = True
    """Whole nodes per job (--exclusive), so no other job's work distorts a run's timings (on | off)."""
    core_license: str | None = None
    """Slurm license counting the site's real cores; each job asks for tasks x cpus_per_task of it, at most its total (--licenses; license name, null: none)."""
    time_limit_min: int = 60
    """Wall-clock limit per job (minutes); hydra/launcher=local ends a run at it as Slurm would (SIGTERM)."""
    cpus_per_task: int = 1
    """CPU cores per task (--cpus-per-task)."""
    mem_per_node_gb: int | None = None
    """Host memory per node (GB, --mem); null uses the site default."""
    array_parallelism: int = 256
    """Most tasks of one array running at once (the %N throttle) (tasks)."""
    max_retries: int = 2
    """Requeues allowed after preemption or time limit, per task, of a run that checkpoints (training.save_interval > 0)."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run before the job's command (module loads, venv activation); one that exits non-zero stops the job."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables exported into each job (sweepable, e.g. NCCL settings)."""


@dataclass(frozen=True)
class LoggerConfig:
    """Where metrics go besides the console and result.json."""

    wandb_mode: WandbMode = WandbMode.offline
    """W&B client mode (offline | online | disabled)."""
    wandb_project: str = "megasweep"
    """W&B project name."""
    wandb_entity: str | None = None
    """W&B entity (user or team); null uses the client's default."""
    wandb_group: str | None = None
    """W&B group; null means the sweep's name, so one sweep's runs are grouped."""
    wandb_init_timeout_s: float = 30.0
    """Longest wandb.init may wait for its service and, online, the server; then offline (seconds)."""
    tensorboard: bool = False
    """Also write TensorBoard event files in the run directory."""


@dataclass(frozen=True)
class TrainingConfig:
    """What the trainer does and for how long; independent of model and layout."""

    train_iters: int = 10
    """Optimizer steps to run (iterations)."""
    warmup_iters: int = 2
    """Leading iterations excluded from the reported medians (iterations)."""
    log_interval: int = 1
    """Iterations between console log lines, each the mean of the iterations it covers, as Megatron's (iterations)."""
    lr: float = 3.0e-4
    """Peak learning rate (per step)."""
    lr_warmup_iters: int = 0
    """Linear learning-rate warm-up length (iterations)."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay (per step, relative)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 disables (L2 norm)."""
    seed: int = 1234
    """Seed of parameters and synthetic data."""
    data_path: str | None = None
    """Token file (.bin, uint16/uint32 memmap); null uses deterministic synthetic tokens."""
    data_dtype: TokenDtype = TokenDtype.auto
    """Width of data_path's ids, which the headerless file cannot say (auto | uint16 | uint32); auto: uint16 if model.vocab_size <= 65536."""
    save_interval: int = 0
    """Iterations between checkpoints (and one after the last), and resume from the latest of this layout in checkpoint_dir; 0 neither (iterations)."""
    checkpoint_dir: str | None = None
    """Where checkpoints go; null means <run dir>/checkpoints."""
    collective_timeout_s: float = 300.0
    """Bound on any collective before every rank is ended (seconds)."""
    flop_check: bool = False
    """Cross-check the per-GEMM FLOPs with FlopCounterMode on one micro-batch at start (on | off)."""
    profile_steps: list[int] = field(default_factory=list)
    """Iterations to trace with the PyTorch profiler, first to last (iterations); empty traces none."""
    deepspeed_flops_profile: bool = False
    """engine=deepspeed: run iteration warmup_iters + 1 under DeepSpeed's flops profiler, recorded (on | off)."""


@dataclass(frozen=True)
class SearchConfig:
    """What `hydra/sweeper=layouts` searches: the node counts and the layout options it tries."""

    nodes: list[int] = field(default_factory=lambda: [1])
    """Node counts to search (nodes); a layout uses every device of its nodes."""
    micro_batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    """Micro-batch sizes to try (samples)."""
    recompute: list[Recompute] = field(default_factory=lambda: list(Recompute))
    """Recompute modes to try (none | selective | full)."""
    zero_stages: list[int] = field(default_factory=lambda: [0, 1])
    """ZeRO stages to try (0-3; stages 2 and 3 run on DeepSpeed)."""
    sequence_parallel: list[bool] = field(default_factory=lambda: [False, True])
    """Sequence-parallel settings to try where tp > 1 on the native engine (false | true)."""
    virtual_stages: list[int] = field(default_factory=lambda: [1, 2])
    """Model chunks per pipeline rank to try where pp > 1 on the native engine (chunks)."""
    top_k: int = 3
    """Fastest predicted layouts handed to the launcher (layouts)."""
    top_k_per_node_count: bool = False
    """Hand the launcher the top_k fastest of each node count, not of all: a scaling sweep measured in one go (bool)."""
    show: int = 20
    """Ranked layouts printed, fastest first (rows)."""


@dataclass(frozen=True)
class RunConfig:
    """One run: the composition of every group."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Transformer shape."""
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    """Layout and batch sizes."""
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    """Device type."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Slurm site."""
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    """Metric sinks."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Trainer settings."""
    search: SearchConfig = field(default_factory=SearchConfig)
    """Layout search options (`hydra/sweeper=layouts` only)."""


GROUP_SCHEMAS: dict[str, type] = {
    "model": ModelConfig,
    "parallelism": ParallelismConfig,
    "hardware": HardwareConfig,
    "cluster": ClusterConfig,
    "logger": LoggerConfig,
}


def register_configs() -> None:
    """Store the schemas in Hydra's ConfigStore (idempotent).

    `megasweep_schema` is the primary config's base: its typed fields make Hydra reject
    unknown keys and wrongly typed values in every group's YAML and in overrides.
    """
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="megasweep_schema", node=_writable(RunConfig))
    # Kept out of the groups themselves so that `model=...` lists only real models.
    for group, schema in GROUP_SCHEMAS.items():
        cs.store(group=f"schema/{group}", name=group, node=_writable(schema), package=group)


def _writable(schema: type) -> DictConfig:
    """The schema as a typed but writable node.

    OmegaConf marks a frozen dataclass read-only, which would forbid Hydra from merging
    YAML and overrides into it; the types stay enforced, and immutability comes back
    when `to_run_config` builds the frozen dataclasses.
    """
    from omegaconf import OmegaConf

    node = OmegaConf.structured(schema)
    _clear_readonly(node)
    return node


@functools.cache
def _run_schema() -> DictConfig:
    # Building the structured node costs more than the merge itself; sweeps call this per config.
    return _writable(RunConfig)


def _clear_readonly(node: Node) -> None:
    # OmegaConf sets the flag on every nested dataclass node, so clear it all the way down.
    from omegaconf import DictConfig, Node

    node._set_flag("readonly", None)
    if isinstance(node, DictConfig):
        for key in node:
            child = node._get_node(key)
            assert isinstance(child, Node)
            _clear_readonly(child)


def to_run_config(cfg: DictConfig | dict[str, Any]) -> RunConfig:
    """Convert a composed Hydra config (or a plain nested dict) to a RunConfig, once.

    Keys that are not part of the schema (Hydra's own `hydra` node) are dropped.
    """
    from omegaconf import DictConfig, OmegaConf

    data = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    assert isinstance(data, dict)
    # merge() copies its first argument, so the cached schema node is never modified.
    merged = OmegaConf.merge(_run_schema(), {k: v for k, v in data.items() if k in RunConfig.__dataclass_fields__})
    obj = OmegaConf.to_object(merged)
    assert isinstance(obj, RunConfig)
    return obj


@functools.cache
def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(RunConfig)


def to_field_config(name: str, node: DictConfig) -> Any:
    """One group of a composed config (`name`, a RunConfig field; `node`, its node) converted as
    `to_run_config` converts it: the same dataclass as `to_run_config(cfg).<name>`, without
    converting the other groups (a group's conversion reads only its own node; no interpolations).

    A node typed by the field's own dataclass (every group Hydra composes on the schema) is
    instantiated as it stands: merging it into the schema first, as to_run_config does, would
    check the same typed fields a second time. Any other node goes through that merge.
    """
    from omegaconf import OmegaConf

    cls = _field_types()[name]
    typed: DictConfig | ListConfig = node
    if OmegaConf.get_type(node) is not cls:
        data = OmegaConf.to_container(node, resolve=True)
        # merge() copies its first argument, so the cached schema node is never modified.
        typed = OmegaConf.merge(_field_schema(name), data)
    obj = OmegaConf.to_object(typed)
    assert isinstance(obj, cls)
    return obj


@functools.cache
def _field_schema(name: str) -> DictConfig:
    return _writable(_field_types()[name])


def to_plain_dict(run: RunConfig) -> dict[str, Any]:
    """RunConfig as JSON-ready nested dicts (enums as their string values)."""
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(OmegaConf.structured(run), enum_to_str=True)
    assert isinstance(container, dict)
    return {str(k): v for k, v in container.items()}


def unknown_field(key: str) -> str | None:
    """None when the dotted `key` is a field of RunConfig, or lies below a field that holds a dict or a
    list; otherwise one sentence naming the group and the closest fields (difflib), e.g.
    'parallelism.tpp is not a field of parallelism; did you mean parallelism.tp?'.

    For the entry points' messages: Hydra's own suggests adding the key with '+', which the schema
    then rejects too."""
    typ: Any = RunConfig
    done: list[str] = []
    for part in key.split("."):
        if not (isinstance(typ, type) and dataclasses.is_dataclass(typ)):
            return None
        hints = typing.get_type_hints(typ)
        if part not in hints:
            group = ".".join(done)
            prefix = f"{group}." if group else ""
            close = difflib.get_close_matches(part, list(hints), n=3)
            where = f"a field of {group}" if group else "a config group or field"
            if close:
                hint = "did you mean " + " or ".join(f"{prefix}{c}" for c in close) + "?"
            else:
                hint = f"{'fields' if group else 'groups'}: {', '.join(prefix + f for f in hints)}"
            return f"{key} is not {where}; {hint}"
        done.append(part)
        typ = _dataclass_in(hints[part])
    return None


def unknown_override(key: str, text: str) -> str | None:
    """unknown_field's sentence for the command-line override `text` that names `key`, ending with
    the override as typed; None when the key exists. Every entry point reports it in this form."""
    problem = unknown_field(key)
    return None if problem is None else f"{problem} (override '{text}')"


def _field_hint(key: str) -> Any:
    """The annotation of the dotted RunConfig field `key`; None when `key` names no field."""
    typ: Any = RunConfig
    hint: Any = None
    for part in key.split("."):
        if not (isinstance(typ, type) and dataclasses.is_dataclass(typ)):
            return None
        hints = typing.get_type_hints(typ)
        if part not in hints:
            return None
        hint = hints[part]
        typ = _dataclass_in(hint)
    return hint


_BOOLEANS = frozenset({"true", "false", "yes", "no", "on", "off", "1", "0"})
"""What OmegaConf reads as a boolean, case aside."""


def wrong_value(key: str, value: str, *, hint: Any = None) -> str | None:
    """One sentence when the command-line `value` of field `key` cannot be its type (a whole number,
    a number, true/false, one of an enum's names), naming what it can be; None when it can, or when
    the field takes text too (`micro_batch_size: int | str`) or more than one value. The schema
    would reject it after Hydra composed, with a message that names the type's Python class.
    `hint`: the field's annotation where `key` is not RunConfig's (a Hydra plugin's field)."""
    hint = _field_hint(key) if hint is None else hint
    args = _union_members(hint)
    kinds = [a for a in args if a is not type(None)]
    if len(kinds) != 1 or "${" in value:
        return None
    kind = kinds[0]
    if isinstance(kind, type) and dataclasses.is_dataclass(kind) and key not in GROUP_SCHEMAS and not value.startswith("{"):
        # `training=foo`: Hydra refused it while merging ("Invalid type assigned"), exit 1. A group's
        # option (model=tiny) is a config file's name, judged by its own check; a dict
        # (training={lr:1e-4}) is merged into the section, as Hydra does.
        first = next(iter(typing.get_type_hints(kind)), "lr")
        return (f"{key}={value}: {key} is a section of settings, not one value (nor a group of config files); "
                f"set its fields, e.g. {key}.{first}=...")
    if value == "null":
        return None if len(args) > 1 else f"{key}=null: the field needs a value (it has no 'unknown')"
    if typing.get_origin(kind) is list:
        return _wrong_list(key, value, (typing.get_args(kind) or (str,))[0])
    if kind is bool:
        ok, what = value.lower() in _BOOLEANS, "true or false"
    elif kind is int:
        ok, what = re.fullmatch(r"[+-]?\d+", value) is not None, "a whole number"
        if not ok and re.fullmatch(r"[+-]?\d+\.0", value):
            # Hydra reads 1e3 as the float 1000.0, which it gives here: whole, but not written as one.
            what += f" written in digits (a float such as 1e3 is refused: write {value[:-2]})"
    elif kind is float:
        ok, what = re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|[+-]?(inf|nan)", value) is not None, "a number"
    elif isinstance(kind, type) and issubclass(kind, Enum):
        names = [m.name for m in kind]
        ok, what = value in names, f"one of {', '.join(names)}"
        close = difflib.get_close_matches(value, names, n=1)
        what += f" (did you mean {close[0]}?)" if close and not ok else ""
    else:
        return None
    return None if ok else f"{key}={value} is not {what}"


def is_field(key: str) -> bool:
    """Whether the dotted `key` names a field of RunConfig (not a key of a mapping field's own)."""
    return _field_hint(key) is not None


def takes_dict(key: str) -> bool:
    """Whether field `key` holds a mapping of the user's own keys (`cluster.env: dict[str, str]`)."""
    return any(typing.get_origin(a) is dict for a in _union_members(_field_hint(key)))


def takes_list(key: str, *, hint: Any = None) -> bool:
    """Whether field `key` (or the annotation `hint`) holds a list (`search.nodes: list[int]`)."""
    hint = _field_hint(key) if hint is None else hint
    args = _union_members(hint)
    return any(typing.get_origin(a) is list for a in args)


def _wrong_list(key: str, value: str, item: Any) -> str | None:
    """wrong_value for a list field: Hydra takes `search.nodes=4` for a number and fails merging it into
    the list (exit 1, six lines); and an item of the wrong type only once composed."""
    text = value.strip()
    if not (text.startswith("[") and text.endswith("]")):
        if (problem := wrong_value(key, text, hint=item)) is not None:
            # `search.nodes=abc` was told to write search.nodes=[abc], itself refused.
            return f"{key}={value} is not a list, and {value} is not {problem.split(' is not ', 1)[-1]}: write its items in brackets ({key}=[...])"
        return f"{key}={value} is not a list: write it in brackets, e.g. {key}=[{value}]"
    for element in (e.strip().strip("'\"") for e in text[1:-1].split(",")):
        if element and (problem := wrong_value(key, element, hint=item)) is not None:
            return f"{key}={value}: its item {element} is not {problem.split(' is not ', 1)[-1]}"
    return None


def _union_members(hint: Any) -> tuple[Any, ...]:
    """The members of a union annotation (`int | None`, Optional[int]); the annotation alone otherwise."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return typing.get_args(hint)
    return (hint,)


def _dataclass_in(hint: Any) -> Any:
    """The dataclass an annotation names, also inside `X | None`; the annotation itself otherwise."""
    found = [a for a in _union_members(hint) if isinstance(a, type) and dataclasses.is_dataclass(a)]
    return found[0] if found else hint
