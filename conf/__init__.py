"""megasweep's config schema (conf/schema.py) and the YAML config groups beside it."""

from conf.schema import register_configs

register_configs()
