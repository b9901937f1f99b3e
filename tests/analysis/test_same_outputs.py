"""The analysis' faster paths write what the plain ones wrote: results.csv by the csv module as
DataFrame.to_csv wrote it, the plots of the table narrowed to their columns as those of the whole
table, and the CLI's outputs alike whether its plots and results.csv are written by forked processes
or inline; a write that fails aside is done again, and fails, in the CLI's own process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import analysis.__main__ as cli
from analysis.plots import PLOT_COLUMNS, PLOT_FILES, write_plots
from analysis.records import load_sweeps, whole_number_columns, write_results_csv
from analysis.tables import narrow
from tests.analysis.golden.build import build_sweep

REPO = Path(__file__).resolve().parents[2]


def _to_csv(df: pd.DataFrame, path: Path) -> None:
    """results.csv as pandas writes it: counts as Int64, list and dict cells as JSON text, then
    DataFrame.to_csv."""
    out = df.astype({name: "Int64" for name in whole_number_columns(df)})
    for name in out.columns:
        if out[name].dtype == np.dtype(object):
            out[name] = pd.Series(
                [json.dumps(v) if isinstance(v, list | dict) else v for v in out[name].tolist()],
                index=out.index, dtype=object,
            )
    out.to_csv(path, index=False)


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sweep(tmp_path_factory.mktemp("same") / "bloom_sweep")


def _mixed_table() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "f": [1.0, np.nan, -0.0, 1e16, 1 / 3, 1e-05],
            "i": [1, 2, 3, -4, 5, 2**40],
            "b": [True, False, True, True, False, True],
            "s": pd.Series(["a", "comma, inside", 'quote " inside', "new\nline", None, ""], dtype="str"),
            "o": [None, np.nan, 1.5, "text", True, 7],
            "numbers": [[1.0, 2.5], [], None, [np.nan, float("inf")], [1, True, None], [10.0] * 3],
            "nested": [{"k": [1, 2]}, ["a", "b, c"], [[1], [2]], "plain", np.nan, {"x": 'q"'}],
            "strings": [["+nodes=2", "a=b"], ["]", "["], [], ["x"], ["], ["], ["y", "z"]],
            # Repeated values are written once per distinct text: -0.0 is not 0.0, True not 1.
            "zeros": [0.0, -0.0, 0.0, -0.0, np.nan, 0.0],
            "alike": [1, True, 1.0, "1", "cr\rinside", "cr\r, comma"],
            # One list in every row is dumped once; equal lists that JSON writes apart are not one.
            "same": [[0.5, 2.0, 1e16]] * 6,
            "equal": [[1], [1.0], [True], [1], [1], [1]],
            "signed": [[0.0], [-0.0], [0.0], [0.0], [0.0], [0.0]],
            # Counts a missing row made floats: written whole; one that is no whole number stays float.
            "dp": [1.0, np.nan, 4.0, -0.0, 2.0**40, 8.0],
            "world.tp": [2.0, np.nan, 2.5, 1.0, 1.0, 1.0],
        }
    )


@pytest.mark.parametrize("which", ["golden", "mixed", "empty"])
def test_results_csv_is_what_to_csv_wrote(golden: Path, tmp_path: Path, which: str) -> None:
    df = {
        "golden": lambda: load_sweeps([golden], queue=None).table,
        "mixed": _mixed_table,
        "empty": lambda: _mixed_table().iloc[:0],
    }[which]()
    write_results_csv(df, tmp_path / "fast.csv")
    _to_csv(df, tmp_path / "plain.csv")
    assert (tmp_path / "fast.csv").read_bytes() == (tmp_path / "plain.csv").read_bytes()


def test_the_plots_read_only_their_columns(golden: Path, tmp_path: Path) -> None:
    df = load_sweeps([golden], queue=None).table
    whole = write_plots(df, tmp_path / "whole")
    narrowed = write_plots(narrow(df, PLOT_COLUMNS), tmp_path / "narrow")
    assert [p.name for p in whole.written] == [p.name for p in narrowed.written] and whole.written
    for a, b in zip(whole.written, narrowed.written, strict=True):
        assert a.read_bytes() == b.read_bytes(), a.name


def test_cli_outputs_are_the_same_with_the_plots_drawn_aside_or_inline(
    golden: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A fresh interpreter forks its plotting process (on two or more CPUs); here it is told not to.
    proc = subprocess.run(
        [sys.executable, "-m", "analysis", str(golden), "--no-queue", "-o", str(tmp_path / "aside")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    monkeypatch.setattr(cli, "_can_fork", lambda: False)
    assert cli.main([str(golden), "--no-queue", "-o", str(tmp_path / "inline")]) == 0
    inline_stdout = capsys.readouterr().out
    assert proc.stdout.replace(str(tmp_path / "aside"), "OUT") == inline_stdout.replace(str(tmp_path / "inline"), "OUT")
    names = sorted(p.name for p in (tmp_path / "aside").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "inline").iterdir()) and "tflops_mfu.png" in names
    for name in names:
        assert (tmp_path / "aside" / name).read_bytes() == (tmp_path / "inline" / name).read_bytes(), name


@pytest.mark.parametrize("name", PLOT_FILES)
def test_cli_plotting_failure_is_raised_as_before(golden: Path, tmp_path: Path, name: str) -> None:
    # The output directory exists but a plot's path is a directory: savefig fails in the plotting
    # process (the first plot) or in one it forked (the others), and the CLI reports it as it reports
    # any OSError (one line, exit 2), with the tables and the other plots written.
    out = tmp_path / "out"
    (out / name).mkdir(parents=True)
    proc = subprocess.run(
        [sys.executable, "-m", "analysis", str(golden), "--no-queue", "-o", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: ") and name in proc.stderr, proc.stderr
    assert (out / "results.csv").is_file() and (out / "results.md").is_file()
    assert all((out / other).is_file() for other in PLOT_FILES if other != name)


def _cli_in_a_fresh_interpreter(golden: Path, out: Path, options: Sequence[str], then: str) -> str:
    """Runs the CLI's main on golden in a new interpreter, whose modules are its own, and returns
    its exit code and the text of `then` (an expression over sys and cli) evaluated after it."""
    code = (
        "import sys, analysis.__main__ as cli\n"
        f"code = cli.main([{str(golden)!r}, '--no-queue', *{list(options)!r}, '-o', {str(out)!r}])\n"
        f"print(code, {then})\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def test_the_cli_leaves_matplotlib_to_its_plotting_process(golden: Path, tmp_path: Path) -> None:
    # matplotlib's start-up (~0.4 s) belongs to the plotting process; the CLI's own process, which
    # only reads back what was drawn, must not pay it again at the end of its run.
    then = "cli._can_fork(), sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib')[:3]"
    code, forked, matplotlib_modules = _cli_in_a_fresh_interpreter(golden, tmp_path / "out", [], then).split(" ", 2)
    if forked != "True":
        pytest.skip("one CPU: the plots are drawn in the CLI's own process")
    assert (code, matplotlib_modules) == ("0", "[]")
    assert (tmp_path / "out" / "tflops_mfu.png").is_file()


def test_the_cli_imports_neither_hydra_nor_torch(golden: Path, tmp_path: Path) -> None:
    # The analysis reads the schema's dataclasses and the planner's arithmetic and composes nothing:
    # Hydra and OmegaConf cost ~0.15-0.2 s of every start, torch far more.
    then = "sorted({m.split('.')[0] for m in sys.modules} & {'hydra', 'omegaconf', 'torch'})"
    assert _cli_in_a_fresh_interpreter(golden, tmp_path / "out", ["--no-plots"], then) == "0 []"
    assert (tmp_path / "out" / "results.md").is_file()


@pytest.mark.parametrize("when", ["importing", "drawing"])
def test_a_plotting_process_that_dies_is_replaced_by_drawing_here(
    golden: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    def dies(conn: Connection) -> None:
        if when == "drawing":
            conn.send(PLOT_COLUMNS)
            conn.recv()
        os._exit(3)  # as if killed, without a word

    monkeypatch.setattr(cli, "_can_fork", lambda: True)
    monkeypatch.setattr(cli, "_plots_process", dies)
    assert cli.main([str(golden), "--no-queue", "-o", str(tmp_path / "out")]) == 0
    monkeypatch.setattr(cli, "_can_fork", lambda: False)
    assert cli.main([str(golden), "--no-queue", "-o", str(tmp_path / "inline")]) == 0
    for name in PLOT_FILES:
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "inline" / name).read_bytes(), name


def test_a_write_aside_runs_in_another_process_and_is_waited_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "_can_fork", lambda: True)
    path = tmp_path / "pid"
    wait = cli._aside(lambda: (path.write_text(str(os.getpid())), os.getpid()))
    _, pid = wait()  # what it returned comes back
    assert path.read_text() == str(pid) != str(os.getpid())  # written, and by the child


@pytest.mark.parametrize("fork", [True, False])
def test_a_write_that_fails_aside_is_done_again_here_and_raises_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fork: bool
) -> None:
    monkeypatch.setattr(cli, "_can_fork", lambda: fork)
    calls = tmp_path / "calls"

    def write() -> None:
        with open(calls, "a") as f:
            f.write(f"{os.getpid()}\n")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        cli._aside(write)()  # without fork, write() runs (and raises) in the wait
    pids = calls.read_text().split()
    assert pids[-1] == str(os.getpid())
    assert len(pids) == (2 if fork else 1) and (not fork or pids[0] != str(os.getpid()))


def _cli(golden: Path, out: Path, *, sigchld_ignored: bool = False) -> subprocess.CompletedProcess[str]:
    """`python -m analysis` on golden into out, in a fresh interpreter (which forks, on 2+ CPUs)."""

    def ignore_sigchld() -> None:
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # inherited through exec, as from such a parent

    return subprocess.run(
        [sys.executable, "-m", "analysis", str(golden), "--no-queue", "--no-plots", "-o", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300, preexec_fn=ignore_sigchld if sigchld_ignored else None,
    )


@pytest.mark.parametrize("fork", [True, False])
def test_an_unwritable_results_csv_is_one_line_and_exit_2(
    golden: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], fork: bool
) -> None:
    # Written aside or here, results.csv fails the same way: one line, exit 2, results.md written.
    out = tmp_path / "out"
    (out / "results.csv").mkdir(parents=True)
    if fork:
        proc = _cli(golden, out)
        code, err = proc.returncode, proc.stderr
    else:
        monkeypatch.setattr(cli, "_can_fork", lambda: False)
        code, err = cli.main([str(golden), "--no-queue", "--no-plots", "-o", str(out)]), capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: ") and "results.csv" in err
    assert (out / "results.md").is_file()


def test_reports_that_fail_leave_results_csv_whole_and_no_child(
    golden: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = _cli(golden, tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr
    out = tmp_path / "out"
    (out / "results.md").mkdir(parents=True)  # results.md cannot be written: the reports fail
    monkeypatch.setattr(cli, "_can_fork", lambda: True)
    assert cli.main([str(golden), "--no-queue", "--no-plots", "-o", str(out)]) == 2
    # Finished before main returned (it waited for the child), not half written.
    assert (out / "results.csv").read_bytes() == (tmp_path / "whole" / "results.csv").read_bytes()
    time.sleep(1)  # a child left unwaited for would be a zombie by now
    try:
        left = os.waitpid(-1, os.WNOHANG)[0]
    except ChildProcessError:  # no child at all
        left = 0
    assert left == 0


def test_with_sigchld_ignored_the_analysis_still_succeeds(golden: Path, tmp_path: Path) -> None:
    # A parent that ignores SIGCHLD hands that on: children are reaped unasked, and waitpid finds none.
    proc = _cli(golden, tmp_path / "out", sigchld_ignored=True)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "results.csv").read_bytes() == _cli_bytes(golden, tmp_path / "plain")


def _cli_bytes(golden: Path, out: Path) -> bytes:
    proc = _cli(golden, out)
    assert proc.returncode == 0, proc.stderr
    return (out / "results.csv").read_bytes()


def test_a_child_reaped_unasked_leaves_the_write_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def reaped(pid: int, options: int) -> tuple[int, int]:
        real_waitpid(pid, options)  # reaped here, as SIGCHLD ignored would have
        raise ChildProcessError(10, "No child processes")

    real_waitpid = os.waitpid
    monkeypatch.setattr(cli, "_can_fork", lambda: True)
    path = tmp_path / "pid"
    wait = cli._aside(lambda: path.write_text(str(os.getpid())))
    monkeypatch.setattr(cli.os, "waitpid", reaped)
    wait()
    assert path.read_text() == str(os.getpid())  # written again, here


def test_a_fork_that_fails_leaves_the_write_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_fork() -> int:
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(cli, "_can_fork", lambda: True)
    monkeypatch.setattr(cli.os, "fork", no_fork)
    path = tmp_path / "pid"
    wait = cli._aside(lambda: path.write_text(str(os.getpid())))
    assert not path.exists()  # left for the wait, in the order the forked write would come
    wait()
    assert path.read_text() == str(os.getpid())
