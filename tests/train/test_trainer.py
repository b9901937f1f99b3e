"""train.trainer end to end on CPU (tiny shapes, a few iterations), plus data and optimizer (calibration:
test_calibrate.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from conf import register_configs
from conf.schema import ModelConfig, ModelKind, OptimizerImpl, RunConfig, TokenDtype, to_run_config
from train import loop, setup, trainer
from train.data import (
    MASK_PROBABILITY,
    DataFileError,
    MemmapTokens,
    SyntheticTokens,
    get_batch,
    make_source,
    scan_ids,
)
from train.model import IGNORE_INDEX, build_model
from train.optim import TORCH_FOREACH, TORCH_FUSED, build_optimizer, lr_at
from train.planner.layout import Rank
from train.planner.rules import InfeasibleConfig
from train.trainer import TrainingDiverged, TrainingTimeout, _over_capacity, run_training

REPO = Path(__file__).resolve().parents[2]
SMALL = [
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_attention_heads=2",
    "model.seq_length=32",
    "model.vocab_size=256",
    "model.make_vocab_size_divisible_by=64",
    "parallelism.micro_batch_size=2",
    "parallelism.global_batch_size=4",
    "training.train_iters=3",
    "training.warmup_iters=1",
    "logger=disabled",
    # Two calibrations per run add up over a test file; the offline run below keeps them. Datasheet
    # peaks instead (placeholders far above what 2 cores reach): the rules refuse a run with no peak.
    "hardware.peak_measured=false",
    "hardware.peak_tflops_fp32=10.0",
    "hardware.peak_tflops_bf16=10.0",
    "hardware.peak_tflops_fp16=10.0",
]
RECORD_FIELDS = {
    "status",
    "message",
    "config",
    "overrides",
    "world",
    "hardware",
    "versions",
    "git_commit",
    "optimizer",
    "flops_per_iteration",
    "sec_per_iter",
    "samples_per_s",
    "tokens_per_s_per_device",
    "tflops_per_device",
    "mfu",
    "hfu",
    "max_mem_gib",
    "max_mem_gib_per_rank",
    "peak_tflops",
    "peak_source",
    "losses",
}


def compose_run(*overrides: str) -> RunConfig:
    register_configs()  # here, not in conftest alone: the ranks mp.spawn starts compose too
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return to_run_config(compose("config", overrides=[*SMALL, *overrides]))


def read_record(directory: Path) -> dict[str, Any]:
    record: dict[str, Any] = json.loads((directory / "result.json").read_text())
    return record


@pytest.fixture(autouse=True)
def _no_wandb_from_outside(monkeypatch: pytest.MonkeyPatch) -> None:
    # WANDB_MODE wins over the config; pin it so a developer's shell cannot change these tests.
    monkeypatch.setenv("WANDB_MODE", "disabled")


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Any]]]:
    """One real run with W&B offline and a credential in the environment."""
    out = tmp_path_factory.mktemp("offline")
    overrides = ["logger=offline", "hardware.peak_measured=true", "+cluster.env.HF_TOKEN=hf-sekrit"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_API_KEY", "sekrit")
        mp.setenv("NCCL_DEBUG", "INFO")
        # As `python -m train +cluster.env.HF_TOKEN=...` would leave it for W&B's metadata to read.
        mp.setattr(sys, "argv", ["train", *overrides])
        run = compose_run(*overrides)
        returned = run_training(run, output_dir=out, overrides=overrides)
        yield out, returned


def test_record_ok_with_all_fields(offline_run: tuple[Path, dict[str, Any]]) -> None:
    out, returned = offline_run
    record = read_record(out)
    assert record == returned
    assert record["status"] == "ok" and record["message"] is None
    assert set(record) >= RECORD_FIELDS
    assert record["world"] == {"world_size": 1, "dp": 1, "tp": 1, "pp": 1}
    assert record["config"]["model"]["hidden_size"] == 32
    assert record["overrides"] == [
        "logger=offline",
        "hardware.peak_measured=true",
        "+cluster.env.HF_TOKEN=***",
    ]
    assert record["versions"]["torch"] == torch.__version__ and record["versions"]["python"]
    assert record["optimizer"] in (TORCH_FUSED, TORCH_FOREACH)
    assert set(record["flops_per_iteration"]) == {"model", "hardware", "megatron_eq3"}
    assert record["peak_source"] == "measured" and record["peak_tflops"] > 0
    assert record["iterations_run"] == 3 and record["measured_iterations"] == 2 and len(record["losses"]) == 3
    for key in (
        "sec_per_iter",
        "samples_per_s",
        "tokens_per_s_per_device",
        "tflops_per_device",
        "max_mem_gib",
    ):
        assert record[key] > 0, key
    assert record["samples_per_s"] == pytest.approx(4 / record["sec_per_iter"])
    assert record["sec_per_iter"] == pytest.approx(float(np.median(record["iteration_times_s"][1:])))
    assert record["max_mem_gib_per_rank"] == [record["max_mem_gib"]]
    # MFU is either a real fraction or withheld with a stated reason (a noisy calibration).
    mfu = record["mfu"]
    assert (mfu is not None and 0 < mfu <= 1) or any("MFU not recorded" in w for w in record["warnings"])
    assert record["env"] == {"NCCL_DEBUG": "INFO"}


def test_no_credentials_anywhere_in_the_output(offline_run: tuple[Path, dict[str, Any]]) -> None:
    out, _ = offline_run
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.name == "result.json" for p in files) and len(files) > 1
    for path in files:
        data = path.read_bytes()
        assert b"sekrit" not in data, path  # WANDB_API_KEY's value and the HF_TOKEN override's


def test_wandb_offline_run_directory(offline_run: tuple[Path, dict[str, Any]]) -> None:
    out, _ = offline_run
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("run-*.wandb"))  # the log `wandb sync` uploads


def test_wandb_failure_never_stops_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    import wandb

    def broken_init(*args: object, **kwargs: object) -> None:
        raise RuntimeError("W&B is down")

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setattr(wandb, "init", broken_init)
    record = run_training(compose_run("logger=offline"), output_dir=tmp_path, overrides=[])
    assert record["status"] == "ok" and record["iterations_run"] == 3
    assert any("wandb init failed" in w and "W&B is down" in w for w in record["warnings"])
    # Said once, on one line (the fallback itself: tests/train/test_wandb_log.py).
    assert capfd.readouterr().err.count("warning: wandb init failed") == 1


def test_wandb_mode_env_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    from train.wandb_log import resolve_mode

    logger = compose_run("logger=online").logger
    assert resolve_mode(logger, {"WANDB_MODE": "offline"}) == "offline"
    assert resolve_mode(logger, {}) == "online"
    assert resolve_mode(compose_run("logger=disabled").logger, {}) == "disabled"
    # The environment can switch W&B off, never on where the config disabled it (ranks > 0).
    assert resolve_mode(logger, {"WANDB_MODE": "disabled"}) == "disabled"
    assert resolve_mode(compose_run("logger=disabled").logger, {"WANDB_MODE": "offline"}) == "disabled"


def test_wandb_helpers() -> None:
    from train.wandb_log import argv_has_secret, hydra_sweep_name

    assert argv_has_secret(["train", "+cluster.env.HF_TOKEN=x"])
    assert not argv_has_secret(["train", "training.lr=1e-3", "--multirun"])
    assert hydra_sweep_name() is None  # not inside a Hydra job


def _losses(tmp_path: Path, name: str, *overrides: str) -> list[float]:
    record = run_training(compose_run(*overrides), output_dir=tmp_path / name, overrides=list(overrides))
    return record["losses"]


def test_gradient_accumulation_equals_one_large_micro_batch(tmp_path: Path) -> None:
    base = ("parallelism.global_batch_size=8", "parallelism.optimizer=torch")
    accumulated = _losses(tmp_path, "acc", "parallelism.micro_batch_size=2", *base)  # 4 micro-batches
    single = _losses(tmp_path, "one", "parallelism.micro_batch_size=8", *base)
    # Same samples, same normalization: only the fp32 summation order differs (rel. 1e-5).
    assert accumulated == pytest.approx(single, rel=1e-5)
    assert len(single) == 3 and single[0] != single[2]  # the weights did move


def test_gradient_accumulation_bert(tmp_path: Path) -> None:
    base = ("model.kind=bert", "parallelism.global_batch_size=4")
    accumulated = _losses(tmp_path, "acc", "parallelism.micro_batch_size=1", *base)
    single = _losses(tmp_path, "one", "parallelism.micro_batch_size=4", *base)
    assert accumulated == pytest.approx(single, rel=1e-5)


def test_fused_and_foreach_adam_agree(tmp_path: Path) -> None:
    fused = run_training(
        compose_run("parallelism.optimizer=torch_fused"), output_dir=tmp_path / "f", overrides=[]
    )
    foreach = run_training(
        compose_run("parallelism.optimizer=torch"), output_dir=tmp_path / "e", overrides=[]
    )
    assert (fused["optimizer"], foreach["optimizer"]) == (TORCH_FUSED, TORCH_FOREACH)
    # Same math, different kernels: agree to 1e-5 relative over 3 steps.
    assert fused["losses"] == pytest.approx(foreach["losses"], rel=1e-5)


def test_recompute_same_losses_more_hardware_flops(tmp_path: Path) -> None:
    none = run_training(compose_run(), output_dir=tmp_path / "n", overrides=[])
    full = run_training(compose_run("parallelism.recompute=full"), output_dir=tmp_path / "f", overrides=[])
    assert full["losses"] == pytest.approx(none["losses"], rel=1e-6)
    fpi = full["flops_per_iteration"]
    assert fpi["hardware"] > fpi["model"] == none["flops_per_iteration"]["hardware"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_runs(tmp_path: Path, precision: str) -> None:
    record = run_training(
        compose_run(f"parallelism.precision={precision}"), output_dir=tmp_path, overrides=[]
    )
    assert record["status"] == "ok" and record["precision"] == precision
    assert all(np.isfinite(record["losses"]))
    assert abs(record["losses"][0] - np.log(256)) < 0.5  # near-uniform predictions at init


def test_log_interval_lines_cover_their_interval(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # training.log_interval=2 printed iterations 2 and 4 with their own time and loss, as if 1 and 3 were not run.
    run = compose_run("training.train_iters=5", "training.log_interval=2")
    record = run_training(run, output_dir=tmp_path, overrides=[])
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith(" iteration ")]
    assert [int(x.split()[1].split("/")[0]) for x in lines] == [2, 4, 5]
    times, losses = record["iteration_times_s"], record["losses"]
    for line, (a, b) in zip(lines, [(0, 2), (2, 4), (4, 5)], strict=True):
        fields = dict(part.strip().rsplit(": ", 1) for part in line.strip(" |").split(" | ")[1:])
        assert float(fields["elapsed time per iteration (s)"]) == pytest.approx(sum(times[a:b]) / (b - a), abs=1e-3)
        assert float(fields["lm loss"]) == pytest.approx(sum(losses[a:b]) / (b - a), rel=1e-6)


def test_nan_loss_stops_with_nan_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = compose_run("training.lr=1e30", "training.train_iters=6", "parallelism.optimizer=torch")
    with pytest.raises(TrainingDiverged):
        run_training(run, output_dir=tmp_path, overrides=[])
    record = read_record(tmp_path)
    assert record["status"] == "nan" and "NaN" in record["message"]
    assert record["iterations_run"] < 6  # stopped at the first non-finite loss
    assert record["losses"][-1] is None  # NaN/inf written as JSON null
    assert f"result: {tmp_path / 'result.json'}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (torch.OutOfMemoryError("CUDA out of memory"), "oom"),
        (ValueError("boom"), "error"),
        (TrainingTimeout("received SIGTERM"), "timeout"),
    ],
)
def test_failures_write_a_record_and_reraise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: BaseException, status: str
) -> None:
    def failing_train(*args: object, **kwargs: object) -> str:
        raise exc

    monkeypatch.setattr(trainer, "train", failing_train)
    with pytest.raises(type(exc)):
        run_training(compose_run(), output_dir=tmp_path, overrides=["x=1"])
    record = read_record(tmp_path)
    assert record["status"] == status and str(exc) in record["message"]
    assert record["overrides"] == ["x=1"] and record["sec_per_iter"] is None


def test_sigterm_becomes_timeout_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def slow_train(*args: object, **kwargs: object) -> str:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        return "ok"

    monkeypatch.setattr(trainer, "train", slow_train)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(TrainingTimeout):
        run_training(compose_run(), output_dir=tmp_path, overrides=[])
    assert read_record(tmp_path)["status"] == "timeout"
    assert signal.getsignal(signal.SIGTERM) is before  # handlers restored


def test_explicit_apex_on_cpu_is_an_error_record(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="apex"):
        run_training(compose_run("parallelism.optimizer=apex"), output_dir=tmp_path, overrides=[])
    assert read_record(tmp_path)["status"] == "error"


def test_global_batch_must_split_into_micro_batches(tmp_path: Path) -> None:
    run = compose_run("parallelism.micro_batch_size=3", "parallelism.global_batch_size=4")
    with pytest.raises(ValueError, match="multiple"):
        run_training(run, output_dir=tmp_path, overrides=[])


@pytest.mark.slow
def test_cli_subprocess(tmp_path: Path) -> None:
    env = {**os.environ, "WANDB_MODE": "offline"}
    proc = subprocess.run(
        [sys.executable, "-m", "train", "training.train_iters=3", f"hydra.run.dir={tmp_path}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(" iteration ")]
    assert len(lines) == 3 and "lm loss:" in lines[0]
    assert f"result: {tmp_path / 'result.json'}" in proc.stdout
    assert read_record(tmp_path)["status"] == "ok"


# --- data, optimizer, schedule -----------------------------------------------------------

GPT_CFG = ModelConfig(
    name="d", num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=40, vocab_size=1000
)


def test_synthetic_samples_depend_only_on_seed_and_index() -> None:
    a, b = SyntheticTokens(GPT_CFG, seed=1), SyntheticTokens(GPT_CFG, seed=1)
    assert np.array_equal(a.sample(5), b.sample(5)) and len(a.sample(5)) == 41
    assert not np.array_equal(a.sample(5), a.sample(6))
    assert not np.array_equal(a.sample(5), SyntheticTokens(GPT_CFG, seed=2).sample(5))
    whole, _ = get_batch(a, GPT_CFG, indices=range(4), seed=1, device=torch.device("cpu"))
    part, _ = get_batch(a, GPT_CFG, indices=range(2, 4), seed=1, device=torch.device("cpu"))
    assert torch.equal(whole[2:], part)
    assert int(whole.max()) < GPT_CFG.vocab_size - 1  # the last id is reserved for [MASK]


def test_gpt_labels_are_next_tokens() -> None:
    tokens, labels = get_batch(
        SyntheticTokens(GPT_CFG, seed=0), GPT_CFG, indices=[3], seed=0, device=torch.device("cpu")
    )
    assert tokens.shape == labels.shape == (1, 40)
    assert torch.equal(tokens[0, 1:], labels[0, :-1])


def test_bert_masking_is_deterministic_15_percent() -> None:
    cfg = ModelConfig(**{**GPT_CFG.__dict__, "kind": ModelKind.bert, "seq_length": 200})
    source = SyntheticTokens(cfg, seed=0)
    x1, y1 = get_batch(source, cfg, indices=[0, 1], seed=0, device=torch.device("cpu"))
    x2, y2 = get_batch(source, cfg, indices=[0, 1], seed=0, device=torch.device("cpu"))
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    labelled = y1 != IGNORE_INDEX
    assert labelled.sum(dim=1).tolist() == [round(MASK_PROBABILITY * 200)] * 2
    original = torch.from_numpy(source.sample(0)[:-1])
    assert torch.equal(y1[0][labelled[0]], original[labelled[0]])
    assert torch.equal(x1[0][~labelled[0]], original[~labelled[0]])  # unmasked positions untouched
    assert (x1[0][labelled[0]] == cfg.vocab_size - 1).float().mean() > 0.6  # mostly [MASK]


def test_memmap_tokens(tmp_path: Path) -> None:
    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    source = make_source(GPT_CFG, seed=0, data_path=str(path))
    assert isinstance(source, MemmapTokens) and source.dtype == np.uint16
    assert source.sample(0).tolist() == list(range(41))
    assert source.sample(1).tolist() == list(range(40, 81))
    assert np.array_equal(source.sample(source.windows), source.sample(0))  # wraps around
    wide = ModelConfig(**{**GPT_CFG.__dict__, "vocab_size": 100_000})
    np.arange(100, dtype=np.uint32).tofile(tmp_path / "wide.bin")
    assert MemmapTokens(tmp_path / "wide.bin", wide).sample(1)[0] == 40
    np.full(100, 5000, dtype=np.uint16).tofile(tmp_path / "bad.bin")
    with pytest.raises(ValueError, match="vocab_size"):
        MemmapTokens(tmp_path / "bad.bin", GPT_CFG)


def test_uint32_ids_read_as_uint16_are_refused_when_the_file_is_opened(tmp_path: Path) -> None:
    # Ids below the vocabulary written as uint32: read as uint16 they pass any range check (id, 0, id,
    # 0, ...) and trained silently on every other token being 0.
    ids = np.random.default_rng(0).integers(1, GPT_CFG.vocab_size, size=2000)
    path = tmp_path / "u32.bin"
    ids.astype(np.uint32).tofile(path)
    with pytest.raises(DataFileError) as refused:
        make_source(GPT_CFG, seed=0, data_path=str(path))
    message = str(refused.value)
    assert message.startswith(f"training.data_path={str(path)!r} looks like uint32 token ids"), message
    assert "read as uint16, training.data_dtype=auto" in message and "set training.data_dtype=uint32" in message
    assert "100% of the odd positions are 0" in message and "\n" not in message
    with pytest.raises(DataFileError, match="set training.data_dtype=uint32"):  # an explicit uint16 too
        MemmapTokens(path, GPT_CFG, dtype="uint16")
    source = make_source(GPT_CFG, seed=0, data_path=str(path), data_dtype=TokenDtype.uint32)
    assert source.sample(1).tolist() == ids[40:81].tolist()
    # A uint16 file is not taken for one: not with a whole number of 4-byte pairs, nor with a common
    # id 0 (padding, say), which falls on even and odd positions alike.
    padded = np.where(np.random.default_rng(1).random(2000) < 0.5, 0, ids).astype(np.uint16)
    padded.tofile(tmp_path / "padded.bin")
    assert MemmapTokens(tmp_path / "padded.bin", GPT_CFG).sample(0).tolist() == padded[:41].tolist()


def test_an_id_beyond_the_vocabulary_anywhere_in_the_file_is_refused_when_it_is_opened(tmp_path: Path) -> None:
    ids = np.random.default_rng(0).integers(0, GPT_CFG.vocab_size, size=5000).astype(np.uint16)
    ids[-1] = 4321  # in the last window only: before, the run stopped when (if) it drew that window
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    with pytest.raises(DataFileError) as refused:
        MemmapTokens(path, GPT_CFG)
    message = str(refused.value)
    assert message.startswith(f"training.data_path={str(path)!r}: its largest token id is 4321"), message
    assert "(read as uint16, training.data_dtype=auto)" in message and "model.vocab_size=1000" in message
    assert "at token 4999" in message and "training.data_dtype to the width" in message
    # Opening reads at most scan_limit ids (every rank opens the file; a corpus of hundreds of GB is
    # not read whole by each): a window past them is checked when it is drawn, with the same message.
    inside = ids.copy()
    inside[-1], inside[4950] = 0, 4321  # in the last window drawn (the file's last 39 tokens are never read)
    inside.tofile(tmp_path / "late.bin")
    late = MemmapTokens(tmp_path / "late.bin", GPT_CFG, scan_limit=4000)
    assert late.sample(0).max() < GPT_CFG.vocab_size
    with pytest.raises(DataFileError, match=r"its largest token id is 4321 .* at token 4950"):
        late.sample(late.windows - 1)
    # The scan reads bounded chunks; the largest id and the first out-of-range one span chunks.
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    ids[[700, 4200]] = 1500
    assert scan_ids(ids, 1000, chunk=512) == (4321, 700)
    assert scan_ids(tokens, 5000, chunk=512) == (4321, None)
    # uint16 ids read as uint32 (a vocabulary above 65536 reads uint32 by default): the width is named.
    wide = ModelConfig(**{**GPT_CFG.__dict__, "vocab_size": 100_000})
    np.arange(1, 1001, dtype=np.uint16).tofile(tmp_path / "u16.bin")
    with pytest.raises(DataFileError, match=r"training.data_dtype=auto\).*set training.data_dtype=uint16"):
        MemmapTokens(tmp_path / "u16.bin", wide)
    assert MemmapTokens(tmp_path / "u16.bin", wide, dtype="uint16").sample(0)[0] == 1


def test_memmap_training_run(tmp_path: Path) -> None:
    ids = np.random.default_rng(0).integers(0, 256, size=5000)
    ids.astype(np.uint16).tofile(tmp_path / "u16.bin")
    ids.astype(np.uint32).tofile(tmp_path / "u32.bin")
    record = run_training(
        compose_run(f"training.data_path={tmp_path / 'u16.bin'}"), output_dir=tmp_path / "u16", overrides=[]
    )
    assert record["status"] == "ok"
    # The same ids as uint32: refused before the first step, as every data-file error (record: error)...
    with pytest.raises(DataFileError):
        run_training(compose_run(f"training.data_path={tmp_path / 'u32.bin'}"), output_dir=tmp_path / "x", overrides=[])
    refused = read_record(tmp_path / "x")
    assert refused["status"] == "error" and refused["iterations_run"] == 0
    assert refused["message"].startswith("DataFileError: training.data_path=")
    assert "set training.data_dtype=uint32" in refused["message"]
    # ... and with the width it names, the same training as the uint16 file.
    wide = compose_run(f"training.data_path={tmp_path / 'u32.bin'}", "training.data_dtype=uint32")
    assert run_training(wide, output_dir=tmp_path / "u32", overrides=[])["losses"] == record["losses"]


def test_a_token_file_shorter_than_the_run_wraps_around_and_says_so_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 5 samples of 32 + 1 tokens; 3 iterations of 4 samples read 12: the file is read from its start
    # again, which the run did without a word.
    path = tmp_path / "short.bin"
    np.random.default_rng(0).integers(0, 256, size=5 * 32 + 1).astype(np.uint16).tofile(path)
    record = run_training(compose_run(f"training.data_path={path}"), output_dir=tmp_path / "run", overrides=[])
    assert record["status"] == "ok"
    said = (
        f"training.data_path={str(path)!r} holds 161 tokens (read as uint16): 5 samples of model.seq_length=32 (+1, "
        "the last target), and the run asks for 12 (training.train_iters=3 of parallelism.global_batch_size=4): it "
        "wraps around, reading the file from its start again after sample 5 (each sample about 2.4 times); give a "
        "longer file, or fewer training.train_iters, for every sample to be new"
    )
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "wraps around" in line] == [f"warning: {said}"], err
    assert said in record["warnings"]
    # Only the lead rank says it; every rank's record-to-be keeps it.
    run = compose_run(f"training.data_path={path}")
    progress = trainer.Progress()
    setup.token_source(run, lead=False, progress=progress)
    assert progress.warnings == [said] and capsys.readouterr().err == ""
    # A file that holds every sample the run reads says nothing.
    np.random.default_rng(0).integers(0, 256, size=12 * 32 + 1).astype(np.uint16).tofile(path)
    setup.token_source(run, lead=True, progress=(enough := trainer.Progress()))
    assert enough.warnings == [] and capsys.readouterr().err == ""


def test_final_loss_is_the_runs_last_loss_also_after_a_resume_with_nothing_left() -> None:
    # A resume at or past train_iters runs no iteration; the checkpoint's losses are the run's.
    def record(progress: trainer.Progress) -> dict[str, Any]:
        return trainer.build_record(
            compose_run(), rank=Rank(), progress=progress, status="ok", message=None, overrides=[],
            started=datetime.now(timezone.utc), wall_s=0.0,
        )  # fmt: skip

    resumed = record(trainer.Progress(prior_losses=[5.5, 5.25, 5.0], resumed_from_step=3))
    assert resumed["iterations_run"] == 0 and resumed["final_loss"] == 5.0 and resumed["losses"] == [5.5, 5.25, 5.0]
    assert record(trainer.Progress())["final_loss"] is None


def test_optimizer_choice() -> None:
    model = build_model(GPT_CFG)
    assert build_optimizer(model, impl="auto", lr=1e-3, weight_decay=0.1, device_type="cpu")[1] == TORCH_FUSED
    assert (
        build_optimizer(model, impl=OptimizerImpl.torch, lr=1e-3, weight_decay=0.1, device_type="cpu")[1]
        == TORCH_FOREACH
    )
    opt, _ = build_optimizer(model, impl="torch_fused", lr=1e-3, weight_decay=0.1, device_type="cpu")
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decayed["params"]) and all(p.ndim == 1 for p in plain["params"])
    with pytest.raises(ValueError, match="apex"):
        build_optimizer(model, impl="apex", lr=1e-3, weight_decay=0.1, device_type="cpu")


def test_lr_schedule() -> None:
    lrs = [lr_at(i, peak=1.0, warmup_iters=4, total_iters=14) for i in range(1, 15)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]  # linear warm-up
    assert lrs[4] == 1.0 and lrs[-1] > 0.1 and all(a >= b for a, b in zip(lrs[4:], lrs[5:], strict=False))
    assert lr_at(100, peak=1.0, warmup_iters=4, total_iters=14) == pytest.approx(0.1)  # floor
    assert lr_at(1, peak=3.0, warmup_iters=0, total_iters=10) == 3.0


def test_unknown_peak_is_refused_before_training_with_a_record(tmp_path: Path) -> None:
    # What `python -m train` and the dry run refuse (rule precision_supported), run_training refuses
    # too: with no peak, no MFU could be given. Before, it trained and left MFU out.
    run = compose_run("hardware.peak_tflops_fp32=null")
    with pytest.raises(InfeasibleConfig, match=r"\[precision_supported\]"):
        run_training(run, output_dir=tmp_path, overrides=[])
    record = read_record(tmp_path)
    assert record["status"] == "error" and "[precision_supported]" in record["message"]
    assert record["peak_tflops"] is None and record["mfu"] is None and record["iterations_run"] == 0


def test_fp16_overflow_skips_the_step_and_lowers_the_scale() -> None:
    run = compose_run("parallelism.precision=fp16")
    torch.manual_seed(0)
    model = build_model(run.model)
    optimizer, _ = build_optimizer(model, impl="torch", lr=1e-3, weight_decay=0.0, device_type="cpu")
    # 2^40 overflows fp16 activation gradients (max 65504) for sure.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    cpu = torch.device("cpu")
    batches = loop.step_batches(
        run, make_source(run.model, seed=0, data_path=None), rank=Rank(), consumed=0,
        global_batch_size=run.parallelism.global_batch_size, device=cpu,
    )
    before = [p.detach().clone() for p in model.parameters()]
    result = loop.train_step(model, optimizer, scaler, batches, run=run, device=cpu)
    assert result.skipped and result.loss_scale == 2.0**40 and np.isfinite(result.loss)
    assert scaler.get_scale() == 2.0**39
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # no update


def _rank_of_two(rank: int, port: int, out: str) -> None:
    import gc

    from train.dp import GradSync

    # Only the trainer may free what the run built here: with the collector off, whatever it leaves
    # behind is what the interpreter's teardown would have to free, after destroy_process_group.
    gc.disable()
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), WANDB_MODE="disabled")
    torch.set_num_threads(1)
    record = run_training(compose_run("parallelism.dp=2"), output_dir=Path(out), overrides=[])
    left = [o for o in gc.get_objects() if isinstance(o, GradSync)]
    assert record["status"] == "ok" and not left, f"rank {rank}: {record['status']}, {len(left)} GradSync alive"


def test_a_data_parallel_run_frees_its_gradient_hooks_before_it_returns(tmp_path: Path) -> None:
    # The DP gradient hooks' GradSync holds the data-parallel group; if it outlives the run, the
    # interpreter's teardown frees the group after destroy_process_group and gloo may abort the
    # rank after its record said ok (as test_dp's workers did, 5% of the time). mp.spawn raises
    # what a rank raised, and for a rank that died of a signal.
    import torch.multiprocessing as mp

    from train.distributed import free_port

    mp.spawn(_rank_of_two, args=(free_port(), str(tmp_path)), nprocs=2)
    assert read_record(tmp_path)["world"]["dp"] == 2


def _memory_worker(rank: int, init_file: str, out: str) -> None:
    import torch.distributed as dist

    from train.planner.layout import Layout, Rank

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        # Rank 1 (a last pipeline stage, say) holds more than rank 0, which prints the log line.
        loop.max_memory_gib = lambda device: float(rank + 1)  # type: ignore[assignment]
        seen = loop.highest_memory_gib(torch.device("cpu"), Rank(Layout(dp=1, tp=1, pp=2), global_rank=rank))
        Path(f"{out}.{rank}").write_text(repr(seen))
    finally:
        from train.distributed import destroy_process_group

        destroy_process_group()


def test_the_log_lines_memory_is_the_highest_ranks(tmp_path: Path) -> None:
    from .ranks import start_ranks

    start_ranks(_memory_worker, (str(tmp_path / "init"), str(tmp_path / "rank")), 2)
    assert [float((tmp_path / f"rank.{r}").read_text()) for r in range(2)] == [2.0, 2.0]


def test_a_spawn_stopped_before_rank_0_wrote_a_record_still_gets_one(tmp_path: Path) -> None:
    """Ctrl-C (or a worker's failure) in start-up, before rank 0 wrote anything: the parent's record
    is written, since its console line names it."""
    run = compose_run("parallelism.tp=2")
    interrupted_dir, failed_dir = tmp_path / "interrupted", tmp_path / "failed"
    interrupted_dir.mkdir()
    failed_dir.mkdir()
    trainer.record_interruption(run, output_dir=interrupted_dir, overrides=["parallelism.tp=2"])
    record = read_record(interrupted_dir)
    assert record["status"] == "interrupted" and "SIGINT" in record["message"] and record["world"]["tp"] == 2
    trainer.record_worker_failure(run, output_dir=failed_dir, overrides=[], failed_rank=0, failed_code=1)
    record = read_record(failed_dir)
    assert record["status"] == "error" and record["message"].startswith("worker rank 0 exited with code 1")


def test_a_bad_input_is_the_records_cause_whichever_worker_exits_first(tmp_path: Path) -> None:
    """Every rank of a local spawn refuses a missing data file; rank 1 may exit before rank 0. The
    record keeps rank 0's words (the cause), not 'worker rank 1 exited with code 1'."""
    out = tmp_path / "run"
    missing = f"training.data_path={tmp_path / 'missing.bin'}"
    with pytest.raises(DataFileError):  # the record rank 0's worker writes (one process here)
        run_training(compose_run(missing), output_dir=out, overrides=[])
    run = compose_run("parallelism.dp=2", missing)
    written = read_record(out)
    trainer.record_worker_failure(run, output_dir=out, overrides=[], failed_rank=1, failed_code=2)
    record = read_record(out)
    assert record["status"] == "error" and record["message"] == written["message"]
    assert record["message"].startswith("DataFileError: training.data_path=")
    # Another failure of another rank is still named as the cause.
    trainer.write_json_atomic(out / "result.json", {**written, "message": "RuntimeError: gloo: connection reset"})
    trainer.record_worker_failure(run, output_dir=out, overrides=[], failed_rank=1, failed_code=17)
    assert read_record(out)["message"].startswith("worker rank 1 exited with code 17")


def test_a_finished_runs_measured_record_outlives_a_later_spawn_refused_before_training(tmp_path: Path) -> None:
    """Every rank of a local spawn refuses another run's checkpoint directory and exits EXIT_USAGE;
    rank 0 kept the finished run's record (train.trainer._write_unless_kept). The parent keeps it
    too, rather than replacing its figures with 'worker rank 1 exited with code 1'."""
    run = compose_run("parallelism.dp=2")
    finished = run_training(compose_run("training.train_iters=3", "training.warmup_iters=1"), output_dir=tmp_path, overrides=[])
    assert finished["status"] == "ok" and finished["sec_per_iter"] is not None
    measured = (tmp_path / "result.json").read_bytes()
    later = datetime.now(timezone.utc) + timedelta(seconds=2)  # the refused spawn's launch, seconds after
    trainer.record_worker_failure(run, output_dir=tmp_path, overrides=[], failed_rank=1, failed_code=2, since=later)
    assert (tmp_path / "result.json").read_bytes() == measured
    # A failure other than a refused input (an uncaught exception exits 1, a signal or a hook 17), or a
    # record this spawn's rank 0 wrote (started in the launch's second or after), is the failure's record.
    trainer.record_worker_failure(run, output_dir=tmp_path, overrides=[], failed_rank=1, failed_code=1, since=later)
    assert read_record(tmp_path)["message"].startswith("worker rank 1 exited with code 1;")
    (tmp_path / "result.json").write_bytes(measured)
    started = datetime.fromisoformat(finished["started_at"])
    trainer.record_worker_failure(run, output_dir=tmp_path, overrides=[], failed_rank=1, failed_code=2,
                                  since=started + timedelta(microseconds=900_000))  # fmt: skip
    assert read_record(tmp_path)["status"] == "error"
    # A finished run's `ok` without figures (a resume that measured nothing) is kept as rank 0 keeps it:
    # an attempt refused the checkpoint (another run's) that trains nothing does not replace it with `error`.
    from train.checkpoint import CheckpointMismatch

    unmeasured_record = {**finished, "sec_per_iter": None}
    trainer.write_json_atomic(tmp_path / "result.json", unmeasured_record)
    refused = {**finished, "status": "error", "message": "CheckpointMismatch: other seed"}
    kept = trainer._write_unless_kept(tmp_path / "result.json", refused, trainer.Progress(), CheckpointMismatch("x"))
    assert kept == unmeasured_record and read_record(tmp_path) == unmeasured_record
    # An earlier run's `nan` in the directory is not this spawn's outcome (rank 0 ended before it wrote):
    # it was returned as this one's, and the console said "nan:" of a worker that crashed.
    trainer.write_json_atomic(tmp_path / "result.json", {**finished, "status": "nan", "message": "old divergence"})
    failure = trainer.record_worker_failure(run, output_dir=tmp_path, overrides=[], failed_rank=1, failed_code=1,
                                            since=later)  # fmt: skip
    assert failure["status"] == "error" and "old divergence" not in failure["message"], failure["message"]
    assert read_record(tmp_path)["message"].startswith("worker rank 1 exited with code 1;")
    unmeasured = json.dumps({**finished, "sec_per_iter": None}).encode()
    (tmp_path / "result.json").write_bytes(unmeasured)
    trainer.record_worker_failure(run, output_dir=tmp_path, overrides=[], failed_rank=1, failed_code=2, since=later)
    assert (tmp_path / "result.json").read_bytes() == unmeasured


def test_a_device_the_hardware_config_does_not_describe_is_a_warning_in_the_log_and_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # As hardware=a64fx on this x86 machine would: MFU against a peak that is not this device's.
    run = compose_run("hardware.device_pattern=POWER9", "training.train_iters=3", "training.warmup_iters=1")
    record = run_training(run, output_dir=tmp_path, overrides=[])
    assert record["status"] == "ok"  # it still trains: the figures are the user's to judge
    (warning,) = [w for w in record["warnings"] if "does not describe this device" in w]
    assert warning.startswith(f"hardware={run.hardware.name} does not describe this device: the device is 'cpu: ")
    assert "hardware.device_pattern='POWER9' does not match" in warning
    assert f"warning: {warning}" in capsys.readouterr().err
    assert record["device_memory_gib"] is None  # a CPU reports no device memory
    # Where the pattern fits, nothing is said.
    fits = run_training(compose_run("hardware.device_pattern=.", "training.train_iters=3", "training.warmup_iters=1"),
                        output_dir=tmp_path / "fits", overrides=[])  # fmt: skip
    assert not [w for w in fits["warnings"] if "does not describe" in w]


@pytest.mark.parametrize(
    ("status", "measured", "said"),
    [("ok", 5, True), ("timeout", 5, True), ("interrupted", 5, True), ("timeout", 0, False), ("oom", 5, False)],
)
def test_a_stopped_runs_warnings_on_its_figures_are_said_as_a_finished_runs_are(
    status: str, measured: int, said: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A run stopped by its time limit whose peak passed the usable memory said so in its record only:
    # its log, unlike a finished run's, left the warning out (the analysis shows its figures, partial).
    warning = "peak memory 0.63 GiB per device is above the 0.50 GiB usable of hardware=cpu"
    # A stopped run that measured nothing has no figures to warn of: its stop line says all (one line).
    record = {"status": status, "warnings": [warning], "measured_iterations": measured}
    written = trainer._write_unless_kept(tmp_path / "result.json", record, trainer.Progress(), None, unsaid=[warning])
    assert written == record and read_record(tmp_path)["status"] == status
    assert (f"warning: {warning}\n" in capsys.readouterr().err) == said


def test_a_peak_above_the_usable_memory_is_a_warning() -> None:
    # tiny under hardware.memory_gib=0.5 (reserve 0): the dry run predicted 0.47 GiB and accepted it; the run
    # peaked at 0.63 GiB and said nothing (only the analysis, later, called the constraint unmet).
    run = RunConfig()
    run = dataclasses.replace(run, hardware=dataclasses.replace(run.hardware, memory_gib=0.5, memory_reserve_gib=0.0))
    said = _over_capacity(run, 0.63)
    assert said is not None and said.startswith("peak memory 0.63 GiB per device is above the 0.50 GiB usable of ")
    assert "(memory_gib=0.5 less memory_reserve_gib=0)" in said
    assert _over_capacity(run, 0.5) is None and _over_capacity(run, None) is None
