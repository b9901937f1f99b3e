"""train.profiling: a torch.profiler Chrome trace of the chosen iterations lands in the run directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from train.profiling import PROFILE_ENV, parse_steps
from train.trainer import run_training

from .test_trainer import compose_run


def test_parse_steps() -> None:
    assert parse_steps("3,4") == (3, 4)
    assert parse_steps("3-5") == (3, 5)
    assert parse_steps(" 7 ") == (7, 7)
    assert parse_steps("") is None
    with pytest.raises(ValueError, match="count from 1"):
        parse_steps("0,1")
    with pytest.raises(ValueError, match="expected iterations"):
        parse_steps("three")


def test_trace_of_chosen_iterations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv(PROFILE_ENV, "2,3")
    record = run_training(compose_run(), output_dir=tmp_path, overrides=[])
    assert record["status"] == "ok"
    trace = tmp_path / "profile" / "trace_rank0_iters2-3.json"
    assert record["profile"] == {"iterations": [2, 3], "trace": str(trace)}
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    # Both profiled iterations are in it, the unprofiled first one is not, and real ops ran inside.
    assert {"megasweep iteration 2", "megasweep iteration 3"} <= names
    assert "megasweep iteration 1" not in names
    assert any(str(n).startswith("aten::") for n in names)


def test_no_profile_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    record = run_training(compose_run(), output_dir=tmp_path, overrides=[])
    assert "profile" not in record and not (tmp_path / "profile").exists()
