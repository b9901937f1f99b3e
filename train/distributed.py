"""Process start-up: who am I in the job, and the process group + device mesh.

Three ways a run gets its processes:

- torchrun (or anything that sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT);
- srun, one task per device: SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, the master being the
  first host of the allocation and the port derived from the job id;
- `python -m train parallelism.tp=2 ...` on one machine: `fork_local` forks the world's worker
  processes itself (with torchrun's variables) and supervises them; `spawn_local` does the same
  for any command line.

This module does not import torch at module level: `launch_from_env` and `spawn_local` run in
the parent of a local spawn, which never trains.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from train.contract import EXIT_INTERRUPTED
from train.planner.layout import Layout, LayoutError
from train.preemption import install_interrupt_handler, interrupted

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from conf.schema import ParallelismConfig

SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 40000
"""Ports for srun jobs: BASE + job id mod SPAN, so any two jobs whose ids are less than SPAN apart
(every pair that can share a node in practice) get different ports. Each array task has its own
SLURM_JOB_ID, so array tasks on one node differ too; 20000-59999 stays below Linux's default
ephemeral range (32768-60999 overlaps, but an ephemeral clash fails loudly at bind, not silently)."""

RENDEZVOUS_FD_ENV = "MEGASWEEP_RENDEZVOUS_FD"
"""Set by a local spawn in each worker's environment: in rank 0, the descriptor of the socket the
parent bound to MASTER_PORT, on which rank 0's TCPStore listens; the other ranks connect to that port.
A port only looked up as free (bound, closed, then passed on) could be taken by another process
before rank 0 bound it again: two local runs started together on one machine could be handed the
same port."""

KILL_GRACE_S = 10.0
"""Time the survivors of a failed local spawn get after SIGTERM to write their record, before SIGKILL."""

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in a multi-process job, as its launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str
    """'torchrun' (also our local spawn) or 'slurm'."""
    rendezvous_fd: int | None = None
    """A local spawn's bound rendezvous socket (RENDEZVOUS_FD_ENV): rank 0 listens on it; None
    elsewhere (torchrun and srun: rank 0 binds MASTER_PORT itself)."""


def launch_from_env(env: Mapping[str, str]) -> LaunchEnv | None:
    """The job this process belongs to, or None for a lone process (no launcher, or one task).

    torchrun's variables win over Slurm's: a torchrun inside an sbatch script sets both.
    """
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _whole(env, "WORLD_SIZE", least=1)
        if world <= 1:
            return None
        rank = _whole(env, "RANK", below=("WORLD_SIZE", world))
        return LaunchEnv(
            rank=rank,
            world_size=world,
            local_rank=_whole(env, "LOCAL_RANK", "0"),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_whole(env, "MASTER_PORT", "29500", least=1, below=("", 65536)),
            launcher="torchrun",
            rendezvous_fd=_whole(env, RENDEZVOUS_FD_ENV) if env.get(RENDEZVOUS_FD_ENV) else None,
        )
    if "SLURM_PROCID" in env and (world := _whole(env, "SLURM_NTASKS", "1", least=1)) > 1:
        port = env.get("MASTER_PORT")
        return LaunchEnv(
            rank=_whole(env, "SLURM_PROCID", below=("SLURM_NTASKS", world)),
            world_size=world,
            local_rank=_whole(env, "SLURM_LOCALID", "0"),
            master_addr=env.get("MASTER_ADDR") or slurm_master_addr(env.get("SLURM_JOB_NODELIST", "")),
            master_port=_whole(env, "MASTER_PORT", least=1, below=("", 65536))
            if port
            else slurm_master_port(env.get("SLURM_JOB_ID", "0")),
            launcher="slurm",
        )
    return None


def run_world(par: ParallelismConfig, launch: LaunchEnv | None) -> int | None:
    """The devices a run trains on: its launcher's world (torchrun, srun), else the dp x tp x pp
    workers `python -m train` forks (dp null means 1); None for degrees the rules refuse anyway."""
    if launch is not None:
        return launch.world_size
    try:
        return Layout.of(par).world_size
    except LayoutError:
        return None


class LaunchEnvError(ValueError):
    """A launcher's variable (torchrun's, Slurm's) that is not what a launcher sets: one line naming it."""


def _whole(
    env: Mapping[str, str], name: str, default: str | None = None, *, least: int = 0, below: tuple[str, int] | None = None
) -> int:
    """Variable `name` of `env` as a whole number of at least `least` (and below the other variable
    `below` names, with its value); LaunchEnvError naming it otherwise, not int()'s traceback."""
    text = env.get(name, default)
    try:
        value = int(str(text))
    except ValueError:
        value = None
    if value is None or value < least or (below is not None and value >= below[1]):
        bound = "" if below is None else f" and below {below[0]}={below[1]}" if below[0] else f" and below {below[1]}"
        raise LaunchEnvError(
            f"{name}={text!r} in the environment: a launcher (torchrun, srun) sets it to a whole number of at "
            f"least {least}{bound}; unset it to run one process, or start the run with the launcher"
        )
    return value


def slurm_master_port(job_id: str) -> int:
    """The rendezvous port of a Slurm job (see SLURM_PORT_SPAN); array ids like '123_4' use the task's
    own SLURM_JOB_ID when Slurm gives one, else job and task combined."""
    digits = [int(part) for part in re.findall(r"\d+", job_id)] or [0]
    key = digits[0] + sum(digits[1:]) * 7919  # '123_4' and '124_3' must not meet
    return SLURM_PORT_BASE + key % SLURM_PORT_SPAN


def slurm_master_addr(nodelist: str) -> str:
    """First host of a Slurm node list: `scontrol show hostnames` (the authority), else our parser."""
    if not nodelist:
        return "127.0.0.1"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.split()
        if out:
            return out[0]
    return first_host(nodelist)


def first_host(nodelist: str) -> str:
    """First host of a compressed node list ('gpu[003-005,9],cpu1' -> 'gpu003'), zero padding kept."""
    match = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?", nodelist.strip())
    if match is None or not match.group(0):
        raise ValueError(f"cannot parse Slurm node list {nodelist!r}")
    prefix, ranges = match.group(1), match.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


# ---------------------------------------------------------------------------------------------
# The process group and the mesh (in the workers).


def init_process_group(launch: LaunchEnv, *, device_type: str, timeout_s: float) -> None:
    """gloo on CPU, nccl on CUDA; every collective is bounded by `timeout_s`."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    # torchrun's variables, also under srun: libraries that join the group read them (DeepSpeed
    # refuses to start without LOCAL_RANK).
    for key, value in (
        ("MASTER_ADDR", launch.master_addr),
        ("MASTER_PORT", launch.master_port),
        ("RANK", launch.rank),
        ("WORLD_SIZE", launch.world_size),
        ("LOCAL_RANK", launch.local_rank),
    ):
        os.environ.setdefault(key, str(value))
    backend, timeout = "nccl" if device_type == "cuda" else "gloo", timedelta(seconds=timeout_s)
    if launch.rendezvous_fd is None:
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=timeout,
        )
        return
    # A local spawn: rank 0 serves the store on the socket the parent bound, the others connect to it.
    # Every rank passes its store itself, so all use the same (unprefixed) keys.
    store = dist.TCPStore(
        launch.master_addr,
        launch.master_port,
        launch.world_size,
        is_master=launch.rank == 0,
        timeout=timeout,
        master_listen_fd=launch.rendezvous_fd if launch.rank == 0 else None,
    )
    dist.init_process_group(backend=backend, store=store, rank=launch.rank, world_size=launch.world_size, timeout=timeout)


_hold_rendezvous_output = False
"""Set in a forked local worker (`_run_forked`): its rendezvous is local and short, so what it prints
meanwhile can wait for its end (`rendezvous_output_held`). Under torchrun or srun a rendezvous may wait
minutes for another node, and its retry warnings are worth seeing as they come."""


@contextlib.contextmanager
def rendezvous_output_held() -> Iterator[None]:
    """In a forked local worker, hold what is written to stderr (file descriptor 2: c10d's C++ logging
    too) while process groups are created, and drop it if Ctrl-C came meanwhile: a SIGINT in a
    rendezvous makes c10d log about 40 lines of C++ frames per rank ("TCPStore ... Interrupted system
    call") about an interruption the run's one line already reports. Otherwise it is passed on."""
    if not _hold_rendezvous_output:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if not interrupted():
                held.seek(0)
                sys.stderr.buffer.write(held.read())
                sys.stderr.flush()


def cpu_threads(environ: Mapping[str, str]) -> int | None:
    """torch's intra-op thread count for this process: the CPUs Slurm gave the task
    (SLURM_CPUS_PER_TASK), unless OMP_NUM_THREADS says otherwise; None leaves torch's default.

    torch otherwise starts one thread per core of the node whatever the allocation, so the tasks
    of a node (and the jobs sharing it) oversubscribe its cores."""
    if environ.get("OMP_NUM_THREADS") or not environ.get("SLURM_CPUS_PER_TASK"):
        return None
    try:
        return max(1, int(environ["SLURM_CPUS_PER_TASK"]))
    except ValueError:
        return None


def build_mesh(device_type: str, *, pp: int, dp: int, tp: int) -> DeviceMesh:
    """Megatron's rank order: TP fastest (neighbouring ranks, one node), then DP, then PP."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))


def destroy_process_group() -> None:
    """Destroy the default process group, after freeing what still refers to it. What a run built and
    dropped (reference cycles through autograd and DTensor, train.dp's hooks) is otherwise freed in
    the interpreter's teardown, after the group, where gloo's threads sometimes end the process with
    "terminate called without an active exception" (SIGABRT): test_dp's ranks did 9 times in 180,
    and a rank of test_memory's tp=2 layout once in CI."""
    import gc

    import torch.distributed as dist

    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Local spawn (in the parent).


def how_it_ended(code: int | None) -> str:
    """A worker's end in words: 'exited with code N', or for a negative status (os.waitpid's way of
    saying a signal ended it) the signal, named; SIGKILL is what the kernel's out-of-memory killer
    sends when host memory runs out ("exited with -9" named no cause)."""
    if code is None or code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return f"was killed by signal {-code}"
    oom = ", as the kernel's out-of-memory killer does when host memory runs out" if -code == signal.SIGKILL else ""
    return f"was killed by {name} (signal {-code}{oom})"


@dataclass(frozen=True)
class SpawnResult:
    """How a local spawn ended: 0 when every worker exited 0."""

    returncode: int
    failed_rank: int | None
    """The first worker seen to fail (the cause; the others were ended because of it)."""
    failed_code: int | None
    returncodes: tuple[int | None, ...]
    stopped_by: int | None = None
    """The signal (SIGTERM, SIGINT) that made the parent end the workers; None when none did."""


def free_port() -> int:
    """A port free at this moment (for tests that start their own ranks; a local spawn binds its own)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _rendezvous_socket() -> socket.socket:
    """A socket bound to a free local port, kept bound until rank 0's store listens on it
    (RENDEZVOUS_FD_ENV); inheritable, so the workers get it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.set_inheritable(True)
    return sock


class _Forked:
    """A forked worker with the slice of subprocess.Popen's interface `_supervise` uses.

    Its exit status is reaped under a lock: the supervisor polls while a waiter thread waits, and
    a pid can be reaped only once."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped elsewhere (cannot happen under the lock)
                    return self.returncode
                if pid == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
            time.sleep(0.02)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_Worker = subprocess.Popen[bytes] | _Forked


def _worker_env(base: Mapping[str, str], *, rank: int, world_size: int, rendezvous: socket.socket) -> dict[str, str]:
    env = {
        **base,
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(rendezvous.getsockname()[1]),
        RENDEZVOUS_FD_ENV: str(rendezvous.fileno()),
    }
    # As torchrun does: workers sharing a machine each default to one intra-op thread, not one
    # per core each (oversubscribed, they spin against each other); an explicit setting wins.
    if world_size > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def spawn_local(
    argv: Sequence[str],
    *,
    world_size: int,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    poll_s: float = 0.2,
    grace_s: float = KILL_GRACE_S,
) -> SpawnResult:
    """Run `argv` as `world_size` worker processes on this machine and wait for all of them.

    The first worker to exit non-zero ends the others: SIGTERM (the trainer turns it into a record),
    then SIGKILL after `grace_s` for a worker stuck in a collective. A SIGTERM/SIGINT to this parent
    is forwarded the same way, and each worker dies with the parent (PR_SET_PDEATHSIG) even if the
    parent is SIGKILLed, so no worker outlives its run.
    """
    base = dict(os.environ if env is None else env)
    with _rendezvous_socket() as rendezvous:
        procs: list[_Worker] = [
            subprocess.Popen(
                list(argv),
                env=_worker_env(base, rank=rank, world_size=world_size, rendezvous=rendezvous),
                cwd=cwd,
                preexec_fn=_die_with_parent,
                pass_fds=(rendezvous.fileno(),) if rank == 0 else (),
            )
            for rank in range(world_size)
        ]
    return _supervise(procs, poll_s=poll_s, grace_s=grace_s)


def fork_local(
    worker: Callable[[], int],
    *,
    world_size: int,
    poll_s: float = 0.2,
    grace_s: float = KILL_GRACE_S,
) -> SpawnResult:
    """spawn_local's supervision for `world_size` forks of this process, each returning worker()'s
    exit status (1 after an uncaught exception, whose traceback it prints).

    Why fork: the parent has already imported torch and the trainer, composed and checked the
    config; a forked worker starts with all of it, where a fresh `python -m train` pays several
    seconds of imports each (8 workers: most of a short run). The parent must not have touched
    CUDA or run a parallel CPU kernel before (it never does: it only plans and imports).
    """
    rendezvous = _rendezvous_socket()
    base = dict(os.environ)
    sys.stdout.flush()
    sys.stderr.flush()
    procs: list[_Worker] = []
    # Ctrl-C and SIGTERM wait (blocked, pending) until _supervise forwards them and each worker has its
    # own handlers: one arriving mid-fork would otherwise raise in an at-fork hook ("Exception
    # ignored ... KeyboardInterrupt") or leave the parent without the workers it started.
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        for rank in range(world_size):
            pid = os.fork()
            if pid == 0:  # the worker
                env = _worker_env(base, rank=rank, world_size=world_size, rendezvous=rendezvous)
                if rank != 0:
                    rendezvous.close()  # rank 0's alone: a peer must not keep the port once rank 0 is gone
                os._exit(_run_forked(worker, env))
            procs.append(_Forked(pid))
        rendezvous.close()  # the workers have it: rank 0 listens on it
        return _supervise(procs, poll_s=poll_s, grace_s=grace_s)
    except BaseException:
        # A fork refused (EAGAIN, ENOMEM): the workers started so far would wait in their rendezvous
        # for peers that never come.
        _end_all(procs, grace_s=grace_s)
        raise
    finally:
        rendezvous.close()
        # _supervise unblocks them once its handlers are in place; on any other way out a parent left
        # with them blocked would pass that mask on to every process it starts later.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)


_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def _stop_signalled(fd: int) -> int | None:
    """The stop signal (SIGTERM, SIGINT) this process received so far, from the bytes Python's C-level
    handler wrote to its wakeup fd (signal.set_wakeup_fd) as each arrived; None if none did."""
    received = b""
    with contextlib.suppress(BlockingIOError, OSError):
        while chunk := os.read(fd, 512):
            received += chunk
    return next((sig for sig in received if sig in _STOP_SIGNALS), None)


def _run_forked(worker: Callable[[], int], env: Mapping[str, str]) -> int:
    global _hold_rendezvous_output
    code = 1
    # Every signal with a Python handler leaves a byte here the moment it arrives, even while the
    # worker is blocked in C++ (a gloo collective) and before that handler has run.
    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_r, False)
    os.set_blocking(wakeup_w, False)
    try:
        _die_with_parent()
        _hold_rendezvous_output = True
        signal.set_wakeup_fd(wakeup_w, warn_on_full_buffer=False)
        # The parent's handlers forward signals to workers; a worker gets the default SIGTERM back
        # (the trainer installs its own) and Ctrl-C as the trainer takes it (a record, then exit).
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        install_interrupt_handler()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # blocked by fork_local
        os.environ.clear()
        os.environ.update(env)
        torch = sys.modules.get("torch")
        if torch is not None and env.get("OMP_NUM_THREADS"):
            # OpenMP read the parent's environment when torch was imported; say it again here.
            torch.set_num_threads(max(1, int(env["OMP_NUM_THREADS"])))
        code = worker()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED  # the trainer's record says so; a traceback would say nothing more
    except BaseException:
        stopped = _stop_signalled(wakeup_r)
        if stopped is None:
            traceback.print_exc()
            code = 1
        else:
            # Told to stop, the ranks stop at slightly different moments: one still in a collective
            # fails when a peer that stopped first closes its connection ("Connection closed by
            # peer"). The parent's one line and rank 0's record say what happened; this is its echo.
            code = 128 + stopped
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
    return code


def _supervise(procs: Sequence[_Worker], *, poll_s: float, grace_s: float) -> SpawnResult:
    world_size = len(procs)
    # One waiter thread per worker records exit order: a worker that dies makes its peers fail
    # a few milliseconds later, and only the first one is the cause worth reporting.
    exits: list[int] = []

    def wait_for(rank: int) -> None:
        procs[rank].wait()
        exits.append(rank)

    for rank in range(world_size):
        threading.Thread(target=wait_for, args=(rank,), daemon=True).start()
    stop_requested: list[int] = []

    def forward(signum: int, frame: object) -> None:
        stop_requested.append(signum)

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # fork_local's, now that they are forwarded
    failed_rank: int | None = None
    try:
        while any(p.poll() is None for p in procs):
            failed_rank = next((r for r in list(exits) if procs[r].returncode != 0), None)
            if failed_rank is not None or stop_requested:
                # The signal the parent got goes on to the workers: Ctrl-C stays an interruption.
                _end_all(procs, grace_s=grace_s, sig=stop_requested[0] if stop_requested else signal.SIGTERM)
                break
            time.sleep(poll_s)
    finally:
        if any(p.poll() is None for p in procs):
            _end_all(procs, grace_s=grace_s)
        for sig, handler in old.items():
            signal.signal(sig, handler)
    codes = tuple(p.returncode for p in procs)
    if failed_rank is None:
        ordered = list(exits) + [r for r in range(world_size) if r not in exits]
        failed_rank = next((r for r in ordered if codes[r] != 0), None)
    failed_code = None if failed_rank is None else codes[failed_rank]
    # A worker ended by a signal has a negative code; the parent's exit status must stay positive.
    returncode = 0 if failed_rank is None else (failed_code if failed_code and failed_code > 0 else 1)
    return SpawnResult(
        returncode=returncode,
        failed_rank=failed_rank,
        failed_code=failed_code,
        returncodes=codes,
        stopped_by=stop_requested[0] if stop_requested else None,
    )


def _end_all(procs: Sequence[_Worker], *, grace_s: float, sig: int = signal.SIGTERM) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _die_with_parent() -> None:
    # Linux only; elsewhere a SIGKILLed parent can leave workers, which then end at their
    # collective timeout.
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
