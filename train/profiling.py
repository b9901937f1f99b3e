"""A torch.profiler trace of chosen training iterations, written under the run directory.

`training.profile_steps=[3,4]` profiles those iterations (the span from the first to the last
named one) on every rank and writes one Chrome trace per rank:
<run dir>/profile/trace_rank<R>_iters<A>-<B>.json (open it in chrome://tracing or Perfetto).
Profiling slows the profiled iterations down: the record's medians leave them out while any other
measured iteration remains (train.metrics.summarize), and count them when none does.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

PROFILE_DIR = "profile"


def steps_span(steps: Sequence[int]) -> tuple[int, int] | None:
    """training.profile_steps -> (first, last) iteration; [] -> None. Iterations count from 1."""
    if not steps:
        return None
    if min(steps) < 1:
        raise ValueError(
            f"training.profile_steps={list(steps)} names iteration {min(steps)}: iterations count from 1"
        )
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
    def for_steps(cls, steps: Sequence[int], *, run_dir: Path | None, rank: int = 0) -> StepProfiler:
        return cls(steps_span(steps), run_dir=run_dir, rank=rank)

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
