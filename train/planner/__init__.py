"""The planner: everything that judges a layout, as arithmetic, without torch.

    layout      Layout (dp x tp x pp, world size, dp derived, a rank's coordinates and samples), Rank
    batch       the global batch of each step (Megatron's ramp-up)
    sizes       parameter counts, padded vocabulary
    inventory   the parameter tensors a rank holds, and the DP reduction's buckets of them
    flops       FLOPs per iteration (per-GEMM, Megatron Eq. 3, MosaicML), MFU/HFU
    memory      bytes per device: model states, activations, optimizer temporaries
    shapes      GEMM tile and wave quantization
    schedule    the interleaved 1F1B pipeline schedule: order of work, matched exchanges, in flight
    perf        seconds per iteration, part by part (the time model)
    calibration a site's measured figures for the time model (hardware.calibration)
    micro_batch micro_batch_size=auto, predicted
    rules       validate (the one judge of whether a config can run) and advise (caveats)
    plan        one PlanRow per config, for the dry run and plan.csv
    search      every layout the rules accept on the searched node counts, ranked by the time model

The launchers plan on login nodes, the analysis on laptops, the trainer before its first step; all
of them ask this package, so a layout is judged the same way everywhere. tests/train/planner/
test_torch_free.py imports every module here with torch made unimportable.
"""
