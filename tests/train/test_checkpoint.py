"""train.checkpoint: a run stopped by Slurm's signal and restarted in the same run directory ends
with the losses of an uninterrupted run, without repeating the steps it had finished.

End to end through `python -m train` in subprocesses: 6 steps, save_interval=2; the interrupted
attempt gets SIGUSR1 during step 3 from the MEGASWEEP_FAULT_SIGNAL hook (on one rank only: all
ranks must still stop at the same step), saves at the step boundary and exits with
EXIT_REQUEUE; the second attempt resumes from step 3 and runs steps 4-6.

Tolerances: a resumed run compares exactly with the uninterrupted run of its own layout (fp32 on
CPU is deterministic, and the checkpoint restores weights, Adam states and the data position bit
for bit): the one-process run, and DP=2 + ZeRO-1 against an uninterrupted DP=2 + ZeRO-1 run. Every
layout also compares with the one-process run at rel 1e-6: layouts only reorder fp32 sums (DP=2
adds its replicas' gradients in another order than one process accumulates its micro-batches;
< 1e-7 relative here, as in test_parallel), while a resume that lost or mis-restored state (Adam
moments, learning-rate step, data position) moves the next loss by far more.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from conf.schema import ModelConfig, RunConfig, TokenDtype, TrainingConfig
from train.checkpoint import (
    LATEST,
    META,
    Checkpointer,
    CheckpointMismatch,
    CheckpointUnreadable,
    fingerprint,
    layout_key,
    read_latest,
)
from train.contract import EXIT_FAILED, EXIT_REQUEUE, RESULT_FILE
from train.preemption import FAULT_EXIT_CODE

from .test_distributed import REPO, TINY, run_train, worker_env

STEPS = 6
STOP_AT = 3
RUN = [*(o for o in TINY if not o.startswith("training.train_iters=")), f"training.train_iters={STEPS}"]
CKPT = ["training.save_interval=2"]
RTOL_REORDERED = 1e-6


def launch(
    out: Path, *overrides: str, signal_at: str | None = None
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    env = worker_env(**({"MEGASWEEP_FAULT_SIGNAL": signal_at} if signal_at else {}))
    return run_train(out, *RUN, *CKPT, *overrides, env=env, check=False)


def iterations_logged(stdout: str) -> list[int]:
    return [
        int(line.split()[1].rstrip("/")) for line in stdout.splitlines() if line.startswith(" iteration ")
    ]


def interrupt_and_resume(out: Path, *overrides: str, signal_at: str) -> dict[str, Any]:
    """The two attempts of a preempted run; returns the second one's record after checking both."""
    first, stopped = launch(out, *overrides, signal_at=signal_at)
    assert first.returncode == EXIT_REQUEUE, first.stderr[-3000:]
    assert stopped["status"] == "timeout" and "SIGUSR1" in (stopped["message"] + first.stderr)
    assert stopped["iterations_run"] == STOP_AT and len(stopped["losses"]) == STOP_AT
    assert stopped["checkpoint"]["saved_steps"] == [2, STOP_AT]
    assert stopped["checkpoint"]["save_mode"] == "async"  # torch 2.13 has dcp.async_save
    second, resumed = launch(out, *overrides)
    assert second.returncode == 0, second.stderr[-3000:]
    assert resumed["status"] == "ok"
    assert f"resumed from step {STOP_AT}" in second.stdout
    # Steps 1-3 are not run again: this attempt ran 4-6, and its medians cover those only.
    assert resumed["resumed_from_step"] == STOP_AT
    assert resumed["iterations_run"] == STEPS - STOP_AT == len(resumed["iteration_times_s"])
    assert iterations_logged(second.stdout) == list(range(STOP_AT + 1, STEPS + 1))
    assert resumed["measured_iterations"] == STEPS - STOP_AT - 1  # warmup_iters=1 of this attempt
    # The whole run's losses: the first attempt's, carried by the checkpoint, then this one's.
    assert resumed["losses"][:STOP_AT] == stopped["losses"]
    assert len(resumed["losses"]) == STEPS
    return resumed


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("uninterrupted")
    proc, record = launch(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert record["status"] == "ok" and record["resumed_from_step"] is None
    assert record["checkpoint"]["saved_steps"] == [2, 4, 6]
    # `latest` names the last save; older step directories beyond the newest two are pruned.
    ckpt = Path(record["checkpoint"]["dir"])
    assert ckpt.name == layout_key(dp=1, tp=1, pp=1, zero_stage=0)
    assert read_latest(ckpt) == STEPS
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_4", "step_6"]
    losses: list[float] = record["losses"]
    assert len(losses) == STEPS and losses[0] != losses[-1]
    return record


def test_one_process_resume_equals_uninterrupted(tmp_path: Path, uninterrupted: dict[str, Any]) -> None:
    resumed = interrupt_and_resume(tmp_path / "run", signal_at=f"0:{STOP_AT}")
    assert resumed["losses"] == uninterrupted["losses"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "signal_at", "exact"),
    [
        (("parallelism.dp=2", "parallelism.zero_stage=1"), f"1:{STOP_AT}", True),
        (("parallelism.tp=2",), f"0:{STOP_AT}", False),
        (("parallelism.pp=2",), f"1:{STOP_AT}", False),
        # The LayerNorm weights are then replicated DTensors, saved once.
        (("parallelism.tp=2", "parallelism.sequence_parallel=true"), f"1:{STOP_AT}", False),
        # Interleaved: each rank's two chunks (layers 0 and 2, 1 and 3) under its own layout key.
        (("parallelism.pp=2", "parallelism.virtual_stages=2"), f"1:{STOP_AT}", False),
    ],
    ids=["dp2_zero1", "tp2", "pp2", "tp2_sp", "pp2_vpp2"],
)
def test_layout_resume_equals_uninterrupted(
    tmp_path: Path, uninterrupted: dict[str, Any], overrides: tuple[str, ...], signal_at: str, exact: bool
) -> None:
    resumed = interrupt_and_resume(tmp_path / "run", *overrides, signal_at=signal_at)
    if exact:
        proc, same_layout = launch(tmp_path / "uninterrupted", *overrides)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert resumed["losses"] == same_layout["losses"]
    assert resumed["losses"] == pytest.approx(uninterrupted["losses"], rel=RTOL_REORDERED)
    assert Path(resumed["checkpoint"]["dir"]).name.endswith("-vpp2") == ("parallelism.virtual_stages=2" in overrides)
    files = sorted(p.name for p in Path(resumed["checkpoint"]["dir"]).glob("step_6/*.distcp"))
    assert len(files) == 2  # each rank wrote its own part


def test_finished_async_save_is_resumed_after_a_kill_before_the_next_save(
    tmp_path: Path, uninterrupted: dict[str, Any]
) -> None:
    # Step 2's asynchronous save finishes during step 3 (slowed down to 3 s: 1 s was not always enough
    # for the save's thread on make test's loaded cores, CI 2026-11-29); the process then dies at the
    # start of step 4 (os._exit, as SIGKILL or a node failure would end it), before the save of step 4
    # that used to be the first to commit step 2. `latest` must name step 2 already.
    out = tmp_path / "run"
    env = worker_env(MEGASWEEP_FAULT_EXIT="0:4", MEGASWEEP_FAULT_SLOW_FIRST_ATTEMPT="3.0")
    killed = subprocess.run(
        [sys.executable, "-m", "train", *RUN, *CKPT, f"hydra.run.dir={out}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert killed.returncode == FAULT_EXIT_CODE, killed.stderr[-3000:]
    assert not (out / "result.json").exists()  # it died without a record, as a SIGKILLed run does
    assert read_latest(out / "checkpoints" / layout_key(dp=1, tp=1, pp=1, zero_stage=0)) == 2
    second, resumed = launch(out)
    assert second.returncode == 0, second.stderr[-3000:]
    assert resumed["resumed_from_step"] == 2 and iterations_logged(second.stdout) == [3, 4, 5, 6]
    assert resumed["losses"] == uninterrupted["losses"]


def test_unreadable_newest_checkpoint_falls_back_then_is_one_line(
    tmp_path: Path, uninterrupted: dict[str, Any]
) -> None:
    # The finished run's checkpoints (steps 4 and 6) in a new run directory, step 6's shard truncated
    # (a disk that filled, a copy cut short): the run resumes from step 4 and says why, with the
    # losses of the uninterrupted run. Both truncated: one line and a record, not DCP's traceback.
    ckpt = tmp_path / "run" / "checkpoints" / layout_key(dp=1, tp=1, pp=1, zero_stage=0)
    shutil.copytree(uninterrupted["checkpoint"]["dir"], ckpt)
    _truncate_shards(ckpt / "step_6")
    proc, record = launch(tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert record["resumed_from_step"] == 4 and iterations_logged(proc.stdout) == [5, 6]
    assert record["losses"] == uninterrupted["losses"]
    assert any(w.startswith(f"checkpoint not resumed from, unreadable: {ckpt / 'step_6'}: ")
               for w in record["warnings"]), record["warnings"]  # fmt: skip
    for step in (4, 6):
        _truncate_shards(ckpt / f"step_{step}")
    # The run had finished: its measured record stays (nothing trained); without it, the record says why.
    measured = (tmp_path / "run" / RESULT_FILE).read_bytes()
    proc, record = launch(tmp_path / "run")
    assert proc.returncode == EXIT_FAILED and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (tmp_path / "run" / RESULT_FILE).read_bytes() == measured and record["status"] == "ok"
    (tmp_path / "run" / RESULT_FILE).unlink()
    proc, record = launch(tmp_path / "run")
    assert proc.returncode == EXIT_FAILED and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: no checkpoint in {ckpt} can be resumed from ({ckpt / 'step_6'}: "), last
    assert f"; {ckpt / 'step_4'}: " in last and last.endswith(f"(record: {tmp_path / 'run' / 'result.json'})"), last
    assert record["status"] == "error" and record["message"].startswith("CheckpointUnreadable: no checkpoint in")
    assert "Traceback" not in record["message"] and record["iterations_run"] == 0


def _truncate_shards(step_dir: Path) -> None:
    for shard in step_dir.glob("*.distcp"):
        with shard.open("r+b") as f:
            f.truncate(shard.stat().st_size // 2)


def test_another_layouts_checkpoints_are_left_and_the_run_starts_afresh_saying_so(tmp_path: Path) -> None:
    # A checkpoint of dp=2 in the run's checkpoint directory; this run is one process. It refused to start,
    # so a sweep of layouts sharing one training.checkpoint_dir, which the dry run accepts, failed at its
    # second layout.
    other = tmp_path / "run" / "checkpoints" / layout_key(dp=2, tp=1, pp=1, zero_stage=0)
    other.mkdir(parents=True)
    pointer = json.dumps({"step": 2, "dir": "step_2"})
    (other / LATEST).write_text(pointer)
    proc, record = launch(tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert record["status"] == "ok" and record["iterations_run"] == STEPS and record["resumed_from_step"] is None
    said = ("holds checkpoints of layout dp2-tp1-pp1-zero0 only, not of this run's layout dp1-tp1-pp1-zero0: "
            "this run starts afresh")  # fmt: skip
    assert any(said in w for w in record["warnings"]) and "warning: checkpoint directory" in proc.stderr
    assert (other / LATEST).read_text() == pointer


# ---------------------------------------------------------------------------------------------
# In one process, without the trainer.


def _toy(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, torch.amp.GradScaler("cpu", enabled=False)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.ones(3, 4)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _checkpointer(root: Path, **config: Any) -> Checkpointer:
    layout = {"dp": 1, "tp": 1, "pp": 1, "zero_stage": 0}
    return Checkpointer(root, layout=layout, config={"model": "toy", **config}, use_async=False)


def test_round_trip_restores_weights_optimizer_and_rng(tmp_path: Path) -> None:
    model, optimizer, scaler = _toy(0)
    _step(model, optimizer)
    ckpt = _checkpointer(tmp_path)
    assert ckpt.load_latest(model=model, optimizer=optimizer, scaler=scaler) is None  # nothing yet
    ckpt.save(1, model=model, optimizer=optimizer, scaler=scaler, losses=[2.5], consumed_samples=3)
    assert ckpt.mode == "sync" and read_latest(ckpt.dir) == 1
    expected_rand = torch.rand(3)
    _step(model, optimizer)
    expected_weights = [p.detach().clone() for p in model.parameters()]
    # A fresh model (other seed, no optimizer state yet) takes the saved state and repeats step 2.
    fresh, fresh_opt, fresh_scaler = _toy(1)
    resumed = _checkpointer(tmp_path).load_latest(model=fresh, optimizer=fresh_opt, scaler=fresh_scaler)
    assert resumed is not None and (resumed.step, resumed.consumed_samples, resumed.losses) == (1, 3, [2.5])
    assert torch.equal(torch.rand(3), expected_rand)
    _step(fresh, fresh_opt)
    for got, want in zip(fresh.parameters(), expected_weights, strict=True):
        assert torch.equal(got, want)


def test_incomplete_save_is_ignored_and_changed_config_refused(tmp_path: Path) -> None:
    model, optimizer, scaler = _toy(0)
    _step(model, optimizer)
    ckpt = _checkpointer(tmp_path)
    ckpt.save(1, model=model, optimizer=optimizer, scaler=scaler, losses=[1.0], consumed_samples=3)
    # A save killed before its pointer moved leaves a step directory that nothing names.
    (ckpt.dir / "step_2").mkdir()
    resumed = _checkpointer(tmp_path).load_latest(model=model, optimizer=optimizer, scaler=scaler)
    assert resumed is not None and resumed.step == 1
    with pytest.raises(CheckpointMismatch, match=r"other seed \(checkpoint: seed=None; this run: seed=7\)"):
        _checkpointer(tmp_path, seed=7).load_latest(model=model, optimizer=optimizer, scaler=scaler)
    # A model group differs in one field: that field is named, with both values.
    (ckpt.dir / "step_2").rmdir()
    ckpt2 = Checkpointer(tmp_path / "nested", layout=ckpt.layout, config={"model": {"hidden_size": 64, "num_layers": 2}},
                         use_async=False)  # fmt: skip
    ckpt2.save(1, model=model, optimizer=optimizer, scaler=scaler, losses=[1.0], consumed_samples=3)
    other = Checkpointer(tmp_path / "nested", layout=ckpt.layout, config={"model": {"hidden_size": 128, "num_layers": 2}},
                         use_async=False)  # fmt: skip
    with pytest.raises(CheckpointMismatch, match=r"other model\.hidden_size \(checkpoint: model\.hidden_size=64; "
                                                 r"this run: model\.hidden_size=128\)"):  # fmt: skip
        other.load_latest(model=model, optimizer=optimizer, scaler=scaler)


def test_a_resume_under_another_learning_rule_is_refused_and_older_checkpoints_still_resume(tmp_path: Path) -> None:
    # `python -m train training.lr=1e-3` into the run directory of a 3e-4 run resumed and trained on; its
    # record said lr 1e-3 of a loss curve whose first steps ran at 3e-4.
    model, optimizer, scaler = _toy(0)
    _step(model, optimizer)
    layout = {"dp": 1, "tp": 1, "pp": 1, "zero_stage": 0}

    def at(lr: float, directory: Path = tmp_path / "a", **config: Any) -> Checkpointer:
        base = RunConfig(training=TrainingConfig(lr=lr))
        return Checkpointer(directory, layout=layout, config={**fingerprint(base), **config}, use_async=False)

    at(3e-4).save(1, model=model, optimizer=optimizer, scaler=scaler, losses=[1.0], consumed_samples=3)
    assert at(3e-4).load_latest(model=model, optimizer=optimizer, scaler=scaler) is not None
    with pytest.raises(CheckpointMismatch, match=r"other training\.lr \(checkpoint: training\.lr=0\.0003; "
                                                 r"this run: training\.lr=0\.001\)"):  # fmt: skip
        at(1e-3).load_latest(model=model, optimizer=optimizer, scaler=scaler)
    # Saved before the update rule was fingerprinted: no `training` key, resumed as it was.
    older = {k: v for k, v in fingerprint(RunConfig()).items() if k != "training"}
    Checkpointer(tmp_path / "b", layout=layout, config=older, use_async=False).save(
        1, model=model, optimizer=optimizer, scaler=scaler, losses=[1.0], consumed_samples=3)
    assert at(1e-3, tmp_path / "b").load_latest(model=model, optimizer=optimizer, scaler=scaler) is not None


def test_unreadable_latest_or_step_falls_back_to_an_older_complete_one(tmp_path: Path) -> None:
    model, optimizer, scaler = _toy(0)
    ckpt = _checkpointer(tmp_path)
    saved = {}
    for step in (1, 2):
        _step(model, optimizer)
        ckpt.save(step, model=model, optimizer=optimizer, scaler=scaler, losses=[1.0] * step, consumed_samples=3 * step)
        saved[step] = [p.detach().clone() for p in model.parameters()]
    # `latest` that is not JSON: the newest complete step is found without it.
    (ckpt.dir / LATEST).write_text('{"ste')
    fresh, fresh_opt, fresh_scaler = _toy(1)
    resumed = _checkpointer(tmp_path).load_latest(model=fresh, optimizer=fresh_opt, scaler=fresh_scaler)
    assert resumed is not None and resumed.step == 2 and resumed.skipped[0].startswith(f"{ckpt.dir / LATEST}: JSONDecodeError")
    # Step 2 without DCP's metadata: step 1, with its own weights.
    (ckpt.dir / "step_2" / ".metadata").unlink()
    fresh, fresh_opt, fresh_scaler = _toy(1)
    resumed = _checkpointer(tmp_path).load_latest(model=fresh, optimizer=fresh_opt, scaler=fresh_scaler)
    assert resumed is not None and (resumed.step, resumed.consumed_samples) == (1, 3)
    assert all(torch.equal(got, want) for got, want in zip(fresh.parameters(), saved[1], strict=True))
    # Nothing readable: one line naming each checkpoint tried.
    (ckpt.dir / "step_1" / META).unlink()
    with pytest.raises(CheckpointUnreadable) as refused:
        _checkpointer(tmp_path).load_latest(model=fresh, optimizer=fresh_opt, scaler=fresh_scaler)
    message = str(refused.value)
    assert "\n" not in message and f"{ckpt.dir / LATEST}: JSONDecodeError" in message, message
    assert "Remove that directory to start afresh" in message


def test_a_step_saved_again_over_an_unreadable_one_replaces_it_whole(tmp_path: Path) -> None:
    model, optimizer, scaler = _toy(0)
    ckpt = _checkpointer(tmp_path)
    for step in (1, 2):
        _step(model, optimizer)
        ckpt.save(step, model=model, optimizer=optimizer, scaler=scaler, losses=[1.0] * step, consumed_samples=3 * step)
    _truncate_shards(ckpt.dir / "step_2")
    (ckpt.dir / "step_2" / "__1_0.distcp").write_bytes(b"a rank's part from a wider attempt")
    again = _checkpointer(tmp_path)
    resumed = again.load_latest(model=model, optimizer=optimizer, scaler=scaler)
    assert resumed is not None and resumed.step == 1
    _step(model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # DCP's "Detected an existing checkpoint ... overwriting" among them
        again.save(2, model=model, optimizer=optimizer, scaler=scaler, losses=[1.0, 1.0], consumed_samples=6)
    assert sorted(p.name for p in (ckpt.dir / "step_2").iterdir()) == [".metadata", "__0_0.distcp", META]
    saved = [p.detach().clone() for p in model.parameters()]
    fresh, fresh_opt, fresh_scaler = _toy(1)
    resumed = _checkpointer(tmp_path).load_latest(model=fresh, optimizer=fresh_opt, scaler=fresh_scaler)
    assert resumed is not None and (resumed.step, resumed.skipped) == (2, ())
    assert all(torch.equal(got, want) for got, want in zip(fresh.parameters(), saved, strict=True))


def test_resuming_at_the_last_step_says_nothing_was_left_to_train(tmp_path: Path) -> None:
    # The same command again: its checkpoint is at train_iters already, so no iteration runs.
    first, finished = launch(tmp_path / "run")
    assert first.returncode == 0, first.stderr[-2000:]
    measured = (tmp_path / "run" / RESULT_FILE).read_bytes()
    again, record = launch(tmp_path / "run")
    assert again.returncode == 0 and iterations_logged(again.stdout) == [], again.stdout[-2000:]
    warning = f"resumed from step {STEPS}"
    assert f"warning: {warning}" in again.stderr and f"training.train_iters={STEPS}: no iteration ran" in again.stderr
    # The finished run's record stays, figures and all: an `ok` that measured nothing replaced it.
    assert "the run had finished already: the finished run's record, with its measured figures, is kept" in again.stderr
    assert (tmp_path / "run" / RESULT_FILE).read_bytes() == measured and record == finished
    assert finished["sec_per_iter"] is not None
    # Another run in the same directory is refused its checkpoint: an input error, and nothing trained,
    # so the finished run's record stays too; the error line says no record was written.
    other, record = launch(tmp_path / "run", "training.seed=7")
    assert other.returncode == EXIT_FAILED and "Traceback" not in other.stderr, other.stderr[-2000:]
    assert "warning: this attempt was refused before training: the finished run's record" in other.stderr
    last = other.stderr.strip().splitlines()[-1]
    assert last.startswith("error: checkpoint ") and "other seed" in last, last
    assert last.endswith(f"(nothing recorded: {tmp_path / 'run' / RESULT_FILE} is the finished run's record, kept)")
    # Nor does stdout name it as this attempt's result (a "result:" line came before the refusal).
    assert "result: " not in other.stdout and "result: " in again.stdout, other.stdout[-2000:]
    assert (tmp_path / "run" / RESULT_FILE).read_bytes() == measured
    # Without that record (removed; or one without figures), the resume's own record says what happened,
    # with the loss the checkpoint recorded: the run's last loss is known.
    (tmp_path / "run" / RESULT_FILE).unlink()
    third, record = launch(tmp_path / "run")
    assert third.returncode == 0 and iterations_logged(third.stdout) == [], third.stdout[-2000:]
    assert any(w.startswith(warning) for w in record["warnings"])
    assert record["iterations_run"] == 0 and record["losses"] == finished["losses"]
    assert record["final_loss"] == finished["final_loss"] == finished["losses"][-1] is not None


def test_the_steps_after_the_last_interval_are_saved_too(tmp_path: Path) -> None:
    # train_iters=5 with save_interval=2: step 5 was never saved, so the same command again trained it
    # again and its record, of one unmeasured iteration, replaced the finished run's measured one.
    first, finished = launch(tmp_path / "run", "training.train_iters=5")
    assert first.returncode == 0, first.stderr[-2000:]
    assert finished["checkpoint"]["saved_steps"] == [2, 4, 5]
    assert read_latest(Path(finished["checkpoint"]["dir"])) == 5
    measured = (tmp_path / "run" / RESULT_FILE).read_bytes()
    again, _ = launch(tmp_path / "run", "training.train_iters=5")
    assert again.returncode == 0 and iterations_logged(again.stdout) == [], again.stdout[-2000:]
    assert (tmp_path / "run" / RESULT_FILE).read_bytes() == measured


def test_a_token_width_other_than_auto_is_part_of_what_a_resume_must_keep() -> None:
    # It changes the tokens every step sees; `auto`, or the width auto picks, adds no key, so that
    # checkpoints saved before training.data_dtype existed still resume.
    def run(**training: Any) -> RunConfig:
        return RunConfig(model=ModelConfig(vocab_size=512), training=TrainingConfig(**training))

    plain = fingerprint(run(data_path="/data/x.bin"))
    assert "data_dtype" not in plain
    assert fingerprint(run(data_path="/data/x.bin", data_dtype=TokenDtype.uint16)) == plain
    wider = fingerprint(run(data_path="/data/x.bin", data_dtype=TokenDtype.uint32))
    assert wider == {**plain, "data_dtype": "uint32"}
    assert "data_dtype" not in fingerprint(run(data_dtype=TokenDtype.uint32))  # synthetic tokens


def test_a_resumed_attempt_that_measures_nothing_says_why(tmp_path: Path) -> None:
    # The same run asked for one step more: resumed at step 6, its one iteration is this attempt's warm-up.
    # The record was `ok` with sec/it, TFLOPs and MFU null and no word of why.
    first, _ = launch(tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    second, record = launch(tmp_path, f"training.train_iters={STEPS + 1}")
    assert second.returncode == 0 and record["resumed_from_step"] == STEPS, second.stderr[-3000:]
    assert record["iterations_run"] == 1 and record["measured_iterations"] == 0 and record["sec_per_iter"] is None
    assert any(w.startswith("no iteration was measured: this attempt ran 1 iteration(s), all within "
                            "training.warmup_iters=1") for w in record["warnings"]), record["warnings"]  # fmt: skip
    # ... and the console says so too: an `ok` run without sec/it was said in result.json alone.
    assert "warning: no iteration was measured: this attempt ran 1 iteration(s)" in second.stderr, second.stderr[-3000:]

