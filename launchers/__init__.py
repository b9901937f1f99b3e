"""megasweep's Hydra launchers and the machinery they share.

`launchers.compose` composes thousands of sweep configs without one full Hydra compose
each; `launchers.plan` is the dry-run launcher (`hydra/launcher=plan`). The classes Hydra
instantiates are thin subclasses in `hydra_plugins/megasweep/`, because Hydra only accepts
plugins defined in the `hydra_plugins` namespace package.

    __main__    python -m launchers status | rerun | sbatch | calibrate
    compose     thousands of sweep configs composed in seconds
    bulk        the garbage collector paused while thousands of configs or records are built
    sweepdir    one sweep per directory, checked before anything is written
    site        partitions, accounts, QoS the cluster accepts
    entry       the jobs' interpreter and entry module, checked before anything runs
    plan        hydra/launcher=plan, the dry run
    search      hydra/sweeper=layouts, the layout search
    submit      rules, allocations, job arrays via submitit, the manifest
    slurm       hydra/launcher=slurm
    local       hydra/launcher=local
    job         what runs inside each Slurm task (requeue on the trainer's request)
    queue       the one squeue/sacct reader (status and the analysis)
    allocation  a run's Slurm allocation; configs grouped by it
    states      a launched config's state, judged once for status and the analysis
    status      a sweep's progress; rerun --failed
    sbatch      array scripts to submit by hand
    calibrate   measure a site for the time model

Nothing here imports torch: launchers run on login nodes where torch may be absent.
"""
