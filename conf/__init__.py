"""megasweep's config schema (conf/schema.py) and the YAML config groups beside it.

Whatever composes with Hydra calls `register_configs()` first (the entry points do); importing the
package does not, so that the code that only reads the dataclasses never imports Hydra.
"""

from conf.schema import register_configs

__all__ = ["register_configs"]
