"""megasweep's config schema (conf/schema.py) and the YAML config groups beside it.

Whatever composes with Hydra calls `register_configs()` first (the entry points do); importing the
package does not, so that the code that only reads the dataclasses never imports Hydra.
"""

from pathlib import Path

from conf.schema import register_configs

__all__ = ["CONFIG_DIR", "group_options", "register_configs"]

CONFIG_DIR = Path(__file__).resolve().parent
"""megasweep's own config directory: config.yaml and a folder of YAML files per group (the one
`python -m train` composes from)."""


def group_options(group: str) -> list[str]:
    """The options of a config group that CONFIG_DIR holds (its YAML files' stems), sorted."""
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))
