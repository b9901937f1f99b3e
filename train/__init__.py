"""megasweep's trainer (`python -m train`) and the torch-free arithmetic it shares.

Importing this package must not import torch: `train.planner` (sizes, FLOPs, memory, shapes,
rules, the plan) and `train.contract` (file names, records, exit codes) are what the launchers
and the analysis use on machines without torch. The trainer's own modules, most of which
import torch:

    __main__        the entry point: compose, judge (train.planner.rules), fork workers or train
    trainer         run_training: one result.json whatever happens (train.contract.RunRecord)
    loop            train(), train_step(), forward_backward(): the steps
    engine          native or DeepSpeed: one optimizer step over a step's micro-batches
    setup           device, process group, model, parallelism, engine, data, peak
    preemption      Slurm's signals, checkpoint at a step boundary, resume; test fault hooks
    signals         stop signals held while a record is written (torch-free; the launchers' too)
    checkpoint      DCP save and resume of a rank's shards
    failures        what a failed run's exception means: oom, timeout or error
    distributed     torchrun, srun or local workers: the process group and device mesh
    paths           the token file and checkpoint directory judged on this machine (torch-free): the
                    run's refusals at its start, the dry run's and the launchers' warnings before

    model           GPT and BERT, no parallel logic
    parallel        TP, PP, DP and ZeRO-1 applied to a model from outside
    init            meta-device build, shard-exact initialisation
    tensors         a DTensor's local shard, or a plain tensor
    pipeline        Megatron's 1F1B schedule
    dp              DP reduction overlapped with backward, ZeRO-1
    optim           which Adam, the learning-rate schedule
    data            synthetic or memmapped token samples
    tokens          a token file opened and checked (torch-free; numpy)
    ds_engine       DeepSpeed as the other engine
    ds_config       the DeepSpeed config of a run, derived from its RunConfig

    metrics         Megatron log lines, medians, secret scrubbing
    memory          what a rank holds, measured beside the prediction; OOM reports
    mbs_probe       micro_batch_size=auto, probed
    calibrate       a measured matmul peak, cached per host
    calibration_job what each task of a calibration job times (train.planner.calibration)
    flopcheck       PyTorch's FLOP count against train.planner.flops
    profiling       torch.profiler traces of chosen iterations
    power           NVML power, utilisation and memory over the measured iterations
    neighbours      the other Slurm jobs on the run's nodes
    sinks           W&B and TensorBoard
    wandb_log       W&B logging that can never stop training
"""
