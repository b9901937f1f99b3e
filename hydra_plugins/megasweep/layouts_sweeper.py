"""`hydra/sweeper=layouts`: the layout search (logic in launchers/search.py)."""

# No `from __future__ import annotations` here: Hydra's plugin scanner runs this module before
# it is in sys.modules, where dataclasses would look up string annotations and fail.
from dataclasses import dataclass

from hydra.core.config_store import ConfigStore

# The module, not the class: see plan_launcher.py.
from launchers import search as _search
from train.contract import SEARCH_FILE


# Not frozen: Hydra merges `hydra.sweeper.*` overrides into this node.
@dataclass
class LayoutSweeperConf:
    """Options of `hydra/sweeper=layouts`; what it searches is the `search` node (conf.schema.SearchConfig)."""

    _target_: str = "hydra_plugins.megasweep.layouts_sweeper.LayoutSweeper"
    csv_name: str = SEARCH_FILE
    """File every feasible layout is written to, in hydra.sweep.dir (a search added to a sweep that has
    one writes <stem>.append<N>.<suffix> beside it)."""


ConfigStore.instance().store(group="hydra/sweeper", name="layouts", node=LayoutSweeperConf, provider="megasweep")


class LayoutSweeper(_search.LayoutSweeper):
    """Ranks every layout by predicted time and launches the fastest; see launchers.search.LayoutSweeper."""
