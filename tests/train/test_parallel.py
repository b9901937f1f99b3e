"""train.parallel: DP, ZeRO-1, TP and PP on CPU gloo workers give the one-process losses.

Every layout is started through the real entry point (`python -m train ...` in a subprocess,
which forks its workers) and compared on result.json's `losses`: same seed, same samples,
fp32, 3 optimizer steps. Tolerance rel 1e-5: the layouts only change the fp32 summation order
(reductions across ranks, split matmuls), which moved the losses by < 1e-7 relative here.

A pipeline with fewer micro-batches per step than stages runs too (all forwards, then all
backwards, as Megatron's 1F1B does then), and so does a batch ramp-up, whose growing batch
changes the micro-batch count, and with it the pipeline schedule, from step to step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from train.contract import MEMORY_COMPONENTS
from train.planner.inventory import stage_layers
from train.trainer import run_training

from .test_distributed import TINY, run_train, with_overrides
from .test_trainer import compose_run

RTOL = 1e-5


def launch(tmp_path: Path, name: str, *overrides: str) -> dict[str, Any]:
    proc, record = run_train(tmp_path / name, *with_overrides(TINY, *overrides))
    # Rank 0 alone prints: one line per iteration, not one per rank.
    assert sum(line.startswith(" iteration ") for line in proc.stdout.splitlines()) == 3
    return record


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    # The same config in this process (no launcher variables: one process, no process group).
    record = run_training(compose_run(*TINY), output_dir=tmp_path_factory.mktemp("single"), overrides=[])
    losses: list[float] = record["losses"]
    assert len(losses) == 3 and losses[0] != losses[2]  # the weights moved
    assert_memory_as_predicted(record)
    return losses


def assert_memory_as_predicted(record: dict[str, Any]) -> None:
    """Every rank's model states as the planner predicted them, to the byte, and one micro-batch's
    saved activations within 5% (tests/train/test_memory.py covers every recompute mode)."""
    ranks = record["memory"]["ranks"]
    assert [r["rank"] for r in ranks] == list(range(record["world"]["world_size"]))
    for r in ranks:
        for part in MEMORY_COMPONENTS[:4]:
            assert r["measured"][part] == r["predicted"][part], (r["rank"], part)
        acts = r["measured"]["activations_per_micro_batch"]
        assert r["predicted"]["activations_per_micro_batch"] == pytest.approx(acts, rel=0.05)


def test_stage_layers_split_evenly() -> None:
    assert [list(stage_layers(4, stage=s, num_stages=2)) for s in range(2)] == [[0, 1], [2, 3]]
    assert [len(stage_layers(7, stage=s, num_stages=3)) for s in range(3)] == [3, 2, 2]
    assert sorted(i for s in range(4) for i in stage_layers(10, stage=s, num_stages=4)) == list(range(10))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("dp2", ("parallelism.dp=2",)),
        ("tp2", ("parallelism.tp=2",)),
        ("tp2_sp", ("parallelism.tp=2", "parallelism.sequence_parallel=true")),
        ("pp2", ("parallelism.pp=2",)),
        (
            "dp2_tp2_pp2_zero1",
            ("parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=2", "parallelism.zero_stage=1"),
        ),
        # One micro-batch per replica and step (gbs 8 = mbs 4 x dp 2) on two stages.
        # Sequence parallel across a stage boundary, with the attention core recomputed.
        (
            "tp2_pp2_sp_selective",
            ("parallelism.tp=2", "parallelism.pp=2", "parallelism.sequence_parallel=true", "parallelism.recompute=selective"),
        ),
        ("dp2_tp2_pp2_one_micro_batch", ("parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=2", "parallelism.micro_batch_size=4")),
        # Interleaved 1F1B: two chunks of one layer per rank, 4 micro-batches (steady state reached),
        # and with dp 2 two micro-batches per replica (= pp: all forwards first) under ZeRO-1.
        ("pp2_vpp2", ("parallelism.pp=2", "parallelism.virtual_stages=2")),
        ("dp2_pp2_vpp2_zero1", ("parallelism.dp=2", "parallelism.pp=2", "parallelism.virtual_stages=2", "parallelism.zero_stage=1")),
        ("tp2_pp2_vpp2_sp", ("parallelism.tp=2", "parallelism.pp=2", "parallelism.virtual_stages=2", "parallelism.sequence_parallel=true")),
    ],
)
def test_layout_matches_one_process(
    tmp_path: Path, single: list[float], name: str, overrides: tuple[str, ...]
) -> None:
    record = launch(tmp_path, name, *overrides)
    assert record["status"] == "ok"
    assert record["losses"] == pytest.approx(single, rel=RTOL)
    world = record["world"]
    assert world["world_size"] == world["dp"] * world["tp"] * world["pp"]
    assert len(record["max_mem_gib_per_rank"]) == world["world_size"]  # gathered from every rank
    assert_memory_as_predicted(record)
    if "zero_stage=1" in " ".join(overrides):
        assert record["optimizer"].endswith("+ZeRO-1")


# gbs 8 reached from 2, +2 per increment over 12 samples: batches 2, 2, 4, 6, 8, 8, 8.
RAMP = ("parallelism.rampup_batch_size=[2,2,12]", "parallelism.micro_batch_size=1", "training.train_iters=7")


@pytest.mark.slow
def test_rampup_grows_the_batch_and_matches_one_process(tmp_path: Path) -> None:
    alone = run_training(compose_run(*with_overrides(TINY, *RAMP)), output_dir=tmp_path / "one", overrides=[])
    assert alone["global_batch_sizes"] == [2, 2, 4, 6, 8, 8, 8]
    # dp 2 x pp 2: the steps run 1, 1, 2, 3, 4, 4, 4 micro-batches on two stages.
    proc, record = run_train(tmp_path / "layout", *with_overrides(TINY, *RAMP, "parallelism.dp=2", "parallelism.pp=2"))
    assert record["status"] == "ok" and record["full_batch_reached"]
    assert record["losses"] == pytest.approx(alone["losses"], rel=RTOL)
    logged = [int(line.split("global batch size:")[1].split("|")[0]) for line in proc.stdout.splitlines()
              if line.startswith(" iteration ")]
    assert logged == [2, 2, 4, 6, 8, 8, 8]
    # The medians are the full batch's: steps 5-7 (all after the one warm-up iteration).
    assert record["measured_iterations"] == 3
    assert record["samples_per_s"] == pytest.approx(8 / record["sec_per_iter"])


def test_rampup_that_never_reaches_the_full_batch_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    run = compose_run(*with_overrides(TINY, *RAMP, "training.train_iters=3"))
    record = run_training(run, output_dir=tmp_path, overrides=[])
    assert record["status"] == "ok" and record["global_batch_sizes"] == [2, 2, 4]
    assert not record["full_batch_reached"] and record["sec_per_iter"] is None and record["mfu"] is None
    assert any("never reached global_batch_size=8" in w for w in record["warnings"])
