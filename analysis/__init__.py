"""megasweep's analysis: torch-free calculators and reports over measured runs.

    __main__    python -m analysis: tables, recommendation, scaling, plots; compare, calibrate
    records     sweeps (result.json, plan.csv, manifest, Slurm's queue) into one table
    tables      results.md in the seeds' format, scaling and ZeRO comparison tables
    recommend   the layout that finishes the same work soonest
    plots       PNG plots (matplotlib, Agg)
    compare     two sweeps, before and after: per-config ratios
    calc        python -m analysis.calc: TFLOPs, MFU and HFU of a measured iteration
    calibrate   fit the time model's factors to measured runs
    wandb_io    W&B in and out

Here: the number parsers behind both CLIs' arguments (devices, seconds, nodes, GiB).
"""

import math


def whole_at_least_one(text: str) -> int | None:
    """`text` as a whole number of at least 1 (a count of devices or nodes, a DP multiple); None when
    it is not one. The CLIs word their own errors around it."""
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value >= 1 else None


def finite_above_zero(text: str) -> float | None:
    """`text` as a finite number above 0 (seconds, GiB); None when it is not one (NaN, inf, 0, text)."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None
