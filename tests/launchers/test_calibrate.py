"""`python -m launchers calibrate`: two real jobs on the local Slurm cluster, one node then two, and a
calibration file the time model predicts a CPU layout from."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from conf import CONFIG_DIR
from launchers.calibrate import (
    _executor_parameters,
    attention_shapes,
    core_share,
    gemm_shapes,
    layer_model,
    node_timing,
    nodes_per_host,
    pointwise_shapes,
)
from launchers.compose import FastComposer
from train.planner.calibration import COLLECTIVES, fit_link, load_calibration
from train.planner.perf import predict_time

if TYPE_CHECKING:
    from tests.conftest import SlurmClusterInfo

REPO = Path(__file__).resolve().parents[2]
SMALL = ("model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=2", "model.seq_length=32",
         "model.vocab_size=512", "parallelism.precision=fp32", "hardware.devices_per_node=2",
         "search.nodes=[1]", "search.micro_batch_sizes=[1]")  # fmt: skip


def test_the_shapes_come_from_the_search_and_tasks_reduce_to_their_median() -> None:
    run = FastComposer.from_config_dir(CONFIG_DIR, "config").run_config(list(SMALL))
    shapes = gemm_shapes(run)
    # tp 1 and 2 (2 devices): 6 layer GEMMs and the logits, forward and two backward, per tp.
    assert {s[4] for s in shapes} == {"nt", "nn", "tn"}
    assert any(s[1] == 3 * 64 for s in shapes) and any(s[1] == 3 * 64 // 2 for s in shapes)
    assert [k for k, _ in pointwise_shapes(run)] == ["layer_norm", "gelu", "add", "softmax", "cross_entropy"]
    # One task's JSON record, as node_timing reads it.
    task: dict[str, Any] = {
        "gemms": [{"m": 1, "n": 2, "k": 3, "batch": 1, "precision": "fp32", "seconds": 0.0, "layout": "nn"}],
        "memory_bw_gbs": 0.0, "op_overhead_us": 0.0, "pointwise": {"add": [0.0, 0.0]},
    }  # fmt: skip
    tasks: list[dict[str, Any]] = [
        {**task, "gemms": [{**task["gemms"][0], "seconds": s}], "memory_bw_gbs": s, "pointwise": {"add": [s, s]}}
        for s in (1.0, 3.0, 2.0)
    ]
    for task, s in zip(tasks, (1.0, 3.0, 2.0), strict=True):
        task["layers"] = [{"tp": 2, "kind": "gpt", "hidden_size": 32, "num_attention_heads": 2, "seq_length": 32,
                           "vocab_size": 256, "micro_batch_size": 1, "forward_s": s, "step_s": 3 * s}]
        task["attention"] = [{"batch": 1, "heads": 2, "seq_length": 32, "head_dim": 32, "causal": True,
                              "precision": "fp32", "forward_s": s, "backward_s": 2 * s}]
    t = node_timing(1, 3, tasks)
    assert t.gemms[0].seconds == 2.0 and t.memory_bw_gbs == 2.0 and t.pointwise == {"add": [2.0, 2.0]}
    assert [(x.tp, x.forward_s, x.step_s) for x in t.layers] == [(2, 2.0, 6.0)]
    assert [(a.batch, a.heads, a.forward_s, a.backward_s) for a in t.attention] == [(1, 2, 2.0, 4.0)]
    # The attention core of each (micro-batch, heads per rank) the search runs: tp 1 and 2, mbs 1.
    assert attention_shapes(run) == [(1, 1, 32, 32, True), (1, 2, 32, 32, True)]
    bert = FastComposer.from_config_dir(CONFIG_DIR, "config").run_config([*SMALL, "model.kind=bert", "search.micro_batch_sizes=[1,4]"])
    assert {(b, causal) for b, _, _, _, causal in attention_shapes(bert)} == {(1, False), (4, False)}
    assert layer_model(run) == ("gpt", 32, 2, 32, 256, 1)  # a head per device of a node


def test_a_calibration_job_asks_for_the_configs_memory_in_gigabytes() -> None:
    """sbatch reads a bare --mem as megabytes (the launcher's jobs are checked on the cluster in
    tests/launchers/test_slurm_launcher.py)."""
    composer = FastComposer.from_config_dir(CONFIG_DIR, "config")
    assert _executor_parameters(composer.run_config([*SMALL, "cluster.mem_per_node_gb=64"]), 1, None)["mem"] == "64G"
    assert "mem" not in _executor_parameters(composer.run_config(list(SMALL)), 1, None)


def test_the_core_share_counts_the_threads_of_the_tasks_on_each_host() -> None:
    def task(host: str, cpus: int, threads: int, device: str = "cpu x1 threads", node: str = "") -> dict[str, Any]:
        return {"host": host, "node": node or host, "host_cpus": cpus, "threads": threads, "device": device}

    # An emulated cluster: two nodes' 4 tasks of a thread each on one host of 2 CPUs, half a core each.
    emulated = [task("vm", 2, 1, node=n) for n in ("node1", "node1", "node2", "node2")]
    assert core_share(emulated) == 0.5 and nodes_per_host(emulated) == 2
    # Real nodes: 2 tasks of 2 threads on each 8-CPU host, a core per thread.
    real = [task(h, 8, 2) for h in ("n1", "n1", "n2", "n2")]
    assert core_share(real) == 1.0 and nodes_per_host(real) == 1
    # The most crowded host decides: a job waits for its slowest rank.
    assert core_share([task("n1", 4, 2), task("n1", 4, 2), task("n2", 4, 3), task("n2", 4, 3)]) == pytest.approx(4 / 6)
    # GPU ranks compute on their own devices; a job from before the tasks reported their host.
    assert core_share([task("g1", 2, 8, device="NVIDIA H100 80GB HBM3")] * 4) == 1.0
    assert core_share([{"device": "cpu x1 threads"}] * 4) == 1.0 and nodes_per_host([{"device": "cpu"}] * 4) == 1


def test_calibrate_on_one_and_two_nodes_then_predict(slurm_cluster: SlurmClusterInfo, tmp_path: Path) -> None:
    out = tmp_path / "cal.json"
    proc = subprocess.run(
        [sys.executable, "-m", "launchers", "calibrate", *SMALL, f"cluster.partition={slurm_cluster.partition}",
         "--min-seconds", "0.002", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "intra-node link" in proc.stdout and "inter-node link" in proc.stdout
    assert "narrow layer at tp=2" in proc.stdout
    cal = load_calibration(str(out))
    assert [(t.nodes, t.tasks_per_node) for t in cal.nodes] == [(1, 2), (2, 2)]
    # cluster.cpus_per_task=1: a thread per task; the emulated nodes share this host's CPUs.
    assert [t.core_share for t in cal.nodes] == [min(1.0, (os.cpu_count() or 1) / (2 * t.nodes)) for t in cal.nodes]
    assert [t.nodes_per_host for t in cal.nodes] == [1, 2]
    assert all(t.sustained_tflops > 0 for t in cal.nodes)
    run = FastComposer.from_config_dir(CONFIG_DIR, "config").run_config(list(SMALL))
    for timing in cal.nodes:
        assert len(timing.gemms) == len(gemm_shapes(run)) and all(g.seconds > 0 for g in timing.gemms)
        assert timing.memory_bw_gbs > 0 and timing.op_overhead_us > 0
        assert set(timing.pointwise) == {"layer_norm", "gelu", "add", "softmax", "cross_entropy"}
        # The narrow layer at tp 1 and 2: under TP it waits for four all-reduces besides, so it is slower.
        layer = {x.tp: x for x in timing.layers}
        assert set(layer) == {1, 2} and 0 < layer[1].step_s < layer[2].step_s
    for scope in ("intra", "inter"):
        measured = [c for c in cal.collectives if c.scope == scope]
        assert {c.op for c in measured} == set(COLLECTIVES)
        link = fit_link(measured)
        assert link is not None and link.bandwidth > 0
    calibrated = FastComposer.from_config_dir(CONFIG_DIR, "config").run_config(
        [*SMALL, f"hardware.calibration={out}", "parallelism.global_batch_size=2"])
    par = calibrated.parallelism
    assert predict_time(calibrated.model, par, calibrated.hardware, dp=2).sec_per_iter > 0
    # A failed measurement is an error naming the problem, not a traceback.
    bad = subprocess.run([sys.executable, "-m", "launchers", "calibrate", "--nodes", "0", "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "node counts are positive" in bad.stderr


@pytest.mark.parametrize(("stop", "code", "words"), [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "stopped")])
def test_ctrl_c_or_kill_cancels_the_calibration_job_and_writes_nothing(
    stop: signal.Signals, code: int, words: str, slurm_cluster: SlurmClusterInfo, tmp_path: Path
) -> None:
    """Ctrl-C while waiting on a calibration job: it ended in a traceback, and the job, of use only to
    the process that stopped, ran on to its end. A kill (SIGTERM) ended the process at once, exit 143,
    and left the job queued."""
    out = tmp_path / "cal.json"
    args = [sys.executable, "-m", "launchers", "calibrate", *SMALL, f"cluster.partition={slurm_cluster.partition}",
            "--min-seconds", "0.5", "--out", str(out)]  # fmt: skip
    # Its own process group, SIGINT as a terminal delivers it (a background shell would have it ignored).
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    try:
        assert proc.stdout is not None
        line = ""
        while "job" not in line:
            line = proc.stdout.readline()
            assert line, "calibrate ended before queueing its job"
        job = line.split("job ")[1].split(",")[0]
        if stop == signal.SIGINT:
            os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C: the whole process group
        else:
            proc.send_signal(stop)  # `kill <pid>`: the process alone
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        subprocess.run(["scancel", job], timeout=30, check=False)
    assert proc.returncode == code, err
    assert f"calibrate: stopped; job {job} cancelled" in err and "Traceback" not in err, err
    assert f"calibrate: {words}; {out} not written" in err, err
    assert not out.exists()
    state = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job, "-o", "State"], capture_output=True, text=True, timeout=30)
    assert state.stdout.startswith("CANCELLED"), state.stdout  # "CANCELLED by <uid>"


def test_jobs_slurm_would_refuse_are_refused_before_either_is_queued(
    slurm_cluster: SlurmClusterInfo, tmp_path: Path
) -> None:
    # A node feature no node has: the one-node job was refused at its sbatch, exit 1, naming a submitit
    # log that did not exist; one that only the two-node job could not have would be refused minutes later.
    out = tmp_path / "cal.json"
    proc = subprocess.run(
        [sys.executable, "-m", "launchers", "calibrate", *SMALL, f"cluster.partition={slurm_cluster.partition}",
         "cluster.constraint=nosuch", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(
        "error: Slurm refuses 2 job(s) (asked with sbatch --test-only, which queues nothing): the 1-node calibration "
        "job: allocation failure: Invalid feature specification; the 2-node calibration job: "
    ), proc.stderr
    assert proc.stderr.rstrip().endswith("Nothing was submitted or measured. Change the cluster.* fields, then "
                                         "calibrate again. (Where a site's sbatch --test-only refuses jobs that sbatch "
                                         "itself would queue, --no-test-only leaves this check out.)")
    assert "calibrate: 1 node(s): job" not in proc.stdout and not out.exists()
    # Left out, the check asks nothing: sbatch itself refuses the one-node job as it is queued.
    unchecked = subprocess.run(
        [sys.executable, "-m", "launchers", "calibrate", *SMALL, f"cluster.partition={slurm_cluster.partition}",
         "cluster.constraint=nosuch", "--out", str(out), "--no-test-only"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert unchecked.returncode != 0 and "asked with sbatch --test-only" not in unchecked.stderr, unchecked.stderr
    assert "Invalid feature specification" in unchecked.stderr and not out.exists(), unchecked.stderr


@pytest.mark.parametrize(
    ("args", "words"),
    [(["--min-seconds", "-1"], "error: --min-seconds -1.0: the shortest time each figure is timed for is a number of "
                               "seconds above 0"),
     (["--min-seconds", "nan"], "error: --min-seconds nan: "),
     (["--out", "{tmp}"], "error: --out {tmp}: cannot write the calibration file there (it is a directory)"),
     (["--out", "/sys/megasweep-test/cal.json"], "error: --out /sys/megasweep-test/cal.json: cannot write the "
                                                  "calibration file there ("),
     # An empty list timed no GEMM (on Slurm: a job queued for nothing, its file useless); a zero
     # micro-batch ended in a ZeroDivisionError traceback, an empty list of them in "max() arg is an empty sequence".
     (["search.nodes=[]"], "error: calibrate times the layouts of the search, which cannot search: search.nodes=[] "
                           "must be a non-empty list of positive node counts, e.g. search.nodes=[1,2,4]"),
     (["search.micro_batch_sizes=[0]"], "error: calibrate times the layouts of the search, which cannot search: "
                                        "search.micro_batch_sizes=[0] must be a non-empty list of positive"),
     (["search.micro_batch_sizes=[]"], "error: calibrate times the layouts of the search, which cannot search: "
                                       "search.micro_batch_sizes=[] must be"),
     # No layout of the search can run: it queued jobs that timed 42 GEMM shapes for a search ranking none.
     (["search.micro_batch_sizes=[64]"], "error: calibrate times the layouts of the search, and no layout of the "
                                         "72 tried is feasible ([global_batch_divisible] 72 layout(s), e.g. "),
     # Replaced on every layout timed: parallelism.tp=2 was accepted without a word and tp=1's shapes timed too.
     (["parallelism.tp=2", "+parallelism.micro_batch_size=4"],
      "error: calibrate times the layouts of the search, which sets parallelism.tp=2 +parallelism.micro_batch_size=4 "
      "itself on every one: leave it out and narrow the search instead (parallelism.tp: search.nodes (every dp x tp x "
      "pp of their devices is tried); parallelism.micro_batch_size: search.micro_batch_sizes=[N])")],
)  # fmt: skip
def test_a_bad_option_is_refused_naming_it_before_any_job(args: list[str], words: str, tmp_path: Path) -> None:
    # --min-seconds -1 or nan was accepted (each figure then timed once, however short); an --out that
    # cannot be written failed after the jobs had run, as an OSError naming no option.
    args = [a.format(tmp=tmp_path) for a in args]
    full = ["--out", str(tmp_path / "cal.json"), *args] if "--out" not in args else args
    proc = subprocess.run([sys.executable, "-m", "launchers", "calibrate", "--here", *full], cwd=REPO,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.startswith(words.format(tmp=tmp_path)), proc.stderr
    assert proc.stderr.rstrip().endswith("nothing was submitted") and not (tmp_path / "cal.json").exists()


def test_calibrate_here_measures_this_device_without_slurm(tmp_path: Path) -> None:
    out = tmp_path / "here.json"
    proc = subprocess.run(
        [sys.executable, "-m", "launchers", "calibrate", "--here", *SMALL, "--min-seconds", "0.002", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "on this machine" in proc.stdout and "link" not in proc.stdout  # one task: no collective timed
    cal = load_calibration(str(out))
    run = FastComposer.from_config_dir(CONFIG_DIR, "config").run_config(list(SMALL))
    [timing] = cal.nodes
    # Every shape the search's layouts run, tp=2's too: a rank's GEMM is timed on one device alike.
    assert (timing.nodes, timing.tasks_per_node) == (1, 1) and not cal.collectives
    assert {(g.m, g.n, g.k, g.batch, g.layout) for g in timing.gemms} == set(gemm_shapes(run))
    assert all(g.seconds > 0 for g in timing.gemms) and timing.memory_bw_gbs > 0
    assert [x.tp for x in timing.layers] == [1]
    assert [(a.batch, a.heads) for a in timing.attention] == [(1, 1), (1, 2)]
    assert all(a.forward_s > 0 for a in timing.attention)
    assert "attention core (SDPA): 2 shapes" in proc.stdout
    one = FastComposer.from_config_dir(CONFIG_DIR, "config").run_config([*SMALL, f"hardware.calibration={out}"])
    assert predict_time(one.model, one.parallelism, one.hardware, dp=1).sec_per_iter > 0
