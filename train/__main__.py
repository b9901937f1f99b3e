"""`python -m train`: one training run; with `-m`, a sweep handed to a Hydra launcher.

The Hydra config is converted to the frozen RunConfig here, once; nothing below this
entry point sees Hydra or OmegaConf objects.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

import conf  # noqa: F401  (registers the schema in Hydra's ConfigStore)
from conf.schema import to_run_config
from train.validation import InfeasibleConfig, validate


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> dict[str, Any]:
    hydra_cfg = HydraConfig.get()
    try:
        run = to_run_config(cfg)
    except OmegaConfBaseException as bad_override:
        # e.g. `+model.foo=1`: Hydra adds the key, the typed schema rejects it here.
        if hydra_cfg.mode == RunMode.MULTIRUN:
            raise
        print(f"error: {bad_override}", file=sys.stderr)
        sys.exit(2)
    violations = validate(run, world_size=None)
    if violations:
        infeasible = InfeasibleConfig(violations)
        if hydra_cfg.mode == RunMode.MULTIRUN:
            # In a sweep the launcher records this as a `skipped` row; the sweep goes on.
            raise infeasible
        # A single run: one clear paragraph and a usage-error exit status, not a traceback.
        print(f"error: {infeasible}", file=sys.stderr)
        sys.exit(2)
    # torch is imported only here, so that `--help`, validation and dry runs stay light.
    from train.trainer import run_training

    return run_training(
        run,
        output_dir=Path(hydra_cfg.runtime.output_dir),
        overrides=list(hydra_cfg.overrides.task),
    )


if __name__ == "__main__":
    main()
