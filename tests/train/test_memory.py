"""train.memory: what a rank holds, counted and measured, against train.planner.memory's prediction.

The layouts are those of the equal-loss grid (test_parallel): one process, dp2, tp2, pp2,
dp2 x tp2 x pp2 with ZeRO-1, sequence parallel and pp2 with two virtual stages (interleaved). Each rank is set up by train.setup.setup itself (real gloo processes,
the meta-device build, TP, the pipeline stage, DP buckets), then measures one micro-batch's saved
activations in every recompute mode and precision; the prediction for its stage must be within
5% (it is exact on this machine). The model states are compared in the trainer's own record
(test_parallel checks them for every layout of the grid).
"""

from __future__ import annotations

import dataclasses
import json
import os
import traceback
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from conf.schema import Precision, Recompute, RunConfig
from train import distributed
from train.distributed import free_port
from train.memory import SavedTensors, model_state_bytes, saved_activation_bytes

from .ranks import start_ranks
from .test_distributed import TINY
from .test_trainer import compose_run

ACTIVATION_RTOL = 0.05


def test_saved_tensors_count_storages_once_and_leave_parameters_out() -> None:
    layer = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)

    def forward() -> torch.Tensor:
        y = layer(x)  # saves x (its input); the weight is a parameter
        return (y * y).sum() + (y.t() * y.t()).sum()  # y saved by both products (once), y.t() a view

    assert saved_activation_bytes(forward, layer) == 2 * 4 * 8 * 4


def test_measuring_saved_tensors_leaves_nothing_allocated() -> None:
    # exp saves its own output: returned to autograd by the pack hook, that output held its own
    # grad_fn, a cycle the collector cannot free, and the measured graph stayed for the whole run
    # (an H100 run peaked one micro-batch's activations above a plain loop).
    x = torch.randn(64, 64, requires_grad=True)
    made: list[weakref.ref[torch.Tensor]] = []

    def forward() -> torch.Tensor:
        y = (x * 2).exp()
        z = torch.softmax(y, dim=-1)  # saves its output too
        made.extend((weakref.ref(y), weakref.ref(z)))
        return z.sum()

    assert saved_activation_bytes(forward, nn.Linear(1, 1)) == 2 * 64 * 64 * 4
    assert [r() for r in made] == [None, None]  # freed by reference counts alone, no gc needed
    # The hooks themselves return the tensor unchanged to a backward inside the watch.
    saved = SavedTensors()
    with saved.watching():
        (x * 2).exp().sum().backward()
    assert x.grad is not None and saved.nbytes == 64 * 64 * 4 and not saved.held


def test_model_states_count_parameters_gradients_and_adam() -> None:
    model = nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    states = model_state_bytes(model, optimizer)
    params = 8 * 4 + 4
    assert states.weights == states.gradients == 4 * params
    assert states.optimizer == 8 * params + 4 * 2  # two moments; a float32 step counter per tensor
    assert states.master == 0


def test_saved_tensor_hooks_see_through_checkpoints() -> None:
    # Non-reentrant checkpoints save their inputs through the outer hooks and nothing else: what
    # full recompute keeps is exactly the block inputs.
    from train.model import build_model, set_recompute

    run = compose_run(*TINY)
    model = build_model(run.model, seed=0)
    tokens = torch.randint(0, run.model.vocab_size, (2, run.model.seq_length))
    none = saved_activation_bytes(lambda: model(tokens), model)
    set_recompute(model, Recompute.full)
    full = saved_activation_bytes(lambda: model(tokens), model)
    assert 0 < full < none


# ---------------------------------------------------------------------------------------------
# Every rank of the equal-loss grid's layouts, each recompute mode and precision.

GRID = {
    "dp2": ("parallelism.dp=2",),
    "tp2": ("parallelism.tp=2",),
    "pp2": ("parallelism.pp=2",),
    "dp2_tp2_pp2_zero1": ("parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=2", "parallelism.zero_stage=1"),
    "tp2_sp": ("parallelism.tp=2", "parallelism.sequence_parallel=true"),
    "tp2_pp2_sp": ("parallelism.tp=2", "parallelism.pp=2", "parallelism.sequence_parallel=true"),
    # Interleaved: each rank's two chunks, the first rank's chunk 1 and the last rank's chunk 0 fed
    # by a received activation, as the schedule runs them.
    "pp2_vpp2": ("parallelism.pp=2", "parallelism.virtual_stages=2"),
}


def measure_every_mode(run: RunConfig, rank_index: int | None) -> list[dict[str, Any]]:
    """This process's rank, set up as the trainer does, measured and predicted in every mode."""
    from train import distributed, memory
    from train.engine import NativeEngine
    from train.model import set_recompute
    from train.planner.memory import stage_memory
    from train.setup import setup
    from train.trainer import Progress, current_rank

    rank = current_rank(run, distributed.launch_from_env(os.environ))
    progress = Progress()
    s = setup(run, rank=rank, progress=progress)
    engine = s.engine
    assert isinstance(engine, NativeEngine)  # the grid's layouts are native: DeepSpeed's tensors are its own
    stage = engine.state.stage
    rows = []
    for precision in (Precision.fp32, Precision.bf16):
        for mode in Recompute:
            variant = dataclasses.replace(
                run, parallelism=dataclasses.replace(run.parallelism, precision=precision, recompute=mode)
            )
            set_recompute(engine.model, mode)
            measured = memory.measure_stage_activations(
                engine.model, run=variant, device=s.device, loss_sum=engine.state.loss_sum,
                first=stage is None or stage.is_first, last=stage is None or stage.is_last,
            )
            layout = rank.layout
            predicted = stage_memory(
                variant.model, variant.parallelism, dp=layout.dp, stage=rank.coords.pp, hardware=run.hardware,
                micro_batches=layout.micro_batches(run.parallelism.global_batch_size, run.parallelism.mbs),
            ).activations_per_micro_batch
            rows.append({"rank": rank_index, "stage": rank.coords.pp, "precision": precision.value,
                         "recompute": mode.value, "measured": measured, "predicted": predicted})
    return rows


def _worker(rank: int, world: int, port: int, run: RunConfig, out: str) -> None:
    try:
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port), OMP_NUM_THREADS="1",
        )
        torch.set_num_threads(1)
        rows = measure_every_mode(run, rank)
        Path(out, f"{rank}.json").write_text(json.dumps(rows))
        # A rank that exits while its peers still talk to it tears gloo's threads down under them
        # ("terminate called without an active exception", SIGABRT): leave together.
        torch.distributed.barrier()
    except BaseException:
        Path(out, f"{rank}.error").write_text(traceback.format_exc())
        raise
    finally:
        distributed.destroy_process_group()


def assert_within(rows: list[dict[str, Any]]) -> None:
    modes = {(r["precision"], r["recompute"]) for r in rows}
    assert len(modes) == 6
    for r in rows:
        assert r["measured"] > 0
        assert r["predicted"] == pytest.approx(r["measured"], rel=ACTIVATION_RTOL), r


def test_one_process_every_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert_within(measure_every_mode(compose_run(*TINY), None))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(GRID))
def test_layout_every_rank_every_mode(tmp_path: Path, name: str) -> None:
    run = compose_run(*TINY, *GRID[name])
    world = 8 if name.startswith("dp2_tp2_pp2") else 4 if name.startswith("tp2_pp2") else 2
    start_ranks(_worker, (world, free_port(), run, str(tmp_path)), world)
    errors = sorted(tmp_path.glob("*.error"))
    assert not errors, errors[0].read_text()
    rows = [row for r in range(world) for row in json.loads((tmp_path / f"{r}.json").read_text())]
    assert {r["stage"] for r in rows} == set(range(run.parallelism.pp))
    assert_within(rows)
