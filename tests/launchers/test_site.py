"""Partition, account, QoS and core license are checked with Slurm before anything is queued; a launch that
queues nothing, or has configs refused, fails."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from launchers.allocation import SbatchOptions
from launchers.site import (
    SiteOptionError,
    check_site_options,
    check_site_shapes,
    partition_nodes,
    site_choices,
)
from tests.launchers.test_slurm_launcher import REPO, TINY, sweep
from tests.launchers.test_sweepdir import train_multirun
from train.contract import EXIT_USAGE, read_manifest

if TYPE_CHECKING:
    from tests.conftest import SlurmClusterInfo


def test_slurm_says_what_it_accepts(slurm_cluster: SlurmClusterInfo) -> None:
    assert site_choices("partition") == [slurm_cluster.partition]
    assert site_choices("account") and site_choices("qos")
    assert site_choices("core_license") == [slurm_cluster.core_license]


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        ("partition", "nosuch", "cluster.partition='nosuch' is not a partition of this cluster; partitions: {partition}"),
        ("partition", "debugg", "(did you mean '{partition}'?)"),
        ("account", "nosuch", "cluster.account='nosuch' is not an account you may charge on this cluster; accounts:"),
        ("qos", "nosuch", "cluster.qos='nosuch' is not a QoS you may use on this cluster; QoS:"),
        ("core_license", "core", "is not a license of this cluster (slurm.conf Licenses); licenses: {license}"),
    ],
)
def test_an_unknown_partition_account_qos_or_license_submits_nothing(
    slurm_cluster: SlurmClusterInfo, tmp_path: Path, option: str, value: str, words: str
) -> None:
    # sbatch itself accepts an unknown account or QoS here (no AccountingStorageEnforce).
    sweep_dir = tmp_path / "sweep"
    proc = sweep(sweep_dir, f"cluster.{option}={value}", "+hydra.launcher.sbatch_args.hold=''", check=False)
    assert proc.returncode != 0
    wanted = words.format(partition=slurm_cluster.partition, license=slurm_cluster.core_license)
    assert wanted in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (sweep_dir / "manifest.jsonl").exists() and not (sweep_dir / ".megasweep").exists()
    # The directory this launch made is gone again, with the multirun.yaml Hydra wrote into it first.
    assert not sweep_dir.exists()


def test_each_partition_of_a_list_is_checked(slurm_cluster: SlurmClusterInfo) -> None:
    # sbatch takes --partition=a,b; the list was judged as one name and refused.
    def options(partition: str) -> SbatchOptions:
        return SbatchOptions(partition=partition, account=None, qos=None, gres=None, constraint=None, cpus_per_task=1,
                             mem_per_node_gb=None, array_parallelism=1, setup=())  # fmt: skip

    check_site_options([options(f"{slurm_cluster.partition},{slurm_cluster.partition}")])
    with pytest.raises(SiteOptionError, match=r"cluster.partition='nosuch' is not a partition of this cluster"):
        check_site_options([options(f"{slurm_cluster.partition},nosuch")])


def test_a_partition_or_account_given_as_an_sbatch_option_is_checked_too(
    slurm_cluster: SlurmClusterInfo, tmp_path: Path
) -> None:
    # The launcher's own sbatch options win over the cluster config's and went to sbatch unchecked: a
    # misspelt one was sbatch's error for every array of the sweep.
    sweep_dir = tmp_path / "sweep"
    proc = sweep(sweep_dir, "+hydra.launcher.sbatch_args.partition=debugg", "+hydra.launcher.sbatch_args.hold=''",
                 check=False)  # fmt: skip
    assert proc.returncode == EXIT_USAGE and "Traceback" not in proc.stderr, proc.stderr
    assert (f"error: hydra.launcher.sbatch_args.partition='debugg' is not a partition of this cluster; partitions: "
            f"{slurm_cluster.partition} (did you mean '{slurm_cluster.partition}'?)") in proc.stderr  # fmt: skip
    assert not sweep_dir.exists()
    exported = subprocess.run(
        [sys.executable, "-m", "launchers", "sbatch", "--sbatch-arg", "account=nosuch", "--out-dir",
         str(tmp_path / "scripts"), "--sweep-dir", str(sweep_dir), "training.lr=1e-4"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert exported.returncode == EXIT_USAGE and exported.stderr.startswith(
        "error: --sbatch-arg account='nosuch' is not an account you may charge on this cluster"), exported.stderr
    assert not (tmp_path / "scripts").exists() and not sweep_dir.exists()


@pytest.mark.parametrize("launcher", ["slurm", "local"])
def test_a_launch_with_nothing_to_submit_fails(launcher: str, tmp_path: Path) -> None:
    # Without a measured peak fp32 on a CPU is infeasible: every config is skipped.
    proc = train_multirun(
        "hardware.peak_measured=false", "training.lr=1e-4,2e-4", f"hydra/launcher={launcher}", f"hydra.sweep.dir={tmp_path}"
    )
    assert proc.returncode == EXIT_USAGE and "Nothing was submitted: all 2 configs are infeasible" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_partitions_nodes_are_read(slurm_cluster: SlurmClusterInfo) -> None:
    partitions = partition_nodes()
    assert partitions is not None
    part = partitions[slurm_cluster.partition]
    assert part.default and part.max_nodes is None
    assert [(n.cpus, n.gpus) for n in part.nodes] == [(slurm_cluster.cpus_per_node, 0)] * len(slurm_cluster.nodes)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        # More nodes than the partition has (it would wait with reason PartitionConfig for ever).
        (("parallelism.dp=16", "hardware.devices_per_node=2"), "A job of 8 node(s) x 2 task(s)"),
        # More tasks on a node than its CPUs (sbatch: "CPU count per node can not be satisfied").
        (("parallelism.dp=4",), "A job of 1 node(s) x 4 task(s)"),
    ],
)
def test_a_job_no_nodes_can_hold_submits_nothing(
    slurm_cluster: SlurmClusterInfo, tmp_path: Path, overrides: tuple[str, ...], words: str
) -> None:
    sweep_dir = tmp_path / "sweep"
    proc = sweep(sweep_dir, *overrides, "parallelism.global_batch_size=64", "+hydra.launcher.sbatch_args.hold=''",
                 check=False)  # fmt: skip
    assert proc.returncode != 0 and words in proc.stderr, proc.stderr
    assert f"cannot start in partition '{slurm_cluster.partition}'" in proc.stderr
    assert f"at most {slurm_cluster.cpus_per_node} here" in proc.stderr and "Traceback" not in proc.stderr
    assert "at most 0" not in proc.stderr  # 4 tasks of 1 CPU on a 2-CPU node: no cpus_per_task fits them
    assert not (sweep_dir / "manifest.jsonl").exists()


def test_without_a_partition_the_default_ones_nodes_count(slurm_cluster: SlurmClusterInfo) -> None:
    from launchers.allocation import Allocation, ArrayKey, SbatchOptions

    options = SbatchOptions(partition=None, account=None, qos=None, gres=None, constraint=None, cpus_per_task=1,
                            mem_per_node_gb=None, array_parallelism=1, setup=())  # fmt: skip
    key = ArrayKey(Allocation(nodes=99, tasks_per_node=1, gpus_per_node=0, time_limit_min=1), options)
    with pytest.raises(SiteOptionError, match=f"A job of 99 node.*partition '{slurm_cluster.partition}'"):
        check_site_shapes([key])
    check_site_shapes([ArrayKey(Allocation(nodes=len(slurm_cluster.nodes), tasks_per_node=1, gpus_per_node=0,
                                           time_limit_min=1), options)])  # fmt: skip
    # One task asking for more CPUs than a node has: the fix is cluster.cpus_per_task, not fewer devices
    # per node (it said "set hardware.devices_per_node ... at most 1", which it was already).
    greedy = dataclasses.replace(options, cpus_per_task=slurm_cluster.cpus_per_node + 2)
    with pytest.raises(SiteOptionError) as refused:
        check_site_shapes([ArrayKey(Allocation(nodes=1, tasks_per_node=1, gpus_per_node=0, time_limit_min=1), greedy)])
    assert (f"Set cluster.cpus_per_task to at most {slurm_cluster.cpus_per_node} ({slurm_cluster.cpus_per_node} CPUs "
            "of a node here over its 1 task(s))") in str(refused.value)  # fmt: skip
    assert "set hardware.devices_per_node to what a node runs" not in str(refused.value)


def test_a_job_slurm_would_refuse_is_refused_whole_before_anything_is_queued(
    slurm_cluster: SlurmClusterInfo, tmp_path: Path
) -> None:
    # Two arrays: config 0's asks for a gres no node has, config 1's for nothing special. Without the
    # sbatch --test-only check, config 1's array was queued and config 0 marked refused afterwards.
    sweep_dir = tmp_path / "sweep"
    proc = sweep(sweep_dir, "cluster.gres=nosuch:1,null", "+hydra.launcher.sbatch_args.hold=''", check=False)
    assert proc.returncode == EXIT_USAGE and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(
        "error: Slurm refuses 1 job(s) (asked with sbatch --test-only, which queues nothing): config(s) 0 (1 node(s) "
        "x 1 task(s), 0 GPU(s)/node, 20 min): sbatch: error: Invalid generic resource (gres) specification. Nothing "
        "was submitted. Change the cluster.* fields or the sbatch options (hydra.launcher.sbatch_args.<name>), then "
        "launch again."
    ), proc.stderr
    assert not sweep_dir.exists()  # no manifest, no launch record, no multirun.yaml: nothing was queued

    # An sbatch option sbatch lacks refuses every array that carries it, each named once.
    proc = sweep(sweep_dir, "training.lr=1e-4,2e-4", "+hydra.launcher.sbatch_args.no-such-option=1", check=False)
    assert proc.returncode == EXIT_USAGE and "config(s) 0-1 (1 node(s)" in proc.stderr, proc.stderr
    assert "sbatch: unrecognized option '--no-such-option=1'" in proc.stderr and not sweep_dir.exists()

    # The export's scripts are judged as they will be submitted: none is written.
    def export(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "launchers", "sbatch", "--out-dir", str(tmp_path / "scripts"), "--sweep-dir",
             str(sweep_dir), *args, "cluster.constraint=nosuch", "training.lr=1e-4"],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    exported = export()
    assert exported.returncode == EXIT_USAGE and "Traceback" not in exported.stderr, exported.stderr
    assert "allocation failure: Invalid feature specification. Nothing was exported or written. " \
           "Change the cluster.* fields or the sbatch options (--sbatch-arg), then export again." in exported.stderr
    assert not (tmp_path / "scripts").exists() and not sweep_dir.exists()
    # Asked not to (scripts for another cluster than this machine's, say), it writes them.
    unchecked = export("--no-test-only")
    assert unchecked.returncode == 0, unchecked.stderr
    assert len(list((tmp_path / "scripts").glob("*.sbatch"))) == 1


def test_ctrl_c_while_slurm_judges_the_arrays_leaves_nothing(slurm_cluster: SlurmClusterInfo, tmp_path: Path) -> None:
    # sbatch --test-only made slow (a busy controller): the Ctrl-C lands while it runs. The launch ends
    # as interrupted, and the new sweep directory, which held Hydra's multirun.yaml alone, goes again.
    bin_dir, started = tmp_path / "bin", tmp_path / "test-only-started"
    bin_dir.mkdir()
    real = shutil.which("sbatch")
    (bin_dir / "sbatch").write_text(f"#!/bin/bash\n[ \"$1\" = --test-only ] && touch {started} && sleep 30\n"
                                    f"exec {real} \"$@\"\n")  # fmt: skip
    (bin_dir / "sbatch").chmod(0o755)
    sweep_dir = tmp_path / "sweep"
    args = [sys.executable, "-m", "train", "-m", *TINY, "training.lr=1e-4,2e-4", "hydra/launcher=slurm",
            "hydra.launcher.job_name=ctrlc-test-only", f"hydra.sweep.dir={sweep_dir}"]  # fmt: skip
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    launcher = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not started.exists() and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert started.exists(), launcher.communicate(timeout=60)
        os.killpg(launcher.pid, signal.SIGINT)
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        subprocess.run(["scancel", "--name=ctrlc-test-only"], timeout=30, check=False)
    assert launcher.returncode == 130 and "Traceback" not in err, err
    assert not sweep_dir.exists()


def test_a_drained_node_refuses_no_job_that_would_wait_for_it(slurm_cluster: SlurmClusterInfo, tmp_path: Path) -> None:
    # sbatch --test-only judges against the nodes up now: with one drained, a job of every node was
    # refused ("Requested node configuration is not available"), where sbatch queues it to wait.
    # With every node up the same words mean that no node can ever hold the job: memory more than any has.
    big = sweep(tmp_path / "big", "cluster.mem_per_node_gb=100000", check=False)
    assert big.returncode == EXIT_USAGE and "Requested node configuration is not available" in big.stderr, big.stderr
    # Another partition's state says nothing of this job's (sites keep maintenance partitions inactive).
    subprocess.run(["scontrol", "create", "partitionname=megasweep-maint", f"nodes={slurm_cluster.nodes[-1]}",
                    "state=inactive"], check=True, timeout=30)  # fmt: skip
    try:
        big = sweep(tmp_path / "big", "cluster.mem_per_node_gb=100000", check=False)
    finally:
        subprocess.run(["scontrol", "delete", "partitionname=megasweep-maint"], check=True, timeout=30)
    assert big.returncode == EXIT_USAGE and "Requested node configuration is not available" in big.stderr, big.stderr
    last = slurm_cluster.nodes[-1]
    every = ("hardware.devices_per_node=1", f"parallelism.dp={len(slurm_cluster.nodes)}",
             f"parallelism.global_batch_size={len(slurm_cluster.nodes)}")  # fmt: skip
    subprocess.run(["scontrol", "update", f"nodename={last}", "state=drain", "reason=megasweep-test"], check=True, timeout=30)
    try:
        proc = sweep(tmp_path / "drained", *every, "+hydra.launcher.sbatch_args.hold=''",
                     "hydra.launcher.job_name=drained-node", check=False)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("slurm: 1 configs: 1 submitted in 1 array(s) ("), proc.stdout
        # A partition set down: sbatch queues every job to wait, so nothing "not available" is refused.
        subprocess.run(["scontrol", "update", f"nodename={last}", "state=resume"], timeout=30, check=True)
        subprocess.run(["scontrol", "update", f"partitionname={slurm_cluster.partition}", "state=down"], timeout=30,
                       check=True)  # fmt: skip
        down = sweep(tmp_path / "down", "cluster.mem_per_node_gb=100000", "+hydra.launcher.sbatch_args.hold=''",
                     "hydra.launcher.job_name=drained-node", check=False)  # fmt: skip
        assert down.returncode == 0 and down.stdout.startswith("slurm: 1 configs: 1 submitted"), down.stderr
    finally:
        subprocess.run(["scancel", "--name=drained-node"], timeout=30, check=False)
        subprocess.run(["scontrol", "update", f"partitionname={slurm_cluster.partition}", "state=up"], timeout=30,
                       check=False)  # fmt: skip
        subprocess.run(["scontrol", "update", f"nodename={last}", "state=resume"], timeout=30, check=False)
        # Back up (sinfo shows it not responding for some seconds after the resume) before the next test.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and subprocess.run(
            ["sinfo", "-h", "-n", last, "-o", "%t"], capture_output=True, text=True, timeout=30
        ).stdout.strip() not in ("idle", "mix", "alloc"):
            time.sleep(1)


def test_a_controller_that_does_not_judge_is_asked_once_and_the_jobs_go_unchecked(
    slurm_cluster: SlurmClusterInfo, tmp_path: Path
) -> None:
    # The controller busy for sbatch --test-only (fault injected around the cluster's own sbatch): each
    # of the three arrays waited for its own answer, and the launch said nothing of it.
    bin_dir, asked = tmp_path / "bin", tmp_path / "asked"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        f"#!/bin/bash\nif [ \"$1\" = --test-only ]; then echo x >> {asked}; echo 'sbatch: error: Batch job "
        f"submission failed: Unable to contact slurm controller (connect failure)' >&2; exit 1; fi\n"
        f"exec {shutil.which('sbatch')} \"$@\"\n"
    )
    (bin_dir / "sbatch").chmod(0o755)
    sweep_dir = tmp_path / "sweep"
    args = [sys.executable, "-m", "train", "-m", *TINY, "cluster.time_limit_min=5,10,15", "hydra/launcher=slurm",
            "+hydra.launcher.sbatch_args.hold=''", "hydra.launcher.job_name=unjudged", f"hydra.sweep.dir={sweep_dir}"]  # fmt: skip
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    try:
        proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    finally:
        subprocess.run(["scancel", "--name=unjudged"], timeout=30, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("slurm: 3 configs: 3 submitted in 3 array(s) ("), proc.stdout
    assert asked.read_text().count("x") == 1
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: Slurm did not judge")]
    assert warnings == [
        "warning: Slurm did not judge the jobs before they are queued (sbatch --test-only: sbatch: error: Batch job "
        "submission failed: Unable to contact slurm controller (connect failure)); sbatch has the last word as each "
        "is queued"
    ], proc.stderr


def test_a_later_batch_of_a_sweep_is_judged_by_sbatch_as_it_is_queued(slurm_cluster: SlurmClusterInfo, tmp_path: Path) -> None:
    # One config a batch: the first batch was queued, then sbatch --test-only refused the second whole,
    # "Nothing was submitted", and its config was listed nowhere for rerun --failed to find.
    sweep_dir = tmp_path / "sweep"
    try:
        proc = sweep(sweep_dir, "cluster.gres=null,nosuch:1", "hydra.sweeper.max_batch_size=1",
                     "+hydra.launcher.sbatch_args.hold=''", "hydra.launcher.job_name=batches", check=False)  # fmt: skip
    finally:
        subprocess.run(["scancel", "--name=batches"], timeout=30, check=False)
    assert proc.returncode not in (0, EXIT_USAGE) and "Nothing was submitted" not in proc.stderr, proc.stderr
    assert "1 of 1 configs (1) were refused by sbatch" in proc.stderr
    first, second = read_manifest(sweep_dir / "manifest.jsonl")
    assert (first.status, second.status) == ("submitted", "refused")
    assert second.reason is not None and "Invalid generic resource" in second.reason


def test_a_jobs_words_name_the_memory_it_asks_for() -> None:
    # Slurm's refusal of cluster.mem_per_node_gb=999999 described the job by its nodes, tasks, GPUs and
    # minutes: everything but the memory that made Slurm refuse it.
    from launchers.allocation import Allocation, ArrayKey
    from launchers.submit import ConfigSpec, job_words

    shape = Allocation(nodes=1, tasks_per_node=1, gpus_per_node=0, time_limit_min=20)
    for mem, said in ((999999, ", cluster.mem_per_node_gb=999999)"), (None, "0 GPU(s)/node, 20 min)")):
        options = SbatchOptions(partition=None, account=None, qos=None, gres=None, constraint=None, cpus_per_task=1,
                                mem_per_node_gb=mem, array_parallelism=1, setup=())  # fmt: skip
        key = ArrayKey(shape, options)
        assert job_words([ConfigSpec(3, (), "3", key, ())], key).endswith(said)


def test_a_slurm_conf_that_names_no_file_is_one_line_at_once(tmp_path: Path) -> None:
    # Each Slurm command retried to its timeout: a launch waited five minutes, then called every config
    # refused by sbatch (exit 1), and an export alike.
    env = {**os.environ, "SLURM_CONF": str(tmp_path / "nosuch.conf")}
    words = f"error: SLURM_CONF={tmp_path / 'nosuch.conf'}: no such file, so no Slurm command can read"
    commands = (
        [sys.executable, "-m", "train", "-m", *TINY, "hydra/launcher=slurm", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        [sys.executable, "-m", "launchers", "sbatch", f"--out-dir={tmp_path / 'scripts'}",
         f"--sweep-dir={tmp_path / 'exported'}", *TINY],
    )  # fmt: skip
    for command in commands:
        tic = time.monotonic()
        proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == EXIT_USAGE and proc.stderr.startswith(words), proc.stderr
        assert time.monotonic() - tic < 20  # no Slurm command waited for its timeout
    assert list(tmp_path.iterdir()) == []
