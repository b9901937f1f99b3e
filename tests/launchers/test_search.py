"""`hydra/sweeper=layouts`: a search from a model and node counts to the launched top K."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from omegaconf import OmegaConf

from launchers.queue import is_live, read_states
from tests.bench import bench_time_model
from tests.launchers.test_plan import read_rows, run_train
from tests.launchers.test_slurm_launcher import REPO, TINY, result
from train.contract import EXIT_USAGE, MULTIRUN_FILE, SEARCH_FILE, appended_name, read_manifest

if TYPE_CHECKING:
    from tests.conftest import SlurmClusterInfo

GPT = ("model=gpt_1.3b", "hardware=a100_80gb", "parallelism.precision=bf16", "parallelism.global_batch_size=512")


def test_search_plans_every_layout_and_hands_the_top_k_to_the_launcher(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "search"
    proc = run_train("-m", "hydra/sweeper=layouts", "hydra/launcher=plan", *GPT, "search.nodes=[1,2]",
                     "search.top_k=3", "search.show=5", f"hydra.sweep.dir={sweep_dir}")
    assert proc.returncode == 0, proc.stderr
    assert "TORCH_IMPORTED=False" in proc.stdout  # the search runs on login nodes
    assert "where the time goes" in proc.stdout and "feasible and ranked" in proc.stdout
    ranked = sorted(read_rows(sweep_dir / "search.csv"), key=lambda r: int(r["pred_rank"]))
    assert [int(r["pred_rank"]) for r in ranked] == list(range(1, len(ranked) + 1))
    planned = read_rows(sweep_dir / "plan.csv")
    assert len(planned) == 3
    for top, row in zip(ranked[:3], planned, strict=True):
        assert row["overrides"].endswith(top["overrides"])
        assert float(row["pred_sec_per_iter"]) == float(top["pred_sec_per_iter"])


def test_a_scaling_search_hands_the_top_k_of_each_node_count_and_says_what_more_nodes_buy(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "search"
    proc = run_train("-m", "hydra/sweeper=layouts", "hydra/launcher=plan", *GPT, "search.nodes=[1,2,4]",
                     "search.top_k=2", "search.top_k_per_node_count=true", f"hydra.sweep.dir={sweep_dir}")
    assert proc.returncode == 0, proc.stderr
    ranked = sorted(read_rows(sweep_dir / "search.csv"), key=lambda r: int(r["pred_rank"]))
    # Ranked over every node count, the top ones are all 4-node layouts: the top_k of all would
    # measure no scaling.
    assert {r["nodes"] for r in ranked[:6]} == {"4"}
    best = {n: [r for r in ranked if r["nodes"] == n] for n in ("1", "2", "4")}
    planned = read_rows(sweep_dir / "plan.csv")
    assert [r["nodes"] for r in planned] == ["1", "1", "2", "2", "4", "4"]
    for row, top in zip(planned, [*best["1"][:2], *best["2"][:2], *best["4"][:2]], strict=True):
        assert row["overrides"].endswith(top["overrides"])
    # The console says what each node count's fastest layout gives, against one node's.
    lines = proc.stdout.splitlines()
    start = lines.index("fastest per node count (speed-up and scaling efficiency against the fastest on 1 node(s)):")
    one, two, four = (best[n][0] for n in ("1", "2", "4"))
    t1, t2, t4 = (float(r["pred_sec_per_iter"]) for r in (one, two, four))
    assert lines[start + 1].startswith(f"  1 node(s): rank {one['pred_rank']}, {t1:.4g} s/it, MFU ")
    assert lines[start + 2].endswith(f", x{t1 / t2:.2f} ({100 * t1 / t2 / 2:.0f}% efficiency)")
    assert lines[start + 3].startswith(f"  4 node(s): rank 1, {t4:.4g} s/it")
    assert 1 < t1 / t2 <= 2 and 2 < t1 / t4 <= 4


def test_a_search_that_cannot_be_run_as_asked_says_what_to_change(tmp_path: Path) -> None:
    def search(name: str, *args: str) -> subprocess.CompletedProcess[str]:
        return run_train("-m", "hydra/sweeper=layouts", "hydra/launcher=plan", *GPT, *args, f"hydra.sweep.dir={tmp_path / name}")

    # One device and ZeRO stages above 0 only: nothing is tried, and "see the rules above" named none.
    empty = search("z", "hardware.devices_per_node=1", "search.zero_stages=[1]")
    assert empty.returncode == EXIT_USAGE and "leaves no layout to try" in empty.stderr, empty.stderr
    assert "add 0 to search.zero_stages" in empty.stderr and "rules above" not in empty.stderr
    # A model no searched layout holds: the rules are above, and more nodes is the way out.
    big = run_train("-m", "hydra/sweeper=layouts", "hydra/launcher=plan", "model=gpt3_175b", "hardware=a100_80gb",
                    "parallelism.global_batch_size=512", "search.nodes=[1]", f"hydra.sweep.dir={tmp_path / 'b'}")  # fmt: skip
    assert big.returncode == EXIT_USAGE and "more nodes give each layout more devices" in big.stderr, big.stderr
    # A micro-batch no global batch takes: more nodes cannot help, and are not offered.
    odd = search("m", "search.nodes=[1]", "search.micro_batch_sizes=[3]")
    assert odd.returncode == EXIT_USAGE and "[global_batch_divisible]" in odd.stdout, odd.stdout + odd.stderr
    assert "more nodes" not in odd.stderr and "change the values those rules name" in odd.stderr, odd.stderr
    # Offload with the default stages (0, 1): the rules name parallelism.engine and zero_stage, which the
    # search refuses as overrides; the search's own option is named.
    off = search("o", "search.nodes=[1]", "parallelism.offload=optimizer")
    assert off.returncode == EXIT_USAGE and "[offload_requires_zero]" in off.stdout, off.stdout + off.stderr
    assert "parallelism.offload=optimizer needs ZeRO stage 2 or 3, which run on DeepSpeed: search.zero_stages=[2,3]" in off.stderr
    # hydra.launcher.world_size fixed the devices the launcher planned on: it refused the search's top 3.
    world = search("w", "search.nodes=[1,2]", "hydra.launcher.world_size=8")
    assert world.returncode == EXIT_USAGE and "leave hydra.launcher.world_size out" in world.stderr, world.stderr
    assert not (tmp_path / "w" / SEARCH_FILE).exists()
    # A search that launched nothing (top_k=0) was replaced by the next one without a word.
    assert search("k", "search.nodes=[1]", "search.top_k=0").returncode == 0
    first = (tmp_path / "k" / SEARCH_FILE).read_bytes()
    again = search("k", "search.nodes=[2]", "search.top_k=0")
    assert again.returncode == EXIT_USAGE and "already holds a layout search" in again.stderr, again.stderr
    assert (tmp_path / "k" / SEARCH_FILE).read_bytes() == first
    added = search("k", "search.nodes=[2]", "search.top_k=0", "hydra.launcher.append=true")
    assert added.returncode == 0 and (tmp_path / "k" / appended_name(SEARCH_FILE, 1)).exists()
    # search.* without the layout search did nothing: the one default config was planned.
    ignored = run_train("-m", "hydra/launcher=plan", *GPT, "search.nodes=[1,2,4]", f"hydra.sweep.dir={tmp_path / 'i'}")
    assert ignored.returncode == EXIT_USAGE and "add hydra/sweeper=layouts" in ignored.stderr, ignored.stderr
    assert not (tmp_path / "i").exists()


def test_a_swept_value_and_an_unpredictable_hardware_are_refused(tmp_path: Path) -> None:
    swept = run_train("-m", "hydra/sweeper=layouts", "hydra/launcher=plan", *GPT, "model=gpt_1.3b,gpt_2.7b",
                      f"hydra.sweep.dir={tmp_path / 'a'}")
    assert swept.returncode != 0
    assert "model=gpt_1.3b,gpt_2.7b lists several values" in swept.stderr
    assert "Traceback" not in swept.stderr
    # The search sets every layout field itself: a pinned one was silently replaced (tp=1 for tp=2).
    pinned = run_train("-m", "hydra/sweeper=layouts", "hydra/launcher=plan", *GPT, "parallelism.tp=2",
                       "parallelism.recompute=full", f"hydra.sweep.dir={tmp_path / 'p'}")
    assert pinned.returncode != 0 and "Traceback" not in pinned.stderr
    assert "replace parallelism.tp=2 parallelism.recompute=full" in pinned.stderr
    assert "search.recompute=[MODE]" in pinned.stderr and not (tmp_path / "p" / "search.csv").exists()
    zero = run_train("-m", "hydra/sweeper=layouts", "hydra/launcher=plan", *GPT, "search.micro_batch_sizes=[0]",
                     f"hydra.sweep.dir={tmp_path / 'z'}")
    assert zero.returncode != 0 and "Traceback" not in zero.stderr  # was a ZeroDivisionError
    assert "search.micro_batch_sizes=[0] must be a non-empty list of positive" in zero.stderr
    cpu = run_train("-m", "hydra/sweeper=layouts", "hydra/launcher=plan", "hardware.devices_per_node=2",
                    f"hydra.sweep.dir={tmp_path / 'b'}")
    assert cpu.returncode == EXIT_USAGE  # nothing the input allows can be ranked
    assert "found nothing to rank" in cpu.stderr and "measures its peak" in cpu.stderr
    # Its figures alone were ignored while peak_measured=true: the hint says to turn it off, and what else.
    assert "with hardware.peak_measured=false: its peak_tflops_*, memory_bw_gbs and intra_node_bw_gbs" in cpu.stderr
    # Refused, it leaves nothing: a search.csv left there made the same search, asked again, "already held".
    assert not (tmp_path / "b").exists()
    # The time model's own reason, not a guess at a missing figure.
    missing = run_train("-m", "hydra/sweeper=layouts", "hydra/launcher=plan", *GPT, "search.micro_batch_sizes=[4]",
                        f"hardware.calibration={tmp_path / 'cal.json'}", f"hydra.sweep.dir={tmp_path / 'c'}")
    assert missing.returncode != 0
    assert f"hardware.calibration='{tmp_path / 'cal.json'}' cannot be read" in missing.stderr


def test_a_search_into_a_sweep_or_an_unwritable_directory_is_refused_before_it_writes(tmp_path: Path) -> None:
    # A directory holding a sweep: refused as the launchers refuse it, before search.csv or multirun.yaml.
    sweep_dir = tmp_path / "sweep"
    sweep_dir.mkdir()
    manifest = '{"index": 0, "overrides": ["model=tiny"], "output_dir": "0", "status": "submitted"}\n'
    (sweep_dir / "manifest.jsonl").write_text(manifest)
    (sweep_dir / "multirun.yaml").write_text("the earlier sweep's\n")
    held = run_train("-m", "hydra/sweeper=layouts", "hydra/launcher=plan", *GPT, "search.nodes=[1]",
                     f"hydra.sweep.dir={sweep_dir}")
    assert held.returncode == EXIT_USAGE and "Traceback" not in held.stderr, held.stderr
    assert "already holds a sweep" in held.stderr and "hydra.launcher.append=true" in held.stderr
    assert sorted(p.name for p in sweep_dir.iterdir()) == ["manifest.jsonl", "multirun.yaml"]
    assert (sweep_dir / "multirun.yaml").read_text() == "the earlier sweep's\n"
    # A file where the directory should be: one paragraph naming the option, no traceback.
    (tmp_path / "file").write_text("")
    unwritable = run_train("-m", "hydra/sweeper=layouts", "hydra/launcher=plan", *GPT, "search.nodes=[1]",
                           f"hydra.sweep.dir={tmp_path / 'file' / 'sweep'}")
    assert unwritable.returncode == EXIT_USAGE and "Traceback" not in unwritable.stderr, unwritable.stderr
    assert f"hydra.sweep.dir={tmp_path / 'file' / 'sweep'}: cannot write there" in unwritable.stderr


def local_search(sweep_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A search of TINY's layouts on 2 devices of this machine, run by the local launcher. The CPU's
    figures are given by hand (what a calibration provides); TINY's micro-batch is left out: the
    search sets it (search.micro_batch_sizes) and refuses a pinned one."""
    return subprocess.run(
        [sys.executable, "-m", "train", "-m", *(a for a in TINY if not a.startswith("parallelism.micro_batch_size=")),
         "hydra/sweeper=layouts", "hydra/launcher=local",
         "hardware.peak_measured=false", "hardware.peak_tflops_fp32=0.05", "hardware.memory_bw_gbs=5",
         "hardware.intra_node_bw_gbs=1", "hardware.devices_per_node=2", "parallelism.precision=fp32",
         "search.nodes=[1]", "search.recompute=[none]", "search.zero_stages=[0]", "search.sequence_parallel=[false]",
         "search.virtual_stages=[1]", *args, f"hydra.sweep.dir={sweep_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=180,
    )  # fmt: skip


def test_a_search_whose_launch_is_refused_leaves_the_directory_as_it_was(
    slurm_cluster: SlurmClusterInfo, tmp_path: Path
) -> None:
    # The site check refuses the launch after the search wrote its ranking: into a new directory,
    # the directory goes again; added to a search, that search's ranking and config stay alone.
    refused = slurm_search(tmp_path / "new" / "run", "cluster.partition=nosuch")
    assert refused.returncode == EXIT_USAGE, refused.stdout + refused.stderr
    assert "is not a partition of this cluster" in refused.stderr
    assert "search.csv was removed again" in refused.stderr
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"
    assert slurm_search(kept, "search.top_k=0").returncode == 0
    before = {p.name: p.read_bytes() for p in kept.iterdir()}
    assert sorted(before) == [MULTIRUN_FILE, SEARCH_FILE]
    added = slurm_search(kept, "cluster.partition=nosuch", "hydra.launcher.append=true")
    assert added.returncode == EXIT_USAGE and "search.append1.csv was removed again" in added.stderr, added.stderr
    assert {p.name: p.read_bytes() for p in kept.iterdir()} == before
    # The same search, asked again where nothing was launched, is not told the directory "already holds" one.
    again = slurm_search(tmp_path / "new" / "run", "cluster.partition=nosuch")
    assert again.returncode == EXIT_USAGE and "already holds" not in again.stderr, again.stderr
    # A directory that was there, empty: it stays, empty (the search's multirun.yaml went too).
    (tmp_path / "empty").mkdir()
    assert slurm_search(tmp_path / "empty", "cluster.partition=nosuch").returncode == EXIT_USAGE
    assert list((tmp_path / "empty").iterdir()) == []


def test_the_benchs_held_jobs_are_cancelled_when_it_stops_before_releasing_them(
    slurm_cluster: SlurmClusterInfo, tmp_path: Path
) -> None:
    # bench_time_model queues its searches' jobs held and releases them one at a time; stopped in
    # between, its `finally` must leave none of them in the cluster (they would stay held for ever).
    queued = slurm_search(tmp_path / "nodes1", f"cluster.partition={slurm_cluster.partition}", "search.top_k=2",
                          "+hydra.launcher.sbatch_args.hold=''")  # fmt: skip
    assert queued.returncode == 0, queued.stdout + queued.stderr
    jobs = bench_time_model.held_jobs(tmp_path / "nodes1")
    try:
        assert len(jobs) == 2
        held = read_states(jobs)
        assert all(state == "PENDING (JobHeldUser)" for state in held.values()), held
        bench_time_model.cancel_held(tmp_path)  # nodes2 was never made: nothing to read there
        states = read_states(jobs)
    finally:
        subprocess.run(["scancel", *jobs], check=False, capture_output=True)
    assert set(states) == set(jobs) and not any(is_live(state) for state in states.values()), states


def slurm_search(sweep_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """local_search's search of TINY's layouts, handed to the Slurm launcher (the tests refuse it,
    launch nothing, or hold what they queue and cancel it)."""
    return local_search(sweep_dir, "search.micro_batch_sizes=[1]", "search.top_k=1", "hydra/launcher=slurm", *args)


def test_the_top_layouts_run_on_the_local_launcher(tmp_path: Path) -> None:
    # The CPU's figures given by hand (what a calibration provides): 2 devices, one layout of each kind.
    # TINY's micro-batch is left out: the search sets it (search.micro_batch_sizes) and refuses a pinned one.
    sweep_dir = tmp_path / "run"
    proc = local_search(sweep_dir, "search.micro_batch_sizes=[1]", "search.top_k=2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    entries = read_manifest(sweep_dir)
    assert len(entries) == 2
    records = [result(sweep_dir, e) for e in entries]
    assert [r["status"] if r else None for r in records] == ["ok", "ok"]
    # What ran is what the search ranked first and second.
    ranked = sorted(read_rows(sweep_dir / "search.csv"), key=lambda r: int(r["pred_rank"]))
    layouts = [tuple(r["config"]["parallelism"][k] for k in ("dp", "tp", "pp")) for r in records if r]
    top = [tuple(int(row[k]) for k in ("dp", "tp", "pp")) for row in ranked[:2]]
    assert sorted(layouts) == sorted(top) and len(set(layouts)) == 2


def test_a_search_added_to_a_sweep_keeps_the_first_searchs_ranking(tmp_path: Path) -> None:
    # The added search wrote its ranking over search.csv: the first one's layouts were lost.
    sweep_dir = tmp_path / "run"
    first = local_search(sweep_dir, "search.micro_batch_sizes=[1]", "search.top_k=1")
    assert first.returncode == 0, first.stdout + first.stderr
    ranking, config = (sweep_dir / SEARCH_FILE).read_bytes(), (sweep_dir / MULTIRUN_FILE).read_bytes()
    added = local_search(sweep_dir, "search.micro_batch_sizes=[2]", "search.top_k=1", "hydra.launcher.append=true")
    assert added.returncode == 0, added.stdout + added.stderr
    assert (sweep_dir / SEARCH_FILE).read_bytes() == ranking
    assert (sweep_dir / MULTIRUN_FILE).read_bytes() == config
    # The added search's ranking and config, under one number.
    assert f"{appended_name(SEARCH_FILE, 1)}" in added.stdout
    assert {r["micro_batch_size"] for r in read_rows(sweep_dir / appended_name(SEARCH_FILE, 1))} == {"2"}
    kept = OmegaConf.load(sweep_dir / appended_name(MULTIRUN_FILE, 1))
    assert "search.micro_batch_sizes=[2]" in kept.hydra.overrides.task
    # Status and the analysis read the sweep's two launches as one sweep.
    assert [(e.index, e.status) for e in read_manifest(sweep_dir)] == [(0, "submitted"), (1, "submitted")]
    status = subprocess.run([sys.executable, "-m", "launchers", "status", str(sweep_dir)],
                            cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert status.returncode == 0 and "2 done" in status.stdout, status.stdout + status.stderr
    analysis = subprocess.run([sys.executable, "-m", "analysis", str(sweep_dir), "--no-plots", "-o", str(tmp_path / "an")],
                              cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert analysis.returncode == 0, analysis.stdout + analysis.stderr
    assert sorted(r["run_dir"] for r in read_rows(tmp_path / "an" / "results.csv")) == ["0", "1"]


# Issue 12's Done-means on the local cluster: about 4.5 minutes on this VM (calibration ~50 s, twelve
# measured jobs one at a time ~200 s), twice that when a second attempt runs. `alone`: the predictions come from a calibration and are compared with
# timings, so nothing else may run on the two cores meanwhile; make test runs it after the others.
@pytest.mark.alone
@pytest.mark.timeout(1500)
def test_a_calibrated_search_predicts_what_the_cluster_measures(
    slurm_cluster: SlurmClusterInfo, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # --min-seconds 0.02 rather than the bench's 0.05: the calibration takes ~50 s instead of ~80 (make test's
    # budget); a CPU figure is the best 1 ms window of its timing either way (train.calibration_job).
    # A second attempt (calibration, searches and measurements all again) runs only when the first misses:
    # this VM's speed drifts over minutes (2026-11-26: one-node copy 14.4 and 20.5 GB/s in calibrations
    # 20 minutes apart, 44 in an earlier session), and a calibration taken in a fast minute misses with
    # measurements taken in a slow one. One attempt must meet both targets; a model that misses them
    # misses in both. Every attempt's figures are printed.
    for attempt in (1, 2):
        out = tmp_path / f"attempt{attempt}"
        out.mkdir()
        rows = bench_time_model.run(out, cluster=(f"cluster.partition={slurm_cluster.partition}",), min_seconds=0.02)
        lines, mae, in_top3 = bench_time_model.report(rows)
        with capsys.disabled():  # the figures, in make test's output whatever the outcome
            print(f"\nissue 12, the time model on the local cluster (attempt {attempt}):\n" + "\n".join(lines))
        _check_search(out, rows, lines)
        if mae <= bench_time_model.TARGET_MAE and in_top3:
            break
    assert mae <= bench_time_model.TARGET_MAE, lines
    assert in_top3, lines


def _check_search(out: Path, rows: list[bench_time_model.Row], lines: list[str]) -> None:
    # Every layout of the search's top 6 on each node count ran and was compared.
    assert len(rows) == 2 * bench_time_model.PER_NODE_COUNT, lines
    assert {nodes for nodes, *_ in rows} == {1, 2}
    measured = {word for _, label, *_ in rows for word in label.split()}
    assert {"mbs1", "mbs2", "full", "none"} <= measured, lines
    # Each search ranked layouts of every kind (data, tensor, pipeline parallelism) before the top 6 ran.
    for nodes in (1, 2):
        ranked = read_rows(out / f"nodes{nodes}" / SEARCH_FILE)
        assert len(ranked) > bench_time_model.PER_NODE_COUNT
        for field in ("dp", "tp", "pp"):
            assert any(f"parallelism.{field}=2" in r["overrides"].split() for r in ranked), (nodes, field)

