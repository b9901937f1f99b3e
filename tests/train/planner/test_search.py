"""train.planner.search: the layouts a search tries, the planner's judgement of each, the ranking."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from conf.schema import Engine, ParallelismConfig, Recompute, RunConfig, SearchConfig
from train.planner.rules import validate
from train.planner.search import (
    format_search,
    layout_overrides,
    layouts,
    scaling_lines,
    search_layouts,
    search_problems,
    top_layouts,
)

from .test_plan import compose_run

GPT = ("model=gpt_1.3b", "hardware=a100_80gb", "parallelism.precision=bf16", "parallelism.global_batch_size=512")


def gpt_1_3b() -> RunConfig:
    return compose_run(*GPT)


def layout_dp(p: ParallelismConfig) -> int:
    assert p.dp is not None  # layouts() sets dp from the device count: a search never leaves it to the world size
    return p.dp


def test_layouts_cover_every_factorisation_of_each_node_count() -> None:
    run = gpt_1_3b()
    search = SearchConfig(nodes=[1, 2], micro_batch_sizes=[1, 4], recompute=[Recompute.none, Recompute.full],
                          zero_stages=[0, 1], sequence_parallel=[False], virtual_stages=[1])
    seen = list(layouts(run, search))
    # 8 devices: (tp, pp) over 10 ordered factorisations; 16 devices: 15; 24 layers allow every pp here.
    shapes = {(d, layout_dp(p), p.tp, p.pp) for d, p in seen}
    assert len([s for s in shapes if s[0] == 8]) == 10 and len([s for s in shapes if s[0] == 16]) == 15
    assert all(layout_dp(p) * p.tp * p.pp == d for d, p in seen)
    # ZeRO over one replica is not tried twice; ZeRO 2-3 would run on DeepSpeed.
    assert not any(p.zero_stage and p.dp == 1 for _, p in seen)
    replicas = sum(1 for s in shapes if s[1] > 1)
    assert len(seen) == (len(shapes) + replicas) * 2 * 2
    deep = list(layouts(run, dataclasses.replace(search, zero_stages=[2], sequence_parallel=[False, True])))
    assert deep and all(p.engine == Engine.deepspeed and not p.sequence_parallel for _, p in deep)
    # Sequence parallel doubles the native layouts with tp > 1, and only those.
    both = list(layouts(run, dataclasses.replace(search, sequence_parallel=[False, True])))
    assert {p for _, p in both if not p.sequence_parallel} == {p for _, p in seen}
    assert {dataclasses.replace(p, sequence_parallel=False) for _, p in both if p.sequence_parallel} == {
        p for _, p in seen if p.tp > 1
    }
    # Virtual stages: tried on native pipelines whose chunks hold whole layers (24 layers) and whose
    # steps run whole groups of pp micro-batches (512 / (mbs x dp)), never on DeepSpeed.
    chunky = list(layouts(run, dataclasses.replace(search, virtual_stages=[1, 2, 5])))
    assert {p for _, p in chunky if p.virtual_stages == 1} == {p for _, p in seen}
    interleaved = [p for _, p in chunky if p.virtual_stages > 1]
    assert interleaved and {p.virtual_stages for p in interleaved} == {2}  # 5 splits no pp's layers
    expected = {p for _, p in seen if p.pp > 1 and 24 % (2 * p.pp) == 0 and (512 // (p.mbs * layout_dp(p))) % p.pp == 0}
    assert {dataclasses.replace(p, virtual_stages=1) for p in interleaved} == expected
    deep = list(layouts(run, dataclasses.replace(search, zero_stages=[2], virtual_stages=[1, 2])))
    assert all(p.virtual_stages == 1 for _, p in deep)


def test_ranked_layouts_are_feasible_fastest_first_and_reproducible_from_their_overrides() -> None:
    run = gpt_1_3b()
    result = search_layouts(run, SearchConfig(nodes=[1, 2]))
    assert result.ranked and not result.unpredicted
    times = [c.row.pred_sec_per_iter for c in result.ranked]
    assert times == sorted(times)
    assert [c.row.pred_rank for c in result.ranked] == list(range(1, len(times) + 1))
    for c in result.ranked[:5]:
        assert validate(c.run, world_size=c.row.devices) == []
        again = compose_run("model=gpt_1.3b", "hardware=a100_80gb", "parallelism.precision=bf16",
                            "parallelism.global_batch_size=512", *c.overrides)
        assert again.parallelism == c.run.parallelism
        assert c.overrides == layout_overrides(c.run.parallelism) and c.row.overrides == " ".join(c.overrides)
    assert sum(result.rejected.values()) >= result.candidates - len(result.ranked)
    text = format_search(result, show=4)
    # Header, 4 layouts, the summary, the fastest of each node count under a heading, the rules line and
    # one example per rule.
    nodes = len({c.row.nodes for c in result.ranked})
    assert nodes > 1 and len(text.splitlines()) == 1 + 4 + 1 + (1 + nodes) + 1 + len(result.rejected)
    assert "where the time goes" in text and "rejected by rule" in text


def test_each_rejecting_rule_is_shown_with_an_example_reason() -> None:
    # A V100 has no bf16: the count alone gave no hint that fp16 or fp32 would do.
    run = compose_run(*GPT, "hardware=v100_32gb")
    result = search_layouts(run, SearchConfig(nodes=[1], micro_batch_sizes=[1]))
    assert not result.ranked and result.rejected["precision_supported"] == result.candidates
    text = format_search(result, show=3)
    example = next(line for line in text.splitlines() if line.startswith("  [precision_supported] e.g. "))
    assert "parallelism.tp=" in example and "Valid precision on v100_32gb: fp16, fp32" in example


def test_cpu_layouts_are_feasible_but_unpredicted() -> None:
    run = compose_run("hardware.devices_per_node=2")
    result = search_layouts(run, SearchConfig(nodes=[1], micro_batch_sizes=[1]))
    assert result.unpredicted and not result.ranked


def test_unpredicted_layouts_carry_the_time_model_reason(tmp_path: Path) -> None:
    # A calibration file that is missing or empty left every layout unpredicted without saying why.
    small = SearchConfig(nodes=[1], micro_batch_sizes=[4], recompute=[Recompute.none], zero_stages=[0],
                         sequence_parallel=[False], virtual_stages=[1])  # fmt: skip
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    for path, why in ((tmp_path / "missing.json", "cannot be read"), (empty, "version None")):
        run = compose_run(*GPT, f"hardware.calibration={path}")
        result = search_layouts(run, small)
        assert result.unpredicted and not result.ranked
        [(reason, n)] = result.unpredictable.items()
        assert f"hardware.calibration='{path}'" in reason and why in reason and n == len(result.unpredicted)
        assert all(f"[unpredicted] {reason}" in c.row.warnings for c in result.unpredicted)
        assert f"unpredicted ({n}): {reason}" in format_search(result, show=3)


def test_a_predicted_mfu_above_100_percent_is_flagged() -> None:
    result = search_layouts(gpt_1_3b(), SearchConfig(nodes=[1], micro_batch_sizes=[4]))
    assert "MFU above 100%" not in format_search(result, show=3)
    first = result.ranked[0]
    wrong = dataclasses.replace(first, row=dataclasses.replace(first.row, pred_mfu=1.48))
    text = format_search(dataclasses.replace(result, ranked=[wrong, *result.ranked[1:]]), show=3)
    assert "warning: 1 ranked layouts predict an MFU above 100%" in text and "hardware.calibration" in text


def test_a_value_listed_twice_is_searched_once() -> None:
    once = SearchConfig(nodes=[1], micro_batch_sizes=[4], recompute=[Recompute.none], zero_stages=[0])
    twice = SearchConfig(nodes=[1, 1], micro_batch_sizes=[4, 4], recompute=[Recompute.none, Recompute.none],
                         zero_stages=[0, 0])  # fmt: skip
    assert list(layouts(gpt_1_3b(), twice)) == list(layouts(gpt_1_3b(), once))


def test_an_option_that_leaves_nothing_to_try_or_divides_by_zero_is_refused() -> None:
    assert search_problems(SearchConfig()) == []
    bad = SearchConfig(nodes=[0], micro_batch_sizes=[0], recompute=[], zero_stages=[4], virtual_stages=[0],
                       top_k=-1, show=-1)  # fmt: skip
    problems = " ".join(search_problems(bad))
    for option in ("nodes=[0]", "micro_batch_sizes=[0]", "recompute=[]", "zero_stages=[4]", "virtual_stages=[0]",
                   "top_k=-1", "show=-1"):  # fmt: skip
        assert f"search.{option} must be" in problems
    assert "e.g. search.micro_batch_sizes=[1,2,4,8]" in problems


def test_the_top_k_is_of_all_node_counts_or_of_each_and_one_node_count_has_no_scaling_line() -> None:
    search = SearchConfig(nodes=[1, 2], micro_batch_sizes=[4], recompute=[Recompute.none], zero_stages=[0],
                          sequence_parallel=[False], virtual_stages=[1], top_k=2)  # fmt: skip
    result = search_layouts(gpt_1_3b(), search)
    assert top_layouts(result, search) == result.ranked[:2]
    assert {c.row.nodes for c in result.ranked[:2]} == {2}
    each = top_layouts(result, dataclasses.replace(search, top_k_per_node_count=True))
    assert [c.row.nodes for c in each] == [1, 1, 2, 2]
    assert each[2:] == result.ranked[:2] and each[:2] == [c for c in result.ranked if c.row.nodes == 1][:2]
    assert scaling_lines(result)[1].startswith("  1 node(s): rank ") and len(scaling_lines(result)) == 3
    alone = search_layouts(gpt_1_3b(), dataclasses.replace(search, nodes=[2]))
    assert scaling_lines(alone) == [] and "fastest per node count" not in format_search(alone, 3)


def test_a_node_count_without_a_ranked_layout_says_why_and_the_baseline_is_named() -> None:
    # 175B on one node fits no layout: the scaling lines started at 16 nodes without a word of the one.
    run = compose_run("model=gpt3_175b", "hardware=a100_80gb", "parallelism.precision=bf16",
                      "parallelism.global_batch_size=512")  # fmt: skip
    search = SearchConfig(nodes=[16, 1, 32], micro_batch_sizes=[1], recompute=[Recompute.full], zero_stages=[1],
                          sequence_parallel=[False], virtual_stages=[1])  # fmt: skip
    result = search_layouts(run, search)
    assert result.nodes == (1, 16, 32)
    lines = scaling_lines(result)
    assert lines[0] == "fastest per node count (speed-up and scaling efficiency against the fastest on 16 node(s)):"
    assert lines[1] == "  1 node(s): no feasible layout"
    assert lines[2].startswith("  16 node(s): rank ") and "efficiency" not in lines[2]
    assert lines[3].startswith("  32 node(s): rank ") and "% efficiency)" in lines[3]
    # Feasible but unpredicted (no inter-node bandwidth: two nodes cannot be priced) is said as such.
    tiny = compose_run("model=tiny", "hardware=cpu", "hardware.peak_measured=false", "hardware.peak_tflops_fp32=1",
                       "hardware.memory_bw_gbs=10", "hardware.intra_node_bw_gbs=10", "hardware.devices_per_node=2",
                       "parallelism.global_batch_size=8")  # fmt: skip
    small = search_layouts(tiny, dataclasses.replace(search, nodes=[1, 2]))
    assert {c.row.nodes for c in small.ranked} == {1} and {c.row.nodes for c in small.unpredicted} == {2}
    assert scaling_lines(small)[2] == f"  2 node(s): {len(small.unpredicted):,} feasible, none predicted"
