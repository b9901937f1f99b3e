"""Checkpoint and resume with torch.distributed.checkpoint (DCP), so a requeued job goes on from
its last saved step instead of starting over.

On disk, for a run whose checkpoint root is R (training.checkpoint_dir, else <run dir>/checkpoints):

    R/<layout>/step_<N>/      DCP files (every rank writes its own part) + meta.json (rank 0)
    R/<layout>/latest         {"step": N, "dir": "step_<N>"}, replaced atomically

`latest` is written only after the whole of step_<N> is on disk, so a job killed mid-save resumes
from the previous complete checkpoint; a step directory that `latest` does not name is ignored.
<layout> is "dp2-tp1-pp1-zero1": a checkpoint holds this layout's shards (TP-sliced DTensors,
pipeline stages' own layers, ZeRO-1 optimizer states of the parameters this DP rank owns): a run
resumes only its own layout's, never another's (those are left as they are, and a run whose layout
has none starts afresh, saying so).

What is saved, per rank, under one DCP state dict:
- "model": get_model_state_dict(stage module): DTensor shards for TP, each stage's own names
  (layers.2...), replicated tensors saved once (DCP de-duplicates identical keys);
- "optim": per-parameter optimizer states keyed by the parameter's name; under ZeRO-1 one entry
  per bucket slice, keyed by the rank (train.dp.DistributedOptimizer). Not DCP's
  get_optimizer_state_dict: it reads optimizer.state, which the distributed optimizer leaves
  empty (its inner optimizer holds the slices). Distinct keys per rank mean every rank writes
  exactly its own states;
- "rng.rank<r>": this rank's RNG states (torch, CUDA, numpy, Python);
and in meta.json (rank 0): step, consumed samples, the whole run's losses (so a resumed run's
record holds the same loss curve as an uninterrupted one), the loss scaler, the layout and the
config fields that must not change across a resume.

Saves are asynchronous (dcp.async_save: the state is copied to host memory, then written by a
background thread while training goes on) when this torch has it, else synchronous; `mode` says
which. At most one save is in flight; its `latest` is written once it has completed (checked at
every step boundary, without waiting, and waited for at the next save, at a stop, or at the end of
training).
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import warnings
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from conf.schema import RunConfig, TokenDtype, to_plain_dict
from train.contract import CHECKPOINT_DIR, layout_key, write_json_atomic
from train.dp import DistributedOptimizer
from train.tokens import token_dtype

LATEST = "latest"
META = "meta.json"
KEEP = 2
"""Complete checkpoints kept per layout: the newest, and one more in case the newest turns out bad."""


class CheckpointMismatch(ValueError):
    """The checkpoint directory holds a checkpoint of this run's layout that it cannot resume from
    (another model, batch or update rule); the message says what differs and what to do."""


class CheckpointUnreadable(CheckpointMismatch):
    """No checkpoint of this run's layout in the checkpoint directory can be read (a `latest` that is
    not JSON, a step directory without its files, a truncated shard); the message says which and why."""


@dataclass(frozen=True)
class Resumed:
    """What load_latest restored."""

    step: int
    consumed_samples: int
    losses: list[float]
    """Losses of steps 1..step, from the attempts that saved them."""
    path: Path
    skipped: tuple[str, ...] = ()
    """Newer checkpoints that could not be read, each 'path: why', passed over for this one."""


def checkpoint_root(run: RunConfig, output_dir: Path) -> Path:
    return (
        Path(run.training.checkpoint_dir) if run.training.checkpoint_dir else Path(output_dir) / CHECKPOINT_DIR
    )


OPTIMIZER_FIELDS = ("lr", "lr_warmup_iters", "weight_decay", "grad_clip")
"""training fields of the update rule: resumed under others, the record's config (and its loss curve's
label) would describe steps that ran under the saving run's values. Checkpoints saved before they were
fingerprinted lack them, and are resumed as before."""


def fingerprint(run: RunConfig) -> dict[str, Any]:
    """Config fields a resume must not change: they change the weights' shapes, the data each step
    sees, or how each step updates the weights (OPTIMIZER_FIELDS). train_iters is not among them:
    extending a run is a legitimate resume (the learning-rate schedule then follows the new length
    from the resumed step on)."""
    par, tr = run.parallelism, run.training
    return {
        "training": {name: getattr(tr, name) for name in OPTIMIZER_FIELDS},
        "model": to_plain_dict(run)["model"],
        "micro_batch_size": par.mbs,
        "global_batch_size": par.global_batch_size,
        "precision": str(getattr(par.precision, "value", par.precision)),
        "seed": tr.seed,
        "data_path": tr.data_path,
        # Only where it reads the file otherwise than auto would: older checkpoints have no such key.
        **({"data_dtype": TokenDtype(tr.data_dtype).value} if tr.data_path and _dtype_differs(run) else {}),
    }


def _dtype_differs(run: RunConfig) -> bool:
    tr, vocab = run.training, run.model.vocab_size
    return token_dtype(tr.data_dtype, vocab) != token_dtype(None, vocab)


def read_latest(directory: Path) -> int | None:
    """The step `directory/latest` names, None without one."""
    try:
        pointer = json.loads((Path(directory) / LATEST).read_text())
    except FileNotFoundError:
        return None
    return int(pointer["step"])


@dataclass
class Checkpointer:
    """Saves and restores one rank's training state; every rank of the job makes one, in the same
    order (it creates a process group), and calls save / load_latest / wait together."""

    root: Path
    layout: Mapping[str, int]
    config: Mapping[str, Any]
    """fingerprint(run)."""
    rank: int = 0
    use_async: bool = True
    mode: str = field(init=False)
    """'async' or 'sync': how saves are made."""
    committed: list[int] = field(init=False, default_factory=list)
    """Steps whose checkpoint is complete, in this attempt."""
    warnings: list[str] = field(init=False, default_factory=list)
    other_layouts: tuple[str, ...] = field(init=False, default=())
    """Layouts (layout_key) whose checkpoints load_latest found in `root` where this one had none."""

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.dir = self.root / layout_key(**self.layout)
        self.mode = "async" if self.use_async and hasattr(_dcp(), "async_save") else "sync"
        self._distributed = dist.is_available() and dist.is_initialized()
        if not self._distributed:
            # DCP warns at every one-process save that it 'assumes' no_dist, which we pass on purpose;
            # the async writer warns from its own thread, out of reach of catch_warnings.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        # A group of its own: the async writer's collectives run on a background thread and must not
        # interleave with the training's on the default group; gloo, because async_save stages to
        # host memory and needs a CPU backend even when training uses NCCL.
        self._group = dist.new_group(backend="gloo") if self._distributed else None
        self._pending: tuple[int, Future[Any]] | None = None
        self._modes: dict[int, str] = {}

    # -----------------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        losses: Sequence[float],
        consumed_samples: int,
        blocking: bool = False,
    ) -> None:
        """Checkpoint the state after `step`. Asynchronous unless `blocking` or mode is 'sync'; the
        previous save is completed (and committed) first."""
        self.wait()
        if step in self.committed:
            return
        path = self.dir / f"step_{step}"
        if self.rank == 0 and path.exists():
            # Left by an attempt killed mid-save, or a checkpoint the resume passed over as unreadable: its
            # old .metadata beside this save's new meta.json would read as complete while the shards are
            # rewritten (a kill then resumed a mix of both), and DCP warned of overwriting it.
            shutil.rmtree(path)
        if self._distributed:
            dist.barrier(group=self._group)  # no rank writes its part before rank 0 has cleared the way
        path.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            write_json_atomic(
                path / META,
                {
                    "step": step,
                    "consumed_samples": consumed_samples,
                    "losses": [float(x) for x in losses],
                    "scaler": {k: _plain(v) for k, v in scaler.state_dict().items()},
                    "layout": dict(self.layout),
                    "config": dict(self.config),
                    "save_mode": "sync" if blocking else self.mode,
                    "torch": torch.__version__,
                },
            )
        dcp = _dcp()
        state = self._state_dict(model, optimizer)
        self._modes[step] = "sync" if blocking else self.mode
        if self.mode == "async" and not blocking:
            try:
                with _single_process_quiet():
                    future = dcp.async_save(
                        state, checkpoint_id=path, process_group=self._group, no_dist=not self._distributed
                    )
            except (RuntimeError, AssertionError, NotImplementedError) as exc:
                self.mode = self._modes[step] = "sync"
                self.warnings.append(f"async checkpoint save unavailable ({exc}); saving synchronously")
            else:
                self._pending = (step, future)  # type: ignore[assignment]
                return
        with _single_process_quiet():
            dcp.save(state, checkpoint_id=path, process_group=self._group, no_dist=not self._distributed)
        self._commit(step)

    def wait(self) -> int | None:
        """Finish the save in flight, if any, and commit it; the last committed step of this attempt."""
        if self._pending is not None:
            step, future = self._pending
            self._pending = None
            future.result()
            self._commit(step)
        return self.committed[-1] if self.committed else None

    def poll(self) -> None:
        """Commit the save in flight if it has finished, without waiting for it: every rank calls it at
        every step boundary, so that `latest` names a finished checkpoint as soon as it is on disk and
        a job killed outright (SIGKILL, a node failure) before the next save resumes from it."""
        if self._pending is not None and self._pending[1].done():
            self.wait()

    def _commit(self, step: int) -> None:
        # On rank 0 the save has returned only after every rank's part was written and the
        # metadata file finished (DCP gathers the ranks' write results first), so the pointer may
        # move now.
        if self.rank == 0:
            write_json_atomic(self.dir / LATEST, {"step": step, "dir": f"step_{step}"})
            self._prune(step)
            print(
                f"checkpoint: step {step} saved ({self._modes.pop(step, self.mode)}) to {self.dir}",
                flush=True,
            )
        self.committed.append(step)

    def _prune(self, latest: int) -> None:
        steps = sorted(
            int(p.name.removeprefix("step_"))
            for p in self.dir.glob("step_*")
            if p.name.removeprefix("step_").isdigit()
        )
        keep = [s for s in steps if s <= latest][-KEEP:]
        for s in steps:
            if s < latest and s not in keep:
                shutil.rmtree(self.dir / f"step_{s}", ignore_errors=True)

    # -----------------------------------------------------------------------------------------

    def load_latest(
        self, *, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler
    ) -> Resumed | None:
        """Restore the newest complete checkpoint of this layout into model, optimizer, scaler and
        the RNGs; None when there is none (other_layouts then names those `root` holds). Raises
        CheckpointMismatch when the newest holds another model, batch or update rule.

        A checkpoint that cannot be read (its files missing, truncated or not what DCP wrote) is
        passed over for the next older complete one (KEEP are kept for this), and Resumed.skipped
        says so; CheckpointUnreadable, one line per checkpoint tried, when none can be read."""
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

        problems: list[str] = []
        try:
            step = read_latest(self.dir)
        except (OSError, ValueError, KeyError, TypeError) as exc:  # not JSON, not {"step": N}
            problems.append(f"{self.dir / LATEST}: {_short(exc)}")
            step = None
        if step is None and not problems:
            # Each layout keeps its checkpoints in a directory of its own, so that a sweep of layouts can
            # share one training.checkpoint_dir (the dry run accepts it): another layout's are left as
            # they are, and this run starts afresh, saying so (it refused to start, the sweep's second
            # layout failing after its first had trained).
            self.other_layouts = tuple(sorted(p.parent.name for p in self.root.glob(f"*/{LATEST}")))
            return None
        # `latest` first, then the older complete ones (DCP writes .metadata last, rank 0's meta.json first).
        older = sorted((s for s in _complete_steps(self.dir) if step is None or s < step), reverse=True)
        for candidate in ([step] if step is not None else []) + older:
            path = self.dir / f"step_{candidate}"
            try:
                meta = json.loads((path / META).read_text())
                saved, layout = meta["config"], meta["layout"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                problems.append(f"{path}: {_short(exc)}")
                continue
            theirs, ours = _flat(saved), _flat(self.config)
            # A field fingerprinted since the checkpoint was saved is not a change (OPTIMIZER_FIELDS).
            later = {f"training.{name}" for name in OPTIMIZER_FIELDS} - set(theirs)
            changed = sorted(k for k in (set(theirs) | set(ours)) - later if theirs.get(k) != ours.get(k))
            if changed or layout != dict(self.layout):
                raise CheckpointMismatch(
                    f"checkpoint {path} was saved by a run with other {', '.join(changed) or 'layout'} "
                    f"(checkpoint: {', '.join(f'{k}={theirs.get(k)!r}' for k in changed)}; this run: "
                    f"{', '.join(f'{k}={ours.get(k)!r}' for k in changed)}); this run cannot resume "
                    "from it. Use the saving run's config, or another training.checkpoint_dir."
                )
            try:
                self._load(path, meta, model=model, optimizer=optimizer, scaler=scaler)
            except (CheckpointException, OSError, ValueError, KeyError, RuntimeError) as exc:
                problems.append(f"{path}: {_short(exc)}")
                continue
            return Resumed(
                step=int(meta["step"]),
                consumed_samples=int(meta["consumed_samples"]),
                losses=[float(x) for x in meta["losses"]],
                path=path,
                skipped=tuple(problems),
            )
        raise CheckpointUnreadable(
            f"no checkpoint in {self.dir} can be resumed from ({'; '.join(problems)}). Remove that directory "
            "to start afresh, or use another training.checkpoint_dir (or run directory)."
        )

    def _load(
        self,
        path: Path,
        meta: Mapping[str, Any],
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
    ) -> None:
        _init_optimizer_state(_stateful(optimizer))
        state = self._state_dict(model, optimizer)
        with _single_process_quiet():
            _dcp().load(state, checkpoint_id=path, process_group=self._group, no_dist=not self._distributed)
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state["model"])
        if isinstance(optimizer, DistributedOptimizer):
            optimizer.refresh_from_model()  # its fp32 slices of the parameters, from the restored model
        _set_rng_state(state[f"rng.rank{self.rank}"])
        if meta["scaler"]:
            scaler.load_state_dict(meta["scaler"])

    def _state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {
            "model": get_model_state_dict(model),
            "optim": optimizer_state(model, optimizer, rank=self.rank),
            f"rng.rank{self.rank}": _rng_state(),
        }


# ---------------------------------------------------------------------------------------------
# Optimizer states by parameter name.


def _dcp() -> ModuleType:
    # Imported on first use: torch.distributed.checkpoint (with DTensor) is over a second of
    # start-up that a run without checkpoints (most benchmark runs) need not pay.
    import torch.distributed.checkpoint as dcp

    return dcp


def _stateful(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds the states: ZeRO-1's inner one (this DP rank's slices), else itself."""
    return optimizer.inner if isinstance(optimizer, DistributedOptimizer) else optimizer


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, *, rank: int = 0) -> dict[str, dict[str, Any]]:
    """{parameter name: its optimizer state (references, not copies)} for the parameters whose
    states this rank holds; under ZeRO-1 one entry per bucket slice, named by the global rank
    (every rank writes exactly its own). Learning rate and weight decay are not saved: the
    trainer sets them from the config and the iteration at every step."""
    if isinstance(optimizer, DistributedOptimizer):
        return optimizer.named_states(f"zero1.rank{rank}")
    names = {id(p): name for name, p in model.named_parameters()}
    holder = _stateful(optimizer)
    out: dict[str, dict[str, Any]] = {}
    for group in holder.param_groups:
        for p in group["params"]:
            if p in holder.state and holder.state[p]:
                out[names[id(p)]] = dict(holder.state[p])
    return out


@torch.no_grad()
def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the (lazily made) states with one zero-gradient, zero-learning-rate step, so that
    a checkpoint can be loaded into them in place. It leaves the weights bit-identical (the
    update and the decoupled decay are both multiplied by lr = 0); the states it makes are then
    overwritten by the load."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not params or all(optimizer.state.get(p) for p in params):
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs, strict=True):
        g["lr"] = lr
    for p in params:
        p.grad = None


# ---------------------------------------------------------------------------------------------
# RNG and small helpers.


def _flat(config: Mapping[str, Any]) -> dict[str, Any]:
    """fingerprint() with its nested groups spelt as the overrides that change them (model.hidden_size)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def _complete_steps(directory: Path) -> list[int]:
    """Steps under `directory` whose save finished: rank 0's meta.json and DCP's .metadata, which
    DCP writes last, once every rank's part is on disk."""
    return [
        int(p.name.removeprefix("step_"))
        for p in Path(directory).glob("step_*")
        if p.name.removeprefix("step_").isdigit() and (p / META).is_file() and (p / ".metadata").is_file()
    ]


def _short(exc: BaseException) -> str:
    """One line for why a checkpoint could not be read: DCP's CheckpointException holds every
    rank's traceback; its first rank's exception says it."""
    failures = getattr(exc, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
    if isinstance(failures, dict) and failures:
        exc = failures[min(failures)][0]
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every call of a one-process run that it 'assumes' no_dist; we pass it on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _plain(value: Any) -> Any:
    """JSON form of a GradScaler state value (floats and ints; a tensor scale becomes a float)."""
    return value.item() if isinstance(value, torch.Tensor) else value
