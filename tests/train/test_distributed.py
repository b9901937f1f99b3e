"""train.distributed: who a process is in its job, and the supervised local spawn.

The end-to-end test starts real gloo workers through `python -m train` and kills one mid-run.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from train import distributed
from train.distributed import (
    SLURM_PORT_BASE,
    SLURM_PORT_SPAN,
    LaunchEnvError,
    first_host,
    free_port,
    how_it_ended,
    launch_from_env,
    slurm_master_port,
    spawn_local,
)

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "model.num_layers=4",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=32",
    "model.vocab_size=512",
    "model.make_vocab_size_divisible_by=64",
    "parallelism.micro_batch_size=2",
    "parallelism.global_batch_size=8",
    "parallelism.precision=fp32",
    "training.train_iters=3",
    "training.warmup_iters=1",
    "logger=disabled",
    "hardware.peak_measured=false",
    "hardware.peak_tflops_fp32=1.0",
]


def with_overrides(base: Sequence[str], *new: str) -> list[str]:
    """`base` with the keys `new` sets replaced by its values (Hydra refuses one key twice)."""
    keys = {o.split("=", 1)[0] for o in new}
    return [*(o for o in base if o.split("=", 1)[0] not in keys), *new]


def worker_env(**extra: str) -> dict[str, str]:
    """The test's environment without any launcher variables, one thread per worker (2 cores)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        and not k.startswith("SLURM_")
    }
    return {**env, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", **extra}


def run_train(
    out: Path, *overrides: str, env: Mapping[str, str] | None = None, check: bool = True
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """`python -m train <overrides> hydra.run.dir=<out>` as a user runs it (worker_env unless `env`
    is given): the finished process and its result.json. check=True first asserts it exited 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "train", *overrides, f"hydra.run.dir={out}"],
        cwd=REPO,
        env=dict(env) if env is not None else worker_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    record: dict[str, Any] = json.loads((out / "result.json").read_text())
    return proc, record


def test_lone_process_has_no_launch() -> None:
    assert launch_from_env({}) is None
    assert launch_from_env({"RANK": "0", "WORLD_SIZE": "1"}) is None
    # An sbatch script's single task: the trainer spawns its own workers instead.
    assert launch_from_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None


def test_torchrun_env() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "1234"}
    launch = launch_from_env({**env, "SLURM_PROCID": "0", "SLURM_NTASKS": "2"})  # torchrun wins
    assert launch is not None
    assert (launch.rank, launch.world_size, launch.local_rank) == (3, 4, 1)
    assert (launch.master_addr, launch.master_port, launch.launcher) == ("n1", 1234, "torchrun")


@pytest.mark.parametrize(
    ("env", "words"),
    [({"RANK": "0", "WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' in the environment: a launcher (torchrun, srun) sets it to "
                                          "a whole number of at least 1;"),
     ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK='4' in the environment: a launcher (torchrun, srun) sets it to a whole "
                                        "number of at least 0 and below WORLD_SIZE=4;"),
     ({"RANK": "1", "WORLD_SIZE": "4", "MASTER_PORT": "x"}, "MASTER_PORT='x' in the environment"),
     ({"SLURM_PROCID": "-1", "SLURM_NTASKS": "2"}, "SLURM_PROCID='-1' in the environment")],
)  # fmt: skip
def test_a_launchers_variable_that_is_not_a_whole_number_is_named(env: dict[str, str], words: str) -> None:
    # int()'s "invalid literal for int() with base 10" was a traceback from `python -m train`.
    with pytest.raises(LaunchEnvError) as refused:
        launch_from_env(env)
    assert str(refused.value).startswith(words) and "unset it to run one process" in str(refused.value)


def test_srun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # No scontrol on PATH: the node list is parsed by our own fallback.
    monkeypatch.setenv("PATH", "/nonexistent")
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_NODELIST": "gpu[007-010]",
        "SLURM_JOB_ID": "4242",
    }
    launch = launch_from_env(env)
    assert launch is not None
    assert (launch.rank, launch.world_size, launch.local_rank, launch.launcher) == (5, 8, 1, "slurm")
    assert launch.master_addr == "gpu007"
    assert launch.master_port == SLURM_PORT_BASE + 4242
    assert launch_from_env({**env, "MASTER_PORT": "999"}).master_port == 999  # type: ignore[union-attr]


def test_joining_an_srun_world_exports_torchruns_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    # Under srun only SLURM_* are set; DeepSpeed (and other libraries) read torchrun's names.
    import torch.distributed as dist

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        # set, then delete: monkeypatch then removes what init_process_group exports at teardown
        # (a bare delenv of an absent key records nothing, and the variables would leak into the
        # processes later tests start).
        monkeypatch.setenv(key, "unset")
        monkeypatch.delenv(key)
    port = free_port()
    launch = distributed.LaunchEnv(
        rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=port, launcher="slurm"
    )
    distributed.init_process_group(launch, device_type="cpu", timeout_s=30)
    try:
        assert dist.get_world_size() == 1
        assert {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")} == {
            "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_PORT": str(port)
        }
    finally:
        distributed.destroy_process_group()


def test_cpu_threads_follow_the_slurm_allocation() -> None:
    assert distributed.cpu_threads({"SLURM_CPUS_PER_TASK": "10"}) == 10
    # An explicit OMP_NUM_THREADS (the user's, or torchrun's) wins; outside Slurm torch decides.
    assert distributed.cpu_threads({"SLURM_CPUS_PER_TASK": "10", "OMP_NUM_THREADS": "4"}) is None
    assert distributed.cpu_threads({}) is None
    assert distributed.cpu_threads({"SLURM_CPUS_PER_TASK": "x"}) is None


def test_first_host_parser() -> None:
    assert first_host("node1") == "node1"
    assert first_host("node[1-3,7]") == "node1"
    assert first_host("gpu[003-005,9],cpu1") == "gpu003"  # zero padding kept
    assert first_host("a1,b[2-3]") == "a1"


def test_slurm_ports_differ_between_jobs_and_array_tasks() -> None:
    ports = {slurm_master_port(str(job)) for job in range(100_000, 100_500)}
    assert len(ports) == 500 and all(SLURM_PORT_BASE <= p < SLURM_PORT_BASE + SLURM_PORT_SPAN for p in ports)
    assert slurm_master_port("123_4") != slurm_master_port("124_3")


def test_spawn_local_ends_survivors_of_a_failed_worker() -> None:
    # Rank 1 fails at once; ranks 0 and 2 would sleep a minute. Rank 2 ignores SIGTERM, as a
    # worker stuck in a collective does, so it must be SIGKILLed after the grace period.
    script = (
        "import os, signal, sys, time\n"
        "r = int(os.environ['RANK'])\n"
        "assert os.environ['WORLD_SIZE'] == '3' and os.environ['MASTER_ADDR'] == '127.0.0.1'\n"
        "if r == 2: signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "if r == 1: time.sleep(0.5); sys.exit(3)\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    result = spawn_local([sys.executable, "-c", script], world_size=3, env=worker_env(), grace_s=1.0)
    assert time.monotonic() - start < 20  # bounded: far below the workers' 60 s
    assert (result.failed_rank, result.failed_code, result.returncode) == (1, 3, 3)
    assert result.returncodes[0] is not None and result.returncodes[0] < 0  # ended by SIGTERM
    assert result.returncodes[2] == -9  # SIGKILL after the grace period


def test_spawn_local_success() -> None:
    script = "import os, sys; sys.exit(0 if int(os.environ['LOCAL_RANK']) < 2 else 1)"
    assert spawn_local([sys.executable, "-c", script], world_size=2, env=worker_env()).returncode == 0
    failed = spawn_local([sys.executable, "-c", script], world_size=3, env=worker_env())
    assert (failed.failed_rank, failed.returncode) == (2, 1)
    # One intra-op thread per worker by default (as torchrun), the caller's setting otherwise.
    threads = "import os, sys; sys.exit(0 if os.environ['OMP_NUM_THREADS'] == sys.argv[1] else 1)"
    env = {k: v for k, v in worker_env().items() if k != "OMP_NUM_THREADS"}
    assert spawn_local([sys.executable, "-c", threads, "1"], world_size=2, env=env).returncode == 0
    assert spawn_local([sys.executable, "-c", threads, "3"], world_size=2, env={**env, "OMP_NUM_THREADS": "3"}).returncode == 0


def test_a_refused_fork_ends_the_workers_started_and_leaves_no_signal_blocked() -> None:
    # The second fork of three fails (EAGAIN: a process limit; os.fork made to fail in a fresh
    # interpreter, since such a limit does not bind root). fork_local blocks SIGINT and SIGTERM while it
    # forks: left blocked, every process the caller starts later would inherit them blocked.
    script = (
        "import errno, os, signal, sys, time\n"
        "from train import distributed\n"
        "real_fork, forks, pids = os.fork, [], []\n"
        "def fork():\n"
        "    forks.append(1)\n"
        "    if len(forks) == 2: raise OSError(errno.EAGAIN, 'Resource temporarily unavailable')\n"
        "    pid = real_fork()\n"
        "    if pid: pids.append(pid)\n"
        "    return pid\n"
        "os.fork = fork\n"
        "try:\n"
        "    distributed.fork_local(lambda: time.sleep(60) or 0, world_size=3, grace_s=1.0)\n"
        "except OSError as exc:\n"
        "    print('refused', exc.errno == errno.EAGAIN)\n"
        "print('blocked', sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])))\n"
        "for pid in pids:\n"
        "    try: os.waitpid(pid, os.WNOHANG); print('left', pid)\n"
        "    except ChildProcessError: print('ended', pid)\n"
    )
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:2] == ["refused True", "blocked []"], proc.stdout
    assert len(lines) == 3 and lines[2].startswith("ended "), proc.stdout  # the one worker forked, reaped
    assert time.monotonic() - start < 30  # not the worker's 60 s


def test_a_worker_that_fails_after_it_was_told_to_stop_prints_no_traceback(tmp_path: Path) -> None:
    # SIGTERM reaches every worker at once, but they stop at slightly different moments: one still
    # blocked in a gloo collective (where its Python handler cannot run) fails when a peer that
    # stopped first closes the connection. That failure is an echo of the stop (the parent prints
    # the one line), not a traceback; a worker that fails without being told to stop still prints one.
    script = (
        "import os, signal, sys, threading, time\n"
        "from train import distributed\n"
        "def worker():\n"
        "    told = []\n"
        "    signal.signal(signal.SIGTERM, lambda *_: told.append(1))  # as the trainer's, too late\n"
        "    open(os.path.join(sys.argv[2], str(os.getpid())), 'w').close()  # its handler is in\n"
        "    while sys.argv[1] == 'stop' and not told: time.sleep(0.01)\n"
        "    raise RuntimeError('Connection closed by peer')\n"
        "def stop_once_both_listen():\n"
        "    # the workers' handlers, and the parent's that forwards the signal to them\n"
        "    while len(os.listdir(sys.argv[2])) < 2 or signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:\n"
        "        time.sleep(0.01)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "if sys.argv[1] == 'stop':\n"
        "    threading.Thread(target=stop_once_both_listen, daemon=True).start()\n"
        "result = distributed.fork_local(worker, world_size=2, grace_s=5.0)\n"
        "print('codes', sorted(result.returncodes), 'stopped_by', result.stopped_by)\n"
    )
    # SIGTERM once both workers and the parent have their handlers in (a fixed delay, 1 s until
    # 2026-11-27, would stop a start slower than it before).
    (tmp_path / "stop").mkdir()
    (tmp_path / "fail").mkdir()
    stopped = subprocess.run([sys.executable, "-c", script, "stop", str(tmp_path / "stop")], cwd=REPO,
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert stopped.returncode == 0, stopped.stderr
    assert "Traceback" not in stopped.stderr and "Connection closed" not in stopped.stderr, stopped.stderr
    assert stopped.stdout.split() == ["codes", "[143,", "143]", "stopped_by", str(int(signal.SIGTERM))], stopped.stdout
    failed = subprocess.run([sys.executable, "-c", script, "fail", str(tmp_path / "fail")], cwd=REPO,
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert failed.stderr.count("RuntimeError: Connection closed by peer") >= 1, failed.stderr
    assert "Traceback" in failed.stderr, failed.stderr
    # The first failure makes the parent stop the other worker, which may then end as told to: 143 once
    # its handler is in, killed by the signal (-15) when it came before the worker installed one (CI on
    # f6459fc, 2026-11-27: "codes [-15, 1]"), or failing the same way itself (1).
    assert failed.stdout.startswith("codes ["), failed.stdout + failed.stderr
    codes = ast.literal_eval(failed.stdout.split("codes ", 1)[1].split(" stopped_by", 1)[0])
    assert 1 in codes and set(codes) <= {1, 128 + signal.SIGTERM, -signal.SIGTERM}, failed.stdout


RENDEZVOUS_HELD = (
    "import errno, os, socket, sys, time\n"
    "from train import distributed\n"
    "launch = distributed.launch_from_env(os.environ)\n"
    "if launch.rank == 1:\n"
    "    # Before rank 0 has done anything (it waits), the port is taken: no other process can get it.\n"
    "    with socket.socket() as s:\n"
    "        try:\n"
    "            s.bind(('127.0.0.1', launch.master_port))\n"
    "            sys.exit(9)\n"
    "        except OSError as exc:\n"
    "            assert exc.errno == errno.EADDRINUSE, exc\n"
    "else:\n"
    "    time.sleep(1.0)\n"
    "import torch, torch.distributed as dist\n"
    "distributed.init_process_group(launch, device_type='cpu', timeout_s=60)\n"
    "t = torch.ones(1) * (launch.rank + 1)\n"
    "dist.all_reduce(t)\n"
    "dist.destroy_process_group()\n"
    "sys.exit(0 if t.item() == 3 else 8)\n"
)
"""A local spawn's two ranks: rank 1 finds MASTER_PORT bound before rank 0 starts, then both meet there."""


def test_a_local_spawns_rendezvous_port_is_held_from_before_the_workers_start() -> None:
    # A port looked up as free and bound again later by rank 0 could be taken meanwhile (by another
    # local run's rank 0), and the rendezvous would fail. The parent now binds it and rank 0's store
    # listens on that socket.
    result = spawn_local([sys.executable, "-c", RENDEZVOUS_HELD], world_size=2, env=worker_env())
    assert (result.returncode, result.returncodes) == (0, (0, 0)), result
    script = f"import sys; from train import distributed; sys.exit(distributed.fork_local(lambda: exec({RENDEZVOUS_HELD!r}) or 0, world_size=2).returncode)"
    forked = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=120)
    assert forked.returncode == 0, forked.stdout + forked.stderr


def test_free_port_is_bindable() -> None:
    import socket

    port = distributed.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_worker_a_signal_ended_is_said_so() -> None:
    # A worker the kernel's OOM killer ended was "exited with -9", a status no process exits with.
    assert how_it_ended(17) == "exited with code 17"
    assert how_it_ended(-9) == (
        "was killed by SIGKILL (signal 9, as the kernel's out-of-memory killer does when host memory runs out)"
    )
    assert how_it_ended(-15) == "was killed by SIGTERM (signal 15)"
    assert how_it_ended(-200) == "was killed by signal 200"


@pytest.mark.slow
def test_killed_worker_ends_the_run_with_an_error_record(tmp_path: Path) -> None:
    # Rank 1 exits abruptly at the start of iteration 2: rank 0 is then blocked in (or entering)
    # a collective. The run must end well within the collective timeout, with an error record.
    env = worker_env(MEGASWEEP_FAULT_EXIT="1:2")
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "train",
            *TINY,
            "parallelism.dp=2",
            "training.collective_timeout_s=120",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert time.monotonic() - start < 100, "ended by the collective timeout, not by the supervisor"
    assert proc.returncode != 0
    assert "worker rank 1 exited with code 17" in proc.stderr
    record = json.loads((tmp_path / "result.json").read_text())
    assert record["status"] == "error"
    assert record["message"].startswith("worker rank 1 exited with code 17")
    assert record["world"]["world_size"] == 2 and len(record["losses"]) == 1  # iteration 1 ran
    # Stopped before every rank's peak was gathered: no list of one figure posing as two ranks'.
    assert record["max_mem_gib_per_rank"] == [] and record["max_mem_gib"] > 0, record["max_mem_gib_per_rank"]
