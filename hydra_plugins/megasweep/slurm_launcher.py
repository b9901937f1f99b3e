"""`hydra/launcher=slurm`: one job array per allocation (logic in launchers/slurm.py)."""

# No `from __future__ import annotations` here: Hydra's plugin scanner runs this module before
# it is in sys.modules, where dataclasses would look up string annotations and fail.
from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore

# The module, not the class: Hydra's scanner registers every plugin class it finds in this
# module's namespace, and only the subclass below may be registered from here.
from launchers import slurm as _slurm


# Not frozen: Hydra merges `hydra.launcher.*` overrides into this node.
@dataclass
class SlurmLauncherConf:
    """Options of `hydra/launcher=slurm` (set with hydra.launcher.<name>=...)."""

    _target_: str = "hydra_plugins.megasweep.slurm_launcher.SlurmLauncher"
    wait: bool = False
    """Block until every job has ended and return their results; false: return once queued.
    A sweep of an app that is not megasweep's (any Hydra task function) always waits."""
    array_parallelism: int | None = None
    """Most tasks of one array running at once (%N); null: cluster.array_parallelism (tasks)."""
    max_array_size: int | None = None
    """Largest array to submit; null: MaxArraySize from `scontrol show config` (tasks)."""
    sbatch_args: dict[str, str] = field(default_factory=dict)
    """Extra sbatch options without dashes, e.g. {exclusive: '', mail-type: END}."""
    srun_args: list[str] = field(default_factory=list)
    """Extra srun arguments of each job's step."""
    python: str | None = None
    """Interpreter of the jobs; null: the one running this sweep. One missing here, or a module it cannot
    import, is warned of before anything is queued (launchers.entry)."""
    module: str = "train"
    """Entry module each array task runs (`python -m <module> <overrides>`)."""
    job_name: str | None = None
    """Slurm job name; null: hydra.job.name."""
    append: bool = False
    """Add the configs to the sweep already in hydra.sweep.dir, with new indices; false refuses a
    directory that holds a sweep (manifest.jsonl)."""
    test_only: bool = True
    """Ask Slurm to judge each array's script (sbatch --test-only) before anything is queued, and refuse
    the launch when it refuses one; false: sbatch judges each array as it is queued."""


ConfigStore.instance().store(
    group="hydra/launcher", name="slurm", node=SlurmLauncherConf, provider="megasweep"
)


class SlurmLauncher(_slurm.SlurmLauncher):
    """Submits a sweep as one Slurm job array per allocation; see launchers.slurm.SlurmLauncher."""
