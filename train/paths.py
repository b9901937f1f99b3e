"""A run's paths outside its run directory, judged on this machine: the token file it reads
(training.data_path: train.tokens) and the directory it checkpoints into (training.checkpoint_dir).

The run refuses what these checks find at its start (python -m train: cannot_run_here, and train.data
when it opens the file), which for a sweep is after it was queued. The dry run (hydra/launcher=plan)
and the launchers' check before they submit (launchers.submit.plan_configs) ask the same checks up
front, as warnings, not refusals: the login node that plans may not see the compute nodes' file
systems, and a path missing here may exist there. PathWarnings checks each distinct path once however
many configs name it, and says one warning per path: once per sweep, however many batches a sweeper hands
its launcher (one PathWarnings per launcher, each batch's warnings(once=True) leaving out those said).

Torch-free; numpy (train.tokens) is imported only for a config that names a token file.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from conf.schema import ParallelismConfig, RunConfig
from train.contract import unwritable, unwritable_below
from train.planner.batch import BatchSchedule

if TYPE_CHECKING:
    from train.tokens import TokenFile


def checkpoint_dir_problem(where: str, *, make: bool = True) -> str | None:
    """Why training.checkpoint_dir=`where` cannot hold checkpoints (one line naming the field, the value and
    the fix), or None when it can. `make`: create it as the run about to save there does; false judges it
    without creating anything (the nearest directory that exists is written to), for a dry run."""
    if Path(where).exists() and not Path(where).is_dir():
        return f"training.checkpoint_dir={where} is a file, not a directory: name a directory (made if missing)"
    why = unwritable(where) if make else unwritable_below(where)
    if why is None:
        return None
    return (f"training.checkpoint_dir={where}: cannot write there ({why}); name a directory you can create and "
            "write, or leave it null for <run dir>/checkpoints")  # fmt: skip


def samples_asked(par: ParallelismConfig, train_iters: int) -> int:
    """Samples a run of `train_iters` steps reads, its batch ramp-up included (samples)."""
    return BatchSchedule.of(par).consumed_before(train_iters + 1)


def wraps_around(file: TokenFile, run: RunConfig) -> str | None:
    """The warning for a token file that holds fewer samples than `run` reads (it reads the file from its
    start again); None when it holds them all."""
    seq, par, iters = run.model.seq_length, run.parallelism, run.training.train_iters
    samples, held = samples_asked(par, iters), file.windows_of(seq)
    if samples <= held:
        return None
    ramp = " after its ramp-up" if BatchSchedule.of(par).ramps else ""
    return (
        f"training.data_path={file.path!r} holds {len(file.tokens):,} tokens (read as {file.dtype.name}): "
        f"{held:,} samples of model.seq_length={seq} (+1, the last target), and the run asks for {samples:,} "
        f"(training.train_iters={iters} of parallelism.global_batch_size={par.global_batch_size}{ramp}): it wraps "
        f"around, reading the file from its start again after sample {held:,} (each sample about "
        f"{samples / held:.1f} times); give a longer file, or fewer training.train_iters, for every sample to be new"
    )


@dataclass
class _Found:
    """What some configs naming one path would meet: a refusal (the first), or a wrap-around (the widest)."""

    message: str
    refused: bool
    configs: int = 1
    passes: float = 0.0


class PathWarnings:
    """The paths of a sweep's configs, checked here before anything is queued: `note` each config that
    would run, then `warnings()`, one line per distinct path.

    A file is opened once per width it is read as, and each distinct (file, model, samples) judged once:
    `note` on a config that names no path, or one judged already, costs a dictionary lookup."""

    def __init__(self) -> None:
        self._files: dict[tuple[str, str, str], TokenFile | str] = {}
        self._judged: dict[tuple[object, ...], tuple[str, bool, float] | None] = {}
        self._found: dict[tuple[str, str, bool], _Found] = {}
        self._named: dict[tuple[str, str], int] = {}
        self._said: set[tuple[str, str, bool]] = set()

    def note(self, run: RunConfig) -> None:
        """Check the paths `run` reads and writes (where not checked already), and count it."""
        tr = run.training
        if tr.data_path:
            par, m = run.parallelism, run.model
            ramp = tuple(par.rampup_batch_size) if par.rampup_batch_size else None
            key = (tr.data_path, str(tr.data_dtype), m.vocab_size, m.seq_length, par.global_batch_size, ramp,
                   tr.train_iters)  # fmt: skip
            if key not in self._judged:
                self._judged[key] = self._judge_data(run)
            self._count("training.data_path", tr.data_path, self._judged[key])
        if tr.checkpoint_dir and isinstance(tr.save_interval, int) and tr.save_interval > 0:
            place = ("training.checkpoint_dir", tr.checkpoint_dir)
            if place not in self._judged:
                problem = checkpoint_dir_problem(tr.checkpoint_dir, make=False)
                self._judged[place] = None if problem is None else (problem, True, 0.0)
            self._count(*place, self._judged[place])

    def _judge_data(self, run: RunConfig) -> tuple[str, bool, float] | None:
        """(the warning's words, whether the run refuses the file, how often it reads each sample) for `run`'s
        token file; None when it trains on it reading each sample at most once."""
        from train.tokens import DataFileError, TokenFile, dtype_setting, token_dtype

        tr, m = run.training, run.model
        assert tr.data_path is not None
        setting = dtype_setting(tr.data_dtype)
        opened = (tr.data_path, setting, token_dtype(setting, m.vocab_size).name)
        if opened not in self._files:
            try:
                self._files[opened] = TokenFile(tr.data_path, vocab_size=m.vocab_size, dtype=setting)
            except DataFileError as exc:
                self._files[opened] = str(exc)
        file = self._files[opened]
        if isinstance(file, str):
            return file, True, 0.0
        try:
            file.refuse_for(seq_length=m.seq_length, vocab_size=m.vocab_size)
        except DataFileError as exc:
            return str(exc), True, 0.0
        note = wraps_around(file, run)
        passes = samples_asked(run.parallelism, tr.train_iters) / file.windows_of(m.seq_length)
        return None if note is None else (note, False, passes)

    def _count(self, field: str, path: str, outcome: tuple[str, bool, float] | None) -> None:
        self._named[(field, path)] = self._named.get((field, path), 0) + 1
        if outcome is None:
            return
        message, refused, passes = outcome
        # A path's refusal and its wrap-around are two lines: configs of two vocabularies or lengths may
        # meet one each (a refusal outweighing the other dropped the wrap-around and its configs).
        found = self._found.get((field, path, refused))
        if found is None:
            self._found[(field, path, refused)] = _Found(message, refused, passes=passes)
            return
        found.configs += 1
        if passes > found.passes:  # the warning names the config that reads the file most often over
            found.message, found.passes = message, passes

    def refusals(self) -> list[str]:
        """What a run here would refuse, one line per distinct path (for a launch whose runs are this
        machine's: nothing else may see other files)."""
        return [f"{f.message} [{self._configs(key)}]" for key, f in self._found.items() if f.refused]

    def warnings(self, *, here: bool = False, once: bool = False) -> list[str]:
        """One line per distinct path with a problem, in the order the configs named them; `here`: the
        runs are this machine's, so the refusals are left to refusals() and no other file system is
        imagined. `once`: without the lines an earlier call with `once` returned (a sweeper's later batch
        says only the paths its configs newly name; a line said counts the configs noted until then)."""
        found_now = {key: f for key, f in self._found.items() if not (once and key in self._said)}
        if once:
            self._said.update(key for key, f in found_now.items() if not (here and f.refused))
        if here:
            return [f"{f.message} [{self._configs(key)}]" for key, f in found_now.items() if not f.refused]
        where = f"checked on this machine ({socket.gethostname()}), which may not see the file systems the runs will"
        lines = []
        for key, found in found_now.items():
            then = "; a run that finds the same refuses it at its start, after the sweep was queued" if found.refused else ""
            lines.append(f"{found.message} [{where}{then}; {self._configs(key)}]")
        return lines

    def _configs(self, key: tuple[str, str, bool]) -> str:
        """'n of the m config(s) naming it', or 'm config(s) name it' where all of them meet it."""
        configs, named = self._found[key].configs, self._named[key[:2]]
        return f"{configs} config(s) name it" if configs == named else f"{configs} of the {named} config(s) naming it"
