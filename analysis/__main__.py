"""`python -m analysis`: tables, recommendation, scaling and plots of one or more sweeps.

    python -m analysis <sweep dir> [more sweep dirs] [-o OUT] [--max-nodes N] [--max-mem-gib G]
                       [--dp-multiple K] [--no-plots] [--no-queue] [--wandb-log [--wandb-project P]
                       [--wandb-entity E] [--wandb-group G]]
    python -m analysis --wandb ENTITY/PROJECT --group SWEEP [-o OUT] [same options]
    python -m analysis --wandb-offline DIR [more DIRs] [--group SWEEP] [-o OUT] [same options]
    python -m analysis compare <before sweep> <after sweep> [-o OUT] [--match auto|overrides|layout]
    python -m analysis calibrate <sweep dir> [more sweep dirs] [--json FILE]

The first form reads every result.json, plan.csv row and manifest.jsonl entry of the sweeps and
writes into OUT (default <first sweep dir>/analysis): results.csv (every field), results.md
(the seeds' table, the recommendation, scaling, the ZeRO comparison when the sweeps vary
parallelism.engine, zero_stage or offload, what is missing), scaling.csv, zero.csv (with the
ZeRO comparison) and the PNG plots.
It prints the recommendation, what a dry run planned and nobody ran (a plan directory: plan.csv and
no manifest), what is still missing (at most CONSOLE_ROWS of each) and which plots had nothing
measured to draw (those are not written). The second form writes compare.md and
compare.csv (default OUT: <after sweep>/analysis) and prints the comparison. (A sweep directory
literally named 'compare' is given as ./compare.) The third fits the time model's efficiency factors
to the measured runs and prints the fit and its residuals (analysis.calibrate).

--wandb reads the trainer's runs of one W&B group through wandb's public API (network and a key
needed; default OUT ./analysis-<SWEEP>); --wandb-offline reads offline W&B runs (sweep
directories, run directories or .wandb files) with wandb's own log reader: a sweep whose
result.json files are gone can still be analysed (analysis.wandb_io says what W&B cannot give
back). --wandb-log also logs the analysis as one W&B run (job_type 'analysis') in the sweep's
project and group: explicit, because the default must never touch the network. Project,
entity and group default to the records' logger.* config, the group then to the sweep's name;
WANDB_MODE wins over the records' wandb_mode (offline when neither says). A failing W&B only
warns: the local outputs are written either way.

The first form's exit status (train.contract) says what a script may rely on: 0 when a layout is
recommended (a line on stderr when configs still pending or running may change it) or the input is a
dry run's plan, which is its own answer; with no recommendation, 3 (EXIT_UNFINISHED) while configs
are still pending or running and 1 (EXIT_FAILED) when every run ended and none qualifies (all failed,
or the constraints exclude every one), each with a line on stderr. The tables are written in every
case. Bad input ends with one line on stderr and exit status 2; a reader that went away
(`| head`) with exit status 141 and nothing on stderr (train.contract.EXIT_BROKEN_PIPE). No torch
is imported.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import functools
import gc
import multiprocessing
import os
import pickle
import shlex
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from analysis import finite_above_zero, whole_at_least_one
from conf.overrides import argparse_hint
from launchers.queue import unanswered_words
from train.contract import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_UNFINISHED,
    EXIT_USAGE,
    exit_on_broken_pipe,
    unwritable_below,
)

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.process import BaseProcess

    import pandas as pd

    from analysis.plots import Plots
    from analysis.records import QueueLookup, Sweeps


T = TypeVar("T")

CONSOLE_ROWS = 20
"""Rows of the planned and missing configs the console shows; results.md and results.csv have all (rows)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # One line, like every other bad input, instead of argparse's usage block.
        print(f"error: {message}{argparse_hint(message, self)} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def _at_least_one(text: str) -> int:
    """A count of nodes or a DP multiple: a whole number, 1 or more (0 would exclude every run, or divide by 0)."""
    if (value := whole_at_least_one(text)) is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1, e.g. 8")
    return value


def _gib(text: str) -> float:
    """A memory limit in GiB: a finite number above 0."""
    if (value := finite_above_zero(text)) is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB above 0, e.g. 70")
    return value


def _analyse_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m analysis",
        description="Analyse megasweep sweeps. Also: `python -m analysis compare BEFORE AFTER` (two sweeps "
        "side by side; compare --help) and `python -m analysis calibrate SWEEP...` (fit the time model's "
        "efficiency factors to measured runs; calibrate --help).",
        epilog="Exit status: 0 when a layout is recommended (or for a dry run's plan); with no recommendation, "
        "3 while configs are still pending or running and 1 when every run ended and none qualifies; 2 for bad "
        "input. The tables are written in every case but 2.",
    )
    p.add_argument("sweeps", nargs="*", type=Path, help="sweep directories")
    src = p.add_argument_group("W&B as the source (instead of sweep directories)")
    src.add_argument("--wandb", metavar="ENTITY/PROJECT", default=None, help="read the runs of --group from W&B")
    src.add_argument("--wandb-offline", metavar="DIR", nargs="+", type=Path, default=None,
                     help="read offline W&B runs (sweep dirs, run dirs or .wandb files)")
    src.add_argument("--group", default=None, help="W&B group (the sweep's name) to read")
    p.add_argument("-o", "--out", type=Path, default=None, help="output directory (default: <first sweep>/analysis)")
    p.add_argument("--max-nodes", type=_at_least_one, default=None, help="recommend layouts on at most this many nodes")
    p.add_argument("--max-mem-gib", type=_gib, default=None, help="recommend layouts peaking at most this (GiB)")
    p.add_argument("--dp-multiple", type=_at_least_one, default=None, help="recommend layouts whose DP is a multiple of this")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots (and remove an earlier analysis's from the output directory)")
    p.add_argument("--no-queue", action="store_true", help="do not ask squeue/sacct about missing runs")
    log = p.add_argument_group("logging the analysis to W&B")
    log.add_argument("--wandb-log", action="store_true", help="log the analysis as a W&B run (WANDB_MODE honoured)")
    log.add_argument("--wandb-project", default=None, help="default: the records' logger.wandb_project")
    log.add_argument("--wandb-entity", default=None, help="default: the records' logger.wandb_entity")
    log.add_argument("--wandb-group", default=None, help="default: the records' logger.wandb_group, else the sweep")
    return p


def _load(args: argparse.Namespace) -> tuple[Sweeps, Path]:
    """The sweeps to analyse and the default output directory, from whichever source was named."""
    from analysis.records import AnalysisError, load_sweeps

    sources = sum(bool(x) for x in (args.sweeps, args.wandb, args.wandb_offline))
    if sources != 1:
        raise AnalysisError("give sweep directories, --wandb ENTITY/PROJECT or --wandb-offline DIR (one of them)")
    if args.group is not None and not (args.wandb or args.wandb_offline):
        raise AnalysisError("--group selects W&B runs: use it with --wandb or --wandb-offline")
    if args.wandb:
        from analysis.wandb_io import server_sweeps

        if not args.group:
            raise AnalysisError("--wandb needs --group SWEEP (the W&B group of the sweep's runs)")
        return server_sweeps(args.wandb, args.group), Path(f"analysis-{args.group}")
    if args.wandb_offline:
        from analysis.wandb_io import offline_sweeps

        first = args.wandb_offline[0]
        return offline_sweeps(args.wandb_offline, group=args.group), (first if first.is_dir() else first.parent) / "analysis"
    unanswered: list[str] = []
    sweeps = load_sweeps(args.sweeps, queue=None if args.no_queue else _queue(unanswered))
    if unanswered:
        sweeps = dataclasses.replace(sweeps, warnings=(*sweeps.warnings, unanswered_words(unanswered)))
    return sweeps, args.sweeps[0] / "analysis"


def _queue(unanswered: list[str]) -> QueueLookup:
    """Slurm's states (launchers.queue), and into `unanswered` why it could not be asked, when it could
    not: a job that ended without its record then reads pending, and the analysis must say so."""
    from launchers.queue import ask_states

    def lookup(job_ids: Sequence[str]) -> Mapping[str, str]:
        answer = ask_states(job_ids)
        unanswered.extend(w for w in answer.unanswered if w not in unanswered)
        return answer.states

    return lookup


def _compare_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m analysis compare",
        description="Compare two sweeps (before / after): per-config sec/it and TFLOPs ratios, repeated runs "
        "pooled, changes within the noise flagged; writes compare.md and compare.csv. Exit status 0, or 2 "
        "for bad input.",
    )
    p.add_argument("before", type=Path, help="sweep directory before the change")
    p.add_argument("after", type=Path, help="sweep directory after the change")
    p.add_argument("-o", "--out", type=Path, default=None, help="output directory (default: <after>/analysis)")
    p.add_argument(
        "--match", choices=("auto", "overrides", "layout"), default="auto",
        help="pair configs by their overrides (order-free), by their layout (model, hardware, batch sizes, "
        "DP/TP/PP, ZeRO, recompute, precision, engine), or auto: by overrides, else by layout when no "
        "override set is in both sweeps (default auto)",
    )  # fmt: skip
    p.add_argument("--no-queue", action="store_true", help="do not ask squeue/sacct about missing runs")
    return p


class _PlotsAside:
    """The plots drawn by a forked process while this one loads the sweep and writes the tables, when
    that can help: matplotlib's start-up and the drawing take about as long as results.csv and
    results.md, and neither needs the other. Forked at the start, before the table exists: the child
    imports matplotlib while this process loads, then receives the table narrowed to the plots'
    columns (a fork after loading would have this process copy every page of the table it touches
    while the child lives). Elsewhere (one CPU, no fork, other threads running, whose locks a fork
    could catch held) the plots are drawn here when result() asks. Either way result() gives
    write_plots' Plots or raises what it raised."""

    def __init__(self) -> None:
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None
        self._job: tuple[pd.DataFrame, Path] | None = None
        self._sent = False

    @classmethod
    def start(cls) -> _PlotsAside:
        aside = cls()
        if _can_fork():
            context = multiprocessing.get_context("fork")
            aside._conn, child_end = context.Pipe()
            aside._process = context.Process(target=_plots_process, args=(child_end, aside._conn), daemon=True)
            aside._process.start()
            child_end.close()
        return aside

    def draw(self, df: pd.DataFrame, out: Path) -> None:
        """The plots of df into out: handed to the plotting process, or kept for result()."""
        self._job = (df, out)
        if self._conn is None:
            return
        from analysis.tables import narrow

        try:
            columns = self._conn.recv()  # what the plots read, once the child has imported them
            self._conn.send((narrow(df, columns), out))
            self._sent = True
        except Exception:  # it died, or the table does not pickle: drawn here instead
            self._stop()

    def result(self) -> Plots:
        if self._conn is not None:
            try:
                status, value = self._conn.recv()
            except (EOFError, OSError):  # it died drawing (killed): drawn again here
                self._stop()
            else:
                if status == "error":
                    raise value
                return value
        from analysis.plots import write_plots

        assert self._job is not None
        return write_plots(*self._job)

    def close(self) -> None:
        """Ends the plotting process: one given a table finishes it (no file left half written)."""
        if self._conn is not None:
            self._conn.close()
        if self._process is not None:
            if not self._sent:
                self._process.terminate()  # it was only importing matplotlib
            self._process.join()

    def _stop(self) -> None:
        self._sent = False
        self.close()
        self._conn = self._process = None


def _can_fork() -> bool:
    affinity = getattr(os, "sched_getaffinity", None)  # Linux's: the CPUs this process may use
    return (
        affinity is not None
        and len(affinity(0)) > 1
        and "fork" in multiprocessing.get_all_start_methods()
        and threading.active_count() == 1
    )


def _plots_process(conn: Connection, parent_end: Connection) -> None:
    """The forked child: imports the plots, sends the columns they read, receives (table, out), draws
    and sends back ('ok', Plots) or ('error', the exception)."""
    # The parent's end, a copy the fork made: held open here, it kept the parent's close from reaching
    # this process as the end of the pipe, and a parent that stopped before it had a table (bad input)
    # waited for ever on a child whose SIGTERM a handler of the parent's caught (a caller's own, such
    # as the trainer's in a test process, inherited by the fork).
    parent_end.close()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    failed: BaseException | None = None
    columns: tuple[str, ...] = ()
    try:
        from analysis.plots import PLOT_COLUMNS, pyplot

        pyplot()  # matplotlib's start-up, while the parent loads the sweep
        columns = PLOT_COLUMNS
    except BaseException as exc:  # raised to the parent with the table, as drawing here would
        failed = exc
    try:
        conn.send(columns)
        df, out = conn.recv()
    except (EOFError, OSError):
        return  # the parent stopped before it had a table (bad input): nothing to draw
    try:
        if failed is not None:
            raise failed
        result: tuple[str, object] = ("ok", _plots_side_by_side(df, out))
    except BaseException as exc:  # all of it goes back to the parent, which raises it
        exc.add_note("In the plotting process:\n" + "".join(traceback.format_exception(exc)).rstrip())
        result = ("error", exc)
    try:
        try:
            conn.send(result)
        except (EOFError, OSError):
            pass  # the parent has stopped waiting (its tables failed)
        except Exception:  # an exception that does not pickle: its text does
            conn.send(("error", RuntimeError(f"plotting failed: {result[1]!r}")))
    finally:
        conn.close()


def _plots_side_by_side(df: pd.DataFrame, out: Path) -> Plots:
    """write_plots(df, out), each plot but the first drawn by a forked process (_aside) of its own.

    Drawing takes longer than results.csv or results.md (PNG encoding alone is a third of it): in one
    process the plots would run alone at the end, with the other CPU idle; three processes share
    the CPUs with the tables' evenly. A plot that fails is drawn again here, and raises here."""
    from analysis.plots import PLOT_FILES, plots_written, write_plot

    out.mkdir(parents=True, exist_ok=True)
    aside = [_aside(functools.partial(write_plot, name, df, out)) for name in PLOT_FILES[1:]]
    answers: list[str | None] = []
    failed: BaseException | None = None
    draws: list[Callable[[], str | None]] = [functools.partial(write_plot, PLOT_FILES[0], df, out), *aside]
    for draw in draws:
        try:
            answers.append(draw())
        except BaseException as exc:  # the first raised once all are waited for: no file left half written
            failed = failed or exc
    if failed is not None:
        raise failed
    return plots_written(out, answers)


def _tables(
    df: pd.DataFrame, sweeps: Sweeps, args: argparse.Namespace, out: Path
) -> tuple[list[Path], str, str, bool]:
    """The recommendation, results.csv, results.md, scaling.csv and zero.csv (those with rows) into out:
    (the files written, results.md's text, the recommendation's text, whether it recommends a run)."""
    from analysis.records import write_results_csv

    # Started first: results.csv takes longest (every cell of every column) and needs only the table.
    csv_written = _aside(lambda: write_results_csv(df, out / "results.csv"))
    try:
        written, md, rec_text, recommended = _reports(df, sweeps, args, out)
    except BaseException:
        # results.csv is finished all the same (the child reaped, no half-written file left), as
        # when it was written first; what stopped the reports is what the user sees.
        with contextlib.suppress(Exception):
            csv_written()
        raise
    csv_written()
    return [out / "results.csv", *written], md, rec_text, recommended


def _reports(
    df: pd.DataFrame, sweeps: Sweeps, args: argparse.Namespace, out: Path
) -> tuple[list[Path], str, str, bool]:
    """_tables' files but results.csv: results.md, scaling.csv and zero.csv (those with rows)."""
    from analysis.recommend import Constraints, recommend, recommendation_text
    from analysis.tables import results_markdown, scaling_frame, scaling_markdown, zero_frame, zero_markdown

    constraints = Constraints(max_nodes=args.max_nodes, max_mem_gib=args.max_mem_gib, dp_multiple_of=args.dp_multiple)
    recs = recommend(df, constraints)
    rec_text = recommendation_text(df, recs, constraints)
    planned = int((df["outcome"] == "planned").sum())
    if not recs and planned and df["outcome"].isin(("planned", "skipped")).all():
        skipped = len(df) - planned
        rec_text = (
            f"No recommendation: nothing has run. This is a dry run: {planned} config(s) planned, not run"
            + (f", {skipped} skipped as infeasible" if skipped else "")
            + "; the fastest predicted are listed under 'Planned, not run'."
        )
    scaling = scaling_frame(df)
    scaling_md = scaling_markdown(scaling)
    zero = zero_frame(df)
    md = results_markdown(
        df, labels=sweeps.labels, recommendation=rec_text, scaling=scaling_md, zero=zero_markdown(zero)
    )
    (out / "results.md").write_text(md, encoding="utf-8")
    written = [out / "results.md"]
    for name, frame in (("scaling.csv", scaling), ("zero.csv", zero)):
        if not frame.empty:
            frame.to_csv(out / name, index=False)
            written.append(out / name)
        else:
            # An earlier analysis's table, of other sweeps, would read as this one's (as plots do).
            (out / name).unlink(missing_ok=True)
    return written, md, rec_text, bool(recs)


def _aside(write: Callable[[], T]) -> Callable[[], T]:
    """write() run by a forked child while this process goes on; the callable returned waits for it
    and gives what write() returned (pickled back through a pipe).

    A child that fails (or is killed) leaves the write to this process, which then raises what
    write() raises, as if nothing had been forked. Without a fork (see _can_fork; a fork refused;
    SIGCHLD ignored, which reaps the child before anyone can ask how it ended) the callable
    returned is write() itself: the files come in the same order, and fail alike, either way.
    Forked after loading, unlike the plots: the child only reads the table and lives about a
    second, so the pages this process writes meanwhile (results.md touches the table's objects)
    are few to copy. results.csv of 10,000 records takes ~0.5 s, now beside results.md and the plots.
    """
    if not _can_fork() or signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN:
        return write
    sys.stdout.flush()
    sys.stderr.flush()
    reader, writer = os.pipe()
    try:
        pid = os.fork()
    except OSError:  # no process to spare (EAGAIN, ENOMEM)
        os.close(reader)
        os.close(writer)
        return write
    if pid == 0:  # the child: nothing of the parent's (atexit, buffers, finally) may run here
        code = 1
        try:
            os.close(reader)
            value = pickle.dumps(write())
            with open(writer, "wb") as pipe:
                pipe.write(value)
            code = 0
        finally:
            os._exit(code)
    os.close(writer)

    def wait() -> T:
        with open(reader, "rb") as pipe:
            value = pipe.read()  # before waiting: a child whose answer fills the pipe waits for this
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:  # reaped already (SIGCHLD ignored since): how it ended is unknown
            status = -1
        if status == -1 or os.waitstatus_to_exitcode(status) != 0:
            return write()
        return pickle.loads(value)

    return wait


def analyse(argv: Sequence[str]) -> int:
    from analysis.records import MISSING
    from analysis.tables import missing_markdown, planned_markdown, summary_line

    args = _analyse_parser().parse_args(argv)
    if args.out is not None:
        _check_out(args.out)
    # Started first, so that matplotlib's start-up and the drawing run beside the loading and the tables.
    plotting = None if args.no_plots else _PlotsAside.start()
    try:
        # What is loaded stays to the end: the cyclic collector need not scan its ~200,000 containers
        # at all (each scan of them takes ~0.1 s; a short-lived process frees them at exit).
        gc.disable()
        try:
            sweeps, default_out = _load(args)
        finally:
            gc.freeze()
            gc.enable()
        for w in sweeps.warnings:
            print(f"warning: {w}", file=sys.stderr)
        df = sweeps.table
        out = args.out or _check_out(default_out, option=False)
        out.mkdir(parents=True, exist_ok=True)
        if plotting is not None:
            plotting.draw(df, out)
        else:
            _forget_plots(out)
        written, md, rec_text, recommended = _tables(df, sweeps, args, out)
        plots = plotting.result() if plotting is not None else None
    finally:
        if plotting is not None:
            plotting.close()
    plot_files = list(plots.written) if plots else []
    written += plot_files
    planned = int((df["outcome"] == "planned").sum())
    if args.wandb_log:
        from analysis.wandb_io import log_analysis, resolve_destination

        dest = resolve_destination(
            df, labels=sweeps.labels, project=args.wandb_project, entity=args.wandb_entity, group=args.wandb_group
        )
        run_dir, warning = log_analysis(df, dest=dest, out_dir=out, recommendation=rec_text,
                                        results_markdown=md, plots=plot_files)
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
        if run_dir:
            upload = f"; upload it with: wandb sync {shlex.quote(str(run_dir))}" if dest.mode == "offline" else ""
            print(f"W&B ({dest.mode}): analysis run in {dest.project}/{dest.group or '-'}, {run_dir}{upload}")
    print(summary_line(df))
    print()
    print(rec_text)
    if planned:
        print()
        print(f"Planned, not run ({planned} feasible config(s) of a dry run, never launched; "
              f"each work's fastest predicted first, with the plan's predictions):")
        print(planned_markdown(df, limit=CONSOLE_ROWS))
    missing = df["outcome"].isin(MISSING)
    if missing.any():
        print()
        print(f"Missing ({int(missing.sum())} config(s) still pending or running):")
        print(missing_markdown(df, limit=CONSOLE_ROWS))
    print()
    if plots is not None and plots.skipped:
        print(plots.skipped_line())
    print(f"wrote {', '.join(p.name for p in written)} to {out}")
    return _exit_status(df, recommended=recommended, sweeps=args.sweeps)


def _exit_status(df: pd.DataFrame, *, recommended: bool, sweeps: Sequence[Path] = ()) -> int:
    """What the analysis tells a script (the tables are written whatever it is): EXIT_OK when it
    recommends a layout (a line on stderr when configs still to end may change it) or reads a dry
    run's plan, which recommends nothing by design; else EXIT_UNFINISHED while configs are pending or
    running, EXIT_FAILED when every run ended and none qualifies."""
    from analysis.records import MISSING

    outcomes = df["outcome"]
    left = int(outcomes.isin(MISSING).sum())
    where = shlex.quote(str(sweeps[0])) if len(sweeps) == 1 else "<sweep dir>"
    wait = f"{left} config(s) still pending or running (python -m launchers status --wait {where} waits for them)"
    if recommended:
        if left:
            print(f"analysis: the recommendation may change: {wait}", file=sys.stderr)
        return EXIT_OK
    if (outcomes == "planned").any() and outcomes.isin(("planned", "skipped")).all():
        return EXIT_OK  # a dry run's plan, with something feasible in it
    if left:
        print(f"analysis: no recommendation yet: {wait}", file=sys.stderr)
        return EXIT_UNFINISHED
    why = "every config is infeasible (skipped)" if (outcomes == "skipped").all() else "no run that ended qualifies"
    print(f"analysis: no recommendation: {why} (see above)", file=sys.stderr)
    return EXIT_FAILED


def _forget_plots(out: Path) -> None:
    """--no-plots: an earlier analysis's plots in `out` (of other sweeps, or of fewer runs) would be
    read as this one's, beside its tables; they go, as a plot with nothing to draw does (write_plot)."""
    from analysis.plots import PLOT_FILES

    for name in PLOT_FILES:
        (out / name).unlink(missing_ok=True)


def compare(argv: Sequence[str]) -> int:
    from analysis.compare import compare_sweeps, format_comparison
    from analysis.records import load_sweeps, sweep_labels

    args = _compare_parser().parse_args(argv)
    if args.out is not None:
        _check_out(args.out)
    unanswered: list[str] = []
    queue = None if args.no_queue else _queue(unanswered)
    before, after = load_sweeps([args.before], queue=queue), load_sweeps([args.after], queue=queue)
    for w in [*before.warnings, *after.warnings, *([unanswered_words(unanswered)] if unanswered else [])]:
        print(f"warning: {w}", file=sys.stderr)
    result = compare_sweeps(before.table, after.table, match=args.match)
    labels = sweep_labels([args.before, args.after])
    text = format_comparison(result, before=labels[0], after=labels[1])
    out = args.out or _check_out(args.after / "analysis", option=False)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.md").write_text(text, encoding="utf-8")
    result.table.to_csv(out / "compare.csv", index=False)
    print(text)
    print(f"wrote compare.md, compare.csv to {out}")
    return 0


def _check_out(out: Path, *, option: bool = True) -> Path:
    """`out`, proved writable before anything is loaded or written there, and made only then (a
    refusal after this check, a sweep that does not load, leaves no empty directory); AnalysisError
    naming -o (or, for the default, the directory) otherwise, where mkdir's OSError named neither."""
    from analysis.records import AnalysisError

    why = unwritable_below(out)
    if why is None:
        return out
    if option:
        raise AnalysisError(f"-o {out}: cannot write the analysis there ({why}); name a directory you can create "
                            "and write")  # fmt: skip
    raise AnalysisError(f"cannot write the analysis to {out} ({why}); choose a directory you can write with -o DIR")


def _command_hint(args: Sequence[str]) -> str:
    """'; did you mean ...?' when the first argument, read as a sweep directory that does not exist,
    is close to a command (`calibrat` was said to be a missing sweep directory, nothing more)."""
    if not args or args[0].startswith("-") or args[0] in COMMANDS or Path(args[0]).exists():
        return ""
    close = difflib.get_close_matches(args[0], COMMANDS, n=1)
    return f"; did you mean python -m analysis {close[0]}?" if close else ""


COMMANDS = ("compare", "calibrate")
"""What `python -m analysis <first argument>` runs instead of analysing sweep directories."""


def main(argv: Sequence[str] | None = None) -> int:
    from analysis.records import AnalysisError

    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args and args[0] == "compare":
            return compare(args[1:])
        if args and args[0] == "calibrate":
            from analysis.calibrate import main as calibrate

            return calibrate(args[1:])
        return analyse(args)
    except AnalysisError as exc:
        print(f"error: {exc}{_command_hint(args)}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        raise  # stdout's reader went away (`| head`): said by exit_on_broken_pipe, not as an error
    except OSError as exc:
        # Unwritable output directory, unreadable sweep: the user's to fix, not a bug to trace.
        print(f"error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    exit_on_broken_pipe(main)
