"""train.calibration_job in one process (GEMMs in training's operand layouts, pointwise ops, a copy)
and in two gloo processes (timing every rank at once)."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from train import calibration_job
from train.calibration_job import (
    CACHE_BYTES,
    LAYER_ATTEMPTS,
    CalibrationSpec,
    _gemm,
    attention_seconds,
    best_seconds,
    concurrent_seconds,
    fresh_operands,
    layer_timings,
    measure,
    per_layer,
    pointwise_seconds,
)

from .ranks import start_ranks


@pytest.mark.parametrize("layout", ["nt", "nn", "tn"])
def test_each_layout_computes_the_gemm_it_names(layout: str) -> None:
    call = _gemm(8, 16, 4, 1, layout, torch.float32, torch.device("cpu"))
    assert tuple(call().shape) == (8, 16)  # type: ignore[attr-defined]
    assert tuple(_gemm(8, 16, 4, 3, layout, torch.float32, torch.device("cpu"))().shape) == (3, 8, 16)  # type: ignore[attr-defined]


def test_best_seconds_is_the_fastest_trial_of_a_known_sleep() -> None:
    seconds = best_seconds(lambda: time.sleep(0.002), device=torch.device("cpu"), min_seconds=0.01, trials=2)
    assert 0.002 <= seconds < 0.01


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_neighbours_stalls_do_not_decide_a_cpu_timing() -> None:
    # A call of 0.2 ms whose every 8th call a neighbour holds up for 4 ms (one of the OpenMP team's
    # threads descheduled for a scheduler slice; calibration_job.WINDOW_S): every 50 ms trial's
    # mean carries the stalls (0.7 ms), the best window does not.
    turn = itertools.count(1)

    def call() -> None:
        _spin(0.004 if next(turn) % 8 == 0 else 0.0002)

    seconds = best_seconds(call, device=torch.device("cpu"), min_seconds=0.05, trials=3)
    assert 0.0002 <= seconds < 0.0004


def test_the_figure_still_spends_trials_times_min_seconds() -> None:
    # Short windows, but as long a timing in all as trials of min_seconds each were.
    tic = time.perf_counter()
    best_seconds(lambda: _spin(0.0002), device=torch.device("cpu"), min_seconds=0.02, trials=3)
    assert time.perf_counter() - tic >= 0.06


def test_one_layer_is_a_positive_forward_within_its_step() -> None:
    # (forward, step) seconds of the 1- and 9-layer models: 8 layers between them.
    assert per_layer((1.0, 3.0), (9.0, 27.0)) == (1.0, 3.0)
    assert per_layer((1.0, 3.0), (0.9, 27.0)) is None  # the larger model's forward timed faster
    assert per_layer((1.0, 3.0), (9.0, 2.0)) is None  # a negative step
    assert per_layer((1.0, 3.0), (9.0, 8.0)) is None  # a step below its forward


def _narrow_spec() -> CalibrationSpec:
    return CalibrationSpec(gemms=(), precision="fp32", device_type="cpu", message_bytes=(), copy_bytes=1,
                           layer_model=("gpt", 16, 2, 8, 64, 1), min_seconds=0.0, trials=1)  # fmt: skip


def test_a_slowed_small_model_is_timed_again_not_recorded_negative(monkeypatch: pytest.MonkeyPatch) -> None:
    # The tester's --here run: the 1-layer model met a busy neighbour, so the 9-layer model's step
    # came out faster (step -22.6 ms a layer). A neighbour only adds time: the next attempt's figures
    # replace the slowed ones, and the layer is their difference.
    times = iter([0.001, 0.05, 0.009, 0.027,  # 1 layer (forward, step slowed), 9 layers
                  0.001, 0.003, 0.009, 0.027])  # fmt: skip
    monkeypatch.setattr(calibration_job, "concurrent_seconds", lambda fn, **_: next(times))
    [layer] = layer_timings(_narrow_spec(), None, torch.device("cpu"), {"min_seconds": 0.0, "trials": 1})
    assert layer["forward_s"] == pytest.approx(0.001) and layer["step_s"] == pytest.approx(0.003)


def test_a_layer_never_timed_consistently_records_an_upper_bound(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Every attempt times the 9-layer model's step below the 1-layer model's: no difference holds, so
    # the 9-layer model's time per layer, positive and step >= forward, with a word on stderr.
    times = iter([0.002, 0.09, 0.018, 0.045] * LAYER_ATTEMPTS[1])
    monkeypatch.setattr(calibration_job, "concurrent_seconds", lambda fn, **_: next(times))
    [layer] = layer_timings(_narrow_spec(), None, torch.device("cpu"), {"min_seconds": 0.0, "trials": 1})
    assert layer["forward_s"] == pytest.approx(0.002) and layer["step_s"] == pytest.approx(0.005)
    assert 0 < layer["forward_s"] <= layer["step_s"]
    assert "no consistent difference" in capsys.readouterr().err


def test_one_process_measures_everything_but_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    spec = CalibrationSpec(gemms=((32, 64, 16, 1, "nt"), (32, 16, 64, 1, "nn")), precision="fp32", device_type="cpu",
                           message_bytes=(1024,), copy_bytes=1 << 20, pointwise=(("gelu", (64, 64)),),
                           attention=((2, 4, 64, 16, True),), min_seconds=0.001, trials=1,
                           sustained_seconds=0.01)  # fmt: skip
    out = measure(spec)
    # The largest GEMM sustained, and who this task is on which host (launchers.calibrate.core_share).
    assert out["sustained_tflops"] > 0 and out["threads"] >= 1 and out["host_cpus"] >= 1
    assert out["host"] and out["node"]
    [core] = out["attention"]
    assert (core["batch"], core["heads"], core["seq_length"], core["head_dim"], core["causal"]) == (2, 4, 64, 16, True)
    assert core["forward_s"] > 0 and "backward_s" in core and core["precision"] == "fp32"
    assert [(g["m"], g["layout"]) for g in out["gemms"]] == [(32, "nt"), (32, "nn")]
    assert all(g["seconds"] > 0 for g in out["gemms"])
    assert out["memory_bw_gbs"] > 0 and out["op_overhead_us"] > 0 and out["collectives"] == []
    forward, backward = pointwise_seconds("cross_entropy", (8, 32), torch.float32, torch.device("cpu"),
                                          {"min_seconds": 0.001, "trials": 1})
    assert forward > 0 and backward >= 0
    assert out["pointwise"]["gelu"][0] > 0


def test_the_timed_attention_core_is_the_models(monkeypatch: pytest.MonkeyPatch) -> None:
    # attention_seconds hands SDPA what train.model's Attention does: the same strided q, k, v views
    # of a QKV output, the same causality, and so the same result.
    from train.model import Attention

    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls: list[tuple[tuple[torch.Tensor, ...], dict[str, bool], torch.Tensor]] = []

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: bool) -> torch.Tensor:
        out = sdpa(q, k, v, is_causal=kwargs["is_causal"])  # the one keyword expected: asserted below
        calls.append(((q, k, v), kwargs, out))
        return out

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    for causal in (True, False):
        calls.clear()
        attention_seconds((2, 4, 16, 8, causal), torch.float32, torch.device("cpu"), {"min_seconds": 0.0, "trials": 1})
        (q, k, v), kwargs, out = calls[0][0], calls[0][1], calls[0][2]
        attn = Attention(32, 4, causal=causal)
        model_q = attn.qkv(torch.randn(2, 16, 32)).view(2, 16, -1, 3, 8).permute(3, 0, 2, 1, 4)[0]
        assert q.shape == model_q.shape and q.stride() == model_q.stride()
        assert kwargs == {"is_causal": causal}
        assert torch.allclose(out, attn._core(q, k, v))


def test_timed_operands_take_turns_beyond_the_cache() -> None:
    # Small operands: as many copies as CACHE_BYTES holds (at most 64), handed out in turn.
    made = iter(range(1000))
    supply = fresh_operands(lambda: next(made), 1 << 20)
    assert [supply() for _ in range(66)] == [*range(64), 0, 1]
    # Operands larger than the cache: still two, so no call reads the previous one's.
    big = iter(range(1000))
    supply = fresh_operands(lambda: next(big), CACHE_BYTES + 1)
    assert [supply() for _ in range(3)] == [0, 1, 0]


def test_successive_attention_timings_read_other_operands(monkeypatch: pytest.MonkeyPatch) -> None:
    sdpa = torch.nn.functional.scaled_dot_product_attention
    queries: list[int] = []

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
        queries.append(q.data_ptr())
        return sdpa(q, k, v, is_causal=is_causal)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    attention_seconds((2, 4, 16, 8, True), torch.float32, torch.device("cpu"), {"min_seconds": 0.0, "trials": 2})
    assert len(queries) >= 2 and all(a != b for a, b in itertools.pairwise(queries))


def _timing_worker(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        # Rank 1's call takes three times rank 0's: a step waits for rank 1.
        pause = 0.002 if rank == 0 else 0.006
        seconds = concurrent_seconds(lambda: time.sleep(pause), device=torch.device("cpu"), min_seconds=0.03, trials=2)
        Path(f"{out}.{rank}").write_text(repr(seconds))
    finally:
        dist.destroy_process_group()


def test_every_rank_reports_the_slowest_ranks_time(tmp_path: Path) -> None:
    # Timed on its own, rank 0 would report 2 ms a call; every rank gets the 6 ms a step would see.
    start_ranks(_timing_worker, (str(tmp_path / "init"), str(tmp_path / "rank")), 2)
    seconds = [float((tmp_path / f"rank.{r}").read_text()) for r in range(2)]
    assert seconds[0] == seconds[1]
    assert 0.006 <= seconds[0] < 0.012
