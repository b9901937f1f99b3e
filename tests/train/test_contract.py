"""train.contract: atomic writes, the record, the sweep manifest (round trip, statuses, old refused
entries, exported configs' job ids)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest

from train import contract
from train.contract import (
    ENTRY_STATUSES,
    EXPORTED_JOBS_DIR,
    MEDIAN_FIELDS,
    LaunchedLayout,
    ManifestEntry,
    ManifestError,
    RunRecord,
    append_manifest,
    join_overrides,
    read_manifest,
    recorded_job_id,
    resolve_exported,
    split_overrides,
    write_json_atomic,
    write_manifest,
)


def test_manifest_round_trip_and_partial_last_line(tmp_path: Path) -> None:
    entries = [
        ManifestEntry(
            0, ("parallelism.tp=2",), "./runs//0/", "submitted", None, "1234_0", {"nodes": 2, "tasks_per_node": 2}
        ),
        ManifestEntry(1, ("parallelism.tp=3",), "runs/1", "skipped", "heads not divisible by tp"),
        ManifestEntry(2, ("cluster.partition=x",), "runs/2", "refused", "sbatch refused: invalid partition"),
        ManifestEntry(3, ("training.lr=1",), "runs/3", "exported", "exported to a.sbatch, array task 0"),
    ]
    path = write_manifest(entries, tmp_path / "manifest.jsonl")
    back = read_manifest(tmp_path)
    assert back == entries and back[0].output_dir == "runs/0" and back[0].nodes == 2
    assert [e.status for e in back] == ["submitted", "skipped", "refused", "exported"]
    assert json.loads(path.read_text().splitlines()[0])["overrides"] == ["parallelism.tp=2"]
    append_manifest([ManifestEntry(4, (), "runs/4", "submitted", job_id="1234_4")], path)
    with path.open("a") as f:
        f.write('{"index": 5, "overr')  # the launcher is mid-write
    assert [e.index for e in read_manifest(path)] == [0, 1, 2, 3, 4]


def test_old_refused_entries_read_as_refused(tmp_path: Path) -> None:
    # Before `refused` existed, a refused sbatch was written `skipped` with this reason.
    lines = [
        {"index": 0, "overrides": [], "output_dir": "0", "status": "skipped",
         "reason": "sbatch refused: sbatch: error: invalid partition specified: nosuch"},
        {"index": 1, "overrides": [], "output_dir": "1", "status": "skipped", "reason": "tp=3 does not divide"},
    ]
    path = tmp_path / "manifest.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    refused, skipped = read_manifest(path)
    assert refused.status == "refused" and refused.reason is not None and "nosuch" in refused.reason
    assert skipped.status == "skipped"


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('{"index": 0, "overrides": [], "output_dir": "a", "status": "done"}', "status"),
        ('{"index": -1, "overrides": [], "output_dir": "a", "status": "submitted"}', "index"),
        ('{"overrides": [], "output_dir": "a", "status": "submitted"}', "missing key"),
        ('{"index": 0, "overrides": [], "output_dir": "/abs", "status": "submitted"}', "relative"),
        ("not json", "not JSON"),
    ],
)
def test_manifest_bad_lines_name_the_line(tmp_path: Path, line: str, match: str) -> None:
    path = tmp_path / "manifest.jsonl"
    path.write_text(line + "\n" + '{"index": 1, "overrides": [], "output_dir": "b", "status": "submitted"}\n')
    with pytest.raises(ManifestError, match=match) as info:
        read_manifest(path)
    assert ":1:" in str(info.value)


def test_unknown_status_lists_the_valid_ones() -> None:
    with pytest.raises(ManifestError) as info:
        ManifestEntry(0, (), "0", "queued")
    assert "'queued'" in str(info.value) and all(s in str(info.value) for s in ENTRY_STATUSES)


def test_exported_entries_take_the_job_id_their_task_recorded(tmp_path: Path) -> None:
    entries = [
        ManifestEntry(0, (), "0", "exported", "exported to a.sbatch, array task 0"),
        ManifestEntry(1, (), "1", "exported", "exported to a.sbatch, array task 1"),
        ManifestEntry(2, (), "2", "exported", "exported to a.sbatch, array task 2"),
        ManifestEntry(3, (), "3", "submitted", job_id="9_3"),
    ]
    jobs = tmp_path / EXPORTED_JOBS_DIR
    jobs.mkdir(parents=True)
    (jobs / "0").write_text("41_0\n")
    (jobs / "2").write_text("not a job id\n")  # not what a task writes: unknown, not trusted
    (jobs / "3").write_text("41_3\n")  # a submitted entry's own job id wins
    assert recorded_job_id(tmp_path, 0) == "41_0" and recorded_job_id(tmp_path, 1) is None
    resolved = resolve_exported(entries, tmp_path)
    assert [(e.status, e.job_id) for e in resolved] == [
        ("exported", "41_0"),
        ("exported", None),
        ("exported", None),
        ("submitted", "9_3"),
    ]
    # Nothing recorded at all (no .megasweep directory): every exported entry stays without a job.
    assert resolve_exported(entries[:1], tmp_path / "elsewhere") == entries[:1]


def test_atomic_write_replaces_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "result.json"
    write_json_atomic(path, {"status": "ok", "x": [1, 2]})
    write_json_atomic(path, {"status": "nan"})
    assert json.loads(path.read_text()) == {"status": "nan"}
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]
    mode = path.stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask  # readable by the sweep's other users, not mkstemp's 0600


def test_atomic_write_leaves_no_partial_file_on_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "result.json"
    write_json_atomic(path, {"status": "ok"})

    def crash(src: object, dst: object) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(contract.os, "replace", crash)
    with pytest.raises(OSError, match="disk gone"):
        write_json_atomic(path, {"status": "error", "big": "x" * 100_000})
    assert json.loads(path.read_text()) == {"status": "ok"}  # the old record, whole
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]  # no temporary left behind


def test_atomic_write_rejects_nan_without_touching_file(tmp_path: Path) -> None:
    path = tmp_path / "result.json"
    with pytest.raises(ValueError):
        write_json_atomic(path, {"loss": float("nan")})
    assert not path.exists()


def test_record_to_dict_turns_non_finite_into_null() -> None:
    assert contract._finite({"a": float("nan"), "b": [float("inf"), 1.0], "c": "x"}) == {
        "a": None,
        "b": [None, 1.0],
        "c": "x",
    }


def test_a_record_is_matched_to_its_config_by_its_overrides() -> None:
    record = {"status": "ok", "overrides": ["b=2", "a=1", "+w.API_KEY=***"]}
    assert contract.record_matches(record, ["a=1", "b=2", "+w.API_KEY=secret", "hydra.sweep.subdir=x"])
    assert not contract.record_matches(record, ["a=1", "b=3", "+w.API_KEY=secret"])
    assert contract.record_matches({"status": "ok"}, ["a=1"])  # older records: the directory's word
    assert "interrupted" in contract.STATUSES and contract.EXIT_INTERRUPTED == 128 + 2


def test_rerun_of_round_trips_and_is_written_only_when_set(tmp_path: Path) -> None:
    plain = ManifestEntry(index=0, overrides=("a=1",), output_dir="0", status="refused")
    rerun = ManifestEntry(index=1, overrides=("a=2",), output_dir="1", status="submitted", job_id="3", rerun_of=0)
    write_manifest([plain, rerun], tmp_path / "manifest.jsonl")
    assert read_manifest(tmp_path) == [plain, rerun]
    assert "rerun_of" not in (tmp_path / "manifest.jsonl").read_text().splitlines()[0]
    with pytest.raises(ManifestError, match="rerun_of must be a config index"):
        ManifestEntry(index=1, overrides=(), output_dir="1", status="submitted", rerun_of="0")  # type: ignore[arg-type]


LAYOUT = LaunchedLayout(model="gpt_1.3b", hardware="a100_80gb", dp=4, tp=2, pp=2, micro_batch_size="auto",
                        global_batch_size=512, seq_length=2048, params=1_300_000_000, zero_stage=1,
                        sequence_parallel=True)  # fmt: skip


def test_a_launched_layout_round_trips_and_is_written_only_when_set(tmp_path: Path) -> None:
    launched = ManifestEntry(0, ("parallelism.tp=2",), "0", "submitted", job_id="7_0", layout=LAYOUT.to_json())
    skipped = ManifestEntry(1, ("parallelism.tp=3",), "1", "skipped", "tp=3 does not divide")
    path = write_manifest([launched, skipped], tmp_path / "manifest.jsonl")
    back = read_manifest(path)
    assert back == [launched, skipped] and LaunchedLayout.from_json(back[0].layout) == LAYOUT
    assert set(LAYOUT.to_json()) == {f.name for f in dataclasses.fields(LaunchedLayout)}
    assert "layout" not in path.read_text().splitlines()[1] and back[1].layout == {}
    # A later launcher's field is left out; a field of the wrong kind is refused, naming it.
    assert LaunchedLayout.from_json({**LAYOUT.to_json(), "experts": 8}) == LAYOUT
    with pytest.raises(ManifestError, match="layout.tp must be a positive integer, got 0"):
        LaunchedLayout.from_json({**LAYOUT.to_json(), "tp": 0})
    with pytest.raises(ManifestError, match="layout lacks dp"):
        LaunchedLayout.from_json({k: v for k, v in LAYOUT.to_json().items() if k != "dp"})


def test_an_old_manifest_without_layouts_still_loads(tmp_path: Path) -> None:
    # Written before the launchers kept each config's layout: every entry reads, with none.
    line = {"index": 0, "overrides": ["parallelism.tp=2"], "output_dir": "0", "status": "submitted", "reason": None,
            "job_id": "7_0", "shape": {"nodes": 1, "tasks_per_node": 2}}  # fmt: skip
    (tmp_path / "manifest.jsonl").write_text(json.dumps(line) + "\n")
    (entry,) = read_manifest(tmp_path)
    assert entry.layout == {} and entry.job_id == "7_0"
    # Only the layout's own kind is judged on reading: its fields are read where they are used.
    (tmp_path / "manifest.jsonl").write_text(json.dumps({**line, "layout": [1]}) + "\n")
    with pytest.raises(ManifestError, match=":1: layout must be an object"):
        read_manifest(tmp_path)


def test_a_manifest_line_is_read_as_json_reads_it(tmp_path: Path) -> None:
    # Read by orjson first, which makes an integer past 64 bits a float: such a line is json's to read.
    path = tmp_path / "manifest.jsonl"
    first = json.dumps({"index": 2**70, "overrides": ["a=1"], "output_dir": "a", "status": "submitted"})
    path.write_text(first + "\n" + '{"index": 1, "overrides": [], "output_dir": "b", "status": "submitted", '
                    '"shape": {"n": 1.0}}\n')  # fmt: skip
    with pytest.raises(ManifestError, match=r":2: shape must map names to integers"):
        read_manifest(path)
    path.write_text(first + "\n")
    assert read_manifest(path)[0].index == 2**70


@pytest.mark.parametrize(
    "path", ["a/b", "./a//b/", "a/./b", ".", "", "./", "a/../b", "runs/12", "/abs/x/", "//net/x", "a/b/.", "../up"]
)
def test_normalize_dir_spells_a_directory_as_its_posix_parts(path: str) -> None:
    # The parts pathlib sees, without the cost of pathlib for the relative ones.
    parts = [p for p in PurePosixPath(path).parts if p not in ("", ".")]
    assert contract.normalize_dir(path) == ("/".join(parts) or ".")


def _with_reader_gone(args: list[str]) -> tuple[int, bytes]:
    """Run `args` with stdout a pipe whose reader is gone before the process writes (closed here at
    once), as `... | head` leaves it once head has its lines: the first write fails with EPIPE."""
    proc = subprocess.Popen(args, cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)  # fmt: skip
    assert proc.stdout is not None
    proc.stdout.close()
    _, stderr = proc.communicate(timeout=120)
    return proc.returncode, stderr


def test_a_tool_whose_reader_went_away_exits_141_quietly(tmp_path: Path) -> None:
    printing = "from train.contract import exit_on_broken_pipe\nexit_on_broken_pipe(lambda: print('x' * 100) or 0)"
    assert _with_reader_gone([sys.executable, "-c", printing]) == (contract.EXIT_BROKEN_PIPE, b"")
    # `python -m analysis <dir> | head` printed "error: Broken pipe" with exit 2 before.
    plan = subprocess.run([sys.executable, "-m", "train", "-m", "parallelism.tp=1,2", "hydra/launcher=plan",
                           f"hydra.sweep.dir={tmp_path / 'plan'}"], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, timeout=120)  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    analysis = [sys.executable, "-m", "analysis", str(tmp_path / "plan"), "--no-plots", "-o", str(tmp_path / "out")]
    assert _with_reader_gone(analysis) == (contract.EXIT_BROKEN_PIPE, b"")
    # `python -m launchers status <dir> | head` said "error: <dir>: cannot be read (Broken pipe)", exit 2.
    sweep = subprocess.run([sys.executable, "-m", "train", "-m", "training.lr=1e-4,2e-4", "hydra/launcher=local",
                            "hydra.launcher.python=/bin/false", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                           cwd=Path(__file__).resolve().parents[2], capture_output=True, timeout=120)  # fmt: skip
    assert (tmp_path / "sweep" / contract.MANIFEST_FILE).exists(), sweep.stderr
    status = [sys.executable, "-m", "launchers", "status", "--ok-if-failed", str(tmp_path / "sweep")]
    assert _with_reader_gone(status) == (contract.EXIT_BROKEN_PIPE, b"")


@pytest.mark.parametrize(
    "overrides",
    [
        ["model=tiny", "parallelism.tp=2"],
        ["logger.wandb_group='my group'", "+x=\"a b\"", "training.lr=1e-4"],
        ["search.nodes=[1, 2]", "+d={a: 1, b: [2, 3]}", "name=${now:%H %M}", "f=range(1, 5)"],
        ["quote='it\\'s mine'", "~model.dropout", "++k=v"],
        # As Hydra's basic sweeper rebuilds an unquoted value (escape_special_characters).
        ["cluster.comment=my\\ run", "x=a\\(b", "y=c\\[d\\]", "z=e\\ \\ f", "model=tiny"],
        [],
    ],
)
def test_plan_csv_overrides_read_back_as_written(overrides: list[str]) -> None:
    # A value holding spaces (quoted, a list, an interpolation) was cut apart where it was read.
    assert split_overrides(join_overrides(overrides)) == overrides


def test_the_median_fields_are_the_records_own() -> None:
    # results.csv blanks them by name for a failed run: a renamed record field would stay behind.
    fields = {f.name for f in dataclasses.fields(RunRecord)}
    assert set(MEDIAN_FIELDS) <= fields and len(set(MEDIAN_FIELDS)) == len(MEDIAN_FIELDS)
