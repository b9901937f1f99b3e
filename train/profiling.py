"""A torch.profiler trace of chosen training iterations, written under the run directory.

MEGASWEEP_PROFILE_STEPS='3,4' (or '3-5', or '7') profiles those iterations (the span from the
first to the last named one) on every rank and writes one Chrome trace per rank:
<run dir>/profile/trace_rank<R>_iters<A>-<B>.json (open it in chrome://tracing or Perfetto).
A `training.profile_steps: list[int]` config field is the intended switch; the env var stands in.
Profiling slows the profiled iterations down: they count in the record's medians like any other,
so profile iterations inside the warm-up (or accept the bias) when timing matters.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

PROFILE_ENV = "MEGASWEEP_PROFILE_STEPS"
PROFILE_DIR = "profile"


def parse_steps(spec: str) -> tuple[int, int] | None:
    """'3,4' / '3-5' / '7' -> (first, last) iteration; '' -> None. Iterations count from 1."""
    spec = spec.strip()
    if not spec:
        return None
    parts = [p for chunk in spec.split(",") for p in chunk.split("-")]
    try:
        steps = [int(p) for p in parts if p.strip()]
    except ValueError as exc:
        raise ValueError(f"{PROFILE_ENV}={spec!r}: expected iterations like '3,4' or '3-5'") from exc
    if not steps or min(steps) < 1:
        raise ValueError(f"{PROFILE_ENV}={spec!r}: iterations count from 1")
    return min(steps), max(steps)


class StepProfiler:
    """begin(i) before iteration i's work and end(i) after it (after the device sync)."""

    def __init__(self, steps: tuple[int, int] | None, *, run_dir: Path | None, rank: int = 0) -> None:
        self.steps = steps if run_dir is not None else None
        self.run_dir, self.rank = run_dir, rank
        self.trace: Path | None = None
        self._prof: Any = None
        self._label: Any = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str], *, run_dir: Path | None, rank: int = 0) -> StepProfiler:
        return cls(parse_steps(environ.get(PROFILE_ENV, "")), run_dir=run_dir, rank=rank)

    def begin(self, iteration: int) -> None:
        if self.steps is None or not self.steps[0] <= iteration <= self.steps[1]:
            return
        if iteration == self.steps[0]:
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            self._prof = profile(activities=activities, record_shapes=True)
            self._prof.__enter__()
        # One named span per iteration, so the trace shows where each one starts and ends.
        self._label = record_function(f"megasweep iteration {iteration}")
        self._label.__enter__()

    def end(self, iteration: int) -> Path | None:
        """The trace's path once the last profiled iteration ends, else None."""
        if self._prof is None:
            return None
        self._label.__exit__(None, None, None)
        assert self.steps is not None and self.run_dir is not None
        if iteration < self.steps[1]:
            return None
        self._prof.__exit__(None, None, None)
        out = self.run_dir / PROFILE_DIR / f"trace_rank{self.rank}_iters{self.steps[0]}-{self.steps[1]}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        self._prof.export_chrome_trace(str(out))
        self._prof, self.trace = None, out
        return out

    def record(self) -> dict[str, Any] | None:
        """The record's `profile` entry: the iterations and this rank's trace; None when not profiling."""
        if self.steps is None:
            return None
        return {"iterations": list(self.steps), "trace": None if self.trace is None else str(self.trace)}
