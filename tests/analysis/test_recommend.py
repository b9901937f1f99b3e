"""The recommendation: lowest seconds per iteration for the same work, not the highest TFLOPs."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from analysis.calc import compose_run
from analysis.recommend import (
    Constraints,
    Recommendation,
    format_recommendations,
    left_out,
    recommend,
    recommendation_text,
    unqualified,
)
from analysis.records import load_sweeps
from analysis.tables import format_err, format_sec, scaling_frame
from tests.analysis.golden.build import (
    build_sweep,
    fixture,
    hardware_conf,
    predicted_sweep_data,
    stopped_sweep_data,
)
from train.contract import MANIFEST_FILE

REPO = Path(__file__).resolve().parents[2]


def _two_layouts() -> dict:
    # Seed 001, 'Choosing the fastest 3D Topology' (MBS=2 tables, 02-20):
    #   | 40 | 200B | 4 | 8 | 10 | 2 | 2048 | 43GB | 207.92 | 100.43 |   highest TFLOPs, 40 nodes
    #   | 48 | 194B | 8 | 8 |  6 | 2 | 2048 | 45GB | 172.36 |  98.43 |   faster per iteration, 48 nodes
    data = copy.deepcopy(fixture())
    data["runs"] = [r for r in data["runs"] if r["name"] in ("n40_pp10_mbs2", "n48_pp6_mbs2")]
    return data


def test_lowest_sec_per_iter_wins_over_highest_tflops(tmp_path: Path) -> None:
    df = load_sweeps([build_sweep(tmp_path / "s", _two_layouts())], queue=None).table
    (rec,) = recommend(df)
    assert (rec.best.nodes, rec.best.dp, rec.best.pp, rec.best.sec_per_iter) == (48, 8, 6, 172.36)
    assert (rec.highest_tflops.nodes, rec.highest_tflops.tflops) == (40, 100.43)
    assert rec.runner_up is not None and rec.runner_up.nodes == 40
    # Margin: the runner-up takes 207.92 / 172.36 - 1 = 20.6% longer per iteration.
    assert rec.margin_pct == pytest.approx(100 * (207.92 / 172.36 - 1))
    text = format_recommendations([rec])
    assert "20.6% faster per iteration than the runner-up" in text
    assert "highest TFLOPs is DP=4 TP=8 PP=10 MBS=2 on 40 node(s)" in text
    assert "constraints satisfied:" in text


def test_a_gap_of_2x_or_more_is_written_as_a_factor_as_compare_writes_it(tmp_path: Path) -> None:
    # A bf16 run at 0.552 s/it beside an fp16 one at 10.33 on a CPU read "1772.6% faster per
    # iteration"; compare wrote the same gap "18.7x faster".
    data = _two_layouts()
    slow = next(r for r in data["runs"] if r["name"] == "n40_pp10_mbs2")
    slow.update(sec_per_iter=172.36 * 18.7, tflops=100.43 * 10)  # still the highest TFLOPs
    (rec,) = recommend(load_sweeps([build_sweep(tmp_path / "s", data)], queue=None).table)
    text = format_recommendations([rec])
    assert "- margin: 18.7x faster per iteration than the runner-up" in text
    assert "yet 18.7x slower per iteration: ranked by seconds per iteration" in text
    assert "1770.0%" not in text


def test_runs_of_one_dp_tp_pp_mbs_are_told_apart_by_what_differs(tmp_path: Path) -> None:
    # Two runs of DP=4 TP=8 PP=10 MBS=2 that differ in their ZeRO stage: the labels name it, and name
    # nothing else (their recompute, engine and precision are the same).
    data = _two_layouts()
    same = next(r for r in data["runs"] if r["name"] == "n40_pp10_mbs2")
    other = next(r for r in data["runs"] if r["name"] == "n48_pp6_mbs2")
    other.update(nodes=same["nodes"], layout={**same["layout"], "zero_stage": 0})
    (rec,) = recommend(load_sweeps([build_sweep(tmp_path / "s", data)], queue=None).table)
    assert rec.runner_up is not None
    assert {rec.best.label, rec.runner_up.label} == {
        "DP=4 TP=8 PP=10 MBS=2 ZeRO=0 on 40 node(s) (320 devices)",
        "DP=4 TP=8 PP=10 MBS=2 ZeRO=1 on 40 node(s) (320 devices)",
    }
    assert "ZeRO=0" in format_recommendations([rec]) and "ZeRO=1" in format_recommendations([rec])
    # The Adam implementation is the layout's too (apex's fused kernel against torch's foreach): never
    # pooled as repeats of one layout, as runs that differ only in training.lr are.
    data = _two_layouts()
    other = next(r for r in data["runs"] if r["name"] == "n48_pp6_mbs2")
    other.update(nodes=same["nodes"], layout={**same["layout"], "optimizer": "torch"})
    (rec,) = recommend(load_sweeps([build_sweep(tmp_path / "o", data)], queue=None).table)
    assert rec.candidates == 2 and rec.runner_up is not None
    assert {rec.best.label, rec.runner_up.label} == {
        "DP=4 TP=8 PP=10 MBS=2 optimizer=auto on 40 node(s) (320 devices)",
        "DP=4 TP=8 PP=10 MBS=2 optimizer=torch on 40 node(s) (320 devices)",
    }
    # Runs that differ in DP x TP x PP x MBS only keep the short label.
    (plain,) = recommend(load_sweeps([build_sweep(tmp_path / "t", _two_layouts())], queue=None).table)
    assert plain.best.label == "DP=8 TP=8 PP=6 MBS=2 on 48 node(s) (384 devices)"


def test_fastest_per_node_count_and_failures_excluded(tmp_path: Path) -> None:
    df = load_sweeps([build_sweep(tmp_path / "s")], queue=None).table
    (rec,) = recommend(df)  # the skipped GBS-2016 config is other work and has no successful run
    assert rec.best.sec_per_iter == 161.96 and rec.candidates == 5
    assert [(c.nodes, c.sec_per_iter) for c in rec.per_nodes] == [(40, 207.92), (44, 186.65), (48, 161.96)]
    assert rec.excluded == ("4 did not finish (1 OOM, 1 NaN, 1 timeout, 1 fail)", "1 still pending or running")


def test_a_stopped_runs_partial_figures_are_never_recommended(tmp_path: Path) -> None:
    # A timeout that measured 150 s/it over 47 iterations, faster than both finished runs, and an
    # interrupted run at 180 s/it: results.md shows them marked partial; the recommendation compares the
    # finished runs alone, and counts the stopped ones as not finished.
    df = load_sweeps([build_sweep(tmp_path / "s", stopped_sweep_data())], queue=None).table
    assert int(df["partial"].sum()) == 2
    (rec,) = recommend(df)
    assert rec.best.sec_per_iter == 172.36 and rec.candidates == 2
    assert rec.runner_up is not None and rec.runner_up.sec_per_iter == 207.92
    assert rec.highest_tflops.tflops == 100.43  # not the timeout's 110
    assert rec.per_nodes and all(c.sec_per_iter in (172.36, 207.92) for c in rec.per_nodes)
    assert rec.excluded == ("3 did not finish (2 timeout, 1 interrupted)",)
    assert "150.00" not in recommendation_text(df, [rec])


def test_constraints_filter_and_are_reported(tmp_path: Path) -> None:
    df = load_sweeps([build_sweep(tmp_path / "s")], queue=None).table
    # BLOOM: at most 44 nodes, DP % 4 == 0 (batch ramp-up), keep headroom below 50 GiB.
    (rec,) = recommend(df, Constraints(max_nodes=44, max_mem_gib=50.0, dp_multiple_of=4))
    assert (rec.best.nodes, rec.best.sec_per_iter) == (44, 186.65)
    assert "44 node(s) <= 44 (--max-nodes)" in rec.satisfied
    assert "DP=4 is a multiple of 4 (--dp-multiple)" in rec.satisfied
    assert any("above 50 GiB per device" in e for e in rec.excluded)
    assert any("over the 44-node limit" in e for e in rec.excluded)


def test_runs_that_finished_but_miss_every_limit_are_said_to_miss_them(tmp_path: Path) -> None:
    # Before: "no run finished with a measured iteration", of five runs that finished and measured.
    df = load_sweeps([build_sweep(tmp_path / "s")], queue=None).table
    limits = Constraints(max_nodes=1, dp_multiple_of=64)
    assert recommend(df, limits) == []
    text = format_recommendations([], left_out=left_out(df, limits))
    assert text == ("No recommendation: 5 run(s) finished with a measured iteration, but none met the limits: "
                    "5 over the 1-node limit; 5 with DP not a multiple of 64.")  # fmt: skip
    assert left_out(df[df["outcome"] != "ok"], limits) == ""


def test_different_work_gets_separate_recommendations(tmp_path: Path) -> None:
    data = _two_layouts()
    other = copy.deepcopy(data["runs"][0])
    other.update(name="gbs1024", sec_per_iter=100.0)
    other["layout"]["gbs"] = 1024
    data["runs"].append(other)
    df = load_sweeps([build_sweep(tmp_path / "s", data)], queue=None).table
    recs = recommend(df)
    assert [(r.global_batch_size, r.best.sec_per_iter) for r in recs] == [(1024, 100.0), (2048, 172.36)]
    assert recs[0].runner_up is None and "only run that qualifies" in format_recommendations(recs[:1])


def _only(names: dict[str, tuple[float, float]]) -> dict:
    """The fixture's runs of `names`, each measured at (sec_per_iter, within-run CV)."""
    data = copy.deepcopy(fixture())
    data["runs"] = [r for r in data["runs"] if r["name"] in names]
    for run in data["runs"]:
        run["sec_per_iter"], run["sec_cv"] = names[run["name"]]
    return data


def test_runs_of_one_layout_are_one_candidate_never_each_others_runner_up(tmp_path: Path) -> None:
    # The same config run in two sweeps, 0.8% apart with 0.4% within-run CVs: one layout, so
    # there is no runner-up, however tight each run's iterations were.
    a = build_sweep(tmp_path / "a", _only({"n48_pp6_mbs2": (172.36, 0.004)}))
    b = build_sweep(tmp_path / "b", _only({"n48_pp6_mbs2": (173.74, 0.004)}))
    (rec,) = recommend(load_sweeps([a, b], queue=None).table)
    assert rec.runner_up is None and rec.candidates == 1 and rec.runs == 2 and rec.best.runs == 2
    assert rec.best.sec_per_iter == pytest.approx((172.36 + 173.74) / 2)
    text = format_recommendations([rec])
    assert "runner-up" not in text and "median of 2 runs" in text
    assert "compared 1 qualifying layout(s) from 2 runs (runs of one layout pooled)" in text
    # It said "the only run that qualifies" of two runs.
    assert "- margin: none; it is the only layout (its 2 runs pooled) that qualifies" in text


def test_a_pooled_layouts_tflops_and_mfu_are_its_iterations_work_over_its_median_time(tmp_path: Path) -> None:
    # Four runs of one layout at 1, 1, 2 and 2 s/it: the median time is 1.5 s, and the TFLOPs beside it
    # were the median of the runs' own (F/1 and F/2: 0.75 F), not F/1.5 (0.67 F).
    sweeps = []
    for i, sec in enumerate((1.0, 1.0, 2.0, 2.0)):
        data = _only({"n48_pp6_mbs2": (sec, 0.01)})
        (run,) = data["runs"]
        run["tflops"] = 90.0 / sec  # one iteration's 90 TFLOP per device
        sweeps.append(build_sweep(tmp_path / f"s{i}", data))
    table = load_sweeps(sweeps, queue=None).table
    (rec,) = recommend(table)
    assert rec.best.runs == 4 and rec.best.sec_per_iter == pytest.approx(1.5)
    assert rec.best.tflops == pytest.approx(60.0)
    (peak,) = set((table["tflops"] / table["mfu"]).round(6))  # every run's: its hardware's datasheet figure
    assert rec.best.mfu == pytest.approx(60.0 / peak)


def test_layouts_repeated_across_two_whole_sweeps_are_pooled(tmp_path: Path) -> None:
    # The golden sweep, and again without its first config: the qualifying runs' table labels are
    # not 0..n-1, and the pooled-run counts were assigned by those labels after the rows were
    # renumbered: NaN counts, and `python -m analysis a b` ended in "ValueError: cannot convert
    # float NaN to integer" (a rerun of a sweep, or any two sweeps sharing a layout).
    a = build_sweep(tmp_path / "a")
    data = fixture()
    data["runs"] = data["runs"][1:]
    b = build_sweep(tmp_path / "b", data)
    (rec,) = recommend(load_sweeps([a, b], queue=None).table)
    assert (rec.best.dp, rec.best.pp, rec.best.sec_per_iter, rec.best.runs) == (4, 12, 161.96, 2)
    assert rec.runner_up is not None and (rec.runner_up.dp, rec.runner_up.pp, rec.runner_up.runs) == (8, 6, 2)
    assert rec.candidates == 5 and rec.runs == 9  # DP=4 PP=10 MBS=2 ran in a only
    assert "161.96 s/it (median of 2 runs)" in format_recommendations([rec])


def test_a_small_runs_figures_keep_their_digits(tmp_path: Path) -> None:
    # A CPU-sized sweep: two decimals read "0.00 s/it, 0.00 TFLOPs/device" for the winner and the
    # runner-up alike; the recommendation takes the results table's digits.
    data = fixture()
    for run in data["runs"]:
        if "sec_per_iter" in run:  # skipped and pending runs have none
            run["sec_per_iter"], run["tflops"] = run["sec_per_iter"] / 40_000, run["tflops"] / 30_000
    (rec,) = recommend(load_sweeps([build_sweep(tmp_path / "s", data)], queue=None).table)
    text = format_recommendations([rec])
    assert f"{format_sec(161.96 / 40_000)} s/it (median" not in text  # one run each here
    assert f"{format_sec(161.96 / 40_000)} s/it, " in text and "0.00 s/it" not in text, text
    assert " 0.00 TFLOPs" not in text and "TFLOPs/device" in text, text


def test_one_model_name_with_another_shape_is_other_work(tmp_path: Path) -> None:
    # A second sweep of the same model name at half the width (model.hidden_size=7200, a quarter of
    # the parameters), each run 3x faster: its runs were pooled with the full model's as one layout
    # ("median of 2 runs", CV 70.7%), one recommendation for two pieces of work.
    a = build_sweep(tmp_path / "a")
    data = copy.deepcopy(fixture())
    data["model"] = {**data["model"], "hidden_size": 7200, "num_attention_heads": 48}
    for run in data["runs"]:
        run["extra_overrides"] = ["model.hidden_size=7200", "model.num_attention_heads=48"]
        run["params"] = None  # the size the planner gives this shape
        if run.get("sec_per_iter"):
            run["sec_per_iter"] /= 3
    b = build_sweep(tmp_path / "b", data)
    recs = recommend(load_sweeps([a, b], queue=None).table)
    assert [(r.size, r.best.sec_per_iter, r.best.runs, r.runs) for r in recs] == [
        ("203B", 161.96, 1, 5), ("51.6B", pytest.approx(161.96 / 3), 1, 5),
    ]  # fmt: skip
    text = format_recommendations(recs)
    assert "median of" not in text
    # Each sweep's pending config is counted with its own shape's work.
    assert text.count("1 still pending or running") == 2


def test_one_model_name_of_another_kind_is_other_work(tmp_path: Path) -> None:
    # model=tiny model.kind=gpt,bert: the BERT run and the GPT run of one layout were pooled as two
    # runs of it ("2.13 s/it (median of 2 runs)"), one recommendation for two models.
    a = build_sweep(tmp_path / "a")
    data = copy.deepcopy(fixture())
    data["model"] = {**data["model"], "kind": "bert"}
    for run in data["runs"]:
        run["extra_overrides"] = ["model.kind=bert"]
        if run.get("sec_per_iter"):
            run["sec_per_iter"] *= 1.2
    b = build_sweep(tmp_path / "b", data)
    table = load_sweeps([a, b], queue=None).table
    recs = recommend(table)
    assert sorted((r.best.sec_per_iter, r.best.runs) for r in recs) == [(161.96, 1), (pytest.approx(161.96 * 1.2), 1)]
    assert "median of" not in format_recommendations(recs)
    # The scaling table's rows name the kind where it varies: one cell took the faster of the two.
    variants = scaling_frame(table)["variant"]
    assert variants.str.endswith(" bert").any() and variants.str.endswith(" gpt").any()


def test_the_noise_of_a_repeated_layout_is_its_spread_across_runs(tmp_path: Path) -> None:
    # DP=8 PP=6 ran at 150 and 210 s/it (median 180, CV 23.6% across the runs), each run's own
    # iterations spread by 0.4%; DP=4 PP=10 ran twice at 207.92. A 15.5% margin is inside that noise,
    # which the within-run CVs (0.6% combined) would have hidden.
    a = build_sweep(tmp_path / "a", _only({"n48_pp6_mbs2": (150.0, 0.004), "n40_pp10_mbs2": (207.92, 0.004)}))
    b = build_sweep(tmp_path / "b", _only({"n48_pp6_mbs2": (210.0, 0.004), "n40_pp10_mbs2": (207.92, 0.004)}))
    (rec,) = recommend(load_sweeps([a, b], queue=None).table)
    assert (rec.best.dp, rec.best.pp, rec.best.sec_per_iter, rec.best.runs) == (8, 6, 180.0, 2)
    assert rec.runner_up is not None and (rec.runner_up.dp, rec.runner_up.pp, rec.runner_up.runs) == (4, 10, 2)
    across = float(np.std([150.0, 210.0], ddof=1) / 180.0)
    assert rec.best.sec_cv == pytest.approx(across)
    assert rec.runner_up.sec_cv == pytest.approx(0.004)  # no spread across its runs: its own
    assert rec.margin_pct == pytest.approx(100 * (207.92 / 180 - 1)) and not rec.decided
    text = format_recommendations([rec])
    assert text.startswith("No clear winner")
    assert ("CV 23.6% (the wider of the spread across its 2 runs and within its widest run) and 0.4% (the wider "
            "of the spread across its 2 runs and within its widest run)") in text  # fmt: skip


def test_runs_on_other_hardware_are_other_work(tmp_path: Path) -> None:
    gpu = _only({"n48_pp6_mbs2": (172.36, 0.004), "n40_pp10_mbs2": (207.92, 0.004)})
    cpu = _only({"n48_pp6_mbs2": (26000.0, 0.004)})
    cpu["hardware"] = {**cpu["hardware"], "name": "cpu"}
    df = load_sweeps([build_sweep(tmp_path / "gpu", gpu), build_sweep(tmp_path / "cpu", cpu)], queue=None).table
    recs = recommend(df)
    assert [(r.hardware, r.best.sec_per_iter, r.candidates) for r in recs] == [
        ("a100_80gb", 172.36, 2),
        ("cpu", 26000.0, 1),
    ]
    assert recs[1].runner_up is None
    text = format_recommendations(recs)
    assert "Fastest for bloom_200b_l80_h14400 (203B) on a100_80gb, GBS 2048" in text
    assert "Fastest for bloom_200b_l80_h14400 (203B) on cpu, GBS 2048" in text
    assert "of it in the sweep(s): model, hardware cpu, GBS 2048 and sequence length" in text
    # One hardware: the work need not name it (the golden results.md).
    (one,) = recommend(load_sweeps([tmp_path / "gpu"], queue=None).table)
    assert " on a100_80gb" not in format_recommendations([one])


def test_work_with_no_qualifying_run_is_named_beside_the_recommendation(tmp_path: Path) -> None:
    # Two global batches; every run of the second ran out of memory: its work vanished from the
    # recommendation without a line (only GBS 2048's was printed).
    data = copy.deepcopy(fixture())
    extra = copy.deepcopy(next(r for r in data["runs"] if r["name"] == "n48_pp6_mbs2"))
    extra.update(name="gbs4096_oom", status="oom", message="OutOfMemoryError", sec_per_iter=None, tflops=None)
    extra["layout"] = {**extra["layout"], "gbs": 4096}
    data["runs"].append(extra)
    df = load_sweeps([build_sweep(tmp_path / "s", data)], queue=None).table
    recs, others = recommend(df), unqualified(df)
    assert [r.global_batch_size for r in recs] == [2048]
    assert "No recommendation for bloom_200b_l80_h14400 (203B), GBS 4096, sequence 2048: none of its 1 config(s) " \
           "qualifies (1 did not finish (1 OOM))." in others  # fmt: skip
    text = format_recommendations(recs, others=others)
    assert text.startswith("Fastest for bloom_200b_l80_h14400 (203B), GBS 2048") and text.endswith(others[-1])
    # Outside a constraint, said as such.
    limited = unqualified(df, Constraints(max_nodes=8))
    assert any("GBS 2048" in line and "over the 8-node limit" in line for line in limited), limited


def test_nothing_qualifies(tmp_path: Path) -> None:
    df = load_sweeps([build_sweep(tmp_path / "s")], queue=None).table
    assert recommend(df, Constraints(max_nodes=8)) == []
    assert format_recommendations([]).startswith("No recommendation")


def test_a_margin_inside_the_noise_is_no_winner_and_names_what_to_repeat(tmp_path: Path) -> None:
    # Seed 001's two fastest layouts, 161.96 and 172.36 s/it (6.4% apart), as if each run's
    # iterations had spread by 5%: sqrt(5^2 + 5^2) = 7.1% of noise, more than the margin.
    data = copy.deepcopy(fixture())
    noisy = {"n48_pp12_mbs2": 0.05, "n48_pp6_mbs2": 0.05, "n44_pp11_mbs2": 0.01}
    for run in data["runs"]:
        if run["name"] in noisy:
            run["sec_cv"] = noisy[run["name"]]
        if run["name"] == "n48_pp12_mbs2":
            run["neighbours"] = {"nodes": "node[1-48]", "at_start": ["77_1", "78"], "at_end": ["78"]}
    sweep = build_sweep(tmp_path / "s", data)
    # The command line, as a user runs it on a sweep directory.
    proc = subprocess.run(
        [sys.executable, "-m", "analysis", str(sweep), "--no-plots", "--no-queue"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "No clear winner for bloom_200b_l80_h14400 (203B), GBS 2048, sequence 2048: DP=4 TP=8 PP=12" in out
    assert "Fastest for" not in out
    assert "6.4% faster per iteration than the runner-up" in out
    assert "inside the noise" in out and "CV 5.0% and 5.0%, combined 7.1%" in out
    # The top two are within each other's noise; 186.65 s/it is 15% away, outside 5.1%.
    assert "repeat the top 2" in out and "training.train_iters" in out and "cluster.exclusive=true" in out
    assert "parallelism.pp=12" in out and "parallelism.pp=6" in out
    assert "the best shared its nodes with 2 other Slurm job(s)" in out
    # The golden runs asked for whole nodes (a GPU site's cluster.exclusive=true) and still saw
    # neighbours: asking for whole nodes again is no remedy, and the note does not offer it as one.
    assert "it had asked for whole nodes (cluster.exclusive=true), yet Slurm listed them there" in out
    assert "(cluster.exclusive=true asks for whole nodes)" not in out
    table = (sweep / "analysis" / "results.md").read_text()
    assert "| 161.96 | 5.0% |" in table and "beside 2 other job(s)" in table
    # The example puts the new values after the run's overrides: Hydra keeps the last value of a key,
    # and a run's own overrides may set training.train_iters (the advice said the opposite order,
    # which reran with the old count).
    assert "hydra/launcher=slurm <its overrides> training.train_iters=<more> cluster.exclusive=true`" in out
    assert compose_run(["training.train_iters=4", "training.train_iters=9"]).training.train_iters == 9
    assert compose_run(["training.train_iters=9", "training.train_iters=4"]).training.train_iters == 4


def test_a_slower_run_whose_spread_reaches_the_best_leaves_no_clear_winner(tmp_path: Path) -> None:
    # The runner-up (172.36 s/it) is 6.4% behind with 1.4% of combined noise, but the third (186.65,
    # 15.2% behind) spread by 25%: sqrt(1^2 + 25^2) = 25.0% reaches the best. The verdict looked at
    # the runner-up alone and called a winner.
    data = copy.deepcopy(fixture())
    for run in data["runs"]:
        run["sec_cv"] = {"n48_pp12_mbs2": 0.01, "n48_pp6_mbs2": 0.01, "n44_pp11_mbs2": 0.25}.get(run["name"], 0.01)
    (rec,) = recommend(load_sweeps([build_sweep(tmp_path / "s", data)], queue=None).table)
    assert rec.margin_pct is not None and rec.noise_pct is not None and rec.margin_pct > rec.noise_pct
    assert [c.sec_per_iter for c in rec.close] == [186.65] and not rec.decided
    text = format_recommendations([rec])
    assert text.startswith("No clear winner for") and "Fastest for" not in text
    assert "outside the noise (CV 1.0% and 1.0%, combined 1.4%); but slower runs' iterations spread" in text
    assert "CV 25.0%), so a rerun could put one of them first" in text
    # The best and the third, not "the top 2": the runner-up is outside the noise.
    assert "repeat these 2 (within the noise of each other)" in text and "parallelism.pp=11" in text


def test_the_repeat_command_leaves_a_layout_searchs_own_options_out(tmp_path: Path) -> None:
    # A searched sweep's runs record search.* options, which a sweep without the search refuses.
    data = copy.deepcopy(fixture())
    for run in data["runs"]:
        run["sec_cv"] = {"n48_pp12_mbs2": 0.01, "n48_pp6_mbs2": 0.01, "n44_pp11_mbs2": 0.25}.get(run["name"], 0.01)
        run["extra_overrides"] = ["search.nodes=[44,48]", "search.top_k=5"]
    (rec,) = recommend(load_sweeps([build_sweep(tmp_path / "s", data)], queue=None).table)
    text = format_recommendations([rec])
    (advice,) = _lines(rec, "- to decide:")
    listed = text.split(advice, 1)[1]
    assert "parallelism.pp=11" in listed and "search." not in listed, listed


def test_a_margin_outside_the_noise_is_a_winner(tmp_path: Path) -> None:
    data = _two_layouts()
    for run in data["runs"]:
        run["sec_cv"] = 0.03  # 4.2% of noise against a 20.6% margin
    df = load_sweeps([build_sweep(tmp_path / "s", data)], queue=None).table
    (rec,) = recommend(df)
    assert rec.decided and rec.noise_pct == pytest.approx(100 * (2 * 0.03**2) ** 0.5)
    text = format_recommendations([rec])
    assert text.startswith("Fastest for") and "outside the noise (CV 3.0% and 3.0%, combined 4.2%)" in text


def test_unknown_noise_calls_no_winner_and_asks_for_measured_spreads(tmp_path: Path) -> None:
    data = _two_layouts()
    for run in data["runs"]:
        run["sec_cv"] = None  # one measured iteration each, or a table imported without spreads
    df = load_sweeps([build_sweep(tmp_path / "s", data)], queue=None).table
    (rec,) = recommend(df)
    assert rec.noise_pct is None and rec.margin_pct is not None and not rec.decided
    text = format_recommendations([rec])
    assert text.startswith("No clear winner for") and "(noise unknown)" in text.splitlines()[0]
    assert "repeat the top 2 (at least two measured iterations each" in text
    assert "parallelism.pp=6" in text and "parallelism.pp=10" in text


# ---------------------------------------------------------------------------------------------
# Predicted best against measured best


def _predicted(tmp_path: Path, factors: list[float]) -> tuple[Recommendation, list[float], list[float]]:
    """The recommendation over PREDICTED_LAYOUTS measured at factors x prediction; predictions; measured."""
    data, predicted = predicted_sweep_data(factors)
    (rec,) = recommend(load_sweeps([build_sweep(tmp_path / "s", data)], queue=None).table)
    return rec, predicted, [run["sec_per_iter"] for run in data["runs"]]


def test_the_predicted_best_that_measured_best_is_said_so(tmp_path: Path) -> None:
    # Every run 10-20% slower than predicted, the predicted order kept.
    rec, predicted, measured = _predicted(tmp_path, [1.1, 1.15, 1.2, 1.12, 1.18])
    fastest = min(range(len(measured)), key=measured.__getitem__)
    assert fastest == min(range(len(predicted)), key=predicted.__getitem__)
    assert rec.best.sec_per_iter == measured[fastest] and rec.best.pred_sec_per_iter == predicted[fastest]
    assert rec.predicted_rank == 1 and rec.predicted_best == rec.best and rec.predicted_best_slower_pct == 0.0
    text = format_recommendations([rec])
    assert (
        f"- prediction: the time model also predicted it fastest of the {len(measured)} "
        f"(predicted {format_sec(predicted[fastest])} s/it, Err {format_err(predicted[fastest] / measured[fastest] - 1)}): "
        "the predicted best was the measured best"
    ) in text


def test_a_predicted_best_that_measured_slower_is_named_with_how_much_slower(tmp_path: Path) -> None:
    _, predicted = predicted_sweep_data([1.0] * 5)
    favourite = min(range(len(predicted)), key=predicted.__getitem__)
    # The model's favourite measured slowest of all (10% behind the slowest prediction), the others as predicted.
    factors = [1.1 * max(predicted) / p if i == favourite else 1.0 for i, p in enumerate(predicted)]
    rec, predicted, measured = _predicted(tmp_path, factors)
    fastest = min(range(len(measured)), key=measured.__getitem__)
    assert fastest != favourite
    rank = 1 + sum(p < predicted[fastest] for p in predicted)
    slower = 100 * (measured[favourite] / measured[fastest] - 1)
    assert rec.predicted_best is not None and rec.predicted_best.sec_per_iter == measured[favourite]
    assert rec.predicted_rank == rank and rec.predicted_best_slower_pct == pytest.approx(slower)
    text = format_recommendations([rec])
    assert (
        f"- prediction: the predicted best was not the measured best: the time model predicted "
        f"{rec.predicted_best.label} fastest (predicted {format_sec(predicted[favourite])} s/it, Err "
        f"{format_err(1 / factors[favourite] - 1)}), "
        f"which measured {format_sec(measured[favourite])} s/it, {slower:.1f}% slower per iteration than the "
        f"measured fastest; the model ranked the measured fastest {rank} of {len(measured)} "
        f"(predicted {format_sec(predicted[fastest])} s/it, Err {format_err(predicted[fastest] / measured[fastest] - 1)})"
    ) in text


def test_no_prediction_line_unless_every_compared_run_was_predicted(tmp_path: Path) -> None:
    # The BLOOM fixture's hardware lacks the memory bandwidth the time model needs.
    df = load_sweeps([build_sweep(tmp_path / "s")], queue=None).table
    (rec,) = recommend(df)
    assert rec.predicted_best is None and rec.predicted_rank is None
    assert "prediction:" not in format_recommendations([rec])


def test_a_run_whose_record_gives_no_layout_is_left_out_and_counted(tmp_path: Path) -> None:
    # A result.json copied out of its sweep, or written by hand, may not say how many nodes or
    # which degrees it ran with: the recommendation leaves it out and says so, rather than failing.
    df = load_sweeps([build_sweep(tmp_path / "s")], queue=None).table
    fastest = df["sec_per_iter"].idxmin()
    (before,) = recommend(df)
    damaged = df.copy()
    damaged.loc[fastest, "nodes"] = float("nan")
    damaged.loc[df["sec_per_iter"].nlargest(1).index, "dp"] = 0.0  # as a record with no world would read
    (rec,) = recommend(damaged)
    assert rec.candidates == before.candidates - 2
    assert rec.best.sec_per_iter > before.best.sec_per_iter == df.loc[fastest, "sec_per_iter"]
    assert any(e.startswith("2 whose record does not give its layout") for e in rec.excluded), rec.excluded
    assert "2 whose record does not give its layout" in format_recommendations([rec])


def test_the_memory_limit_judges_a_layout_by_its_runs_highest_peak(tmp_path: Path) -> None:
    # The fastest layout ran in two sweeps, peaking at 43 and 52 GiB: --max-mem-gib 50 left out the
    # second run only, and the layout stood, pooled from its run below the limit.
    a = build_sweep(tmp_path / "a")
    data = copy.deepcopy(fixture())
    next(r for r in data["runs"] if r["name"] == "n48_pp12_mbs2")["mem_gib"] = 52.0
    b = build_sweep(tmp_path / "b", data)
    (rec,) = recommend(load_sweeps([a, b], queue=None).table, Constraints(max_mem_gib=50.0))
    assert (rec.best.dp, rec.best.pp, rec.best.sec_per_iter) == (8, 6, 172.36)
    assert "4 above 50 GiB per device" in rec.excluded, rec.excluded  # its two runs, and DP=4 PP=10 MBS=4's two


def test_a_run_without_measured_memory_is_not_called_above_the_memory_limit(tmp_path: Path) -> None:
    # --max-mem-gib 50 with a run that recorded no peak memory: it was excluded as "above 50 GiB
    # per device", a figure nobody measured.
    data = copy.deepcopy(fixture())
    next(r for r in data["runs"] if r["name"] == "n48_pp12_mbs2")["mem_gib"] = None
    df = load_sweeps([build_sweep(tmp_path / "s", data)], queue=None).table
    (rec,) = recommend(df, Constraints(max_mem_gib=50.0))
    assert (rec.best.dp, rec.best.pp, rec.best.sec_per_iter) == (8, 6, 172.36)
    assert "1 above 50 GiB per device" in rec.excluded  # DP=4 PP=10 MBS=4 at 55 GiB
    assert "1 with no measured peak memory to check against --max-mem-gib" in rec.excluded


def test_a_run_without_its_layout_is_counted_once_under_constraints(tmp_path: Path) -> None:
    # With --max-nodes and --dp-multiple, a run whose record gives no nodes or DP was counted
    # twice or thrice: as without its layout, and as "over the 44-node limit" and "with DP not a
    # multiple of 4" (NaN compared False), figures it does not have.
    df = load_sweeps([build_sweep(tmp_path / "s")], queue=None).table
    damaged = df.copy()
    damaged.loc[df["sec_per_iter"].idxmin(), ["nodes", "dp"]] = float("nan")
    (rec,) = recommend(damaged, Constraints(max_nodes=44, dp_multiple_of=4))
    assert "1 whose record does not give its layout (nodes, devices, DP, TP, PP and micro-batch, each at least 1)" in rec.excluded
    assert "1 over the 44-node limit" in rec.excluded  # DP=8 PP=6 on 48 nodes; the damaged run not again
    assert not any("not a multiple" in e for e in rec.excluded)


# ---------------------------------------------------------------------------------------------
# What the recommendation says of memory and of the cluster, from the records' configs


def _edit_record(path: Path, **fields: object) -> None:
    record = json.loads(path.read_text())
    record.update(fields)
    path.write_text(json.dumps(record))


def _lines(rec: Recommendation, start: str) -> list[str]:
    return [line for line in format_recommendations([rec]).splitlines() if line.startswith(start)]


def test_a_peak_above_the_device_memory_is_flagged_not_satisfied(tmp_path: Path) -> None:
    # A hand-edited record: the best run's peak (45.2 GiB) raised above the A100's 79.15 GiB. It
    # read "constraints satisfied: ... peak memory 85.0 GiB per device of 78.2 GiB usable".
    sweep = build_sweep(tmp_path / "s", _two_layouts())
    _edit_record(sweep / "runs" / "1" / "result.json", max_mem_gib=85.0, max_mem_gib_per_rank=[82.0, 85.0])
    (rec,) = recommend(load_sweeps([sweep], queue=None).table)
    assert (rec.best.sec_per_iter, rec.best.mem_gib, rec.best.mem_device_gib) == (172.36, 85.0, 79.15)
    (unmet,) = _lines(rec, "- constraint not met:")
    assert "peak memory 85.00 GiB per device is above the 79.15 GiB of the device its hardware config" in unmet
    assert "a device with more memory than hardware.memory_gib says, or a wrong record" in unmet
    (satisfied,) = _lines(rec, "- constraints satisfied:")
    assert "peak memory" not in satisfied and satisfied.startswith("- constraints satisfied: finished")
    # Within the device but above its usable 78.15 GiB (79.15 less the 1 GiB reserve): said so too.
    _edit_record(sweep / "runs" / "1" / "result.json", max_mem_gib=78.5, max_mem_gib_per_rank=[78.0, 78.5])
    (rec,) = recommend(load_sweeps([sweep], queue=None).table)
    assert _lines(rec, "- constraint not met:") == [
        "- constraint not met: peak memory 78.50 GiB per device is above the 78.15 GiB usable (hardware.memory_gib "
        "less memory_reserve_gib): it left less free than the reserve the planner keeps"
    ]
    # The runner-up's 43 GiB fits: when it is the best, its memory is satisfied as before.
    _edit_record(sweep / "runs" / "0" / "result.json", sec_per_iter=100.0)
    (rec,) = recommend(load_sweeps([sweep], queue=None).table)
    assert rec.best.mem_gib == 43.0 and _lines(rec, "- constraint not met:") == []
    assert "peak memory 43.0 GiB per device of 78.2 GiB usable" in _lines(rec, "- constraints satisfied:")[0]
    # A small run's peak keeps the digits its comparison needs: "0.5 GiB <= 0.55 GiB" read as rounding.
    _edit_record(sweep / "runs" / "0" / "result.json", max_mem_gib=0.534, max_mem_gib_per_rank=[0.5, 0.534])
    (rec,) = recommend(load_sweeps([sweep], queue=None).table, Constraints(max_mem_gib=0.55))
    assert "peak memory 0.53 GiB per device of 78.2 GiB usable; peak memory 0.53 GiB <= 0.55 GiB (--max-mem-gib)" in (
        _lines(rec, "- constraints satisfied:")[0])  # fmt: skip


def test_a_run_on_a_larger_device_than_its_config_says_is_flagged_with_why(tmp_path: Path) -> None:
    # Real runs on 80 GB A100s whose config said a100_40gb (39.59 GiB): their 43 and 45.2 GiB peaks
    # are real, and the layout would not fit the 40 GB device the config describes.
    data = _two_layouts()
    data["hardware"] = hardware_conf("a100_40gb")
    sweep = build_sweep(tmp_path / "s", data)
    for run in ("0", "1"):
        _edit_record(sweep / "runs" / run / "result.json", device_memory_gib=79.15)
    (rec,) = recommend(load_sweeps([sweep], queue=None).table)
    (unmet,) = _lines(rec, "- constraint not met:")
    assert "peak memory 45.20 GiB per device is above the 39.59 GiB of the device its hardware config" in unmet
    assert "hardware=a100_40gb does not describe this device: the device has 79.15 GiB" in unmet
    assert "peak memory" not in _lines(rec, "- constraints satisfied:")[0]


def test_a_best_that_ran_on_another_device_is_flagged_not_silently_fastest(tmp_path: Path) -> None:
    # A sweep of a100_80gb whose faster job landed on an H100 node: it won as "Fastest for ..." with
    # no word of the device (its memory fits, so the memory check said nothing either).
    sweep = build_sweep(tmp_path / "s", _two_layouts())
    record = json.loads((sweep / "runs" / "1" / "result.json").read_text())
    config = {**record["config"], "hardware": {**record["config"]["hardware"], "device_pattern": "A100"}}
    _edit_record(sweep / "runs" / "1" / "result.json", device="NVIDIA H100 80GB HBM3", config=config)
    (rec,) = recommend(load_sweeps([sweep], queue=None).table)
    assert rec.best.sec_per_iter == 172.36 and rec.best.device_mismatch
    (unmet,) = _lines(rec, "- constraint not met:")
    assert unmet.startswith("- constraint not met: it ran on a device its hardware config does not describe (")
    assert "'NVIDIA H100 80GB HBM3'" in unmet and "may not be the fastest on the device the config names" in unmet
    # The same runs on the device their config names: nothing to flag.
    (clean,) = recommend(load_sweeps([build_sweep(tmp_path / "t", _two_layouts())], queue=None).table)
    assert clean.unmet == ()


def _noisy(cluster: dict | None) -> dict:
    """The golden runs with the two fastest inside each other's noise and the best beside two other
    jobs, under `cluster` (the fixture's GPU site when None)."""
    data = copy.deepcopy(fixture())
    if cluster is not None:
        data["cluster"] = cluster
    for run in data["runs"]:
        if run["name"] in ("n48_pp12_mbs2", "n48_pp6_mbs2"):
            run["sec_cv"] = 0.05
        if run["name"] == "n48_pp12_mbs2":
            run["neighbours"] = {"nodes": "node[1-48]", "at_start": ["77_1", "78"], "at_end": ["78"]}
    return data


def test_on_the_local_cluster_the_advice_is_its_core_license_not_whole_nodes(tmp_path: Path) -> None:
    # Runs recorded under conf/cluster/local.yaml (cluster=local): its emulated nodes share one host, so
    # cluster.exclusive=true isolated nothing; the `cores` license is what keeps its runs apart.
    local = hardware_conf("local", "cluster")
    assert (local["name"], local["exclusive"], local["core_license"]) == ("local", False, "cores")
    (rec,) = recommend(load_sweeps([build_sweep(tmp_path / "s", _noisy(local))], queue=None).table)
    assert (rec.best.cluster, rec.best.exclusive, rec.best.core_license) == ("local", False, "cores")
    text = format_recommendations([rec])
    assert "repeat the top 2" in text and "cluster.exclusive=true" not in text
    (advice,) = _lines(rec, "- to decide:")
    assert "cluster local's `cores` license (cluster.core_license)" in advice
    assert advice.endswith("`python -m train -m hydra/launcher=slurm <its overrides> training.train_iters=<more>` "
                           "(this last: Hydra keeps the last value given for a key, and a run's overrides may set it):")
    (shared,) = _lines(rec, "- the best shared its nodes")
    assert "`cores` license (cluster.core_license) kept the jobs running together to no more CPUs" in shared


def test_runs_of_this_machine_are_advised_the_local_launcher_not_slurm(tmp_path: Path) -> None:
    # A hydra/launcher=local sweep (its manifest names no Slurm job, its records looked at no job's nodes):
    # the advice was a Slurm launch on whole nodes, which such a user may not have.
    data = _noisy(None)
    for run in data["runs"]:
        run.pop("neighbours", None)
    sweep = build_sweep(tmp_path / "s", data)
    manifest = sweep / MANIFEST_FILE
    entries = [json.loads(line) for line in manifest.read_text().splitlines()]
    manifest.write_text("".join(json.dumps({**e, "job_id": None}) + "\n" for e in entries))
    (rec,) = recommend(load_sweeps([sweep], queue=None).table)
    (advice,) = _lines(rec, "- to decide:")
    assert "as a sweep of their own on this machine, whose launcher runs them one at a time" in advice
    assert "hydra/launcher=local <its overrides> training.train_iters=<more>`" in advice
    assert "slurm" not in advice and "whole nodes" not in advice and "license" not in advice
    # Runs sbatch started by hand have no manifest, but the best's record saw its job's nodes: Slurm's advice.
    by_hand = build_sweep(tmp_path / "t", _noisy(None))
    (by_hand / MANIFEST_FILE).unlink()
    (rec,) = recommend(load_sweeps([by_hand], queue=None).table)
    assert rec.best.slurm and "hydra/launcher=slurm" in _lines(rec, "- to decide:")[0]


def test_without_whole_nodes_or_a_license_the_advice_is_whole_nodes(tmp_path: Path) -> None:
    # A GPU site's cluster config with whole nodes turned off: whole nodes are what would isolate the runs.
    shared_site = {**hardware_conf("generic_gpu", "cluster"), "exclusive": False}
    (rec,) = recommend(load_sweeps([build_sweep(tmp_path / "s", _noisy(shared_site))], queue=None).table)
    (advice,) = _lines(rec, "- to decide:")
    assert "on whole nodes (cluster.exclusive=true)" in advice and "license" not in advice
    assert advice.endswith("training.train_iters=<more> cluster.exclusive=true` (these two last: Hydra keeps the "
                           "last value given for a key, and a run's overrides may set them):")
    (shared,) = _lines(rec, "- the best shared its nodes")
    assert shared.endswith("its timing includes their load (cluster.exclusive=true asks for whole nodes)")
    # The fixture's own runs asked for whole nodes: the advice keeps them, the note does not offer them again.
    (rec,) = recommend(load_sweeps([build_sweep(tmp_path / "t", _noisy(None))], queue=None).table)
    assert "on whole nodes (cluster.exclusive=true)" in _lines(rec, "- to decide:")[0]
    assert "it had asked for whole nodes (cluster.exclusive=true)" in _lines(rec, "- the best shared its nodes")[0]


def test_configs_whose_work_is_not_known_yet_are_said_not_compared(tmp_path: Path) -> None:
    # A launched sweep has no plan.csv: a config still pending (or ended without a record) has no model
    # or global batch, so no work group held it, and the one finished run read as the only candidate.
    sweep = build_sweep(tmp_path / "sweep")
    (sweep / "plan.csv").unlink()
    df = load_sweeps([sweep], queue=None).table
    text = recommendation_text(df, recommend(df))
    assert text.endswith(
        "Not compared: 1 config(s) whose work (model, global batch) nothing read here says, with no record and no "
        "plan row (1 pending). The pending and running ones are compared once they write their records; a dry run "
        "of the sweep's configs into its directory (hydra/launcher=plan, hydra.launcher.append=true) places them now."
    ), text
    # With the plan, the pending config is in its work's group, counted there, and nothing is left over.
    placed = load_sweeps([build_sweep(tmp_path / "planned")], queue=None).table
    text = recommendation_text(placed, recommend(placed))
    assert "Not compared" not in text and "1 still pending or running" in text
