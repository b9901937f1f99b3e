"""The single-machine Slurm cluster of slurm/cluster-up.sh behaves like a real site's.

Everything here talks to the real daemons through the real client commands (sbatch, srun, salloc,
sacct, scontrol): launchers that work against this cluster work against Slurm, not against a mock.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.launchers.test_slurm_launcher import REPO, TINY, array_of
from train.contract import read_manifest

if TYPE_CHECKING:
    # Only for annotations: importing conftest at run time would load it a second time.
    from tests.conftest import SlurmClusterInfo

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(120)]

# Jobs here run in a second or two; the bound only stops a broken cluster from hanging the suite.
JOB_TIMEOUT_S = 60


def slurm(*args: str, timeout: float = JOB_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout}{proc.stderr}")
    return proc


def sacct_states(job_id: str) -> dict[str, str]:
    """JobID -> State for the job, its array tasks and its steps, as sacct reports them."""
    out = slurm("sacct", "-j", job_id, "--format=JobID,State", "-n", "-P").stdout
    states = {}
    for line in out.splitlines():
        if line.strip():
            jid, state = line.split("|", 1)
            states[jid] = state
    return states


def wait_until(what: str, probe: Callable[[], bool], timeout: float = 20.0) -> None:
    # slurmctld sends job records to slurmdbd asynchronously: sacct may lag the job's end by a moment.
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.25)


def submit(*args: str, check: bool = True) -> str:
    """sbatch --wait: returns the job id once the job has ended."""
    proc = slurm("sbatch", "--parsable", "--wait", *args, check=check)
    return proc.stdout.strip().split(";")[0]


def test_nodes_partition_and_limits_match_cluster_info(slurm_cluster: SlurmClusterInfo) -> None:
    rows = slurm("sinfo", "-h", "-N", "-p", slurm_cluster.partition, "-o", "%N %T %c").stdout.split()
    nodes = rows[0::3]
    assert tuple(sorted(nodes, key=lambda n: int(n.removeprefix("node")))) == slurm_cluster.nodes
    assert set(rows[1::3]) <= {"idle", "mixed", "allocated", "completing"}, rows
    assert {int(c) for c in rows[2::3]} == {slurm_cluster.cpus_per_node}

    partition = slurm("scontrol", "show", "partition", slurm_cluster.partition).stdout
    # A declared CPU runs one job at a time unless the jobs ask to share it; measuring jobs never
    # ask, and the `cores` license holds them to the real cores.
    assert f"OverSubscribe=YES:{slurm_cluster.oversubscribe}" in partition
    assert "Default=YES" in partition
    licenses = slurm("scontrol", "show", "licenses", "--oneliner").stdout.split()
    assert f"LicenseName={slurm_cluster.core_license}" in licenses
    assert f"Total={slurm_cluster.cores}" in licenses
    if "MEGASWEEP_SLURM_CORES" not in os.environ:
        assert slurm_cluster.cores == len(os.sched_getaffinity(0))  # nproc: the host's real cores

    config = dict(
        (key.strip(), value.strip())
        for key, _, value in (
            line.partition("=") for line in slurm("scontrol", "show", "config").stdout.splitlines()
        )
    )
    assert int(config["MaxArraySize"]) == slurm_cluster.max_array_size
    assert config["AccountingStorageType"] == "accounting_storage/slurmdbd"
    assert config["ClusterName"] == slurm_cluster.cluster_name
    assert config["JobRequeue"] == "1"


def test_two_nodes_two_tasks_each_get_ranks_0_to_3(slurm_cluster: SlurmClusterInfo, tmp_path: Path) -> None:
    out = tmp_path / "ranks.out"
    script = tmp_path / "ranks.sh"
    script.write_text("#!/bin/bash\nsrun bash -c 'echo \"$SLURM_PROCID $SLURM_NTASKS $SLURMD_NODENAME\"'\n")
    first_two = ",".join(slurm_cluster.nodes[:2])
    submit("--nodes=2", "--ntasks-per-node=2", f"--nodelist={first_two}", f"--output={out}", str(script))

    ranks = sorted(
        (int(r), int(n), node) for r, n, node in (line.split() for line in out.read_text().splitlines())
    )
    assert [r for r, _, _ in ranks] == [0, 1, 2, 3]
    assert {n for _, n, _ in ranks} == {4}
    # Slurm's block distribution: ranks 0-1 on the first node, 2-3 on the second.
    assert [node for _, _, node in ranks] == [slurm_cluster.nodes[0]] * 2 + [slurm_cluster.nodes[1]] * 2


def test_srun_and_salloc_start_steps_from_the_command_line(slurm_cluster: SlurmClusterInfo) -> None:
    direct = slurm("srun", "--nodes=2", "--ntasks=2", "printenv", "SLURMD_NODENAME").stdout.split()
    assert len(set(direct)) == 2 and set(direct) <= set(slurm_cluster.nodes)

    allocated = slurm("salloc", "--nodes=1", "srun", "printenv", "SLURM_JOB_PARTITION").stdout.split()
    assert allocated == [slurm_cluster.partition]


def test_finished_job_is_completed_in_sacct(slurm_cluster: SlurmClusterInfo, tmp_path: Path) -> None:
    job_id = submit(f"--output={tmp_path / 'ok.out'}", "--wrap", "echo done")

    wait_until("sacct to show the job COMPLETED", lambda: sacct_states(job_id).get(job_id) == "COMPLETED")
    assert sacct_states(job_id)[f"{job_id}.batch"] == "COMPLETED"
    assert (tmp_path / "ok.out").read_text() == "done\n"


def test_failing_job_is_failed_with_its_exit_code(slurm_cluster: SlurmClusterInfo, tmp_path: Path) -> None:
    job_id = submit(f"--output={tmp_path / 'fail.out'}", "--wrap", "exit 3", check=False)

    wait_until("sacct to show the job FAILED", lambda: sacct_states(job_id).get(job_id) == "FAILED")
    exit_code = slurm("sacct", "-j", job_id, "-X", "--format=ExitCode", "-n", "-P").stdout.strip()
    assert exit_code == "3:0"


def test_four_task_array_runs_every_task(slurm_cluster: SlurmClusterInfo, tmp_path: Path) -> None:
    job_id = submit(
        "--array=0-3",
        f"--output={tmp_path / '%A_%a.out'}",
        "--wrap",
        'echo "$SLURM_ARRAY_TASK_ID $SLURM_ARRAY_JOB_ID"',
    )

    for task in range(4):
        assert (tmp_path / f"{job_id}_{task}.out").read_text().split() == [str(task), job_id]
    expected = {f"{job_id}_{task}" for task in range(4)}

    def all_completed() -> bool:
        states = sacct_states(job_id)
        return all(states.get(task) == "COMPLETED" for task in expected)

    wait_until("sacct to show all 4 array tasks COMPLETED", all_completed)


def test_running_job_can_be_requeued(slurm_cluster: SlurmClusterInfo) -> None:
    job_id = slurm(
        "sbatch", "--parsable", "--requeue", "--output=/dev/null", "--wrap", "sleep 60"
    ).stdout.strip()
    try:
        wait_until(
            "the job to start",
            lambda: slurm("squeue", "-h", "-j", job_id, "-o", "%T").stdout.strip() == "RUNNING",
        )
        slurm("scontrol", "requeue", job_id)

        assert "Restarts=1" in slurm("scontrol", "show", "job", job_id).stdout
        wait_until(
            "sacct to record the first run as REQUEUED",
            lambda: sacct_states(job_id).get(job_id) == "REQUEUED",
        )
    finally:
        slurm("scancel", job_id, check=False)


def recorded_pids(state_dir: Path) -> dict[str, int]:
    return {f.stem: int(f.read_text()) for f in sorted((state_dir / "pids").glob("*.pid"))}


@pytest.mark.skipif(os.geteuid() != 0, reason="cluster-up.sh needs root")
def test_cluster_up_is_a_no_op_when_up_and_restarts_a_dead_node(slurm_cluster: SlurmClusterInfo) -> None:
    up = [str(slurm_cluster.scripts_dir / "cluster-up.sh")]
    status = [str(slurm_cluster.scripts_dir / "cluster-status.sh"), "--quiet"]
    # The tests before it leave jobs that are being requeued or cancelled: once (CI, 2026-11-26) a
    # node's slurmd restarted while one was torn down on it. Compare the daemons on a quiet cluster.
    deadline = time.monotonic() + 120
    while slurm("squeue", "-h", "-o", "%i", check=False).stdout.strip() and time.monotonic() < deadline:
        time.sleep(1)
    before = recorded_pids(slurm_cluster.state_dir)
    slurm("bash", *up)
    assert recorded_pids(slurm_cluster.state_dir) == before

    victim = f"slurmd-{slurm_cluster.nodes[-1]}"
    pid = before[victim]
    assert Path(f"/proc/{pid}/comm").read_text().strip() == "slurmd"
    os.kill(pid, 9)
    wait_until(f"{victim} to exit", lambda: not Path(f"/proc/{pid}").exists() or "Z" in _proc_state(pid))
    assert slurm("bash", *status, check=False).returncode != 0

    slurm("bash", *up)
    after = recorded_pids(slurm_cluster.state_dir)
    assert after[victim] != pid
    assert {k: v for k, v in after.items() if k != victim} == {k: v for k, v in before.items() if k != victim}
    slurm("bash", *status)


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return "gone"


# ---------------------------------------------------------------------------------------------
# The `cores` license: measuring jobs never run on more CPUs at once than the host has cores.

# Three launches at once, as three users (or one impatient one) would: two sweeps of one-CPU
# configs, each one array of two tasks with its own %2 throttle, and one config of two nodes x one
# task. Without the license the five would all start together: 6 CPUs' worth on the emulated nodes.
CORE_LIMITED_LAUNCHES = {
    "sweep-a": ("training.lr=1e-4,2e-4",),
    "sweep-b": ("training.lr=3e-4,4e-4",),
    "two-nodes": ("parallelism.dp=2", "hardware.devices_per_node=1"),
}
# Stated peaks: a calibration per run would add seconds of CPU to each job and time nothing here.
NO_CALIBRATION = ("hardware.peak_measured=false", "hardware.peak_tflops_fp32=1.0")
# Five jobs of ~10 CPU-seconds each, two CPUs at a time, plus three launches' start-up.
CORE_LIMIT_TIMEOUT_S = 240


def launch_sweep(sweep_dir: Path, overrides: tuple[str, ...]) -> subprocess.Popen[str]:
    """`python -m train -m ... hydra/launcher=slurm`, started but not waited for."""
    argv = [sys.executable, "-m", "train", "-m", *TINY, *NO_CALIBRATION, *overrides,
            f"hydra.sweep.dir={sweep_dir}", "hydra/launcher=slurm"]  # fmt: skip
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def queue_rows(job_ids: set[str]) -> list[tuple[str, str, str, str, int]]:
    """(job id, state, reason, licenses, CPUs) of each queued or running job among job_ids."""
    out = slurm("squeue", "-h", "-r", "-o", "%i|%T|%r|%W|%C").stdout
    rows = [line.split("|") for line in out.splitlines() if line.strip()]
    return [(j, st, r, lic, int(c)) for j, st, r, lic, c in rows if j in job_ids]


def peak_cpus(intervals: list[tuple[int, int, int]]) -> int:
    """Most CPUs running at once over (start, end, cpus) intervals; one that ends when another
    starts (both in the same second, Slurm's resolution) does not overlap it."""
    events = sorted([(start, 1, cpus) for start, _, cpus in intervals] + [(end, 0, -cpus) for _, end, cpus in intervals])
    running = peak = 0
    for _, _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


def test_peak_cpus_counts_overlaps_only() -> None:
    assert peak_cpus([(0, 10, 1), (5, 15, 2), (10, 20, 1)]) == 3
    assert peak_cpus([(0, 10, 2), (10, 20, 2)]) == 2


@pytest.mark.timeout(CORE_LIMIT_TIMEOUT_S + 60)
def test_measuring_jobs_of_two_sweeps_and_a_two_node_job_never_outnumber_the_cores(
    slurm_cluster: SlurmClusterInfo, tmp_path: Path
) -> None:
    cores = slurm_cluster.cores
    launches = {name: launch_sweep(tmp_path / name, o) for name, o in CORE_LIMITED_LAUNCHES.items()}
    outputs = {name: proc.communicate(timeout=180)[0] for name, proc in launches.items()}
    assert all(p.returncode == 0 for p in launches.values()), outputs
    entries = {name: read_manifest(tmp_path / name) for name in launches}
    jobs = {str(e.job_id): name for name, es in entries.items() for e in es}
    assert len(jobs) == 5 and all(e.status == "submitted" for es in entries.values() for e in es), entries
    assert len({array_of(j) for j in jobs}) == 3
    assert [e.shape["nodes"] for e in entries["two-nodes"]] == [2]

    try:
        # While they run: each asked for one license per CPU, and what runs never holds more CPUs
        # than the host has cores; the rest wait for licenses (the limit did hold some back).
        reasons: set[str] = set()
        deadline = time.monotonic() + CORE_LIMIT_TIMEOUT_S
        while rows := queue_rows(set(jobs)):
            assert time.monotonic() < deadline, f"jobs still queued after {CORE_LIMIT_TIMEOUT_S}s: {rows}"
            for job, _, _, lic, cpus in rows:
                assert lic == f"{slurm_cluster.core_license}:{min(cpus, cores)}", (job, lic, cpus)
            assert sum(cpus for _, state, _, _, cpus in rows if state == "RUNNING") <= cores, rows
            reasons |= {reason for _, state, reason, _, _ in rows if state == "PENDING"}
            time.sleep(0.5)
    finally:
        slurm("scancel", *sorted({array_of(j) for j in jobs}), check=False)
    assert "Licenses" in reasons, reasons

    # Afterwards, from Slurm's own accounting: every job completed, and at no second did the CPUs
    # of the running ones add up to more than the cores.
    def accounted() -> dict[str, list[str]]:
        rows = slurm("sacct", "-X", "-n", "-P", "-j", ",".join(sorted({array_of(j) for j in jobs})),
                     "--format=JobID,State,Start,End,AllocCPUS").stdout.splitlines()  # fmt: skip
        return {r.split("|")[0]: r.split("|")[1:] for r in rows if r.split("|")[0] in jobs}

    wait_until("sacct to show all five jobs COMPLETED",
               lambda: {s for s, *_ in accounted().values()} == {"COMPLETED"} and len(accounted()) == 5)  # fmt: skip
    intervals = [
        (_epoch(start), _epoch(end), int(cpus)) for _, start, end, cpus in accounted().values()
    ]
    assert sum(c for *_, c in intervals) > cores  # what would have run together without the license
    assert peak_cpus(intervals) <= cores, sorted(intervals)


def _epoch(stamp: str) -> int:
    return int(time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S")))
