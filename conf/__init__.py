"""megasweep's config schema (conf/schema.py) and the YAML config groups beside it.

Whatever composes with Hydra calls `register_configs()` first (the entry points do); importing the
package does not, so that the code that only reads the dataclasses never imports Hydra.
"""

from pathlib import Path

from conf.schema import HardwareConfig, register_configs

__all__ = ["CONFIG_DIR", "group_options", "hardware_options", "register_configs"]

CONFIG_DIR = Path(__file__).resolve().parent
"""megasweep's own config directory: config.yaml and a folder of YAML files per group (the one
`python -m train` composes from)."""


def group_options(group: str) -> list[str]:
    """The options of a config group that CONFIG_DIR holds (its YAML files' stems), sorted."""
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def hardware_options() -> dict[str, HardwareConfig]:
    """Every hardware config of CONFIG_DIR, by option name, as the schema reads it (what a message
    suggests from; a run composes its own with Hydra)."""
    from omegaconf import OmegaConf

    options = {}
    for name in group_options("hardware"):
        node = OmegaConf.merge(OmegaConf.structured(HardwareConfig), OmegaConf.load(CONFIG_DIR / "hardware" / f"{name}.yaml"))
        hw = OmegaConf.to_object(node)
        assert isinstance(hw, HardwareConfig)
        options[name] = hw
    return options
