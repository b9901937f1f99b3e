"""`python -m train`: one training run; with `-m`, a sweep handed to a Hydra launcher.

The Hydra config is converted to the frozen RunConfig here, once; nothing below this entry point
sees Hydra or OmegaConf objects. Then the rules (train.planner.rules) judge the layout on the
world it will run on, before any worker starts: the launcher's world (torchrun, srun), or the
dp x tp x pp workers this process is about to start. A refusal is the dry run's paragraph, rule
names included, on stderr, with exit status train.contract.EXIT_USAGE.

A layout of more than one device started without a launcher forks its dp x tp x pp workers here
(train.distributed.fork_local), each training with torchrun's variables into the same run
directory, and waits for them.

Ctrl-C (SIGINT, to this process or to its whole process group as a terminal sends it) stops every
worker; the record says `interrupted`, one line on stderr says where it is, and the exit status is
train.contract.EXIT_INTERRUPTED, without tracebacks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from conf import CONFIG_DIR, register_configs
from conf.overrides import override_problem
from conf.schema import RunConfig, to_run_config
from train.contract import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_REQUEUE,
    EXIT_TERMINATED,
    EXIT_USAGE,
    RESULT_FILE,
    read_record,
    unwritable_below,
)
from train.distributed import LaunchEnvError, how_it_ended, launch_from_env, run_world
from train.paths import checkpoint_dir_problem
from train.planner.rules import InfeasibleConfig, advise, validate
from train.preemption import install_interrupt_handler, interrupted, note_interrupt

register_configs()  # the primary config extends megasweep_schema, read from Hydra's ConfigStore


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> dict[str, Any]:
    single = HydraConfig.get().mode != RunMode.MULTIRUN
    try:
        return _main(cfg)
    except KeyboardInterrupt:
        _forget_interrupted_start(single)
        raise
    except Exception:
        # Ctrl-C in start-up can surface as another exception: Python 3.11 wraps one raised in a
        # class's __set_name__ (during an import) in RuntimeError, which Hydra prints as a failed
        # job with a traceback. It is the interruption, said as such.
        if interrupted() and single:
            _forget_interrupted_start(single)
            raise KeyboardInterrupt from None
        raise


def _forget_interrupted_start(single: bool) -> None:
    """A single run that Ctrl-C stopped before it wrote anything leaves no directory holding only
    Hydra's .hydra/ (_forget_run_dir keeps any that holds more: a record says `interrupted`). Not
    under a launcher's ranks, where another rank may be starting into the directory (as _refuse's
    `lone`)."""
    try:
        lone = launch_from_env(os.environ) is None
    except LaunchEnvError:
        lone = False
    if single and lone:
        _forget_run_dir(HydraConfig.get())


def _main(cfg: DictConfig) -> dict[str, Any]:
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    install_interrupt_handler()
    try:
        run = to_run_config(cfg)
    except OmegaConfBaseException as bad_override:
        # e.g. `+model.foo=1`: Hydra adds the key, the typed schema rejects it here.
        if multirun:
            raise
        _refuse(str(bad_override), hydra_cfg)
    run = absolute_calibration(run, Path(hydra_cfg.runtime.cwd))
    try:
        launch = launch_from_env(os.environ)
    except LaunchEnvError as bad_env:
        if multirun:
            raise
        _refuse(str(bad_env), hydra_cfg)
    world_size = run_world(run.parallelism, launch)
    violations = validate(run, world_size=world_size, world_fixed=launch is not None)
    if violations:
        infeasible = InfeasibleConfig(violations)
        if multirun:
            # In a sweep the launcher records this as a `skipped` row; the sweep goes on.
            raise infeasible
        # A single run: one clear paragraph and a usage-error exit status, not a traceback.
        _refuse(str(infeasible), hydra_cfg)
    forks = world_size is not None and world_size > 1 and launch is None
    if (cannot := cannot_run_here(run, probe_cuda=not forks)) is not None:
        if multirun:
            raise ValueError(cannot)
        # Before any worker starts: one line, as a rule's, instead of a traceback from every rank.
        _refuse(cannot, hydra_cfg, lone=launch is None)
    if launch is None or launch.rank == 0:
        for note in advise(run):
            print(f"warning: {note}", file=sys.stderr)
    output_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = list(hydra_cfg.overrides.task)
    if world_size is not None and world_size > 1 and launch is None:
        return spawn_workers(run, world_size=world_size, output_dir=output_dir, overrides=overrides, multirun=multirun)
    # torch is imported only here, so that `--help`, validation and dry runs stay light.
    from train.checkpoint import CheckpointMismatch
    from train.tokens import DataFileError
    from train.trainer import (
        TrainingDiverged,
        TrainingPreempted,
        TrainingTimeout,
        record_interruption,
        run_training,
    )

    try:
        return run_training(run, output_dir=output_dir, overrides=overrides)
    except (DataFileError, CheckpointMismatch) as bad_input:
        if multirun:
            raise
        # The record says `error` with these words; the console needs them, not a traceback.
        print(f"error: {bad_input} ({_record_note(output_dir)})", file=sys.stderr)
        sys.exit(EXIT_FAILED)
    except KeyboardInterrupt:
        # Ctrl-C in start-up (W&B's, say) comes before the trainer writes any record: one is written
        # here, since the console line names it; a record that says so already is left as it is.
        record_interruption(run, output_dir=output_dir, overrides=overrides)
        if multirun:
            raise
        print(f"interrupted (record: {output_dir / RESULT_FILE})", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except TrainingPreempted as preempted:
        if multirun:
            raise
        # Checkpointed and stopped on Slurm's signal: a status the launcher requeues on.
        print(f"preempted: {preempted}", file=sys.stderr)
        sys.exit(EXIT_REQUEUE)
    except TrainingTimeout as stopped:
        if multirun:
            raise
        # SIGTERM without a checkpoint: the record says `timeout`; the signal's status, not a traceback.
        print(f"timeout: {stopped} (record: {output_dir / RESULT_FILE})", file=sys.stderr)
        sys.exit(EXIT_TERMINATED)
    except TrainingDiverged as diverged:
        if multirun:
            raise
        # An outcome of training the record says (`nan`), not a fault in megasweep: one line, as the
        # timeout's, where Hydra printed a traceback (once per config of a local sweep).
        print(f"nan: {diverged}", file=sys.stderr)  # its words end with the record's path
        sys.exit(EXIT_FAILED)


def absolute_calibration(run: RunConfig, cwd: Path) -> RunConfig:
    """`run` with a relative hardware.calibration read against `cwd`, where the run was started. The record
    keeps the config, and the analysis predicts each run from its record's: a relative path there was read
    against wherever `python -m analysis` ran, so from another directory every Pred s/it read n/a and
    `analysis calibrate` found nothing to fit."""
    path = run.hardware.calibration
    if not path or Path(path).is_absolute():
        return run
    return dataclasses.replace(run, hardware=dataclasses.replace(run.hardware, calibration=str(cwd / path)))


def _refuse(message: str, hydra_cfg: Any, *, lone: bool = True) -> NoReturn:
    """End a single run refused before it started: its paragraph on stderr, EXIT_USAGE, and no run
    directory left behind when Hydra's own .hydra/ is all it holds (Hydra makes it, and saves the
    config there, before the task runs): a refusal leaves nothing, as a sweep's does. `lone` false
    where ranks a launcher started may judge differently (what this machine can run): one refusing
    must not remove the directory another is starting into. Every rank refuses the rest alike."""
    print(f"error: {message}", file=sys.stderr)
    if lone:
        _forget_run_dir(hydra_cfg)
    sys.exit(EXIT_USAGE)


def _forget_run_dir(hydra_cfg: Any) -> None:
    subdir = str(hydra_cfg.output_subdir or "")
    try:
        run_dir = Path(hydra_cfg.runtime.output_dir).resolve()
        cwd = Path(hydra_cfg.runtime.cwd).resolve()
        # Never the directory the user works in, nor one above it (hydra.run.dir=., hydra.job.chdir=true).
        kept = {cwd, Path.cwd().resolve()}
        if not subdir or any(run_dir == k or run_dir in k.parents for k in kept):
            return
        # Stops at the first file of the user's: a directory that holds more stays as it is.
        if any(p.relative_to(run_dir).parts[0] != subdir for p in run_dir.rglob("*") if not p.is_dir()):
            return
        shutil.rmtree(run_dir)
        # Hydra's default outputs/<date>/<time>: <date>/ and outputs/ too, when this run was their only one
        # (OSError: they hold others). Directories above a hydra.run.dir of the user's own are theirs.
        outputs = cwd / "outputs"
        for above in (run_dir.parent, run_dir.parent.parent):
            if above != outputs and outputs not in above.parents:
                break
            above.rmdir()
    except OSError:
        pass


def cannot_run_here(run: RunConfig, *, probe_cuda: bool = True) -> str | None:
    """Why this machine cannot start `run` as configured, found before any worker starts (the rules
    judge a layout anywhere; these need the machine): None when it can. `probe_cuda` false in a
    parent about to fork its workers: asking CUDA there would poison the fork (each worker's first
    CUDA call would fail), so with a CUDA build of torch they find a missing device themselves."""
    hw, tr = run.hardware, run.training
    if hw.device_type == "cuda":
        import torch

        # A build without CUDA answers without asking the driver, so a parent about to fork asks it too:
        # left to the workers, the one that said why could be ended by the parent before it did (a run of
        # dp=2 said only "the workers refused their input, as said above", with nothing above, exit 1).
        if not torch.backends.cuda.is_built() or (probe_cuda and not torch.cuda.is_available()):
            return (f"hardware={hw.name} needs CUDA, and no CUDA device is visible here: run on a GPU node, or "
                    "choose a CPU hardware config (hardware=cpu)")  # fmt: skip
    if tr.save_interval > 0 and tr.checkpoint_dir is not None:
        # Found here, not at the first save after save_interval iterations (a traceback from every rank).
        return checkpoint_dir_problem(tr.checkpoint_dir)
    return None


def spawn_workers(
    run: RunConfig, *, world_size: int, output_dir: Path, overrides: list[str], multirun: bool
) -> dict[str, Any]:
    """Run the job as `world_size` local workers; rank 0 writes the record. When a worker fails,
    the record says `error` and names it, whatever state the ended survivors left behind."""
    from train.checkpoint import CheckpointMismatch
    from train.distributed import fork_local
    from train.setup import DeviceUnavailable
    from train.tokens import DataFileError
    from train.trainer import (
        TrainingDiverged,
        TrainingPreempted,
        TrainingTimeout,
        record_interruption,
        record_termination,
        record_worker_failure,
        run_training,
    )

    _preload(run)

    def worker() -> int:
        try:
            run_training(run, output_dir=output_dir, overrides=overrides)
        except TrainingPreempted as preempted:
            print(f"preempted: {preempted}", file=sys.stderr, flush=True)
            return EXIT_REQUEUE
        except TrainingTimeout:
            return EXIT_TERMINATED  # rank 0's record says `timeout`; the parent says it once
        except TrainingDiverged:
            return EXIT_FAILED  # every rank sees the all-reduced loss diverge; rank 0's record says `nan`
        except (DataFileError, CheckpointMismatch, DeviceUnavailable) as bad_input:
            # The user's input, the same on every rank: one line (rank 0's), not a traceback from each.
            # EXIT_USAGE tells the parent so (an uncaught exception exits 1): record_worker_failure.
            if os.environ.get("RANK", "0") == "0":
                print(f"error: {bad_input}", file=sys.stderr, flush=True)
            return EXIT_USAGE
        except BaseException:
            # After Ctrl-C a rank may fail in a collective its peers left: a consequence, said once.
            if interrupted():
                return EXIT_INTERRUPTED
            raise
        return 0

    launched = datetime.now(timezone.utc)  # the workers' OOM reports are written after this
    result = fork_local(worker, world_size=world_size)
    if result.stopped_by == signal.SIGINT or result.failed_code == EXIT_INTERRUPTED:
        record_interruption(run, output_dir=output_dir, overrides=overrides)
        message = f"interrupted (record: {output_dir / RESULT_FILE})"
        if multirun:
            raise KeyboardInterrupt(message)
        print(message, file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    if result.returncode != 0 and _preempted(result.failed_code, output_dir):
        # The workers checkpointed and stopped together on Slurm's signal; rank 0's `timeout`
        # record stands, and the exit status asks for a requeue.
        message = f"preempted after a checkpoint (record: {output_dir})"
        if multirun:
            raise RuntimeError(message)
        print(message, file=sys.stderr)
        sys.exit(result.returncode)
    if result.returncode != 0 and (result.stopped_by == signal.SIGTERM or result.failed_code == EXIT_TERMINATED):
        # SIGTERM without a checkpoint (to this parent, or to a worker): ranks that left a collective
        # their stopped peers left fail as a consequence; the run's outcome is the timeout.
        stopped = record_termination(run, output_dir=output_dir, overrides=overrides)
        message = f"timeout: {stopped['message']} (record: {output_dir / RESULT_FILE})"
        if multirun:
            raise RuntimeError(message)
        print(message, file=sys.stderr)
        sys.exit(EXIT_TERMINATED)
    if result.returncode != 0:
        failure = record_worker_failure(
            run,
            output_dir=output_dir,
            overrides=overrides,
            failed_rank=result.failed_rank,
            failed_code=result.failed_code,
            since=launched,
        )
        if failure.get("status") == "nan":
            # Training's own outcome, as a single process says it (no worker traceback, no "exited with").
            message = f"nan: {failure.get('message')} (record: {output_dir / RESULT_FILE})"
            if multirun:
                raise RuntimeError(message)
            print(message, file=sys.stderr)
            sys.exit(EXIT_FAILED)
        message = f"worker rank {result.failed_rank} {how_it_ended(result.failed_code)} ({_record_note(output_dir)})"
        if multirun:
            raise RuntimeError(message)
        if result.failed_code == EXIT_USAGE:
            # Every rank refused the same input, and rank 0's error line said why: a second error line
            # blamed one worker and named a status (2) this command does not exit with. Refused input
            # exits as a single process refusing it does: its record (or the one kept) says why.
            print(f"the workers refused their input, as said above ({_record_note(output_dir)})", file=sys.stderr)
            sys.exit(EXIT_FAILED)
        print(f"error: {message}", file=sys.stderr)
        sys.exit(result.returncode)
    record: dict[str, Any] = json.loads((output_dir / RESULT_FILE).read_text())
    return record


def _record_note(output_dir: Path) -> str:
    """Where a failed attempt's record is, for its error line; or that it wrote none, when the run
    directory's record is a finished run's that the attempt kept (train.trainer._write_unless_kept)."""
    path = output_dir / RESULT_FILE
    record = read_record(path)
    if record is not None and record.get("status") == "ok":
        return f"nothing recorded: {path} is the finished run's record, kept"
    return f"record: {path}"


def _preload(run: RunConfig) -> None:
    """Import, once in the parent, what every forked worker would otherwise import on its own:
    DTensor for TP, DCP to checkpoint, and torch._dynamo, which torch imports on the first call of
    a `torch._disable_dynamo` function: each worker's optimizer constructor (add_param_group) and
    the meta-device build's embedding init are such calls, about 3 s of CPU in every worker."""
    import torch._dynamo  # noqa: F401

    par = run.parallelism
    if par.tp > 1:
        import torch.distributed.tensor.parallel  # noqa: F401
    if run.training.save_interval > 0:
        import torch.distributed.checkpoint  # noqa: F401


def _preempted(code: int | None, output_dir: Path) -> bool:
    if code != EXIT_REQUEUE:
        return False
    try:
        # `cancelled`: rank 0 learnt from Slurm that the stop was scancel's (train.trainer._cancelled_instead).
        return json.loads((output_dir / RESULT_FILE).read_text()).get("status") in ("timeout", "cancelled")
    except (OSError, ValueError):
        return False


def check_override_keys(argv: list[str]) -> str | None:
    """The first command-line override naming a key the schema lacks, an option its group lacks or a
    value its field cannot take, as one line with "did you mean" (conf.overrides.override_problem);
    None when there is none. Hydra's own message for `parallelism.tpp=2` suggests `+parallelism.tpp=2`,
    which the schema then rejects."""
    from hydra._internal.utils import get_args_parser

    args, _ = get_args_parser().parse_known_args(argv)
    # Options of a group may also come from a search path the user adds (on the command line or in
    # conf/config.yaml): only conf/'s own are known here.
    own_options = (
        not (args.config_dir or args.config_path)
        and not any(a.split("=", 1)[0].lstrip("+~").startswith("hydra.searchpath") for a in args.overrides or [])
        and "searchpath" not in (CONFIG_DIR / "config.yaml").read_text(encoding="utf-8")
    )
    overrides = args.overrides or []
    plugins = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] in ("hydra/launcher", "hydra/sweeper")]
    multirun = args.multirun or any(o.lstrip("+").replace(" ", "") == "hydra.mode=MULTIRUN" for o in overrides)
    trains = not (multirun or args.cfg or args.help or args.hydra_help or args.info or args.shell_completion)
    if plugins and trains:
        # Hydra uses a launcher and a sweeper only for -m: a plan meant as a dry run trained here, a Slurm
        # launch trained on the login node, a layout search trained the default layout.
        return (f"{plugins[-1]}: a launcher or sweeper runs a sweep, which -m asks for (python -m train -m ...); "
                "without it this one run would train here")  # fmt: skip
    return override_problem(args.overrides or [], own_options=own_options)


DEFAULT_RUN_DIR = "outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}"
"""Hydra's hydra.run.dir, which conf/config.yaml keeps."""


def check_run_dir(argv: list[str]) -> str | None:
    """One paragraph when a single run's directory (hydra.run.dir) cannot be created and written;
    None when it can, or for a sweep (its launcher checks hydra.sweep.dir). Hydra would create it
    after composing and fail there with a chained traceback. Only the part before the first
    interpolation is checked: `${now:...}` names a new directory under it."""
    if "-m" in argv or "--multirun" in argv:
        return None
    given = [a.split("=", 1)[1] for a in argv if a.startswith("hydra.run.dir=")]
    run_dir = given[-1] if given else DEFAULT_RUN_DIR
    literal = run_dir.split("${", 1)[0]
    path = Path(literal) if literal == run_dir or literal.endswith("/") else Path(literal).parent
    # Judged without making it: `--cfg job`, `--help` and a refused config run nothing and write nothing.
    why = unwritable_below(path)
    if why is None:
        return None
    return (
        f"hydra.run.dir={run_dir}: cannot write {path} ({why}). Nothing was run or written. Choose a "
        "directory you can create and write, e.g. hydra.run.dir=<a path in your home or scratch space>."
    )


def _ctrl_c_said_as_such(signum: int, frame: FrameType | None) -> None:
    """SIGINT handler until a run installs its own: Python's KeyboardInterrupt, and Hydra told to pass on
    whatever exception follows instead of printing it as the command's error (run_interruptibly)."""
    note_interrupt()
    os.environ["HYDRA_FULL_ERROR"] = "1"
    signal.default_int_handler(signum, frame)


def run_interruptibly(command: Callable[[], object]) -> None:
    """Run `command` (Hydra's main); Ctrl-C ends it with one line, `interrupted`, and EXIT_INTERRUPTED.

    The KeyboardInterrupt can be replaced on its way out: a `finally` of OmegaConf's that runs on a
    config it was copying raises an error of its own, which Hydra then printed as the command's with
    exit status 1 (CI, 2026-11-26: Ctrl-C while Hydra's basic sweeper composed a sweep's configs ended in
    "'NoneType' object has no attribute '_invalidate_flags_cache'"). After a Ctrl-C, any error is its
    consequence. SIGINT that the shell had ignored (a background job) stays ignored."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _ctrl_c_said_as_such)
    try:
        command()
    except KeyboardInterrupt:
        # Ctrl-C before training started (imports, composition), or of a sweep: nothing to record here.
        print("interrupted", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except Exception:
        if not interrupted():
            raise  # HYDRA_FULL_ERROR=1 of the user's own: the traceback they asked for
        print("interrupted", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)


def _checked_main() -> None:
    """main, after the checks of the command line that need no composition."""
    if (unknown := check_override_keys(sys.argv[1:])) is not None:
        print(f"error: {unknown}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    if (unwritable_run_dir := check_run_dir(sys.argv[1:])) is not None:
        print(f"error: {unwritable_run_dir}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    main()


if __name__ == "__main__":
    # The checks too: Ctrl-C while they read the config schema printed a KeyboardInterrupt traceback.
    run_interruptibly(_checked_main)
