"""The on-disk contract: every file name, record type and exit code megasweep writes, defined once.

The trainer writes, the launchers write and read, the analysis reads; all three import these
definitions from here and nowhere else, so a field or a file name cannot drift between them:

    <sweep dir>/manifest.jsonl            ManifestEntry per config (launchers; status, analysis)
    <sweep dir>/plan.csv                  PlanRow per config (dry run; analysis)
    <sweep dir>/.megasweep/launch.json    what a rerun needs (launchers)
    <sweep dir>/.megasweep/jobs/<index>   job id an exported array task recorded (launchers)
    <sweep dir>/.megasweep/multirun.earlier.yaml  the sweep's multirun.yaml while a launch keeps it
    <sweep dir>/.megasweep/local/<host>.<pid>.json  LocalRun of a live local launch (launchers)
    <run dir>/result.json                 RunRecord, one per run whatever its outcome (trainer)
    <run dir>/result.attempt<N>.json      the record of attempt N, stopped for a requeue
    <run dir>/result.<job id>.json        a failed run's record, set aside by `rerun --failed`
    <run dir>/deepspeed_config.json       the DeepSpeed config a run used
    <run dir>/tensorboard/                TensorBoard event files (logger.tensorboard=true)
    <run dir>/checkpoints/                checkpoints, unless training.checkpoint_dir puts them elsewhere
    <run dir>/oom.rank<R>.json            OomReport of a rank that ran out of memory (trainer)
    <run dir>/train.log                   the run's console output, iteration lines included (launchers.job)
    <run dir>/train.rank<R>.log           the console output of srun task R > 0 (launchers.job)
    <sweep dir>/.submitit/<job id>/       submitit's scripts and Slurm logs of the launcher's jobs
    <sweep dir>/search.csv                every layout the search judged (hydra/sweeper=layouts)
    <sweep dir>/multirun.append<N>.yaml   the Hydra config of a launch that added configs (appended_name)
    <sweep dir>/search.append<N>.csv      the layouts an added search judged (appended_name)
    <sweep dir>/.slurm/<job id>.out       Slurm logs of an exported array script's tasks
    <cache dir>/peak-<host>.json          PeakCalibration per device, precision, cores, threads, torch (trainer)

The cache directory is $MEGASWEEP_CACHE_DIR, else $XDG_CACHE_HOME/megasweep, else ~/.cache/megasweep
(`cache_dir`): what megasweep measures once per host, not once per run.

Exit codes of megasweep's commands (`python -m train`, `python -m launchers`,
`python -m analysis`) are EXIT_*, below.

Every writer goes through `write_text_atomic`: a reader (status, analysis, a requeued attempt)
sees a file's old content or its whole new content, never a part.

Torch-free and pandas-free: the launchers import it on login nodes.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import operator
import os
import re
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path, PurePosixPath
from typing import Any, NoReturn

import orjson

from train.metrics import scrub_overrides

# ---------------------------------------------------------------------------------------------
# File names

RESULT_FILE = "result.json"
REQUEUE_ADVICE = "requeue to resume"
"""How a record of a run stopped with a checkpoint ends its message (train.preemption): what the
checkpoint is for. A job that is then not requeued says what resumes it instead (launchers.job)."""


def cancelled_words(job: str) -> str:
    """How a record, the task and the log say that Slurm job `job` was cancelled (scancel)."""
    return f"job {job} was cancelled (scancel)"


def cancelled_message(job: str, message: str | None) -> str:
    """The message of a `cancelled` record, from the `timeout` one's: scancel's SIGTERM reads as a time
    limit's to the trainer, and a longer time limit would look like the cure."""
    return f"{cancelled_words(job)}, not stopped by a time limit: {message or 'no message'}"


PLAN_FILE = "plan.csv"
SEARCH_FILE = "search.csv"
"""The layouts a search ranked (the first search's, when one was added later: see appended_name)."""
MANIFEST_FILE = "manifest.jsonl"
MULTIRUN_FILE = "multirun.yaml"
"""Hydra's record of a sweep's config in its directory (the first launch's, when configs were
added later: see appended_name)."""
STATE_DIR = ".megasweep"
"""The launchers' own state in a sweep directory (LAUNCH_FILE, EXPORTED_JOBS_DIR, EARLIER_MULTIRUN_FILE,
LOCAL_RUNS_DIR, LOCK_FILE)."""
LOCK_FILE = f"{STATE_DIR}/lock"
"""Locked (flock) by whoever gives configs indices in the sweep or rewrites its manifest, until the
manifest says so (launchers.sweepdir.sweep_lock); it holds the holder's host, pid and command."""
LAUNCH_FILE = f"{STATE_DIR}/launch.json"
EXPORTED_JOBS_DIR = f"{STATE_DIR}/jobs"
"""Where an exported script's array tasks record their job ids (one file per config index)."""
EARLIER_MULTIRUN_FILE = f"{STATE_DIR}/multirun.earlier.yaml"
"""A copy of the sweep's MULTIRUN_FILE while a launch into its directory has yet to keep it (from
before the launch's sweeper writes its own there until the launcher runs): left by a launch that
was killed meanwhile, it is the sweep's, and the next launch puts it back."""
LOCAL_RUNS_DIR = f"{STATE_DIR}/local"
"""One LocalRun file per `hydra/launcher=local` launch (local_run_path), from its start until its end:
`status` tells a queued, a running and an abandoned config apart by it, as it asks Slurm of a job."""
DS_CONFIG_FILE = "deepspeed_config.json"
TENSORBOARD_DIR = "tensorboard"
CHECKPOINT_DIR = "checkpoints"
"""A run's checkpoint root in its run directory when training.checkpoint_dir is not set (train.checkpoint)."""


def layout_key(*, dp: int, tp: int, pp: int, zero_stage: int, virtual_stages: int = 1) -> str:
    """The directory under the checkpoint root that holds one layout's checkpoints ("dp2-tp1-pp1-zero1"):
    the checkpointer writes it, and a sweep's check of configs sharing a checkpoint_dir compares it."""
    # Interleaving puts other layers on each rank: its own key, and the keys of runs without it unchanged.
    chunks = f"-vpp{virtual_stages}" if virtual_stages > 1 else ""
    return f"dp{dp}-tp{tp}-pp{pp}-zero{zero_stage}{chunks}"


OOM_REPORT_GLOB = "oom.rank*.json"
LOG_FILE = "train.log"
"""A run's console output (rank 0's, or all ranks' of a local spawn), in its run directory."""
SUBMITIT_DIR = ".submitit"
"""Per-job folders of submitit (scripts, pickles, Slurm's output) in a launcher's sweep directory
(`launchers calibrate`: beside its --out file)."""
SLURM_LOG_DIR = ".slurm"
"""Slurm's output of an exported array script's tasks, <array>_<task>.out, in the sweep directory."""
CACHE_DIR_ENV = "MEGASWEEP_CACHE_DIR"
"""Environment variable naming the cache directory (tests point it at a temporary one)."""


def rank_log_name(rank: int) -> str:
    """Name of the console output of srun task `rank` > 0 (rank 0's is LOG_FILE)."""
    return LOG_FILE if rank == 0 else f"train.rank{rank}.log"


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where megasweep keeps what it measures once per host: $MEGASWEEP_CACHE_DIR, else
    $XDG_CACHE_HOME/megasweep, else ~/.cache/megasweep (the XDG base directory convention)."""
    env = os.environ if environ is None else environ
    if env.get(CACHE_DIR_ENV):
        return Path(env[CACHE_DIR_ENV])
    base = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME") or Path.home()) / ".cache")
    return Path(base) / "megasweep"


def peak_cache_path(host: str, environ: Mapping[str, str] | None = None) -> Path:
    """The file holding host `host`'s PeakCalibrations (one per cache_key)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", host) or "unknown-host"
    return cache_dir(environ) / f"peak-{safe}.json"


def cpu_info_cache_path(key: str, environ: Mapping[str, str] | None = None) -> Path:
    """The file holding py-cpuinfo's answer for the CPU model whose /proc/cpuinfo identity hashes to `key`."""
    return cache_dir(environ) / f"cpuinfo-{key}.json"


def oom_report_name(rank: int) -> str:
    """Name of the OomReport rank `rank` writes when it runs out of memory."""
    return f"oom.rank{rank}.json"


def attempt_result_name(attempt: int) -> str:
    """Name of the record of attempt `attempt` (0 first) of a run stopped for a requeue."""
    return f"result.attempt{attempt}.json"


ATTEMPT_RECORD_GLOB = "result.attempt*.json"


def earlier_job_name(name: str, job_id: str | None) -> str:
    """Name an earlier job's OOM report or attempt record `name` is kept under when `rerun --failed`
    resubmits its config: outside OOM_REPORT_GLOB and ATTEMPT_RECORD_GLOB, so the new run reads none of
    them as its own."""
    return f"{job_id or 'previous'}.{name}"


def appended_name(name: str, batch: int | str) -> str:
    """Name of sweep file `name` (MULTIRUN_FILE, SEARCH_FILE) as written by the `batch`-th launch (1
    first) that added configs to a sweep (hydra.launcher.append=true), kept beside the first launch's:
    each launch writes its own, which would lose the one the earlier configs were composed from (Hydra's
    config) or ranked by (a search's layouts). multirun.yaml -> multirun.append<batch>.yaml; batch "*"
    gives the glob pattern of them all."""
    path = PurePosixPath(name)
    return f"{path.stem}.append{batch}{path.suffix}"


def previous_result_name(job_id: str | None) -> str:
    """Name a failed run's record is kept under when `rerun --failed` resubmits its config."""
    return f"result.{job_id or 'previous'}.json"


# ---------------------------------------------------------------------------------------------
# Exit codes

EXIT_OK = 0
EXIT_FAILED = 1
"""The run (or a config of the sweep) ran and failed; its record says why."""
EXIT_USAGE = 2
"""Bad input or an infeasible config: nothing ran. One paragraph on stderr says why."""
EXIT_UNFINISHED = 3
"""`python -m launchers status` and `python -m analysis` on a sweep whose configs are still pending or
running, none failed (status) or none yet recommendable (analysis): ask again later, or wait with
`status --wait`. Distinct from 0, which says the sweep is over."""
EXIT_REQUEUE = 75
"""A run stopped by Slurm's signal after its state was saved: EX_TEMPFAIL (sysexits.h, 'try again
later'). The launcher's in-job wrapper requeues on it; the next attempt resumes."""
EXIT_TERMINATED = 143
"""A run stopped by SIGTERM (`kill`, `timeout`, Slurm's end of the time limit) or by Slurm's SIGUSR1
warning before it, without a checkpoint to requeue from, after its record said `timeout`: 128 +
SIGTERM, as a shell reports a command the signal ended. A checkpointing run stopped so exits
EXIT_REQUEUE instead."""
EXIT_INTERRUPTED = 130
"""A run stopped by Ctrl-C (SIGINT) after its record said `interrupted`: 128 + SIGINT, as a shell
reports a command the signal ended, so that scripts around it stop too."""
EXIT_BROKEN_PIPE = 141
"""A command-line tool whose reader went away (`python -m analysis DIR | head`): 128 + SIGPIPE, what a
shell reports of a command SIGPIPE ended, with nothing on stderr (exit_on_broken_pipe)."""


def exit_on_broken_pipe(main: Callable[[], int]) -> NoReturn:
    """sys.exit(main()), but quietly with EXIT_BROKEN_PIPE when stdout's reader has gone: Python turns
    SIGPIPE into BrokenPipeError, which a tool would print as an error (or a traceback) of its own.
    stdout goes to /dev/null first, so that the interpreter's last flush cannot raise it again."""
    code: object
    try:
        try:
            code = main()
        except SystemExit as done:  # argparse's --help and errors: their text is still to be flushed
            code = done.code
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = EXIT_BROKEN_PIPE
    sys.exit(code)


# ---------------------------------------------------------------------------------------------
# Atomic writes


def write_text_atomic(path: str | Path, text: str | bytes) -> None:
    """Replace `path` with `text` (bytes as they are) atomically: a reader sees the old file or the new one.

    The temporary file lives in the same directory, so os.replace is a rename on one file
    system (atomic on POSIX); fsync first so that a crash after the rename cannot leave an
    empty file behind the new name.
    """
    path = Path(path)
    # A unique sibling opened with "x" (not mkstemp, whose 0600 would survive the rename):
    # the file gets the ordinary umask permissions, so other users of the sweep can read it.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(text.encode("utf-8") if isinstance(text, str) else text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | Path, data: Mapping[str, Any]) -> None:
    """Write JSON so that `path` holds either the old content or the whole new one, never a part."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=False, allow_nan=False) + "\n")


# ---------------------------------------------------------------------------------------------
# result.json

STATUSES = ("ok", "oom", "nan", "error", "timeout", "cancelled", "interrupted")
"""Every value a record's `status` can take (`interrupted`: stopped by Ctrl-C, SIGINT; `cancelled`: its Slurm
job was cancelled with scancel, whose SIGTERM the trainer cannot tell from a time limit's: it asks Slurm's
accounting before it writes its record (train.trainer), and the launcher's in-job wrapper asks again once the
trainer has exited and writes it over a `timeout` record, where accounting knew it only later)."""


MEDIAN_FIELDS = ("sec_per_iter", "sec_per_iter_min", "sec_per_iter_max", "sec_per_iter_cv", "samples_per_s",
                 "tokens_per_s_per_device", "tflops_per_device", "tflops_per_device_hardware",
                 "tflops_per_device_megatron_eq3", "mfu", "hfu")  # fmt: skip
"""RunRecord's figures of the measured iterations (their medians and spread, train.trainer._figures): the
run's speed, which a record of any status holds for the iterations it measured before its end."""


@dataclass(frozen=True)
class RunRecord:
    """Everything result.json holds about one run (one record per run, whatever its outcome)."""

    status: str
    """One of STATUSES: ok | oom | nan | error | timeout | cancelled | interrupted."""
    message: str | None
    config: dict[str, Any]
    """The resolved RunConfig (conf.schema.to_plain_dict), credentials scrubbed."""
    overrides: list[str]
    """The run's Hydra task overrides, credentials scrubbed: what ties the record to its config
    (record_matches), whatever directory it lies in."""
    world: dict[str, int]
    """world_size, dp, tp, pp."""
    hardware: str
    device: str | None
    """What the run actually ran on (GPU product name, or 'cpu')."""
    versions: dict[str, str | None]
    git_commit: str | None
    params: int | None
    """Parameters of the model as built (counted once; tied weights once)."""
    optimizer: str | None
    """The Adam implementation that ran (e.g. 'torch.AdamW(fused)')."""
    precision: str
    flops_per_iteration: dict[str, float]
    """model (per-GEMM, MFU), hardware (with recompute, HFU), megatron_eq3 (Megatron-LM Eq. 3), at the full batch."""
    flops_conventions: dict[str, str]
    """What each flops_per_iteration entry counts, in words."""
    iterations_run: int
    warmup_iters: int
    measured_iterations: int
    """Iterations the medians cover: after the warm-up, at the full global batch, and not profiled
    (training.profile_steps, deepspeed_flops_profile) unless all of them were."""
    skipped_iterations: int
    final_loss: float | None
    """The run's last loss, the last of `losses`: this attempt's last iteration's, or the loss its checkpoint
    recorded when it resumed and ran none (at or past train_iters); None when no step's loss is known."""
    sec_per_iter: float | None
    samples_per_s: float | None
    tokens_per_s_per_device: float | None
    tflops_per_device: float | None
    tflops_per_device_hardware: float | None
    tflops_per_device_megatron_eq3: float | None
    mfu: float | None
    hfu: float | None
    max_mem_gib: float | None
    max_mem_gib_per_rank: list[float]
    """Each rank's peak memory (GiB), gathered after the last step; empty where a run of several ranks
    stopped before it (max_mem_gib is then the highest rank's so far)."""
    max_mem_source: str | None
    peak_tflops: float | None
    peak_source: str | None
    """'datasheet' (hardware config) or 'measured' (matmul calibration at run time); None if unknown."""
    losses: list[float] = field(default_factory=list)
    """lm loss of every iteration run (equal losses across layouts of one model are a correctness check)."""
    iteration_times_s: list[float] = field(default_factory=list)
    """Elapsed seconds of every iteration run, warm-up included."""
    global_batch_sizes: list[int] = field(default_factory=list)
    """Global batch of every iteration run (they differ while a batch ramp-up lasts) (samples)."""
    full_batch_reached: bool = True
    """False when a batch ramp-up never reached global_batch_size: the medians are then None."""
    sec_per_iter_min: float | None = None
    """Fastest measured iteration (the iterations sec_per_iter's median covers) (seconds)."""
    sec_per_iter_max: float | None = None
    """Slowest measured iteration (seconds)."""
    sec_per_iter_cv: float | None = None
    """Coefficient of variation of the measured iterations' seconds (std / mean, fraction); None below 2."""
    device_memory_gib: float | None = None
    """Memory of one device as the runtime reports it (GiB; torch.cuda's total_memory), None on a CPU."""
    neighbours: dict[str, Any] = field(default_factory=dict)
    """Other Slurm jobs on this job's nodes: nodes, at_start, at_end (squeue), during (sacct) (job ids); empty outside Slurm."""
    env: dict[str, str] = field(default_factory=dict)
    """Allow-listed environment variables only (NCCL_*, CUDA_*, SLURM job ids, ...)."""
    warnings: list[str] = field(default_factory=list)
    started_at: str | None = None
    wall_s: float | None = None
    micro_batch: dict[str, Any] | None = None
    """micro_batch_size=auto: requested, chosen, predicted, probed sizes and why (None otherwise)."""
    flop_check: dict[str, Any] | None = None
    """training.flop_check: FlopCounterMode's count against the per-GEMM model (None when off)."""
    power: dict[str, Any] | None = None
    """NVML energy over the measured iterations, or why it was not measured."""
    profile: dict[str, Any] | None = None
    """training.profile_steps: the profiler traces written (None when off)."""
    checkpoint: dict[str, Any] | None = None
    """training.save_interval > 0: directory, save mode, saved steps, warnings (None otherwise)."""
    resumed_from_step: int | None = None
    """The checkpoint step this attempt resumed from (None: it started from scratch)."""
    deepspeed_config: str | None = None
    """engine=deepspeed: path of the DeepSpeed config the run used."""
    deepspeed_flops_profile: dict[str, Any] | None = None
    """training.deepspeed_flops_profile: DeepSpeed's figures beside megasweep's FLOPs."""
    tensorboard_dir: str | None = None
    """logger.tensorboard=true: where the event files are."""
    memory: dict[str, Any] | None = None
    """Every rank's memory, predicted beside measured (MemoryReport.to_dict)."""
    oom: dict[str, Any] | None = None
    """Where the run ran out of memory (OomReport.to_dict of the first rank that did)."""
    peak_calibration: dict[str, Any] | None = None
    """hardware.peak_measured: the PeakCalibration behind peak_tflops (spread, host, cache file)."""
    schema_version: int = 3

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; non-finite floats become None (JSON has no NaN). A measurement the run
        did not take (OPTIONAL_FIELDS at None) is left out, and so is resumed_from_step of a run
        that does not checkpoint."""
        data = _finite(asdict(self))
        if self.checkpoint is None:
            del data["resumed_from_step"]
        return {k: v for k, v in data.items() if not (k in OPTIONAL_FIELDS and v is None)}


OPTIONAL_FIELDS = (
    "micro_batch",
    "flop_check",
    "power",
    "profile",
    "checkpoint",
    "deepspeed_config",
    "deepspeed_flops_profile",
    "tensorboard_dir",
    "memory",
    "oom",
    "peak_calibration",
)
"""RunRecord fields present only when the run took that measurement or used that option."""


# ---------------------------------------------------------------------------------------------
# Memory: predicted (train.planner.memory) beside measured (train.memory), in bytes.

MEMORY_COMPONENTS = ("weights", "gradients", "optimizer", "master", "activations_per_micro_batch")
"""Components predicted and measured one for one: the model states counted from the rank's tensors,
and what one micro-batch's forward saves for the backward (saved-tensor hooks)."""


@dataclass(frozen=True)
class RankMemory:
    """One rank's memory in bytes: the planner's prediction beside what the rank held."""

    rank: int
    stage: int
    """Pipeline stage (0-based)."""
    role: str
    """'only', 'first', 'middle' or 'last'."""
    predicted: dict[str, float]
    """MEMORY_COMPONENTS, plus activations (at the peak), overhead, allocated, reserved, total."""
    measured: dict[str, float | None]
    """MEMORY_COMPONENTS (None: not measured), process_baseline, peak_allocated and peak_reserved
    (CUDA caching allocator) or peak_rss (CPU process)."""
    peak_predicted: float | None = None
    """The prediction of what `peak_measured` measures (`peak_compares` says which)."""
    peak_measured: float | None = None
    peak_compares: str = ""
    """Which figures the peak comparison takes, in words."""

    @property
    def peak_ratio(self) -> float | None:
        if not self.peak_predicted or not self.peak_measured:
            return None
        return self.peak_predicted / self.peak_measured


@dataclass(frozen=True)
class MemoryReport:
    """Every rank's RankMemory, and which software stack the prediction models."""

    stack: str
    ranks: list[RankMemory]
    not_measured: str | None = None
    """Why a component was not measured (engine=deepspeed's activations), None when all were."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "stack": self.stack,
            "units": "bytes",
            "ranks": [{**asdict(r), "peak_ratio": r.peak_ratio} for r in self.ranks],
            **({"not_measured": self.not_measured} if self.not_measured else {}),
        }


@dataclass(frozen=True)
class OomReport:
    """What a rank that ran out of memory knew: where it was, what it held, what was predicted."""

    rank: int
    stage: int
    role: str
    iteration: int
    """Iterations finished before it (0: during setup or the first step)."""
    allocated: float | None
    """Bytes its tensors held when it failed (CUDA caching allocator; None on a CPU)."""
    peak: float | None
    """Peak bytes: max allocated (GPU) or peak resident set (CPU)."""
    reserved: float | None
    """Bytes the caching allocator held (GPU; None on a CPU)."""
    predicted: float | None
    """train.planner.memory's allocated + overhead for this rank (what must fit)."""
    capacity: float
    """The device's usable memory (hardware.memory_gib less the margin)."""
    message: str
    """The allocator's own words."""

    def to_dict(self) -> dict[str, Any]:
        return _finite(asdict(self))

    def sentence(self) -> str:
        """One sentence for the record's message."""
        gib = 2**30
        held = self.allocated if self.allocated is not None else self.peak
        what = "allocated" if self.allocated is not None else "peak resident set"
        parts = [f"rank {self.rank} (pipeline stage {self.stage}, {self.role}) ran out of memory"]
        parts.append(f"after {self.iteration} iterations")
        if held is not None:
            parts.append(f"with {held / gib:.2f} GiB {what}")
        if self.predicted is not None:
            parts.append(f"(predicted {self.predicted / gib:.2f} GiB of {self.capacity / gib:.2f} GiB usable)")
        return " ".join(parts)


def read_oom_reports(run_dir: str | Path, *, since: datetime | None = None) -> list[dict[str, Any]]:
    """The OomReports ranks of this run left, lowest rank first: with `since` (the run's start), only
    those written since, as a directory used again keeps an earlier run's (which made every failure of
    the next one an `oom`, and a diverged run exit 0). A second of slack covers file systems whose
    modification times are whole seconds."""
    reports = []
    for path in sorted(Path(run_dir).glob(OOM_REPORT_GLOB)):
        try:
            if since is not None and path.stat().st_mtime < since.timestamp() - 1.0:
                continue
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(data, dict) and "rank" in data:
            reports.append(data)
    return sorted(reports, key=lambda r: int(r["rank"]))


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def unwritable(path: str | Path) -> str | None:
    """Why `path` cannot be created and written (the OS's words), or None when a file was written there.

    The directory is created if need be, as the run or sweep about to write there would create it.
    """
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        # os.access says yes to root on a read-only file system: only a real write proves it.
        fd, probe = tempfile.mkstemp(prefix=".megasweep-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def unwritable_below(path: str | Path) -> str | None:
    """Why a directory at `path` could not be made and written, found without making it (unwritable
    makes it): `path` itself when it is there, else the nearest directory above it, is written to."""
    path = Path(path).absolute()
    there = next(p for p in (path, *path.parents) if p.exists() or p == Path(p.anchor))
    if not there.is_dir():
        return "it is a file" if there == path else f"{there} is a file"
    return unwritable(there)


def read_record(path: str | Path) -> dict[str, Any] | None:
    """A result.json as a dict, or None when it is missing, unreadable or not a record."""
    return load_record(path)[0]


def load_record(path: str | Path) -> tuple[dict[str, Any] | None, str | None]:
    """(the result.json at `path` as a dict, None) when it is a record; else (None, why its content is
    not one: damaged, or no status), or (None, None) when there is none or it cannot be opened."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError:
        return None, None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    if isinstance(data, dict) and "status" in data:
        return data, None
    return None, "not a run's record (no status)"


def recorded_overrides(overrides: Iterable[str]) -> list[str]:
    """What the record of a run launched with `overrides` holds as its overrides: Hydra's own
    (`hydra.*`, `hydra/...`) go to Hydra's node, not to the task, and credentials are scrubbed."""
    return scrub_overrides(o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/")))


def record_matches(record: Mapping[str, Any], overrides: Iterable[str]) -> bool:
    """Whether `record` (a result.json) is the record of the config launched with `overrides`.

    A directory can hold a record of another config: a sweep launched again into the same
    directory, or one whose subdir names collide across sweeps. The record's own overrides say
    which config ran (order-free; credentials compared scrubbed, as the record keeps them). A
    record without overrides (written before they were recorded) is taken at its directory's word.
    """
    recorded = record.get("overrides")
    if not isinstance(recorded, list):
        return True
    return sorted(map(str, recorded)) == sorted(recorded_overrides(overrides))


# ---------------------------------------------------------------------------------------------
# The measured peak, cached per host (train.calibrate)


PEAK_KERNEL = "linear"
"""The op a measured peak is timed with: F.linear(a, b) = a @ b^T, the layout of every GEMM of the model
(nn.Linear). On this repository's CPU, fp16 torch.mm(a, b) ran 10 to 30 times slower than that layout
(0.0008-0.0026 against 0.024 TFLOP/s, one thread, torch 2.13; fp32 and bf16 alike in both), so the
torch.mm peak was below what fp16 training reached: MFU 223%. Part of the cache key, so that a peak
timed another way is measured again."""


def peak_cache_key(*, device: str, precision: str, cores: int, threads: int, torch: str) -> str:
    """Which calibration of a host's cache file fits a run: what changes the peak a matmul reaches."""
    return f"{device}|{precision}|kernel={PEAK_KERNEL}|cores={cores}|threads={threads}|torch={torch}"


@dataclass(frozen=True)
class PeakCalibration:
    """A matmul peak measured on one host: the cache file's entry and the record's peak_calibration."""

    tflops: float
    """The peak: the best trial, since interference only ever slows a trial down (TFLOP/s)."""
    trials_tflops: list[float]
    """Every timed trial's throughput, in order (TFLOP/s)."""
    median_tflops: float
    """Median of the trials (TFLOP/s)."""
    min_tflops: float
    """Slowest trial (TFLOP/s)."""
    cv: float
    """Coefficient of variation of the trials (std / mean, fraction)."""
    matrix_size: int
    """n of the timed n x n by n x n matmul (elements)."""
    seconds: float
    """Wall time of the calibration, warm-up included (seconds)."""
    host: str
    device: str
    """'cpu', or the GPU's product name."""
    precision: str
    cores: int
    """CPUs of the host (os.cpu_count)."""
    threads: int
    """torch intra-op threads the calibration ran with."""
    torch: str
    """torch version."""
    calibrated_at: str
    """When it was measured (ISO 8601, UTC)."""
    cache_file: str | None = None
    """Where it is cached; None when the cache could not be written."""
    from_cache: bool = False
    """True: read from the cache, measured by an earlier run on this host."""

    @property
    def key(self) -> str:
        return peak_cache_key(
            device=self.device, precision=self.precision, cores=self.cores, threads=self.threads, torch=self.torch
        )

    def to_dict(self) -> dict[str, Any]:
        return _finite(asdict(self))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PeakCalibration:
        """A cached entry; ValueError when it is not one (an older or foreign file)."""
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            calibration = cls(**{k: v for k, v in data.items() if k in names})
        except TypeError as exc:
            raise ValueError(f"not a peak calibration: {exc}") from None
        if not (isinstance(calibration.tflops, int | float) and calibration.tflops > 0):
            raise ValueError(f"not a peak calibration: tflops={calibration.tflops!r}")
        return calibration


# ---------------------------------------------------------------------------------------------
# manifest.jsonl
#
# The launchers (and `python -m launchers sbatch`) write one entry per config they were given;
# `python -m launchers status` and the analysis read it to know which configs are still missing
# a result.json.
#
#     {"index": 3, "overrides": ["parallelism.tp=2"], "output_dir": "3", "status": "submitted",
#      "reason": null, "job_id": "1234_3", "shape": {"nodes": 2, "tasks_per_node": 2},
#      "layout": {"model": "gpt_1.3b", "hardware": "a100_80gb", "dp": 4, "tp": 2, ...}}
#
# `layout` (LaunchedLayout) is what the launcher composed for a config it launched: the model, the
# degrees and the batch, so that the analysis shows a config with no result.json yet (pending,
# running, cancelled before it started) in its layout without composing it again. Written for every
# config that was submitted, exported, refused or interrupted; absent from a skipped one and from
# manifests written before it existed, whose such rows stay blank.
#
# An entry's status is one of ENTRY_STATUSES:
#
#     submitted   a job was queued for it (job_id says which; null for the local launcher)
#     exported    written into an array script by `python -m launchers sbatch`, for the user to
#                 submit: no job id is known when the manifest is written. Each array task records
#                 its own job id in <sweep dir>/.megasweep/jobs/<index> when it starts, and
#                 resolve_exported() puts it into the entry for the readers.
#     refused     sbatch refused its job (unknown partition, bad gres): reason holds Slurm's words
#     skipped     infeasible, never submitted: reason holds the rules' paragraph
#     interrupted a local sweep (hydra/launcher=local, or its rerun) was interrupted (Ctrl-C)
#                 before this config started: it never ran, and will not unless rerun
#     failed      it ran on this machine (the local launcher) and its process ended without writing
#                 a result.json (killed: SIGKILL, the kernel's OOM killer): reason says how. No Slurm
#                 state would ever say so, and it would read as pending for ever
#
# One sweep per directory: a launcher or an export refuses a directory that already has a manifest
# unless asked to add to it; added configs take indices after the last one, never an old one's.
# `rerun_of` marks a config added by `rerun --failed <overrides>`: the failed config it replaces.
#
# Manifests written before `refused` existed stored a refused sbatch as `skipped` with a reason
# starting "sbatch refused: "; they are read as `refused`, so that old sweeps report (and rerun)
# them as the failures they are.

ENTRY_STATUSES = ("submitted", "exported", "refused", "skipped", "interrupted", "failed")
REFUSED_PREFIX = "sbatch refused: "
"""How the reason of a `refused` entry starts (and how old manifests marked one, as `skipped`)."""
_JOB_ID = re.compile(r"\d+(_\d+)?")


class ManifestError(ValueError):
    """A manifest line that is not a valid entry (the message names the file and line)."""


@dataclass(frozen=True)
class LocalRun:
    """A `hydra/launcher=local` launch and the configs it has yet to end, in local_run_path's file."""

    host: str
    """Host name of the machine the local launcher runs on."""
    pid: int
    """The local launcher's process id there."""
    started: str | None
    """That process's start time (clock ticks since boot, /proc/<pid>/stat): tells it from a later
    process given the same id; None where there is no /proc."""
    queued: tuple[int, ...]
    """Indices of the launch's configs that have not ended, the running one included, in launch order."""
    running: int | None = None
    """Index of the config it runs now; None between two."""


def local_run_path(sweep_dir: str | Path, host: str, pid: int) -> Path:
    return Path(sweep_dir) / LOCAL_RUNS_DIR / f"{host}.{pid}.json"


def read_local_runs(sweep_dir: str | Path) -> list[LocalRun]:
    """Every LocalRun file of the sweep that reads as one (none: no local launch is live, or left one)."""
    runs = []
    for path in sorted((Path(sweep_dir) / LOCAL_RUNS_DIR).glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            runs.append(LocalRun(str(data["host"]), int(data["pid"]), data.get("started"),
                                 tuple(int(i) for i in data["queued"]), data.get("running")))  # fmt: skip
        except (OSError, ValueError, TypeError, KeyError):
            continue  # being replaced, or not one: as if absent
    return runs


@dataclass(frozen=True)
class LaunchedLayout:
    """What a launched config runs, as the launcher composed and validated it (ManifestEntry.layout): the
    fields the analysis shows and matches layouts by (analysis.records' layout columns and layout_key),
    named as PlanRow's. Read off the composed config, nothing planned (launchers.submit.launched_layout),
    since a launch of thousands of configs must not slow for it; the nodes and tasks are the entry's
    `shape`."""

    model: str
    """model.name."""
    hardware: str
    """hardware.name."""
    dp: int
    """Model replicas: parallelism.dp, or 1 where it is null (as the allocation counts it)."""
    tp: int
    pp: int
    micro_batch_size: int | str
    """Samples per micro-batch, or 'auto': the run picks the size at its start."""
    global_batch_size: int
    seq_length: int
    """model.seq_length (tokens per sample)."""
    params: int
    """Parameters of the whole model (train.planner.sizes.total_params, vocabulary padded for tp)."""
    zero_stage: int = 0
    offload: str = "none"
    recompute: str = "none"
    precision: str = "bf16"
    engine: str = "native"
    virtual_stages: int = 1
    sequence_parallel: bool = False

    def to_json(self) -> dict[str, Any]:
        """The JSON object of ManifestEntry.layout."""
        # By hand, not dataclasses.asdict: a launch writes its manifest after every array, each entry anew.
        return {
            "model": self.model, "hardware": self.hardware, "dp": self.dp, "tp": self.tp, "pp": self.pp,
            "micro_batch_size": self.micro_batch_size, "global_batch_size": self.global_batch_size,
            "seq_length": self.seq_length, "params": self.params, "zero_stage": self.zero_stage,
            "offload": self.offload, "recompute": self.recompute, "precision": self.precision, "engine": self.engine,
            "virtual_stages": self.virtual_stages, "sequence_parallel": self.sequence_parallel,
        }  # fmt: skip

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> LaunchedLayout:
        """The layout of an entry's `layout` object; ManifestError when a field is missing or of the wrong
        type. Fields it does not know (a later launcher's) are left out."""
        if not isinstance(obj, Mapping):
            raise ManifestError(f"layout must be an object, got {obj!r}")
        known = {k: obj[k] for k in _LAYOUT_FIELDS if k in obj}
        missing = [k for k in _LAYOUT_REQUIRED if k not in known]
        if missing:
            raise ManifestError(f"layout lacks {', '.join(missing)}")
        for name, kind in _LAYOUT_TYPES.items():
            value = known.get(name)
            if value is None and name not in _LAYOUT_REQUIRED:
                known.pop(name, None)
            elif not _of_kind(value, kind):
                raise ManifestError(f"layout.{name} must be {kind}, got {value!r}")
        return cls(**known)


_LAYOUT_FIELDS = tuple(f.name for f in dataclasses.fields(LaunchedLayout))
_LAYOUT_REQUIRED = tuple(f.name for f in dataclasses.fields(LaunchedLayout) if f.default is dataclasses.MISSING)
_LAYOUT_TYPES = {
    "model": "a string", "hardware": "a string", "dp": "a positive integer", "tp": "a positive integer",
    "pp": "a positive integer", "micro_batch_size": "a positive integer or 'auto'",
    "global_batch_size": "a positive integer", "seq_length": "a positive integer", "params": "a non-negative integer",
    "zero_stage": "an integer", "offload": "a string", "recompute": "a string", "precision": "a string",
    "engine": "a string", "virtual_stages": "a positive integer", "sequence_parallel": "true or false",
}  # fmt: skip


def _of_kind(value: Any, kind: str) -> bool:
    if kind == "true or false":
        return isinstance(value, bool)
    if kind == "a string":
        return isinstance(value, str)
    whole = isinstance(value, int) and not isinstance(value, bool)
    if kind == "a positive integer or 'auto'":
        return value == "auto" or (whole and value > 0)
    if kind == "a positive integer":
        return whole and value > 0
    if kind == "a non-negative integer":
        return whole and value >= 0
    return whole


@dataclass(frozen=True)
class ManifestEntry:
    """One config of a sweep as the launcher handled it."""

    index: int
    """Position of the config in the sweep (the Slurm array task id when submitted)."""
    overrides: tuple[str, ...]
    """The Hydra overrides of the config (a list in JSON)."""
    output_dir: str
    """The run's output directory, relative to the sweep directory (POSIX separators)."""
    status: str
    """One of ENTRY_STATUSES (see above)."""
    reason: str | None = None
    """Why the config was skipped or refused; where it was exported to; None when submitted."""
    job_id: str | None = None
    """Slurm job id of the run, e.g. '1234_5' for array task 5 of job 1234; None when none is known."""
    shape: Mapping[str, int] = field(default_factory=dict)
    """Slurm allocation of the job, e.g. {'nodes': 2, 'tasks_per_node': 2}."""
    rerun_of: int | None = None
    """Index of the failed config this one reruns with changed fields (`rerun --failed <overrides>`);
    None for a config launched as such. Written only when set."""
    layout: Mapping[str, Any] = field(default_factory=dict)
    """LaunchedLayout.to_json() of the config as the launcher composed it; empty for a skipped config and
    in manifests written before it existed. Kept as the JSON object it was read as: only the analysis (for
    the few configs without a record) and a plain rerun (for its configs' new entries) read it, through
    LaunchedLayout.from_json, and a damaged one costs those configs their layout, not the whole manifest
    (nor every reading of it the cost of checking it). Written only when set."""

    def __post_init__(self) -> None:
        # Validate here so that an entry that exists is always one the other side can read.
        if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
            raise ManifestError(f"index must be a non-negative integer, got {self.index!r}")
        if not all(isinstance(o, str) for o in self.overrides):
            raise ManifestError(f"overrides must be strings, got {list(self.overrides)!r}")
        if self.status not in ENTRY_STATUSES:
            raise ManifestError(f"status must be one of {', '.join(ENTRY_STATUSES)}, got {self.status!r}")
        if not isinstance(self.output_dir, str) or not self.output_dir:
            raise ManifestError(f"output_dir must be a non-empty relative path, got {self.output_dir!r}")
        if self.output_dir.startswith("/"):  # PurePosixPath's is_absolute, without its cost per entry
            raise ManifestError(f"output_dir must be relative to the sweep directory, got {self.output_dir!r}")
        for key, value in self.shape.items():
            if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, int):
                raise ManifestError(f"shape must map names to integers, got {dict(self.shape)!r}")
        if self.rerun_of is not None and (isinstance(self.rerun_of, bool) or not isinstance(self.rerun_of, int)):
            raise ManifestError(f"rerun_of must be a config index or null, got {self.rerun_of!r}")
        # Frozen: normalise through object.__setattr__ so equal entries compare equal whatever their input.
        object.__setattr__(self, "overrides", tuple(self.overrides))
        object.__setattr__(self, "output_dir", normalize_dir(self.output_dir))
        object.__setattr__(self, "shape", dict(self.shape))
        object.__setattr__(self, "layout", dict(self.layout))

    @property
    def nodes(self) -> int | None:
        return self.shape.get("nodes")

    def to_json(self) -> dict[str, Any]:
        """The entry as the JSON object of one manifest line."""
        return {
            "index": self.index,
            "overrides": list(self.overrides),
            "output_dir": self.output_dir,
            "status": self.status,
            "reason": self.reason,
            "job_id": self.job_id,
            "shape": dict(self.shape),
            **({"rerun_of": self.rerun_of} if self.rerun_of is not None else {}),
            **({"layout": self.layout} if self.layout else {}),
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ManifestEntry:
        """Entry from one line's object; ManifestError when a key is missing or of the wrong type."""
        if not isinstance(obj, Mapping):
            raise ManifestError(f"expected a JSON object, got {type(obj).__name__}")
        missing = [k for k in ("index", "overrides", "output_dir", "status") if k not in obj]
        if missing:
            raise ManifestError(f"missing key(s) {', '.join(missing)}")
        overrides = obj["overrides"]
        if not isinstance(overrides, list):
            raise ManifestError(f"overrides must be a list of strings, got {overrides!r}")
        reason, job_id, shape = obj.get("reason"), obj.get("job_id"), obj.get("shape") or {}
        if reason is not None and not isinstance(reason, str):
            raise ManifestError(f"reason must be a string or null, got {reason!r}")
        status = obj["status"]
        if status == "skipped" and reason is not None and reason.startswith(REFUSED_PREFIX):
            status = "refused"  # written before `refused` existed (see above)
        if job_id is not None and not isinstance(job_id, str | int):
            raise ManifestError(f"job_id must be a string or null, got {job_id!r}")
        if not isinstance(shape, Mapping):
            raise ManifestError(f"shape must be an object, got {shape!r}")
        layout = obj.get("layout") or {}
        if not isinstance(layout, Mapping):
            raise ManifestError(f"layout must be an object, got {layout!r}")
        return cls(
            index=obj["index"],
            overrides=tuple(overrides),
            output_dir=obj["output_dir"],
            status=status,
            reason=reason,
            job_id=None if job_id is None else str(job_id),
            shape=shape,
            rerun_of=obj.get("rerun_of"),
            layout=layout,
        )


def normalize_dir(path: str) -> str:
    """A relative directory in one spelling ('./a//b/' -> 'a/b'), so that paths from both sides match."""
    path = path.replace(os.sep, "/")
    if path.startswith("/"):  # PurePosixPath keeps the root ('/' or '//') as a part of its own
        parts = [p for p in PurePosixPath(path).parts if p not in ("", ".")]
    else:  # the same parts, without pathlib's cost (an analysis normalizes every run's directory)
        parts = [p for p in path.split("/") if p not in ("", ".")]
    return "/".join(parts) or "."


def manifest_path(sweep_dir: str | Path) -> Path:
    return Path(sweep_dir) / MANIFEST_FILE


def reruns_of(entries: Iterable[ManifestEntry]) -> dict[int, int]:
    """Each failed config's index -> the index of the config that reruns it with changed fields
    (`rerun --failed <overrides>`, ManifestEntry.rerun_of). A changed rerun the rules refused
    (`skipped`) never ran and stands for nothing: its failed config stays a failure."""
    return {e.rerun_of: e.index for e in entries if e.rerun_of is not None and e.status != "skipped"}


def read_manifest(path: str | Path) -> list[ManifestEntry]:
    """Entries of a manifest file (or of <dir>/manifest.jsonl when given a directory), in file order.

    A last line without its newline that does not parse is a line the launcher is still
    writing: it is ignored. Any other bad line raises ManifestError naming the line.
    """
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST_FILE
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    entries = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        # orjson first: its parse is a third of json's, and each analysis reads a sweep's every entry (an
        # entry's layout doubled the text). A line it refuses, or reads otherwise (an integer past 64 bits
        # becomes a float, which the entry then refuses), is read again by json, whose reading and words stand.
        try:
            entries.append(ManifestEntry.from_json(orjson.loads(line)))
            continue
        except (orjson.JSONDecodeError, ManifestError):
            pass
        last_unterminated = number == len(lines) and not text.endswith("\n")
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            if last_unterminated:
                break
            raise ManifestError(f"{path}:{number}: not JSON ({exc.msg})") from None
        try:
            entries.append(ManifestEntry.from_json(obj))
        except ManifestError as exc:
            raise ManifestError(f"{path}:{number}: {exc}") from None
    return entries


def recorded_job_id(sweep_dir: str | Path, index: int) -> str | None:
    """The job id an exported script's array task recorded for config `index`, or None (not started)."""
    try:
        text = (Path(sweep_dir) / EXPORTED_JOBS_DIR / str(index)).read_text(encoding="utf-8").strip()
    except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError):
        return None
    # Anything else is not what the script writes: better unknown than a wrong job's state.
    return text if _JOB_ID.fullmatch(text) else None


def resolve_exported(entries: Iterable[ManifestEntry], sweep_dir: str | Path) -> list[ManifestEntry]:
    """Entries with each `exported` one's job id filled in from what its array task recorded.

    The status stays `exported` (the job was submitted by hand, not by megasweep); an entry
    whose task has not started yet keeps job_id None.
    """
    out = []
    for e in entries:
        if e.status == "exported" and e.job_id is None:
            job = recorded_job_id(sweep_dir, e.index)
            e = dataclasses.replace(e, job_id=job) if job is not None else e
        out.append(e)
    return out


def write_manifest(entries: Iterable[ManifestEntry], path: str | Path) -> Path:
    """Write the whole manifest atomically (a reader sees the old file or the new one)."""
    path = Path(path)
    text = "".join(json.dumps(e.to_json(), sort_keys=False) + "\n" for e in entries)
    write_text_atomic(path, text)
    return path


def append_manifest(entries: Iterable[ManifestEntry], path: str | Path) -> Path:
    """Append entries, one whole line per write, for a launcher that submits in batches."""
    path = Path(path)
    with open(path, "a", encoding="utf-8") as f:
        for e in entries:
            f.write(json.dumps(e.to_json()) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return path


# ---------------------------------------------------------------------------------------------
# plan.csv

REASON_SEPARATOR = "; "
"""Separator of the reasons (and warnings) in one CSV cell; rule messages never contain it."""


def join_overrides(overrides: Iterable[str]) -> str:
    """A config's overrides in one plan.csv cell (PlanRow.overrides): as typed, space-separated."""
    return " ".join(overrides)


_GROUPED = re.compile(r"['\"(\[{\\]")
"""A character that may group spaces into one override: a quote, an opening bracket, or the backslash
of an escaped character (Hydra's sweepers escape a value's spaces and brackets: `my\\ run`)."""


def split_overrides(text: str) -> list[str]:
    """The overrides join_overrides joined. A Hydra value may hold spaces ('my group', [1, 2],
    ${...}), so spaces inside quotes and brackets do not split: cut at every space, such a value
    was read as two overrides, and its config as another config."""
    if not _GROUPED.search(text):
        return [o for o in text.split(" ") if o]
    out: list[str] = []
    current: list[str] = []
    quote, depth, escaped = "", 0, False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth = max(0, depth - 1)
        elif ch == " " and depth == 0:
            if current:
                out.append("".join(current))
                current = []
            continue
        current.append(ch)
    if current:
        out.append("".join(current))
    return out


@dataclass(frozen=True)
class PlanRow:
    """The plan of one config. Quantities that cannot be computed for an infeasible config are NaN."""

    feasible: bool
    reasons: list[str]
    """'[rule] message' of every broken rule, in the rules' order; empty when feasible."""
    model: str
    hardware: str
    nodes: int
    devices: int
    dp: int
    tp: int
    pp: int
    micro_batch_size: int
    """Samples per micro-batch; for `auto`, the planner's choice (0 when no size fits: see reasons)."""
    global_batch_size: int
    params: int
    """Parameters of the whole model (train.planner.sizes.total_params, vocabulary padded for tp)."""
    mem_gib: float
    """Predicted peak memory per device, worst pipeline stage (GiB)."""
    mem_capacity_gib: float
    """Usable memory per device: capacity minus the reserve (GiB)."""
    quant_efficiency: float
    """FLOPs-weighted tile x wave efficiency of the GEMMs on one rank (0-1)."""
    model_flops_per_iter: float
    """Model FLOPs of one iteration, all devices (no recomputation)."""
    hardware_flops_per_iter: float
    """Hardware FLOPs of one iteration, all devices (recomputed forwards included)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (chunks; > 1: interleaved 1F1B)."""
    sequence_parallel: bool = False
    """Norms and dropout sharded along the sequence under TP (parallelism.sequence_parallel)."""
    recompute: str = "none"
    """Activation recomputation: none, selective or full (parallelism.recompute)."""
    zero_stage: int = 0
    """ZeRO stage, 0-3 (parallelism.zero_stage)."""
    offload: str = "none"
    """What ZeRO keeps in host memory: none, optimizer or params (parallelism.offload)."""
    precision: str = "bf16"
    """Numeric format of the matmuls: bf16, fp16 or fp32 (parallelism.precision)."""
    engine: str = "native"
    """Training engine: native or deepspeed (parallelism.engine)."""
    pred_sec_per_iter: float = float("nan")
    """Seconds per iteration the time model predicts (train.planner.perf; NaN: a figure it needs is unknown)."""
    pred_tflops: float = float("nan")
    """Model TFLOP/s per device at the predicted time."""
    pred_mfu: float = float("nan")
    """pred_tflops over the dense peak for the precision (0-1)."""
    pred_rank: int = 0
    """1 = predicted fastest among the feasible rows of the same work (train.planner.plan.work_key: model and
    its field overrides, global batch, sequence length; 0: unranked)."""
    overrides: str = ""
    """The Hydra overrides that produced the config (join_overrides; split_overrides reads them back)."""
    warnings: list[str] = field(default_factory=list)
    """'[advisory] message' of a layout that runs with a caveat (train.planner.rules.advise)."""
    pred_note: str = ""
    """Why a feasible row has no prediction: the figure or file the time model lacks (empty: predicted)."""
    seq_length: int = 0
    """Tokens per sample (model.seq_length): with the model and global batch, the work a row is ranked
    among (0: a plan written before this column)."""


PLAN_COLUMNS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(PlanRow))
"""plan.csv's columns: the PlanRow fields, in order."""
_LIST_COLUMNS = ("reasons", "warnings")


_PLAN_VALUES = operator.attrgetter(*PLAN_COLUMNS)
_PLAN_LIST_INDICES = frozenset(i for i, name in enumerate(PLAN_COLUMNS) if name in _LIST_COLUMNS)


def _csv_values(row: PlanRow) -> list[object]:
    # One attrgetter call per row, not one getattr per cell: a plan has 10,000 rows of 25 columns.
    return [
        REASON_SEPARATOR.join(value) if i in _PLAN_LIST_INDICES
        # repr keeps every bit of a float, so a round trip is exact.
        else repr(value) if isinstance(value, float) else value
        for i, value in enumerate(_PLAN_VALUES(row))
    ]


def write_plan_csv(rows: Iterable[PlanRow], path: str | Path) -> Path:
    """Write rows to path as CSV, one column per PlanRow field (lists joined by '; '), atomically."""
    out, text = Path(path), io.StringIO()
    writer = csv.writer(text)
    writer.writerow(PLAN_COLUMNS)
    writer.writerows(_csv_values(row) for row in rows)
    write_text_atomic(out, text.getvalue())
    return out


def _parse(name: str, text: str) -> Any:
    kind = PlanRow.__dataclass_fields__[name].type
    if name in _LIST_COLUMNS:
        return text.split(REASON_SEPARATOR) if text else []
    if kind == "bool":
        return text == "True"
    if kind == "int":
        return int(text)
    if kind == "float":
        return float(text)
    return text


def read_plan_csv(path: str | Path, *, bad: list[str] | None = None) -> list[PlanRow]:
    """Rows written by `write_plan_csv`, as PlanRows again (plans written before a column existed
    read with its default). A row that is not one (cut short or run on: a plan copied, or edited by
    hand; a value that does not parse) is ValueError naming its line, or, given `bad`, named there
    ("line N: why") and left out, so that the other rows are read."""
    rows = []

    def left_out(why: str) -> None:
        if bad is None:
            raise ValueError(f"{path}, {why}") from None  # the line says it; csv's or the parse's context adds nothing
        bad.append(why)

    with Path(path).open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        start = 2  # the line the next row starts on (a quoted field may hold line breaks)
        while True:
            try:
                record = next(reader)
            except StopIteration:
                break
            except csv.Error as exc:  # an unbalanced quote, say: nothing after it reads as rows
                left_out(f"line {start} on: {exc}; the rest of the file is not read")
                break
            try:
                # DictReader gives a short row's missing fields None, and a long row's extra ones the key None.
                if None in record or None in record.values():
                    n = sum(v is not None for k, v in record.items() if k is not None) + len(record.get(None) or ())  # type: ignore[call-overload]
                    raise ValueError(f"{n} fields where the header names {len(reader.fieldnames or ())}")
                rows.append(PlanRow(**{k: _parse(k, v) for k, v in record.items() if k in PlanRow.__dataclass_fields__}))
            except (ValueError, TypeError) as exc:
                left_out(f"line {start}: {exc}")
            start = reader.line_num + 1
    return rows
