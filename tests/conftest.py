"""Shared pytest fixtures.

`slurm_cluster` gives tests a real Slurm cluster on this machine (slurm/cluster-up.sh: munge, MariaDB,
slurmdbd, slurmctld and one slurmd per emulated node). It starts the cluster only when it is not
already up and never stops it: `make test` runs slurm/cluster-down.sh after pytest, and a developer
running pytest by hand keeps the cluster warm between runs.

Every test that uses the fixture gets the `slurm` marker, so `pytest -m "not slurm"` skips them all.
MEGASWEEP_SKIP_SLURM=1 skips them too (a machine where the cluster cannot run).

Every test session gets its own megasweep cache directory (the CPU peak's calibration,
train.calibrate): no test reads or writes the developer's ~/.cache/megasweep, and the processes and
Slurm jobs the tests start inherit the variable.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conf import register_configs
from train.contract import CACHE_DIR_ENV

# Many tests compose with hydra.compose, which reads the schema from Hydra's ConfigStore; the
# entry points (python -m train, analysis.calc, FastComposer) register it themselves.
register_configs()

REPO = Path(__file__).resolve().parents[1]
SLURM_SCRIPTS = REPO / "slurm"
DEFAULT_STATE_DIR = Path("/var/lib/megasweep-slurm")
# The first bring-up on a bare machine installs four Debian packages; later ones take seconds.
BRING_UP_TIMEOUT_S = 900


@dataclass(frozen=True)
class SlurmClusterInfo:
    """What tests need to know about the local cluster (read from its cluster.json)."""

    cluster_name: str
    partition: str
    nodes: tuple[str, ...]
    state_dir: Path
    slurm_conf: Path
    cpus_per_node: int
    oversubscribe: int
    """Jobs that may share a declared CPU when they ask (sbatch --oversubscribe)."""
    core_license: str
    """Slurm license counting the host's real cores (slurm.conf Licenses)."""
    cores: int
    """Its total: the real cores that every job asking for it shares (nproc)."""
    max_array_size: int
    slurm_version: str

    @property
    def scripts_dir(self) -> Path:
        return SLURM_SCRIPTS


def slurm_state_dir() -> Path:
    return Path(os.environ.get("MEGASWEEP_SLURM_DIR") or DEFAULT_STATE_DIR)


def load_cluster_info(state_dir: Path) -> SlurmClusterInfo:
    raw = json.loads((state_dir / "cluster.json").read_text())
    return SlurmClusterInfo(
        cluster_name=raw["cluster_name"],
        partition=raw["partition"],
        nodes=tuple(raw["nodes"]),
        state_dir=Path(raw["state_dir"]),
        slurm_conf=Path(raw["slurm_conf"]),
        cpus_per_node=int(raw["cpus_per_node"]),
        oversubscribe=int(raw["oversubscribe"]),
        core_license=raw["core_license"],
        cores=int(raw["cores"]),
        max_array_size=int(raw["max_array_size"]),
        slurm_version=raw["slurm_version"],
    )


def cluster_is_up() -> bool:
    status = subprocess.run(
        ["bash", str(SLURM_SCRIPTS / "cluster-status.sh"), "--quiet"], capture_output=True, timeout=120
    )
    if status.returncode != 0:
        return False
    # Up, but started by an older slurm/cluster-up.sh (no `cores` license, say): cluster-up then
    # re-renders the configs and restarts what uses them.
    try:
        load_cluster_info(slurm_state_dir())
    except (OSError, KeyError, ValueError):
        return False
    return True


def pytest_configure(config: pytest.Config) -> None:
    # Registered here rather than in pyproject.toml so that the marker lives next to its fixture
    # (--strict-markers rejects unregistered ones).
    config.addinivalue_line("markers", "slurm: needs the local Slurm cluster (slurm/cluster-up.sh)")
    config.addinivalue_line(
        "markers", "alone: compares timings, so runs with no other test beside it (make test: after the others)"
    )


ONE_WORKER_MODULES = (
    "tests/analysis/test_wandb_io.py",
    "tests/train/test_checkpoint.py",
    "tests/train/test_ds_engine.py",
    "tests/train/test_ds_trainer.py",
    "tests/train/test_fp16.py",
    "tests/train/test_vocab_parallel.py",
)
"""Test files whose tests share a costly module-scoped fixture (gloo or DeepSpeed ranks, a real run):
under `--dist loadgroup` each file's tests stay on one worker, so the fixture runs once. Spread over
the workers it ran once per worker (2026-11-26: test_ds_engine's two DeepSpeed ranks, 28 s, on two
workers)."""


# tryfirst: xdist's worker reads the xdist_group markers in its own pytest_collection_modifyitems,
# registered after this conftest and so called before it; without it the markers came too late and
# the Slurm tests of `make test` ran on both workers at once, waiting in the queue for each other.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # An `alone` test times jobs against a prediction: beside another xdist worker's tests its jobs
    # would share the cores, and a miss would say nothing about the model. make test runs these in a
    # pytest of their own after the others (see the Makefile).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    beside = pytest.mark.skip(reason=f"`alone` test under {workers} xdist workers: run it with -p no:xdist")
    for item in items:
        if workers > 1 and item.get_closest_marker("alone") is not None:
            item.add_marker(beside)
        if "slurm_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slurm)
            # Under `pytest -n N --dist loadgroup` (make test) the Slurm tests run one after another on
            # one worker: they share the one cluster and its queue, and some read it whole. The other
            # workers meanwhile run the tests that need only processes of their own.
            # Without xdist (-p no:xdist: make test's `alone` run) the marker is unknown.
            if config.pluginmanager.hasplugin("xdist"):
                item.add_marker(pytest.mark.xdist_group("slurm"))
        elif (file := item.nodeid.split("::")[0]) in ONE_WORKER_MODULES and config.pluginmanager.hasplugin("xdist"):
            item.add_marker(pytest.mark.xdist_group(file))


# CI keeps only pytest's output: a Slurm test that failed (a timeout, mostly) says what the cluster
# was doing at that moment, or a hang cannot be read afterwards (CI on 82f4560, 2026-11-26: three tests
# timed out one after another behind two jobs that never ended, and nothing showed why).
SLURM_LOG_LINES = 30


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "call" and report.failed and item.get_closest_marker("slurm") is not None:
        report.sections.append(("Slurm when the test failed", slurm_snapshot()))
    return report


def slurm_snapshot() -> str:
    """The queue, each listed job's scontrol record and log tail, and slurmctld's log tail (bounded)."""

    def run(*args: str) -> str:
        try:
            proc = subprocess.run(args, capture_output=True, text=True, timeout=15)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{' '.join(args)}: {exc}\n"
        return proc.stdout + proc.stderr

    def tail(path: Path) -> str:
        try:
            lines = path.read_text(errors="replace").splitlines()[-SLURM_LOG_LINES:]
        except OSError as exc:
            return f"({exc})"
        return "\n".join(lines)

    queue = run("squeue", "-h", "-r", "-o", "%i|%T|%r|%M|%N|%j")
    parts = ["squeue (id|state|reason|time|nodes|name):", queue or "(empty)"]
    for job in [line.split("|")[0] for line in queue.splitlines() if "|" in line][:4]:
        record = run("scontrol", "show", "job", job)
        parts += [f"scontrol show job {job}:", record]
        out = next((w.partition("=")[2] for w in record.split() if w.startswith("StdOut=")), "")
        if out:
            parts += [f"last {SLURM_LOG_LINES} lines of {out}:", tail(Path(out))]
    ctld = slurm_state_dir() / "log" / "slurmctld.log"
    parts += [f"last {SLURM_LOG_LINES} lines of {ctld}:", tail(ctld)]
    return "\n".join(parts)


@pytest.fixture(scope="session", autouse=True)
def megasweep_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """This session's cache directory, exported as MEGASWEEP_CACHE_DIR (see the module docstring)."""
    path = tmp_path_factory.mktemp("megasweep-cache")
    patch = pytest.MonkeyPatch()
    patch.setenv(CACHE_DIR_ENV, str(path))
    try:
        yield path
    finally:
        patch.undo()


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmClusterInfo]:
    if os.environ.get("MEGASWEEP_SKIP_SLURM", "") not in ("", "0"):
        pytest.skip("MEGASWEEP_SKIP_SLURM is set")
    if not cluster_is_up():
        # Bringing it up needs root; without root (and without a running cluster) there is nothing
        # this session can do, which is a skip, not a failure.
        if os.geteuid() != 0:
            pytest.skip("the local Slurm cluster is not up and bringing it up needs root")
        if shutil.which("apt-get") is None and shutil.which("slurmctld") is None:
            pytest.skip("no Slurm here and no apt-get to install it")
        up = subprocess.run(
            ["bash", str(SLURM_SCRIPTS / "cluster-up.sh")],
            capture_output=True,
            text=True,
            timeout=BRING_UP_TIMEOUT_S,
        )
        if up.returncode != 0:
            pytest.fail(
                f"slurm/cluster-up.sh failed ({up.returncode}):\n{up.stdout}{up.stderr}", pytrace=False
            )
    info = load_cluster_info(slurm_state_dir())
    # Clients find the cluster through SLURM_CONF even where /etc/slurm/slurm.conf belongs to someone
    # else (cluster-up then leaves it alone).
    patch = pytest.MonkeyPatch()
    patch.setenv("SLURM_CONF", str(info.slurm_conf))
    _cancel_stale_held_jobs()
    try:
        yield info
    finally:
        patch.undo()


def _cancel_stale_held_jobs() -> None:
    """Cancel this user's jobs held in the tests' cluster (JobHeldUser) before any Slurm test.

    The tests that hold jobs release or cancel them themselves, in a `finally`; a run killed outright
    (SIGKILL, or SIGTERM, which skips a `finally`) cannot, and its held jobs stayed queued for ever:
    the next run's tests that wait for an empty queue failed on them. The cluster is the tests' own
    (slurm/cluster-up.sh), so nothing held there at a session's start is anyone else's."""
    listed = subprocess.run(["squeue", "--me", "-h", "-r", "-t", "PD", "-o", "%i|%r"],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    held = [job for job, _, reason in (line.partition("|") for line in listed.stdout.split()) if reason == "JobHeldUser"]
    if held:
        subprocess.run(["scancel", *held], capture_output=True, timeout=60)
        print(f"conftest: cancelled {len(held)} held job(s) an earlier killed run left: {' '.join(held)}", file=sys.stderr)
