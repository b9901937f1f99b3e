"""megasweep's trainer (`python -m train`) and the torch-free arithmetic it shares.

Importing this package must not import torch: `train.planner` (sizes, FLOPs, memory, shapes,
rules, the plan) and `train.contract` (file names, records, exit codes) are what the launchers
and the analysis use on machines without torch. The trainer's own modules import torch:

    __main__     the entry point: compose, judge (train.planner.rules), fork workers or train
    trainer      run_training: one result.json whatever happens (train.contract.RunRecord)
    loop         train(), train_step(), forward_backward(): the steps
    engine       native or DeepSpeed: one optimizer step over a step's micro-batches
    setup        device, process group, model, parallelism, engine, data, peak
    preemption   Slurm's signals, checkpoint at a step boundary, resume; test fault hooks
    model        GPT and BERT, no parallel logic; parallel applies TP, PP, DP and ZeRO-1 to them
"""
