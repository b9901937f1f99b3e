"""BERT under tensor parallelism: `python -m train model.kind=bert parallelism.tp=2` (2 gloo workers)
gives the losses of the same config on one process (bert_345m's layout, shrunk to test size)."""

from __future__ import annotations

from pathlib import Path

import pytest

from train.trainer import run_training

from .test_distributed import TINY
from .test_parallel import RTOL, assert_memory_as_predicted, launch
from .test_trainer import compose_run

BERT = ("model=bert_345m", *TINY, "model.kind=bert", "model.name=bert_tiny")


@pytest.mark.slow
def test_bert_tp2_matches_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    single = run_training(compose_run(*BERT), output_dir=tmp_path / "single", overrides=[])
    assert single["status"] == "ok" and single["config"]["model"]["kind"] == "bert"
    assert single["losses"][0] != single["losses"][2]  # the weights moved
    tp2 = launch(tmp_path, "tp2", *BERT, "parallelism.tp=2")
    assert tp2["status"] == "ok" and tp2["world"] == {"world_size": 2, "dp": 1, "tp": 2, "pp": 1}
    assert tp2["config"]["model"]["kind"] == "bert" and tp2["params"] == single["params"]
    assert tp2["losses"] == pytest.approx(single["losses"], rel=RTOL)
    # Sequence parallel: the head's dense, GELU and LayerNorm also run on each rank's tokens.
    sp = launch(tmp_path, "tp2_sp", *BERT, "parallelism.tp=2", "parallelism.sequence_parallel=true")
    assert sp["status"] == "ok" and sp["losses"] == pytest.approx(single["losses"], rel=RTOL)
    assert_memory_as_predicted(sp)
