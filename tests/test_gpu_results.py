"""The committed GPU report (tests/bench/results/gpu/REPORT.md) is what its raw outputs and today's
planner give: a change to the time model, or to the records, regenerates it
(`python -m tests.bench.gpu.report --write`) instead of leaving the README's GPU figures stale."""

from __future__ import annotations

from tests.bench.gpu.report import RESULTS, memory_rows, report


def test_the_gpu_report_is_derived_from_the_committed_outputs() -> None:
    assert report() == (RESULTS / "REPORT.md").read_text()


def test_every_gpu_record_names_the_device_it_ran_on() -> None:
    import json

    records = sorted(RESULTS.glob("call*/**/result.json"))
    assert len(records) >= 40
    for path in records:
        rec = json.loads(path.read_text())
        assert rec["device"] == "NVIDIA H100 80GB HBM3", path
    assert len(memory_rows()) >= 40
