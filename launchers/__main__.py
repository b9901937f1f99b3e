"""`python -m launchers status|rerun <sweep dir>`: follow and repair a launched sweep;
`python -m launchers sbatch <sweep overrides>`: array scripts to submit with sbatch yourself;
`python -m launchers calibrate <overrides> --out FILE`: measure this site for the time model.

Exit status (train.contract): 0; 1 (EXIT_FAILED) when `status` finds failed, cancelled, preempted, interrupted or
refused configs that no rerun stands for (0 with --ok-if-failed; --skip-cancelled counts no cancelled one), when a local sweep's rerun fails again,
or when sbatch refuses every config a rerun resubmits; 3 (EXIT_UNFINISHED) when `status` finds configs still
pending or running and no failure to report (`status --wait` waits until none is);
130 (EXIT_INTERRUPTED) when Ctrl-C stops a local sweep's rerun, an export (waiting for the sweep's lock),
`status --wait` or a calibration; 2 (EXIT_USAGE), after one paragraph on stderr,
for a directory that is not a sweep, a refused directory or option, a config that does not compose, or a
rerun or export whose every (changed) config is infeasible (nothing resubmitted or exported), or a rerun
whose field=value changes found no failure to apply to (each one rerun already);
141 (EXIT_BROKEN_PIPE), quietly, when stdout's reader went away (`... status DIR | head`)."""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from conf.overrides import argparse_hint, missing_option_line, override_problem
from launchers.queue import unanswered_words
from launchers.status import (
    UNFINISHED_STATES,
    ConfigStatus,
    format_status,
    rerun_failed,
    sweep_status,
    unresolved_failures,
    wait_for_sweep,
)
from train.contract import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNFINISHED,
    EXIT_USAGE,
    SUBMITIT_DIR,
    ManifestError,
    exit_on_broken_pipe,
    unwritable_below,
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line with the close command or option, like every other bad input (argparse prints its
        # usage block first and, before Python 3.14, suggests nothing); its subcommands' parsers too.
        print(f"error: {message}{argparse_hint(message, self)} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def _already_rerun(sweep_dir: Path, overrides: Sequence[str], statuses: Sequence[ConfigStatus]) -> tuple[str, bool]:
    """Why a rerun found nothing to do although configs failed: each stands for a rerun already (one
    queued meanwhile by another `rerun`, say); and whether those reruns made these `overrides`' changes
    (the same command again, a script's retry) rather than others, which these then do not make.
    `statuses`: those the rerun chose from (rerun_failed's `seen`)."""
    from launchers.status import RERUN_STATES, changed_overrides, read_sweep

    stood = [s for s in statuses if s.state in RERUN_STATES and s.rerun_as is not None]
    if not stood:
        return "", False
    shown = ", ".join(f"config {s.index} as config {s.rerun_as}" for s in stood[:5]) + (", ..." if len(stood) > 5 else "")
    listed = {e.index: tuple(e.overrides) for e in read_sweep(sweep_dir)}
    made = bool(overrides) and all(
        s.rerun_as is not None and listed.get(s.rerun_as) == changed_overrides(s.overrides, overrides) for s in stood
    )
    if made:
        return f" to rerun: each failed one is rerun already with {' '.join(overrides)} ({shown})", True
    ignored = f"; {' '.join(overrides)} not applied: rerun those configs' failures to change them" if overrides else ""
    return f" to rerun: each failed one is rerun already ({shown}){ignored}", False


def _cancelled_left_out(sweep_dir: str, statuses: Sequence[ConfigStatus]) -> str:
    """The configs `rerun --skip-cancelled` left out of `statuses` (those it chose from: Slurm is not
    asked again), in words after "; "; empty when none was."""
    left = [s.index for s in unresolved_failures(statuses) if s.state == "cancelled"]
    if not left:
        return ""
    shown = ", ".join(map(str, left[:10])) + (", ..." if len(left) > 10 else "")
    where = shlex.quote(sweep_dir)
    # A script's `status` after this rerun must not read them as failures it is to act on: say how.
    return (f"; left out {len(left)} cancelled config(s) (--skip-cancelled): {shown}; they stay cancelled "
            f"(python -m launchers rerun --failed {where} without --skip-cancelled resubmits them; python -m "
            f"launchers status --skip-cancelled {where} does not count them as failed)")  # fmt: skip


def _swept(text: str) -> bool:
    """Whether `text` is a sweep (`a=1,2`, `a=range(3)`); one Hydra cannot parse is not (its check says why)."""
    from hydra.errors import HydraException

    from launchers.compose import parse_override

    try:
        return parse_override(text).is_sweep_override()
    except HydraException:
        return False


def _hydra_override(text: str) -> bool:
    """Whether `text` sets one of Hydra's own keys (one Hydra cannot parse is said as such elsewhere)."""
    from hydra.errors import HydraException

    from launchers.compose import parse_override

    try:
        return parse_override(text).is_hydra_override()
    except HydraException:
        return False


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(prog="python -m launchers", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser(
        "status", help="table of pending / running / done / failed / cancelled / preempted / skipped configs",
        description="Show where each config of a launched sweep stands. Exit status: 0 when every config "
        "finished and none failed; 1 when configs failed, were cancelled (scancel), preempted by Slurm, interrupted or refused by "
        "sbatch, and no rerun stands for them (0 with --ok-if-failed; cancelled ones not counted with "
        "--skip-cancelled); 3 when configs are still pending or "
        "running and none of that "
        "holds; 2 for a directory that is no launched sweep; 130 when Ctrl-C stops --wait.",
    )  # fmt: skip
    status.add_argument("sweep_dir")
    status.add_argument(
        "--ok-if-failed", action="store_true", help="exit 0 even when configs failed (default: exit 1)"
    )
    status.add_argument(
        "--skip-cancelled", action="store_true",
        help="do not count the configs whose job was cancelled (scancel) as failed, as rerun --failed "
        "--skip-cancelled leaves them out: the table still shows them `cancelled` (default: exit 1 for them)",
    )  # fmt: skip
    status.add_argument(
        "--wait", action="store_true",
        help="wait until no config is pending or running (a line on stderr when the counts change), then show "
        "the table and exit as without it; a sweep whose launch has not listed its configs yet is waited for "
        "while that launch holds the sweep's lock (exit 2 when none does); Ctrl-C stops waiting (exit 130)",
    )  # fmt: skip
    status.add_argument(
        "--poll", type=_poll_seconds, default=None, metavar="SECONDS",
        help=f"with --wait, seconds between looks at Slurm and the records (default {POLL_S:g}, at least "
        f"{MIN_POLL_S:g})",
    )  # fmt: skip
    rerun = sub.add_parser(
        "rerun",
        help="resubmit configs of a sweep",
        description="Resubmit the failed configs of a sweep; with field=value overrides, as new configs "
        "of the sweep with those fields changed. Example: python -m launchers rerun --failed "
        "multirun/x training.train_iters=5",
    )
    rerun.add_argument("sweep_dir")
    rerun.add_argument(
        "--failed", action="store_true", required=True,
        help="the failed, timed-out, cancelled, preempted, interrupted and Slurm-refused configs (required)",
    )  # fmt: skip
    rerun.add_argument(
        "--skip-cancelled", action="store_true",
        help="leave out the configs whose job was cancelled (scancel; `status` shows them `cancelled`), for a "
        "user who cancelled them to drop them; they stay cancelled, and a later rerun --failed without this "
        "option resubmits them (default: resubmit them with the failed ones)",
    )  # fmt: skip
    rerun.add_argument("overrides", nargs="*", help="field=value changes: rerun as new configs with them")
    rerun.add_argument(
        "--no-test-only", dest="test_only", action="store_false",
        help="do not ask Slurm to judge the jobs (sbatch --test-only) before queueing them; a launch that did "
        "not ask (hydra.launcher.test_only=false) is not asked again either",
    )  # fmt: skip
    sbatch = sub.add_parser(
        "sbatch",
        help="write job array scripts (one per allocation) and their task tables, submit nothing",
        description="Expand and validate a sweep as hydra/launcher=slurm does; write one array script "
        "per allocation, for sbatch. Example: python -m launchers sbatch --name lr training.lr=1e-4,3e-4",
    )
    sbatch.add_argument("overrides", nargs="+", help="sweep overrides, as after `python -m train -m`")
    sbatch.add_argument("--name", default=None, help="job name and file stem (default: sweep-<time>)")
    sbatch.add_argument("--out-dir", default="slurm/sweeps", help="where the scripts go (slurm/sweeps)")
    sbatch.add_argument("--sweep-dir", default=None, help="results directory (multirun/sbatch/<name>)")
    sbatch.add_argument("--config-dir", default=None, help="config directory (megasweep's conf/)")
    sbatch.add_argument("--config-name", default="config")
    sbatch.add_argument("--python", default=None, help="interpreter on the nodes (this one)")
    sbatch.add_argument("--module", default="train", help="entry module each task runs (train)")
    sbatch.add_argument("--max-array-size", type=int, default=None, help="(MaxArraySize from scontrol)")
    sbatch.add_argument("--array-parallelism", type=int, default=None, help="%%N (cluster.array_parallelism)")
    sbatch.add_argument(
        "--sbatch-arg", action="append", default=[], metavar="KEY[=VALUE]", help="extra #SBATCH --KEY=VALUE"
    )
    sbatch.add_argument("--srun-arg", action="append", default=[], metavar="ARG", help="extra srun argument")
    calibrate = sub.add_parser(
        "calibrate",
        help="measure this site's GEMMs, memory and links for the time model (two short Slurm jobs)",
        description="Submit a one-node and a two-node job that time what the search's layouts run; write the "
        "file hardware.calibration names. Example (the local cluster, whose emulated nodes hold 2 CPUs): "
        "python -m launchers calibrate cluster=local hardware=cpu hardware.devices_per_node=2 model=gpt_350m "
        "--out calibration/cpu.json",
    )
    calibrate.add_argument("overrides", nargs="*", help="config overrides, as for `python -m train`")
    calibrate.add_argument("--out", required=True, help="calibration file to write (JSON)")
    calibrate.add_argument("--nodes", type=int, nargs="+", default=[1, 2], help="node counts measured (1 2)")
    calibrate.add_argument("--min-seconds", type=float, default=0.05, help="shortest timing of each figure (s)")
    calibrate.add_argument(
        "--here", action="store_true",
        help="measure this machine's one device in this process, without Slurm (no collectives; --nodes ignored)",
    )
    calibrate.add_argument(
        "--no-test-only", dest="test_only", action="store_false",
        help="do not ask Slurm to judge the calibration jobs (sbatch --test-only) before queueing them",
    )
    sbatch.add_argument(
        "--append", action="store_true", help="add the configs to the sweep already in --sweep-dir (new indices)"
    )
    sbatch.add_argument(
        "--no-test-only", dest="test_only", action="store_false",
        help="do not ask this machine's Slurm to judge each script (sbatch --test-only) before writing it",
    )
    args, extra = parser.parse_known_args(argv)
    # argparse ends a positional list at the first option: in `rerun DIR --failed lr=1` or `sbatch a=1
    # --name x b=2` the overrides after the option come back unparsed. They are overrides all the same.
    if extra and hasattr(args, "overrides") and not any(a.startswith("-") for a in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:  # said by the command's parser, which knows its options
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "status" and args.poll is not None and not args.wait:
        status.error(f"--poll {args.poll:g} paces --wait, which was not given: add --wait, or leave --poll out")
    # A misspelt key, a missing group option or a value of the wrong type: the trainer's one line with
    # "did you mean", before anything composes (Hydra's words for them suggest '+key' or hide the
    # reason in an exception's cause). A rerun's sweep, or an export's --config-dir, may have group
    # options of its own: only keys and values are checked there.
    own_options = args.command == "calibrate" or (args.command == "sbatch" and not args.config_dir)
    overrides = getattr(args, "overrides", None) or []
    if args.command == "sbatch":
        # An export refuses Hydra's own keys, whatever they say (launchers.sbatch.expand_sweep): a hint at
        # the hydra/launcher that has such a field sent the user to a second refusal.
        overrides = [o for o in overrides if not _hydra_override(o)]
    if args.command == "rerun" and (hydra := [o for o in overrides if _hydra_override(o)]):
        # Each config reruns the way its launch ran it (launch.json): a Hydra key would only be recorded
        # as a config change (+hydra.launcher.x=y ran duplicates under the old settings).
        print(f"error: {' '.join(hydra)}: rerun --failed takes changes of the configs' fields (field=value, "
              "e.g. training.lr=1e-4 or parallelism.micro_batch_size=2), not Hydra's or the launcher's options; "
              "the configs rerun with the launch settings they were launched with", file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    if args.command == "rerun" and (swept := [o for o in overrides if _swept(o)]):
        # Composition's own words ("sweep with -m") pointed at a flag rerun does not take.
        print(f"error: {' '.join(swept)}: rerun --failed gives each failed config one value per field changed; "
              "to try several, launch them as a sweep (python -m train -m ... hydra.sweep.dir=<new dir>)",
              file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    if (problem := override_problem(overrides, own_options=own_options)) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "calibrate":
        return _calibrate(args)
    if args.command == "sbatch":
        return _sbatch(args, sys.argv[1:] if argv is None else list(argv))
    from hydra.errors import HydraException

    try:
        if args.command == "status":
            return _status(args.sweep_dir, ok_if_failed=args.ok_if_failed, skip_cancelled=args.skip_cancelled,
                           poll_s=(args.poll or POLL_S) if args.wait else None)  # fmt: skip
        seen: list[ConfigStatus] = []
        entries = rerun_failed(args.sweep_dir, args.overrides, test_only=args.test_only,
                               skip_cancelled=args.skip_cancelled, seen=seen)  # fmt: skip
    except (FileNotFoundError, ManifestError, ValueError, HydraException) as exc:
        print(f"error: {missing_option_line(exc) or exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        raise  # stdout's reader went away (`status DIR | head`): exit_on_broken_pipe's, not a read error
    except OSError as exc:  # a manifest or launch record that cannot be read (permissions, an I/O error)
        print(f"error: {exc.filename or args.sweep_dir}: cannot be read ({exc.strerror or exc})", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # a local sweep's rerun: the manifest says which configs were interrupted
        if args.command == "status":  # --wait: the sweep goes on; only the waiting stopped
            print(f"status: stopped waiting (python -m launchers status {shlex.quote(args.sweep_dir)} shows where it is)",
                  file=sys.stderr)  # fmt: skip
            return EXIT_INTERRUPTED
        print(f"rerun: interrupted (python -m launchers status {shlex.quote(args.sweep_dir)} shows where it stopped)", file=sys.stderr)
        return EXIT_INTERRUPTED
    # Said after what was resubmitted, or instead of it: the user reads which configs stay dropped.
    dropped = _cancelled_left_out(args.sweep_dir, seen) if args.skip_cancelled else ""
    if not entries:
        why, made = _already_rerun(args.sweep_dir, args.overrides, seen)
        if why and args.overrides and not made:
            # Changes asked for and made to nothing: a script must not read them as queued.
            print(f"rerun: no failed configs{why}{dropped}", file=sys.stderr)
            return EXIT_USAGE
        print(f"rerun: no failed configs{why}{dropped}")
        return 0
    for e in entries:
        ran = "ran here" if e.job_id is None else f"job {e.job_id}"
        what = ran if e.status == "submitted" else f"{e.status}: {e.reason}"
        origin = f" (rerun of config {e.rerun_of})" if e.rerun_of is not None else ""
        print(f"rerun: config {e.index}{origin}: {what}")
    if dropped:
        print(f"rerun: {dropped.removeprefix('; ')}")
    refused = [e for e in entries if e.status == "refused"]
    if refused and not any(e.status == "submitted" for e in entries):
        # As a launch that sbatch refused: nothing runs, and a script must not read it as queued.
        print(f"rerun: nothing was resubmitted: sbatch refused {len(refused)} config(s) (the reasons are above); "
              f"python -m launchers rerun --failed {shlex.quote(args.sweep_dir)} tries again once the cause is fixed", file=sys.stderr)  # fmt: skip
        return EXIT_FAILED
    here = {e.index for e in entries if e.status == "submitted" and e.job_id is None}
    if here:
        # A local sweep's configs ran to the end before this returns: say whether they failed again.
        again = [s for s in unresolved_failures(sweep_status(args.sweep_dir)) if s.index in here]
        if again:
            print(f"rerun: {len(again)} configs failed again (python -m launchers status {shlex.quote(args.sweep_dir)})",
                  file=sys.stderr)  # fmt: skip
            return EXIT_FAILED
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from hydra.errors import HydraException

    from launchers.calibrate import main as calibrate_main

    if not args.nodes or any(n not in (1, 2) for n in args.nodes):
        print(f"error: --nodes {args.nodes}: node counts are positive and at most 2 (inside a node, and "
              "between two nodes, is what the time model's links need), e.g. --nodes 1 2", file=sys.stderr)
        return EXIT_USAGE
    if not (math.isfinite(args.min_seconds) and args.min_seconds > 0):
        print(f"error: --min-seconds {args.min_seconds}: the shortest time each figure is timed for is a number "
              "of seconds above 0 (default 0.05); nothing was submitted", file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    out = Path(args.out)
    # Found now, not when the jobs have run and their figures have nowhere to go (an OSError naming no option).
    why = "it is a directory" if out.is_dir() else unwritable_below(out.parent)
    if why is not None:
        print(f"error: --out {out}: cannot write the calibration file there ({why}); name a JSON file in a "
              "directory you can create and write, e.g. --out calibration/site.json; nothing was submitted",
              file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    try:
        return calibrate_main(args.overrides, out=out, nodes=args.nodes, min_seconds=args.min_seconds, here=args.here,
                              test_only=args.test_only)  # fmt: skip
    except (HydraException, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # its job, if one was queued, is cancelled (launchers.calibrate)
        print(f"calibrate: interrupted; {args.out} not written", file=sys.stderr)
        return EXIT_INTERRUPTED
    except SystemExit:  # kill or the terminal closing: its job, if one was queued, is cancelled too
        print(f"calibrate: stopped; {args.out} not written", file=sys.stderr)
        raise
    except RuntimeError as exc:  # submitit: a calibration job failed or did not complete
        print(f"error: a calibration job failed: {str(exc).strip().splitlines()[-1]} (its log is under "
              f"{Path(args.out).parent / SUBMITIT_DIR})", file=sys.stderr)
        return EXIT_FAILED


POLL_S = 30.0
"""`status --wait`'s default seconds between looks: one squeue (and sacct) call per look, for every job
of the sweep at once, is little for slurmctld at this pace (submitit's watcher asks at a like pace)."""


MIN_POLL_S = 1.0
"""The shortest `--poll`: each look runs squeue and sacct, which a tighter loop would have slurmctld and
slurmdbd answer without pause."""


def _poll_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= MIN_POLL_S):
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds >= {MIN_POLL_S:g} (e.g. --poll {POLL_S:g})")
    return value


def _status(sweep_dir: str, *, ok_if_failed: bool, poll_s: float | None, skip_cancelled: bool = False) -> int:
    """The table, and an exit status a script can act on: EXIT_FAILED for failures no rerun stands
    for, else EXIT_UNFINISHED while configs are pending or running, else EXIT_OK. `poll_s` (--wait):
    the table once nothing is pending or running, looked at every poll_s seconds. `skip_cancelled`: a
    cancelled config is no failure (one line on stderr counts them), as `rerun --skip-cancelled` drops it."""
    if poll_s is None:
        unanswered: list[str] = []
        statuses = sweep_status(sweep_dir, unanswered=unanswered)
        if unanswered:
            print(f"warning: {unanswered_words(unanswered)}", file=sys.stderr)
    else:
        statuses = wait_for_sweep(sweep_dir, poll_s=poll_s, say=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_status(statuses, sweep_dir=sweep_dir))
    failed = unresolved_failures(statuses)
    if skip_cancelled and (dropped := sum(1 for s in failed if s.state == "cancelled")):
        failed = [s for s in failed if s.state != "cancelled"]
        print(f"status: {dropped} configs cancelled (scancel), not counted as failed (--skip-cancelled)",
              file=sys.stderr)  # fmt: skip
    if not failed or ok_if_failed:
        left = sum(1 for s in statuses if s.state in UNFINISHED_STATES)
        if left:
            # Nothing here ends the wait of a config whose exported script nobody submitted.
            unsubmitted = sum(1 for s in statuses if s.unsubmitted and s.state in UNFINISHED_STATES)
            never = (f"; {unsubmitted} of them exported and never started: submit their script with sbatch (their "
                     "detail names it)") if unsubmitted else ""  # fmt: skip
            print(f"status: {left} configs still pending or running (--wait waits for them){never}", file=sys.stderr)
            return EXIT_UNFINISHED
        return EXIT_OK
    # Named by their states: an interrupted, cancelled or refused config did not fail, it did not run to the end.
    words = {"failed": "configs failed", "cancelled": "configs cancelled (scancel)",
             "preempted": "configs preempted by Slurm", "interrupted": "configs interrupted",
             "refused": "configs refused by sbatch"}  # fmt: skip
    counts = {state: sum(1 for s in failed if s.state == state) for state in words}
    said = ", ".join(f"{n} {words[state]}" for state, n in counts.items() if n)
    if left := sum(1 for s in statuses if s.state in UNFINISHED_STATES):
        said += f" ({left} more still pending or running)"
    # A config cancelled to drop it is one the user may not want back: say how to leave it out.
    skip = (", --skip-cancelled leaves the cancelled ones out, and status --skip-cancelled does not count them"
            if counts["cancelled"] else "")  # fmt: skip
    print(
        f"status: {said} (python -m launchers rerun --failed {shlex.quote(sweep_dir)} resubmits "
        f"them{skip}; --ok-if-failed exits 0)",
        file=sys.stderr,
    )
    return EXIT_FAILED


def _sbatch(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from datetime import datetime

    from hydra.errors import HydraException

    from launchers.sbatch import export_sweep, format_export

    name = args.name or f"sweep-{datetime.now():%Y%m%d-%H%M%S}"
    extra: dict[str, str] = {}
    for given in args.sbatch_arg:
        arg = given if isinstance(given, str) else "--"  # argparse hands `--sbatch-arg=--` over as []
        key, _, value = arg.partition("=")
        # `--sbatch-arg=--exclusive` as sbatch spells it: the script's line adds the dashes itself, and
        # wrote '#SBATCH ----exclusive', which sbatch refuses.
        if not key.lstrip("-"):
            print(f"error: --sbatch-arg {arg!r} names no sbatch option: give KEY[=VALUE], e.g. --sbatch-arg "
                  "exclusive or --sbatch-arg comment=lr-sweep", file=sys.stderr)  # fmt: skip
            return EXIT_USAGE
        extra[key.lstrip("-")] = value
    try:
        export = export_sweep(
            args.overrides,
            name=name,
            out_dir=Path(args.out_dir),
            sweep_dir=Path(args.sweep_dir) if args.sweep_dir else None,
            config_dir=Path(args.config_dir) if args.config_dir else None,
            config_name=args.config_name,
            python=args.python,
            module=args.module,
            max_array_size=args.max_array_size,
            array_parallelism=args.array_parallelism,
            sbatch_args=extra,
            srun_args=args.srun_arg,
            command=shlex.join(["python", "-m", "launchers", *argv]),
            append=args.append,
            test_only=args.test_only,
        )
    except (HydraException, ValueError) as exc:
        print(f"error: {missing_option_line(exc) or exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # waiting for the sweep's lock, say: nothing was written (the lock is why)
        print("sbatch: interrupted before the export finished (the sweep's manifest lists none of its configs)",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    print(format_export(export))
    if not export.scripts:
        # As hydra/launcher=slurm ends a launch whose every config is infeasible: bad input, so that
        # `... sbatch ... && sbatch <script>` stops here rather than at a script that was never written.
        print(f"Nothing was exported: all {len(export.skipped)} configs are infeasible (the rules' reasons "
              "are above)", file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    return 0


if __name__ == "__main__":
    exit_on_broken_pipe(main)
