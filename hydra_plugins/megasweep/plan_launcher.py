"""`hydra/launcher=plan`: the dry-run launcher (logic in launchers/plan.py)."""

# No `from __future__ import annotations` here: Hydra's plugin scanner runs this module before
# it is in sys.modules, where dataclasses would look up string annotations and fail.
from dataclasses import dataclass

from hydra.core.config_store import ConfigStore

# The module, not the class: Hydra's scanner registers every plugin class it finds in this
# module's namespace, and only the subclass below may be registered from here.
from launchers import plan as _plan
from train.contract import PLAN_FILE


# Not frozen: Hydra merges `hydra.launcher.*` overrides into this node.
@dataclass
class PlanLauncherConf:
    """Options of `hydra/launcher=plan` (set with hydra.launcher.<name>=...)."""

    _target_: str = "hydra_plugins.megasweep.plan_launcher.PlanLauncher"
    world_size: int | None = None
    """Devices each config is planned for; null: dp from the config, or 1 (devices)."""
    csv_name: str = PLAN_FILE
    """File the rows are written to, in hydra.sweep.dir."""
    table: bool = True
    """Print the feasible configs (fastest first) and the infeasible ones counted by rule to stdout."""
    top: int | None = _plan.DEFAULT_TOP
    """Feasible rows printed, each work's fastest predicted in turn; null prints all; plan.csv has every row (rows)."""
    progress_every: int = 2000
    """A progress line on stderr every this many configs; 0 for none (configs)."""
    append: bool = False
    """Plan into a directory that holds a launched sweep (manifest.jsonl), adding rows to its
    plan.csv; false refuses such a directory."""


ConfigStore.instance().store(group="hydra/launcher", name="plan", node=PlanLauncherConf, provider="megasweep")


class PlanLauncher(_plan.PlanLauncher):
    """Plans every config of a sweep, runs none; see launchers.plan.PlanLauncher."""
