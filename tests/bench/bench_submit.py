"""Submit benchmark: a 1,000-config sweep to the local Slurm cluster, megasweep vs hydra-submitit-launcher.

    python -m tests.bench bench_submit

Both submit the same 1,000 configs of the tiny model (a training.lr sweep) from
`python -m train -m ...` in a subprocess, with the same sweeper (megasweep's, from
conf/config.yaml), and both submit their jobs held (`--hold`), so that nothing runs: the
figures are the cost of getting 1,000 configs queued, not of training them on two cores.

- `hydra/launcher=slurm` returns once the arrays are queued: its figure is the time until
  the process exits (control returns).
- `hydra/launcher=submitit_slurm` blocks until every job has ended, which with held jobs is
  never (and with running ones, 1,000 trainings on this box, far past any bound). Its figure
  is the time until its array shows up in squeue (queued); the process is then killed
  (after SUBMITIT_GRACE_S) and its time-to-control-return is reported as unbounded.

Peak memory is the maximum RSS of each submitting process (os.wait4's rusage). Arrays are
counted from squeue by the run's unique job name (one sbatch call per array). Everything
submitted is scancelled at the end, whatever happens. Figures only; nothing asserts on time.

The ratio issue 13 targets: megasweep's time to return control over hydra-submitit-launcher's
time just to get the same configs queued, the medians of REPEATS alternating runs of each in this
bench: at most 0.1.

hydra-submitit-launcher comes with the test extras (`pip install -e '.[test]'`, or
`pip install 'hydra-submitit-launcher>=1.2,<1.3'` into the venv); without it, its row fails and
the ratio is not printed. The local cluster: `bash slurm/cluster-up.sh`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIGS = 1000
# Shortest runs of the tiny model, were they ever released (they are held).
TINY = (
    "training.train_iters=1",
    "training.warmup_iters=0",
    "logger=disabled",
    "model.num_layers=1",
    "model.hidden_size=64",
    "model.num_attention_heads=2",
    "model.seq_length=32",
    "model.vocab_size=512",
    "parallelism.micro_batch_size=1",
    "parallelism.global_batch_size=2",
)
BOUND_S = 240.0
"""Longest wait for either launcher to get its jobs queued (seconds)."""
REPEATS = 3
"""Runs of each launcher, alternating; the ratio compares their medians (one run of each moved it from
0.078 to 0.111 within two minutes on this shared machine, 2026-11-29)."""
SUBMITIT_GRACE_S = 5.0
"""How long hydra-submitit-launcher is left blocking after its array is queued (seconds)."""
TARGET_RATIO = 0.1
"""Issue 13: megasweep returns control in at most a tenth of hydra-submitit-launcher's time to queue."""


@dataclass(frozen=True)
class Figures:
    launcher: str
    queued_s: float | None
    """Start until the last array was in squeue (None: not within the bound)."""
    returned_s: float | None
    """Start until the process exited by itself (None: it was killed)."""
    peak_rss_mib: float
    arrays: int
    tasks: int
    note: str


def lr_sweep(n: int = CONFIGS) -> str:
    """`training.lr=v1,...,vn`: n distinct learning rates."""
    return "training.lr=" + ",".join(f"{(i + 1) * 1e-6:.6e}" for i in range(n))


def queued(job_name: str) -> tuple[int, int]:
    """(arrays, array tasks) in squeue under this job name."""
    out = subprocess.run(
        ["squeue", "-h", "-r", "-n", job_name, "-o", "%F %i"], capture_output=True, text=True, timeout=60
    ).stdout
    lines = [line.split() for line in out.splitlines() if line.strip()]
    return len({words[0] for words in lines}), len(lines)


class Child:
    """A submitting process, reaped with os.wait4 so that its peak RSS is known (Popen.poll would lose it)."""

    def __init__(self, args: list[str], log: Path) -> None:
        with log.open("wb") as out:
            # Its own session, so that killing it takes its children too.
            self.proc = subprocess.Popen(
                args, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.code: int | None = None
        self.rss_mib = 0.0

    def reap(self, block: bool = False) -> bool:
        """True once the process has ended (and its status and peak RSS are recorded)."""
        if self.code is None:
            pid, status, usage = os.wait4(self.proc.pid, 0 if block else os.WNOHANG)
            if pid:
                self.code = self.proc.returncode = os.waitstatus_to_exitcode(status)
                self.rss_mib = usage.ru_maxrss / 1024
        return self.code is not None

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.reap():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True

    def kill(self) -> None:
        """End it (its whole session): SIGTERM, then SIGKILL after 20 s."""
        if self.reap():
            return
        for sig, grace in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 60.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            if self.wait(grace):
                return


def run_launcher(
    label: str, launcher_args: list[str], job_name: str, sweep_dir: Path, *, blocks: bool, n: int = CONFIGS
) -> Figures:
    args = [
        sys.executable,
        "-m",
        "train",
        "-m",
        *TINY,
        lr_sweep(n),
        f"hydra.sweep.dir={sweep_dir}",
        *launcher_args,
    ]
    tic = time.monotonic()
    child = Child(args, sweep_dir.with_suffix(".log"))
    queued_s = returned_s = None
    arrays = tasks = 0
    try:
        if not blocks:
            if child.wait(BOUND_S):
                returned_s = time.monotonic() - tic
                arrays, tasks = queued(job_name)
                queued_s = returned_s if tasks >= n else None
                note = f"exit status {child.code}; control returned once queued"
            else:
                note = f"killed: not back within the {BOUND_S:.0f} s bound"
        else:
            # squeue once a second (cheap next to the launcher's own work) until every task is queued.
            while time.monotonic() - tic < BOUND_S and not child.reap():
                arrays, tasks = queued(job_name)
                if tasks >= n:
                    queued_s = time.monotonic() - tic
                    break
                time.sleep(1.0)
            if queued_s is not None:
                child.wait(SUBMITIT_GRACE_S)
            if child.reap():
                returned_s = time.monotonic() - tic
                note = f"exited by itself with status {child.code}"
            else:
                note = (
                    f"still blocking {SUBMITIT_GRACE_S:.0f} s after queueing (it waits for all {n} jobs "
                    "to end): killed, so its time to return control is unbounded here"
                )
    finally:
        child.kill()
        subprocess.run(["scancel", "-n", job_name], timeout=60, check=False)
    if child.code not in (0, None) and returned_s is not None:
        # A launcher that failed by itself: its own words, for whoever reads the figures.
        tail = sweep_dir.with_suffix(".log").read_text(errors="replace").strip().splitlines()[-5:]
        note += "; log: " + " | ".join(tail)
    return Figures(label, queued_s, returned_s, child.rss_mib, arrays, tasks, note)


def _fmt(seconds: float | None, bound: str) -> str:
    return f"{seconds:7.1f} s" if seconds is not None else f"{bound:>9}"


def _ours(sweep_dir: Path, name: str, n: int) -> Figures:
    return run_launcher(
        "megasweep hydra/launcher=slurm",
        ["hydra/launcher=slurm", f"hydra.launcher.job_name={name}", "+hydra.launcher.sbatch_args.hold=''"],
        name, sweep_dir, blocks=False, n=n,
    )  # fmt: skip


def _theirs(sweep_dir: Path, name: str, n: int) -> Figures:
    return run_launcher(
        "hydra-submitit-launcher submitit_slurm",
        ["hydra/launcher=submitit_slurm", "hydra.launcher.partition=debug", f"hydra.launcher.name={name}",
         "hydra.launcher.timeout_min=20", "+hydra.launcher.additional_parameters.hold=true"],
        name, sweep_dir, blocks=True, n=n,
    )  # fmt: skip


def main(n: int = CONFIGS) -> None:
    if (
        shutil.which("sbatch") is None
        or subprocess.run(["sinfo"], capture_output=True, timeout=60).returncode
    ):
        print("bench_submit: no Slurm cluster answers here (slurm/cluster-up.sh): skipped")
        return
    tag = uuid.uuid4().hex[:8]
    ours: list[Figures] = []
    theirs: list[Figures] = []
    names = [(f"bench-ms-{tag}-{i}", f"bench-hsl-{tag}-{i}") for i in range(REPEATS)]
    try:
        with tempfile.TemporaryDirectory(prefix="bench_submit_") as tmp:
            # Alternating, one at a time: a run's figure never includes the other's load.
            for i, (our_name, their_name) in enumerate(names):
                ours.append(_ours(Path(tmp) / f"ours{i}", our_name, n))
                theirs.append(_theirs(Path(tmp) / f"theirs{i}", their_name, n))
    finally:
        # Each run cancels its own jobs; this also covers a bench interrupted between two.
        for name in (x for pair in names for x in pair):
            subprocess.run(["scancel", "-n", name], timeout=60, check=False)
    print(f"submit {n:,} configs of the tiny model (jobs held, then cancelled; bound {BOUND_S:.0f} s), "
          f"{REPEATS} runs of each, alternating:")  # fmt: skip
    print(f"  {'launcher':40} {'queued':>9} {'returned':>9} {'peak RSS':>9} {'arrays':>6} {'tasks':>6}")
    for r in (x for pair in zip(ours, theirs, strict=True) for x in pair):
        print(
            f"  {r.launcher:40} {_fmt(r.queued_s, 'n/a')} {_fmt(r.returned_s, 'unbounded')} "
            f"{r.peak_rss_mib:6.0f} MiB {r.arrays:6d} {r.tasks:6d}"
        )
        print(f"    {r.note}")
    print("  arrays = sbatch calls (one array per call); all jobs of every run were scancelled.")
    returned = [r.returned_s for r in ours if r.returned_s is not None and r.tasks >= n]
    queued = [r.queued_s for r in theirs if r.queued_s is not None]
    if len(returned) == len(ours) and len(queued) == len(theirs):
        mine, other = statistics.median(returned), statistics.median(queued)
        print(f"medians: megasweep returned {mine:.1f} s, hydra-submitit-launcher queued {other:.1f} s")
        print(f"ratio megasweep_returned / submitit_queued = {mine / other:.3f} (target <= {TARGET_RATIO:g})")
    else:
        print("ratio megasweep_returned / submitit_queued: n/a (a launcher did not queue every config in the bound)")


if __name__ == "__main__":
    main()
