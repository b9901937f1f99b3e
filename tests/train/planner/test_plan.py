"""The planner: one row per config, its table and its CSV."""

from __future__ import annotations

import csv
import dataclasses
import itertools
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conf.schema import Recompute, RunConfig
from train.contract import PLAN_COLUMNS, PlanRow, read_plan_csv, write_plan_csv
from train.planner.flops import hardware_flops_per_iteration, model_flops_per_iteration
from train.planner.memory import estimate_memory
from train.planner.plan import format_params, format_plan_table, plan_run
from train.planner.rules import validate
from train.planner.shapes import shape_report
from train.planner.sizes import total_params

ROOT = Path(__file__).resolve().parents[3]


def compose_run(*overrides: str) -> RunConfig:
    from hydra import compose, initialize_config_dir

    from conf.schema import register_configs, to_run_config

    register_configs()  # here, not in conftest alone: `python -m tests.bench bench_search` composes with it
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return to_run_config(compose("config", overrides=list(overrides)))


def bloom_181b(pp: int) -> RunConfig:
    # Seed 001, "Choosing the fastest 3D Topology" with the ramp-up constraint applied:
    #   | 48 | 183B |  4 |  8 | 12 |   1 | 2048 | 30GB | 172.40 |  90.84 | 02-20 |
    # (48 nodes of 8 A100 80GB, DP=4, TP=8, PP=12, MBS=1, GBS=2048, ZeRO-1).
    return compose_run(
        "model=bloom_181b_l72_h14336", "hardware=a100_80gb", "parallelism=megatron_3d",
        f"parallelism.pp={pp}", "parallelism.global_batch_size=2048", "parallelism.micro_batch_size=1",
        "parallelism.rampup_batch_size=[32,32,6000000]",
    )


def test_tiny_is_feasible_and_every_figure_comes_from_its_module() -> None:
    run = compose_run()
    row = plan_run(run)
    assert row.feasible and row.reasons == []
    assert (row.model, row.hardware) == ("tiny", "cpu")
    assert (row.nodes, row.devices, row.dp, row.tp, row.pp) == (1, 1, 1, 1, 1)
    assert (row.micro_batch_size, row.global_batch_size) == (4, 8)
    assert row.params == total_params(run.model, 1)
    assert row.mem_gib == pytest.approx(estimate_memory(run.model, run.parallelism, dp=1, hardware=run.hardware).needed / 2**30)
    assert row.mem_capacity_gib == pytest.approx(16.0 - 2.0)
    assert row.quant_efficiency == pytest.approx(shape_report(run.model, run.parallelism, run.hardware).efficiency)
    assert 0 < row.quant_efficiency <= 1
    assert row.model_flops_per_iter == pytest.approx(model_flops_per_iteration(run.model, global_batch_size=8))
    assert row.hardware_flops_per_iter == pytest.approx(
        hardware_flops_per_iteration(run.model, global_batch_size=8, recompute=Recompute.none)
    )
    assert row.overrides == ""
    assert plan_run(run, overrides="model=tiny").overrides == "model=tiny"


def test_gpt3_175b_on_one_a100_is_infeasible_for_memory() -> None:
    run = compose_run("model=gpt3_175b", "hardware=a100_80gb", "parallelism=megatron_3d", "parallelism.tp=1")
    row = plan_run(run, world_size=1)
    assert not row.feasible
    assert len(row.reasons) == 1 and row.reasons[0].startswith("[memory] Predicted memory")
    assert row.mem_gib > row.mem_capacity_gib == pytest.approx(79.15)
    # 175B parameters at 20 bytes each (seed 000) are ~3.3 TB before activations.
    assert row.mem_gib > 175e9 * 16 / 2**30
    assert row.params == pytest.approx(175e9, rel=0.01)
    assert (row.nodes, row.devices) == (1, 1)
    # Still planned in full: the FLOPs do not depend on fitting.
    assert row.model_flops_per_iter > 0 and row.hardware_flops_per_iter > row.model_flops_per_iter


def test_bloom_181b_fits_with_enough_pipeline_stages() -> None:
    row = plan_run(bloom_181b(pp=12), world_size=48 * 8)
    assert row.feasible, row.reasons
    assert (row.nodes, row.devices, row.dp, row.tp, row.pp) == (48, 384, 4, 8, 12)
    assert row.params == pytest.approx(181e9, rel=0.01)
    # The notes measured 30 GB on this layout; the estimate must at least fit the 80 GB card.
    assert row.mem_gib < row.mem_capacity_gib
    too_few = plan_run(bloom_181b(pp=1), world_size=48 * 8)  # dp = 48: the ramp-up (32 % 48) breaks too
    assert not too_few.feasible
    assert any(r.startswith("[memory] Predicted memory") for r in too_few.reasons)
    assert too_few.mem_gib > too_few.mem_capacity_gib


def test_structurally_broken_config_still_gets_a_row() -> None:
    run = compose_run("parallelism.tp=3", "parallelism.zero_stage=7")
    row = plan_run(run)
    assert not row.feasible
    assert len(row.reasons) == len(validate(run)) >= 4
    # No GEMM shapes for tp=3 over 4 heads, no memory without a ZeRO stage; the model FLOPs do exist.
    assert math.isnan(row.quant_efficiency) and math.isnan(row.mem_gib)
    assert row.model_flops_per_iter == pytest.approx(model_flops_per_iteration(run.model, global_batch_size=8, tp=3))
    broken = plan_run(compose_run("model.hidden_size=250"))
    assert not broken.feasible and math.isnan(broken.model_flops_per_iter)


def test_cached_shape_efficiency_matches_a_fresh_report() -> None:
    # The planner caches shape reports on (tp, micro-batch, precision); layouts that differ elsewhere
    # must get exactly what shape_report computes for them.
    base = compose_run("model=gpt_1.3b", "hardware=a100_80gb", "parallelism=megatron_3d")
    for tp, mbs, gbs, zero in itertools.product([2, 8], [1, 2], [256, 512], [0, 1]):
        par = dataclasses.replace(base.parallelism, tp=tp, micro_batch_size=mbs, global_batch_size=gbs,
                                  zero_stage=zero)
        run = dataclasses.replace(base, parallelism=par)
        row = plan_run(run, world_size=16)
        assert row.quant_efficiency == shape_report(run.model, par, run.hardware).efficiency


def test_a_sweep_agrees_with_validate_row_by_row() -> None:
    base = compose_run("model=gpt_13b", "hardware=a100_80gb", "parallelism=megatron_3d")
    rows = []
    for tp, pp, mbs, zero, recompute, nodes in itertools.product(
        [1, 2, 4, 8], [1, 2, 4, 5], [1, 2, 4], [0, 1, 3], list(Recompute), [1, 2, 4]
    ):
        par = dataclasses.replace(base.parallelism, tp=tp, pp=pp, micro_batch_size=mbs, zero_stage=zero,
                                  recompute=recompute)
        run = dataclasses.replace(base, parallelism=par)
        row = plan_run(run, world_size=nodes * 8)
        assert row.feasible == (validate(run, world_size=nodes * 8) == [])
        assert row.nodes == nodes and row.devices == nodes * 8
        if row.feasible:
            assert row.dp * row.tp * row.pp == row.devices
            assert row.mem_gib <= row.mem_capacity_gib
        rows.append(row)
    assert any(r.feasible for r in rows) and not all(r.feasible for r in rows)


def test_csv_round_trip(tmp_path: Path) -> None:
    rows = [
        plan_run(compose_run(), overrides="model=tiny"),
        plan_run(compose_run("model=gpt3_175b", "hardware=a100_80gb", "parallelism=megatron_3d",
                             "parallelism.tp=1"), world_size=1),
        plan_run(compose_run("hardware=v100_32gb", "parallelism.precision=bf16", "parallelism.tp=3")),
    ]
    assert len(rows[2].reasons) > 1
    path = write_plan_csv(rows, tmp_path / "plan.csv")
    with path.open(newline="") as f:
        records = list(csv.DictReader(f))
    assert tuple(records[0]) == PLAN_COLUMNS == tuple(f.name for f in dataclasses.fields(PlanRow))
    assert records[2]["reasons"] == "; ".join(rows[2].reasons)
    assert records[0]["overrides"] == "model=tiny"
    back = read_plan_csv(path)
    for original, restored in zip(rows, back, strict=True):
        for name in PLAN_COLUMNS:
            a, b = getattr(original, name), getattr(restored, name)
            if isinstance(a, float) and math.isnan(a):
                assert math.isnan(b), name
            else:
                assert a == b, name


def test_table_has_every_column_and_one_line_per_row() -> None:
    rows = [
        plan_run(compose_run()),
        plan_run(compose_run("model=gpt3_175b", "hardware=a100_80gb", "parallelism=megatron_3d",
                             "parallelism.tp=1"), world_size=1),
        plan_run(bloom_181b(pp=12), world_size=384),
    ]
    table = format_plan_table(rows)
    lines = table.splitlines()
    assert len(lines) == 1 + len(rows)
    header = lines[0]
    for column in ("status", "model", "hw", "nodes", "DP", "TP", "PP", "MBS", "GBS", "params", "mem GiB / cap",
                   "quant eff %", "PFLOP/iter", "reasons"):
        assert column in header
    assert lines[1].startswith("ok ") and lines[2].startswith("INFEASIBLE")
    assert "175B" in lines[2] and "181B" in lines[3] and "Predicted memory" in lines[2]
    # Fixed width: every column before the reasons starts at the same offset on every line.
    start = header.index("PFLOP/iter")
    width = len("PFLOP/iter")
    for line in lines[1:]:
        assert line[start: start + width].strip(), line
    assert f"{rows[2].mem_gib:.1f} / {rows[2].mem_capacity_gib:.1f}" in lines[3]


def test_rows_that_differ_only_in_a_layout_option_are_told_apart() -> None:
    # A dry run of parallelism.recompute=none,full parallelism.zero_stage=0,1 printed four identical lines.
    runs = [
        compose_run(f"parallelism.recompute={r}", f"parallelism.zero_stage={z}", f"parallelism.offload={o}",
                    f"parallelism.precision={p}", f"parallelism.engine={e}", f"parallelism.sequence_parallel={sp}")
        for r, z, o, p, e, sp in (
            ("none", 0, "none", "bf16", "native", False),
            ("full", 0, "none", "bf16", "native", False),
            ("none", 1, "none", "bf16", "native", False),
            ("selective", 3, "params", "fp32", "deepspeed", True),
        )
    ]
    rows = [plan_run(run) for run in runs]
    last = rows[3]
    assert (last.recompute, last.zero_stage, last.offload, last.precision, last.engine, last.sequence_parallel) == (
        "selective", 3, "params", "fp32", "deepspeed", True)
    assert (rows[0].recompute, rows[0].zero_stage, rows[0].offload, rows[0].precision, rows[0].engine,
            rows[0].sequence_parallel) == ("none", 0, "none", "bf16", "native", False)

    def columns(table: str) -> list[dict[str, str]]:
        header, *lines = table.splitlines()
        names = header.split()
        return [dict(zip(names, line.split(), strict=False)) for line in lines]

    table = format_plan_table(rows[:3])
    assert len(set(table.splitlines()[1:])) == 3
    cells = columns(table)
    assert [(c["recompute"], c["ZeRO"], c["SP"]) for c in cells] == [("none", "0", "-"), ("full", "0", "-"),
                                                                     ("none", "1", "-")]
    # Offload, precision and engine are shown only when the rows differ in them.
    for name in ("offload", "prec", "engine"):
        assert name not in table.splitlines()[0].split()
    cells = columns(format_plan_table(rows))
    assert [(c["offload"], c["prec"], c["engine"], c["SP"]) for c in cells][::3] == [
        ("none", "bf16", "native", "-"), ("params", "fp32", "deepspeed", "yes")]


def test_a_plan_written_before_the_layout_option_columns_reads_with_their_defaults(tmp_path: Path) -> None:
    path = write_plan_csv([plan_run(compose_run("parallelism.recompute=full"))], tmp_path / "plan.csv")
    with path.open(newline="") as f:
        records = list(csv.DictReader(f))
    new = ("sequence_parallel", "recompute", "zero_stage", "offload", "precision", "engine", "seq_length")
    old = [c for c in PLAN_COLUMNS if c not in new]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=old, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(records)
    (row,) = read_plan_csv(path)
    assert (row.recompute, row.zero_stage, row.sequence_parallel, row.seq_length) == ("none", 0, False, 0)
    assert row.model == "tiny" and row.feasible


def test_a_row_that_is_not_a_plan_row_is_named_by_its_line(tmp_path: Path) -> None:
    # A plan copied while it was written, or edited by hand: a row cut short made the analysis drop the
    # whole plan ("int() argument must be ... not 'NoneType'", no line named), or, cut after the columns
    # that parse, was read with blanks.
    rows = [plan_run(compose_run(f"parallelism.micro_batch_size={mbs}"), overrides=f"m={mbs}") for mbs in (1, 2, 4, 8)]
    path = write_plan_csv(rows, tmp_path / "plan.csv")
    lines = path.read_text().splitlines(keepends=True)
    cut = lines[2][: lines[2].index("m=2") + 2] + "\n"  # cut inside its overrides
    run_on = lines[3].rstrip("\n") + ",extra\n"
    path.write_text("".join([lines[0], lines[1], cut, run_on, lines[4]]))
    bad: list[str] = []
    back = read_plan_csv(path, bad=bad)
    assert [r.overrides for r in back] == ["m=1", "m=8"]
    assert bad == [f"line 3: {len(PLAN_COLUMNS) - 3} fields where the header names {len(PLAN_COLUMNS)}",
                   f"line 4: {len(PLAN_COLUMNS) + 1} fields where the header names {len(PLAN_COLUMNS)}"]  # fmt: skip
    with pytest.raises(ValueError, match=r"plan.csv, line 3: "):
        read_plan_csv(path)
    # A quote left open swallows the rest of the file: csv's own error (a traceback) is named by its line.
    path.write_text("".join([lines[0], lines[1], '"' + "x" * 140_000 + "\n"]))
    bad = []
    assert [r.overrides for r in read_plan_csv(path, bad=bad)] == ["m=1"]
    assert bad == ["line 3 on: field larger than field limit (131072); the rest of the file is not read"]


def test_format_params() -> None:
    assert format_params(1_300_000_000) == "1.3B"
    assert format_params(1_315_575_808) == "1.32B"
    assert format_params(175_000_000_000) == "175B"
    assert format_params(124_439_808) == "124M"
    assert format_params(5_322_240) == "5.32M"
    assert format_params(1_100_000_000_000) == "1.1T"
    assert format_params(512) == "512"


def test_compose_run_composes_outside_pytest() -> None:
    # `python -m tests.bench bench_search` composes with this helper in a fresh interpreter, where
    # conftest never registered the schema (importing conf does not since 14c25c6).
    code = "from tests.train.planner.test_plan import compose_run; print(compose_run('model=gpt_13b').model.name)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "gpt_13b"


def test_planner_does_not_import_torch() -> None:
    code = "import sys, train.planner; assert 'torch' not in sys.modules, 'torch imported'"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_feasible_rows_carry_the_time_model_and_are_ranked_for_the_same_work() -> None:
    from train.planner.perf import predict_time
    from train.planner.plan import rank_predictions, table_order

    runs = [
        compose_run("model=gpt_1.3b", "hardware=a100_80gb", "parallelism.precision=bf16", "parallelism.dp=8",
                    "parallelism.global_batch_size=512", f"parallelism.tp={tp}", f"parallelism.micro_batch_size={mbs}")
        for tp, mbs in ((1, 1), (2, 4), (1, 4))
    ]
    rows = [plan_run(run) for run in runs]
    for run, row in zip(runs, rows, strict=True):
        seconds = predict_time(run.model, run.parallelism, run.hardware, dp=8).sec_per_iter
        assert row.pred_sec_per_iter == pytest.approx(seconds)
        assert row.pred_tflops == pytest.approx(row.model_flops_per_iter / (seconds * row.devices) / 1e12)
        assert row.pred_mfu == pytest.approx(row.pred_tflops / 312.0)
    infeasible = plan_run(compose_run("model=gpt3_175b", "hardware=a100_80gb"))
    cpu = plan_run(compose_run())  # the CPU's peak is measured at run time: nothing to predict from
    assert math.isnan(infeasible.pred_sec_per_iter) and math.isnan(cpu.pred_sec_per_iter)
    ranked = rank_predictions([*rows, infeasible, cpu])
    order = sorted(range(3), key=lambda i: rows[i].pred_sec_per_iter)
    assert [ranked[i].pred_rank for i in order] == [1, 2, 3]
    assert ranked[3].pred_rank == ranked[4].pred_rank == 0
    shown = table_order(ranked)
    assert [r.pred_rank for r in shown] == [1, 2, 3, 0, 0]
    assert not shown[-1].feasible
    assert "pred s/it" in format_plan_table(shown)


def test_a_sequence_length_swept_is_other_work_ranked_on_its_own() -> None:
    # Twice the tokens per sample is more than twice the FLOPs per iteration: seq 2048's layouts were
    # ranked among seq 1024's, and two rows that looked alike in the table read rank 1 and rank 3.
    from train.planner.plan import rank_predictions

    rows = [
        plan_run(compose_run("model=gpt_1.3b", "hardware=a100_80gb", "parallelism.precision=bf16", "parallelism.dp=8",
                             "parallelism.global_batch_size=512", f"parallelism.tp={tp}", f"model.seq_length={seq}"))
        for tp in (1, 2) for seq in (1024, 2048)
    ]  # fmt: skip
    assert [r.seq_length for r in rows] == [1024, 2048, 1024, 2048]
    ranked = rank_predictions(rows)
    for seq in (1024, 2048):
        mine = [r for r in ranked if r.seq_length == seq]
        assert sorted(r.pred_rank for r in mine) == [1, 2]
        assert min(mine, key=lambda r: r.pred_sec_per_iter).pred_rank == 1
    table = format_plan_table(ranked)
    assert " seq " in table.splitlines()[0] and " seq " not in format_plan_table(ranked[:1]).splitlines()[0]


def test_a_model_whose_fields_are_overridden_is_other_work_ranked_and_named_on_its_own() -> None:
    # model=gpt_350m model.kind=gpt,bert: the BERT and GPT rows shared the name and were ranked 1-4 as
    # one work, the table showing only params (356M, 357M) to tell them apart.
    from train.planner.plan import model_changes, rank_predictions, work_key

    common = ("model=gpt_350m", "hardware=a100_80gb", "parallelism.dp=8", "parallelism.global_batch_size=64")
    rows = []
    for kind, mbs in itertools.product(("gpt", "bert"), (1, 2)):
        typed = (*common, f"model.kind={kind}", f"parallelism.micro_batch_size={mbs}")
        rows.append(plan_run(compose_run(*typed), overrides=" ".join(typed)))
    ranked = rank_predictions(rows)
    for kind in ("gpt", "bert"):
        mine = [r for r in ranked if model_changes(r.overrides) == (f"kind={kind}",)]
        assert len(mine) == 2 and sorted(r.pred_rank for r in mine) == [1, 2]
        assert min(mine, key=lambda r: r.pred_sec_per_iter).pred_rank == 1
    assert len({work_key(r) for r in ranked}) == 2
    lines = format_plan_table(ranked).splitlines()[1:]
    assert sum("gpt_350m(kind=bert) " in line for line in lines) == 2
    assert sum("gpt_350m(kind=gpt) " in line for line in lines) == 2
    # Overrides of other groups, the group's choice itself and the sequence length (its own column and
    # key part) leave the model as it is named.
    assert model_changes("model=gpt_350m +model.seq_length=4096 parallelism.tp=2 training.lr=1e-4") == ()
    assert model_changes("+model.num_layers=12 ~model.dropout") == ("dropout", "num_layers=12")
    assert model_changes("model.num_layers=2 model.kind=bert") == model_changes("model.kind=bert model.num_layers=2")


def test_infeasible_rows_are_counted_by_rule_with_an_example() -> None:
    from train.planner.plan import infeasible_by_rule
    from train.planner.rules import reason_rule

    rows = [
        plan_run(compose_run(*overrides))
        for overrides in (
            (),  # feasible: not counted
            ("parallelism.tp=3",),  # tp=3: heads, hidden and ffn all indivisible
            ("parallelism.tp=3", "parallelism.pp=3"),  # ... and pp=3 for 4 layers, on 9 devices
            ("parallelism.pp=3",),
            ("model=gpt3_175b", "hardware=a100_80gb"),  # memory
        )
    ]
    counts = infeasible_by_rule(rows)
    by_rule = {c.rule: c.configs for c in counts}
    # Each count is the rows whose reasons name the rule, as validate() judged them.
    for rule, n in by_rule.items():
        assert n == sum(any(reason_rule(r) == rule for r in row.reasons) for row in rows)
    assert by_rule["heads_divisible_by_tp"] == 2 and by_rule["layers_divisible_by_pp"] == 2
    assert by_rule["memory"] == 1
    assert [c.configs for c in counts] == sorted(by_rule.values(), reverse=True)
    for c in counts:
        assert not c.example.feasible and any(r == f"[{c.rule}] {c.message}" for r in c.example.reasons)
    assert infeasible_by_rule(rows[:1]) == []


def test_reason_rule_reads_the_rule_back_from_a_reason() -> None:
    from train.planner.rules import reason_rule

    (violation, *_) = validate(compose_run("parallelism.tp=3"))
    assert reason_rule(str(violation)) == violation.rule == "heads_divisible_by_tp"
    assert reason_rule("no brackets here") == "" and reason_rule("[] empty") == ""
