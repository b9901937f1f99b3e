"""train.profiling: a torch.profiler Chrome trace of the chosen iterations lands in the run directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from train.profiling import steps_span
from train.trainer import run_training

from .test_trainer import compose_run


def test_steps_span() -> None:
    assert steps_span([3, 4]) == (3, 4)
    assert steps_span([5, 3, 4]) == (3, 5)
    assert steps_span([7]) == (7, 7)
    assert steps_span([]) is None
    with pytest.raises(ValueError, match="training.profile_steps=\\[0, 1\\].*count from 1"):
        steps_span([0, 1])


def test_trace_of_chosen_iterations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    record = run_training(compose_run("training.profile_steps=[2,3]"), output_dir=tmp_path, overrides=[])
    assert record["status"] == "ok"
    trace = tmp_path / "profile" / "trace_rank0_iters2-3.json"
    assert record["profile"] == {"iterations": [2, 3], "trace": str(trace)}
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    # Both profiled iterations are in it, the unprofiled first one is not, and real ops ran inside.
    assert {"megasweep iteration 2", "megasweep iteration 3"} <= names
    assert "megasweep iteration 1" not in names
    assert any(str(n).startswith("aten::") for n in names)


def test_a_profiled_iteration_is_left_out_of_the_medians_while_another_was_measured(tmp_path: Path) -> None:
    # Iterations 2 and 3 are measured (warm-up 1); 3 runs under the profiler, which slows it down.
    record = run_training(compose_run("training.profile_steps=[3]"), output_dir=tmp_path, overrides=[])
    assert record["status"] == "ok" and record["profile"]["iterations"] == [3, 3]
    assert record["measured_iterations"] == 1
    assert record["sec_per_iter"] == record["iteration_times_s"][1]


def test_no_profile_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    record = run_training(compose_run(), output_dir=tmp_path, overrides=[])
    assert "profile" not in record and not (tmp_path / "profile").exists()
