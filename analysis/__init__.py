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
"""
