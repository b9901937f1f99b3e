"""`hydra/sweeper=megasweep`: BasicSweeper with fast batch validation (logic in launchers/compose.py)."""

# No `from __future__ import annotations` here: Hydra's plugin scanner runs this module before
# it is in sys.modules, where dataclasses would look up string annotations and fail.
from dataclasses import dataclass

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore

# The module, not the class: see plan_launcher.py.
from launchers import compose as _compose


# Not frozen: Hydra merges `hydra.sweeper.*` overrides into this node.
@dataclass
class MegasweepSweeperConf:
    """Options of `hydra/sweeper=megasweep`: those of Hydra's basic sweeper, and progress lines."""

    _target_: str = "hydra_plugins.megasweep.sweeper.MegasweepSweeper"
    max_batch_size: int | None = None
    """Jobs handed to the launcher at once; null: all of them (jobs)."""
    params: dict[str, str] | None = None
    """Sweep parameters in the config, as `key: value-list` (added to the command line's)."""
    progress_every: int = 2000
    """A progress line on stderr every this many configs checked; 0 for none (configs)."""


ConfigStore.instance().store(
    group="hydra/sweeper", name="megasweep", node=MegasweepSweeperConf, provider="megasweep"
)


# BasicSweeper is looked up when Hydra's scan runs this module, right after the scan re-ran
# basic_sweeper.py: see launchers.compose.FastValidation for why that matters.
class MegasweepSweeper(_compose.FastValidation, BasicSweeper):
    """Hydra's cartesian-product sweeper; checks each batch with one compose per group choice."""
