"""`hydra/launcher=local`: run a sweep's configs one after another here (logic in launchers/local.py)."""

# No `from __future__ import annotations` here: Hydra's plugin scanner runs this module before
# it is in sys.modules, where dataclasses would look up string annotations and fail.
from dataclasses import dataclass

from hydra.core.config_store import ConfigStore

# The module, not the class: Hydra's scanner registers every plugin class it finds in this
# module's namespace, and only the subclass below may be registered from here.
from launchers import local as _local


# Not frozen: Hydra merges `hydra.launcher.*` overrides into this node.
@dataclass
class LocalLauncherConf:
    """Options of `hydra/launcher=local` (set with hydra.launcher.<name>=...)."""

    _target_: str = "hydra_plugins.megasweep.local_launcher.LocalLauncher"
    python: str | None = None
    """Interpreter of the runs; null: the one running this sweep."""
    module: str = "train"
    """Entry module each config runs (`python -m <module> <overrides>`); an app that is not
    megasweep's runs its own task function in this process instead."""
    append: bool = False
    """Add the configs to the sweep already in hydra.sweep.dir, with new indices; false refuses a
    directory that holds a sweep (manifest.jsonl)."""


ConfigStore.instance().store(
    group="hydra/launcher", name="local", node=LocalLauncherConf, provider="megasweep"
)


class LocalLauncher(_local.LocalLauncher):
    """Runs every config of a sweep on this machine; see launchers.local.LocalLauncher."""
