"""`python -m train`: one training run; with `-m`, a sweep handed to a Hydra launcher.

A layout of more than one device started without a launcher (no torchrun, no multi-task srun)
starts its dp x tp x pp worker processes here, each a `python -m train` of the same overrides
writing into the same run directory, and waits for them (train.distributed.spawn_local).

The Hydra config is converted to the frozen RunConfig here, once; nothing below this
entry point sees Hydra or OmegaConf objects.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

import conf  # noqa: F401  (registers the schema in Hydra's ConfigStore)
from conf.schema import RunConfig, to_run_config
from train.distributed import launch_from_env
from train.validation import InfeasibleConfig, resolve_dp, validate


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
    par = run.parallelism
    world_size = resolve_dp(par, None) * par.tp * par.pp
    if world_size > 1 and launch_from_env(os.environ) is None:
        return spawn_workers(run, world_size=world_size, multirun=hydra_cfg.mode == RunMode.MULTIRUN)
    # torch is imported only here, so that `--help`, validation and dry runs stay light.
    from train.checkpoint import REQUEUE_EXIT_CODE
    from train.trainer import TrainingPreempted, run_training

    try:
        return run_training(
            run,
            output_dir=Path(hydra_cfg.runtime.output_dir),
            overrides=list(hydra_cfg.overrides.task),
        )
    except TrainingPreempted as preempted:
        if hydra_cfg.mode == RunMode.MULTIRUN:
            raise
        # Checkpointed and stopped on Slurm's signal: a status the launcher requeues on.
        print(f"preempted: {preempted}", file=sys.stderr)
        sys.exit(REQUEUE_EXIT_CODE)


def spawn_workers(run: RunConfig, *, world_size: int, multirun: bool) -> dict[str, Any]:
    """Run the job as `world_size` local workers; rank 0 writes the record. When a worker fails,
    the record says `error` and names it, whatever state the ended survivors left behind."""
    from train.distributed import spawn_local

    hydra_cfg = HydraConfig.get()
    output_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = list(hydra_cfg.overrides.task)
    # The parent already saved .hydra/ in the run directory; the workers only add to it.
    argv = [
        sys.executable,
        "-m",
        "train",
        *overrides,
        f"hydra.run.dir={output_dir}",
        "hydra.output_subdir=null",
    ]
    result = spawn_local(argv, world_size=world_size, cwd=Path(__file__).resolve().parents[1])
    if result.returncode != 0 and _preempted(result.failed_code, output_dir):
        # The workers checkpointed and stopped together on Slurm's signal; rank 0's `timeout`
        # record stands, and the exit status asks for a requeue.
        message = f"preempted after a checkpoint (record: {output_dir})"
        if multirun:
            raise RuntimeError(message)
        print(message, file=sys.stderr)
        sys.exit(result.returncode)
    if result.returncode != 0:
        from train.trainer import record_worker_failure

        record_worker_failure(
            run,
            output_dir=output_dir,
            overrides=overrides,
            failed_rank=result.failed_rank,
            failed_code=result.failed_code,
        )
        message = f"worker rank {result.failed_rank} exited with {result.failed_code} (record: {output_dir})"
        if multirun:
            raise RuntimeError(message)
        print(f"error: {message}", file=sys.stderr)
        sys.exit(result.returncode)
    record: dict[str, Any] = json.loads((output_dir / "result.json").read_text())
    return record


def _preempted(code: int | None, output_dir: Path) -> bool:
    from train.checkpoint import REQUEUE_EXIT_CODE

    if code != REQUEUE_EXIT_CODE:
        return False
    try:
        return bool(json.loads((output_dir / "result.json").read_text()).get("status") == "timeout")
    except (OSError, ValueError):
        return False


if __name__ == "__main__":
    main()
