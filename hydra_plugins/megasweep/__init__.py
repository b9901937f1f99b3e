"""megasweep's Hydra plugins: `hydra/launcher=plan` and `hydra/sweeper=megasweep`.

Hydra instantiates only plugin classes defined under the `hydra_plugins` namespace package
(which therefore has no `__init__.py` of its own). The classes here are thin subclasses of
the real ones in `launchers/`, plus their ConfigStore entries. Hydra imports every module
here when it scans for plugins, so they stay light: no torch, no work at import time.
"""
