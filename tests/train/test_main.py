"""`python -m train` and the dry run agree: what the planner accepts trains, what it rejects is refused.

Seeded draws of small layouts (world up to 8 gloo processes, tiny model dims; dp, tp, pp, micro
and global batch, ramp-up, zero_stage, engine, offload, recompute, precision), about half of them
breaking some rule. For each, the planner's verdict (train.planner.plan.plan_run on the config
Hydra composes, exactly what `hydra/launcher=plan` computes) is compared with what the real entry
point does in a subprocess:

* accepted: `python -m train` trains 2 iterations (workers forked as a user's run forks them) and
  ends `ok`, exit status 0;
* rejected: `python -m train` refuses before any worker starts (no result.json, no worker's output),
  exit status EXIT_USAGE, naming on stderr exactly the rules the planner named, as `[rule]`.

The default run is AGREEMENT_SEEDS, fixed seeds; tests/bench/bench_agreement.py draws more
through Hypothesis.

Also the entry point's own endings: Ctrl-C (a real SIGINT to a real run) and unknown keys.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
from hypothesis import strategies as st

from train.contract import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, RESULT_FILE, read_record
from train.planner.plan import plan_run

from .test_distributed import REPO, worker_env
from .test_trainer import compose_run

AGREEMENT_SEEDS = (1, 2, 3, 4, 5, 11, 25, 60, 64, 79, 82, 97, 129, 147, 161, 182, 212, 237, 291, 353)
"""The draws `make test` runs: a small set of seeds below 400 (picked greedily, cheapest first) whose
draws name every rule and train every engine x ZeRO stage x offload, and interleaved 1F1B with and
without DP, that 400 draws reach, plus the first three multi-process draws that train;
test_the_seeds_cover_the_rules_and_engines holds it."""
RULE = re.compile(r"\[([a-z_0-9]+)\]")
T = TypeVar("T")


@dataclass(frozen=True)
class Draw:
    """One drawn config, as the command line a user would type."""

    overrides: tuple[str, ...]
    world: int


KNOBS = ("pp", "heads", "layers", "gbs", "ramp", "zero", "offload", "precision", "iters")
"""What a draw may break, one at a time: about half the draws break none."""


def draw_layout(rng: random.Random) -> Draw:
    """A small layout around the valid ones, drawn from `rng`: every knob valid, or one of them drawn freely."""
    wild_knob = rng.choice(KNOBS) if rng.random() < 0.5 else None

    def pick(knob: str, valid: Callable[[], T], wild: Callable[[], T]) -> T:
        return wild() if knob == wild_knob else valid()

    engine = rng.choice(["native"] * 4 + ["deepspeed"])
    deepspeed = engine == "deepspeed"
    tp = rng.choice([1, 2, 4])
    # DeepSpeed runs no pipeline (rule deepspeed_no_pipeline): now and then one is drawn anyway.
    pp = int(pick("pp", lambda: 1 if deepspeed else rng.choice([p for p in (1, 2, 4) if tp * p <= 8]),
                  lambda: rng.choice([p for p in (1, 2, 3) if tp * p <= 8])))
    dp = rng.choice([d for d in (1, 2, 4) if d * tp * pp <= 8])
    world = dp * tp * pp
    heads = int(pick("heads", lambda: rng.choice([tp, 2 * tp]), lambda: rng.randint(1, 4)))
    layers = pick("layers", lambda: pp * rng.randint(1, 2), lambda: rng.randint(1, 4))
    hidden = 8 * heads
    mbs = rng.choice([1, 2])
    step = mbs * dp
    gbs = pick("gbs", lambda: step * rng.randint(1, 4), lambda: rng.randint(1, 12))
    ramp: list[int] | None = pick(
        "ramp", lambda: rng.choice([None, [step, step, 2 * step]]), lambda: [rng.randint(0, 6) for _ in range(3)]
    )
    if wild_knob != "ramp" and ramp is not None and gbs <= step:
        ramp = None  # a valid ramp starts below the global batch (after the draw: the seeds keep their draws)
    zero = pick("zero", lambda: rng.choice([0, 1, 2, 3] if deepspeed else [0, 1]), lambda: rng.randint(0, 3))
    offloads = ["none"] + (["optimizer"] if deepspeed and zero else []) + (["params"] if deepspeed and zero == 3 else [])
    offload = pick("offload", lambda: rng.choice(offloads), lambda: rng.choice(["optimizer", "params"]))
    precision = pick("precision", lambda: rng.choice(["fp32", "bf16"] + ([] if deepspeed else ["fp16"])), lambda: "fp16")
    iters = pick("iters", lambda: 2, lambda: rng.choice([0, 1]))  # 1: the warm-up (1) covers the whole run
    recompute = rng.choice(["none", "selective", "full"])
    # Interleaved 1F1B, drawn last so the draws before it keep their values: two chunks per rank where a
    # native pipeline's layers split evenly, and now and then any count anywhere.
    interleavable = engine == "native" and pp > 1 and isinstance(layers, int) and layers % (2 * pp) == 0
    virtual = rng.choice([2, 3]) if rng.random() < 0.1 else rng.choice([1, 2]) if interleavable else 1
    overrides = [
        f"model.num_layers={layers}",
        f"model.hidden_size={hidden}",
        f"model.num_attention_heads={heads}",
        "model.seq_length=16",
        "model.vocab_size=128",
        "model.make_vocab_size_divisible_by=16",
        f"parallelism.tp={tp}",
        f"parallelism.pp={pp}",
        f"parallelism.dp={dp}",
        f"parallelism.micro_batch_size={mbs}",
        f"parallelism.global_batch_size={gbs}",
        f"parallelism.zero_stage={zero}",
        f"parallelism.offload={offload}",
        f"parallelism.engine={engine}",
        f"parallelism.precision={precision}",
        f"parallelism.recompute={recompute}",
        f"parallelism.virtual_stages={virtual}",
        f"training.train_iters={iters}",
        "training.warmup_iters=1",
        "logger=disabled",
        # Datasheet placeholders instead of a calibration per run (the rules want a peak).
        "hardware.peak_measured=false",
        "hardware.peak_tflops_fp32=10.0",
        "hardware.peak_tflops_bf16=10.0",
        "hardware.peak_tflops_fp16=10.0",
    ]
    if ramp is not None:
        overrides.append(f"parallelism.rampup_batch_size=[{','.join(str(v) for v in ramp)}]")
    return Draw(tuple(overrides), world)


def layouts() -> st.SearchStrategy[Draw]:
    """`draw_layout` as a Hypothesis strategy (tests/bench/bench_agreement.py draws hundreds)."""
    return st.builds(draw_layout, st.randoms(use_true_random=False))


def check_agreement(draw: Draw, out: Path) -> None:
    row = plan_run(compose_run(*draw.overrides))
    proc = subprocess.run(
        [sys.executable, "-m", "train", *draw.overrides, f"hydra.run.dir={out}"],
        cwd=REPO,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    shown = " ".join(draw.overrides)
    if row.feasible:
        record = read_record(out / RESULT_FILE)
        assert proc.returncode == 0, f"planned ok, failed: {shown}\n{proc.stderr[-3000:]}"
        assert record is not None and record["status"] == "ok", shown
        assert record["iterations_run"] == 2 and record["world"]["world_size"] == draw.world
        return
    planned = [RULE.match(r).group(1) for r in row.reasons]  # type: ignore[union-attr]
    assert proc.returncode == EXIT_USAGE, f"planned {planned}, exit {proc.returncode}: {shown}\n{proc.stderr[-3000:]}"
    refused = sorted(set(RULE.findall(proc.stderr)))
    assert refused == sorted(planned), (shown, proc.stderr)
    # Before any worker: nothing trained, nothing recorded.
    assert not (out / RESULT_FILE).exists() and " iteration " not in proc.stdout, shown


@pytest.mark.parametrize("seed", AGREEMENT_SEEDS)
def test_planner_and_trainer_agree(tmp_path: Path, seed: int) -> None:
    """One fixed draw per seed: distinct draws (Hypothesis's derandomized ones repeat their first
    simple example), each its own test item so that pytest-xdist spreads them over its workers."""
    check_agreement(draw_layout(random.Random(seed)), tmp_path)


def test_the_seeds_cover_the_rules_and_engines() -> None:
    rules: set[str] = set()
    trained: set[tuple[str, str, str]] = set()
    interleaved_dp: set[bool] = set()
    for seed in AGREEMENT_SEEDS:
        draw = draw_layout(random.Random(seed))
        row = plan_run(compose_run(*draw.overrides))
        rules |= {RULE.match(r).group(1) for r in row.reasons}  # type: ignore[union-attr]
        if row.feasible:
            o = dict(item.split("=", 1) for item in draw.overrides)
            trained.add((o["parallelism.engine"], o["parallelism.zero_stage"], o["parallelism.offload"]))
            if o["parallelism.virtual_stages"] != "1":
                interleaved_dp.add(o["parallelism.dp"] != "1")
    assert rules >= {"train_iters", "warmup_iters", "heads_divisible_by_tp", "layers_divisible_by_pp",
                     "global_batch_divisible", "rampup_batch_size", "native_zero_stage", "native_offload",
                     "offload_requires_zero", "deepspeed_no_pipeline", "deepspeed_fp16_on_cpu",
                     "virtual_stages_need_pp", "layers_divisible_by_virtual_stages", "interleaved_micro_batches",
                     "virtual_stages_native_only"}  # fmt: skip
    assert {("deepspeed", str(z), "none") for z in (0, 1)} | {("deepspeed", "2", "optimizer"),
            ("deepspeed", "3", "params"), ("native", "0", "none"), ("native", "1", "none")} <= trained  # fmt: skip
    assert interleaved_dp == {True, False}


def test_dp2_tp2_pp2_of_the_default_batch_trains(tmp_path: Path) -> None:
    """The issue's first example: one micro-batch per rank (default mbs 4, gbs 8) on 2 stages."""
    overrides = ("parallelism.dp=2", "parallelism.tp=2", "parallelism.pp=2", "model.seq_length=32",
                 "model.hidden_size=64", "training.train_iters=2", "training.warmup_iters=1", "logger=disabled")
    check_agreement(Draw(overrides, 8), tmp_path)


TINY_RUN = ("logger=disabled", "model.num_layers=1", "model.hidden_size=64", "model.seq_length=32")


AS_FROM_A_TERMINAL = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)
"""Runs `python <argv>` with Ctrl-C's default meaning, as a shell starts a foreground command: a test
run from a background job (`cmd &` in a script, nohup) inherits SIGINT ignored, and a Python started
so never turns SIGINT into KeyboardInterrupt."""


def interrupt(argv: Sequence[str], *, whole_group: bool = True, sig: int = signal.SIGINT) -> tuple[int, str]:
    """Start `python <argv>`, wait for its first iteration line, send it SIGINT as a terminal's Ctrl-C
    does (to its whole process group) or as `kill -INT` does (to it alone), or `sig` instead; (exit status,
    stderr).
    Every process of its group must be gone by then."""
    run = subprocess.Popen(
        [sys.executable, "-c", AS_FROM_A_TERMINAL, *argv], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert run.stdout is not None
        for line in run.stdout:  # training is under way once an iteration is logged
            if "iteration" in line:
                break
        if whole_group:
            os.killpg(run.pid, sig)
        else:
            run.send_signal(sig)
        _, stderr = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    with pytest.raises(ProcessLookupError):  # no worker outlived the run
        os.killpg(run.pid, 0)
    return run.returncode, stderr


@pytest.mark.parametrize(("tp", "whole_group"), [(2, True), (2, False), (1, True)])
def test_ctrl_c_records_interrupted_and_stops_every_worker(tmp_path: Path, tp: int, whole_group: bool) -> None:
    code, stderr = interrupt(
        ["-m", "train", f"parallelism.tp={tp}", "training.train_iters=100000", *TINY_RUN, f"hydra.run.dir={tmp_path}"],
        whole_group=whole_group,
    )
    assert code == EXIT_INTERRUPTED, stderr
    assert "Traceback" not in stderr and stderr.strip() == f"interrupted (record: {tmp_path / RESULT_FILE})"
    record = read_record(tmp_path / RESULT_FILE)
    assert record is not None and record["status"] == "interrupted" and "SIGINT" in record["message"]
    assert record["world"]["tp"] == tp


def test_an_unknown_key_gets_did_you_mean(tmp_path: Path) -> None:
    for override in ("parallelism.tpp=2", "+parallelism.tpp=2"):
        proc = subprocess.run(
            [sys.executable, "-m", "train", override, f"hydra.run.dir={tmp_path}"],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == EXIT_USAGE
        assert proc.stderr.strip() == (
            f"error: parallelism.tpp is not a field of parallelism; did you mean parallelism.tp or "
            f"parallelism.pp? (override '{override}')"
        )
        assert not (tmp_path / RESULT_FILE).exists()
    # A sweep (-m) is checked the same way, before the sweeper expands or plans anything.
    for override in ("parallelism.tpp=1,2", "modle.hidden_size=64,128"):
        proc = subprocess.run(
            [sys.executable, "-m", "train", "-m", override, "hydra/launcher=plan", f"hydra.sweep.dir={tmp_path / 's'}"],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == EXIT_USAGE and "did you mean" in proc.stderr, proc.stderr
        assert proc.stderr.strip().endswith(f"(override '{override}')")
        assert not (tmp_path / "s").exists()


def _train(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "train", *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_help_names_the_app_its_launchers_and_every_exit_status() -> None:
    # It read "__main__ is powered by Hydra." and listed the schema/* groups as if they were options.
    from train import contract

    proc = _train("--help")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "__main__" not in text and text.startswith("python -m train: megasweep's trainer")
    for launcher in ("slurm", "local", "plan"):
        assert f"hydra/launcher={launcher}" in text
    statuses = {name: value for name, value in vars(contract).items() if name.startswith("EXIT_") and isinstance(value, int)}
    said = re.search(r"Exit status \(train.contract\): (.*?)\n\n", text, re.S)
    assert said is not None, text
    # Every status the trainer itself ends with is said (the analysis' and status's 3, and a tool's
    # broken pipe, are theirs).
    for name, value in statuses.items():
        if name not in ("EXIT_UNFINISHED", "EXIT_BROKEN_PIPE"):
            assert re.search(rf"(^|[ ;]){value} ", said.group(1)), (name, said.group(1))
    assert "not options to choose" in text and "model: " in text and "python -m launchers --help" in text


def test_an_unknown_group_option_is_bad_input_with_did_you_mean(tmp_path: Path) -> None:
    # Hydra's own error lists the options but exits 1, the status of a run that failed.
    proc = _train("hardware=a100_80", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == EXIT_USAGE
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: hardware=a100_80 is not a hardware config; did you mean a100_80gb or a100_40gb? ")
    assert "options: a100_40gb, a100_80gb, a100_80gb_jean_zay," in line and line.endswith("(override 'hardware=a100_80')")
    assert not (tmp_path / RESULT_FILE).exists()
    # Each option of a choice sweep, before anything is planned or written.
    proc = _train("-m", "model=tiny,gpt13b", "hydra/launcher=plan", f"hydra.sweep.dir={tmp_path / 's'}")
    assert proc.returncode == EXIT_USAGE and "model=gpt13b is not a model config; did you mean gpt_13b" in proc.stderr
    assert not (tmp_path / "s").exists()
    # Removing a group: Hydra either failed with a traceback (null) or left the schema's bare
    # defaults, a CPU without peaks that no YAML file describes (~hardware).
    for override in ("hardware=null", "~hardware"):
        proc = _train(override, f"hydra.run.dir={tmp_path}")
        assert proc.returncode == EXIT_USAGE, proc.stderr
        assert proc.stderr.startswith("error: a run needs a hardware config: null or ~hardware leaves none; "
                                      "choose one of: a100_40gb,"), proc.stderr
        assert "Traceback" not in proc.stderr and not (tmp_path / RESULT_FILE).exists()


def test_a_group_option_from_the_users_search_path_is_left_to_hydra(tmp_path: Path) -> None:
    # A site's own hardware file, found through hydra.searchpath: conf/ does not have it, Hydra does.
    (tmp_path / "site" / "hardware").mkdir(parents=True)
    (tmp_path / "site" / "hardware" / "my_gpu.yaml").write_text(
        (REPO / "conf" / "hardware" / "a100_80gb.yaml").read_text().replace("name: a100_80gb", "name: my_gpu")
    )
    proc = _train(
        "-m", "hardware=my_gpu", "model=gpt_1.3b", f"hydra.searchpath=[file://{tmp_path / 'site'}]",
        "hydra/launcher=plan", f"hydra.sweep.dir={tmp_path / 's'}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "my_gpu" in (tmp_path / "s" / "plan.csv").read_text()


def test_an_unwritable_run_directory_is_one_paragraph(tmp_path: Path) -> None:
    """A single run's directory is checked before Hydra composes (Hydra's own mkdir failed with a
    chained traceback); for a sweep, launchers.sweepdir checks hydra.sweep.dir."""
    for run_dir in ("/proc/megasweep/run", "/proc/megasweep/${now:%H-%M-%S}"):
        proc = subprocess.run(
            [sys.executable, "-m", "train", f"hydra.run.dir={run_dir}", *TINY_RUN],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == EXIT_USAGE, proc.stderr
        assert proc.stderr.startswith(f"error: hydra.run.dir={run_dir}: cannot write /proc/megasweep"), proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    ok = subprocess.run(
        [sys.executable, "-m", "train", f"hydra.run.dir={tmp_path}/new/run", "training.train_iters=2", "training.warmup_iters=1", *TINY_RUN],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert read_record(tmp_path / "new" / "run" / RESULT_FILE) is not None
    # A command that runs nothing leaves no directory (the check made it, to write a probe file there).
    shown = subprocess.run([sys.executable, "-m", "train", "--cfg", "job", f"hydra.run.dir={tmp_path}/cfg/run"],
                           cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert shown.returncode == 0 and "parallelism:" in shown.stdout, shown.stderr
    assert not (tmp_path / "cfg").exists()


def _refused_data_file(data_path: Path, run_dir: Path, *layout: str) -> str:
    """Train the tiny model on `data_path`: it must exit EXIT_FAILED with no traceback; its one error line."""
    proc = subprocess.run(
        [sys.executable, "-m", "train", f"training.data_path={data_path}", f"hydra.run.dir={run_dir}",
         "training.train_iters=2", "training.warmup_iters=1", *TINY_RUN, *layout],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == EXIT_FAILED and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    # Two workers: rank 0's line, and no second one naming a worker and an exit status 2 (every rank
    # refused the input, and the command exits 1).
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    if layout:
        last = proc.stderr.strip().splitlines()[-1]
        assert last == f"the workers refused their input, as said above (record: {run_dir / RESULT_FILE})", last
    return line


def test_a_token_file_that_cannot_be_read_is_one_line_and_a_record(tmp_path: Path) -> None:
    # A missing file, and a directory given as the file: the user's input, not a crash.
    for data_path, layout in ((tmp_path / "missing.bin", ()), (tmp_path, ("parallelism.dp=2",))):
        run_dir = tmp_path / f"run_{data_path.name}"
        line = _refused_data_file(data_path, run_dir, *layout)
        assert line.startswith(f"error: training.data_path='{data_path}' cannot be read as a token file"), line
        record = read_record(run_dir / RESULT_FILE)
        assert record is not None and record["status"] == "error" and "training.data_path=" in record["message"]


@pytest.mark.parametrize("layout", [(), ("parallelism.dp=2",)], ids=["one-process", "two-workers"])
def test_a_run_whose_loss_turns_nan_is_one_line_and_a_record(tmp_path: Path, layout: tuple[str, ...]) -> None:
    # Training's own outcome, recorded `nan`: Hydra printed a traceback for it, once per config of a sweep
    # (two workers: a traceback from each, then "worker rank N exited with 1").
    proc = subprocess.run(
        [sys.executable, "-m", "train", "training.lr=1e30", "training.grad_clip=0", "training.train_iters=4",
         "training.warmup_iters=1", f"hydra.run.dir={tmp_path / 'run'}", *TINY_RUN, *layout],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == EXIT_FAILED and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("nan: loss or gradient norm became NaN/inf at iteration "), proc.stderr[-2000:]
    assert last.endswith(f"; training stopped (record: {tmp_path / 'run' / RESULT_FILE})"), last
    record = read_record(tmp_path / "run" / RESULT_FILE)
    assert record is not None and record["status"] == "nan"


def test_a_uint32_token_file_read_as_uint16_is_one_line_and_a_record(tmp_path: Path) -> None:
    # Refused as the file is opened, before the first step, like a file that cannot be read.
    path = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(1, 1000, size=4000).astype(np.uint32).tofile(path)
    line = _refused_data_file(path, tmp_path / "run")
    assert line.startswith(f"error: training.data_path='{path}' looks like uint32 token ids"), line
    assert "set training.data_dtype=uint32" in line
    record = read_record(tmp_path / "run" / RESULT_FILE)
    assert record is not None and record["status"] == "error" and record["iterations_run"] == 0


@pytest.mark.parametrize("sweep", [False, True])
def test_a_value_of_the_wrong_type_is_bad_input(sweep: bool, tmp_path: Path) -> None:
    # Hydra fails on it while composing, with exit 1 (a failed run's code) and the field's Python type.
    args = ["-m", "parallelism.tp=1,x", f"hydra.sweep.dir={tmp_path}"] if sweep else ["parallelism.precision=fp8"]
    proc = subprocess.run([sys.executable, "-m", "train", *args, *TINY_RUN], cwd=REPO, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == EXIT_USAGE and "Traceback" not in proc.stderr, proc.stderr
    wanted = "parallelism.tp=x is not a whole number" if sweep else "parallelism.precision=fp8 is not one of bf16, fp16, fp32"
    assert proc.stderr.startswith(f"error: {wanted}"), proc.stderr


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@pytest.mark.parametrize("delay_s", [0.0, 0.3])
def test_ctrl_c_in_start_up_of_a_spawn_is_one_line_and_a_record(tmp_path: Path, delay_s: float) -> None:
    """Ctrl-C once the workers are forked, before the first iteration (rendezvous, model build): the
    record the line names exists, and no worker adds c10d's C++ frames about the interrupted call."""
    run = subprocess.Popen(
        [sys.executable, "-c", AS_FROM_A_TERMINAL, "-m", "train", "parallelism.dp=2", "parallelism.tp=2",
         "training.train_iters=100000", *TINY_RUN, f"hydra.run.dir={tmp_path}"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while len(_children(run.pid)) < 4 and time.monotonic() < deadline and run.poll() is None:
            time.sleep(0.01)
        time.sleep(delay_s)
        os.killpg(run.pid, signal.SIGINT)
        _, stderr = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == EXIT_INTERRUPTED, stderr
    assert stderr.strip() == f"interrupted (record: {tmp_path / RESULT_FILE})", stderr[-3000:]
    record = read_record(tmp_path / RESULT_FILE)
    assert record is not None and record["status"] == "interrupted" and record["world"]["world_size"] == 4


# The KeyboardInterrupt a Ctrl-C raises while W&B starts (train.trainer._wandb, before the trainer's
# own handling of it), raised there: the one moment of a single run's start-up that no record covered.
INTERRUPTED_IN_WANDB_START = (
    "import runpy, sys\n"
    "import train.trainer\n"
    "def stopped(*args, **kwargs):\n"
    "    raise KeyboardInterrupt\n"
    "train.trainer._wandb = stopped\n"
    "sys.argv = ['train', *sys.argv[1:]]\n"
    "runpy.run_module('train', run_name='__main__')\n"
)


def test_ctrl_c_in_start_up_of_a_single_run_is_one_line_and_a_record(tmp_path: Path) -> None:
    # Before, the line named a result.json that did not exist.
    proc = subprocess.run([sys.executable, "-c", INTERRUPTED_IN_WANDB_START, *TINY_RUN, f"hydra.run.dir={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == EXIT_INTERRUPTED, proc.stderr[-3000:]
    assert proc.stderr.strip() == f"interrupted (record: {tmp_path / RESULT_FILE})", proc.stderr[-3000:]
    record = read_record(tmp_path / RESULT_FILE)
    assert record is not None and record["status"] == "interrupted" and record["iterations_run"] == 0


# Ctrl-C after Hydra made the run directory and saved .hydra/ there, before the run wrote anything
# (here: while the rules' advice is read).
INTERRUPTED_BEFORE_THE_RUN = (
    "import runpy, sys\n"
    "import train.planner.rules\n"
    "def stopped(*args, **kwargs):\n"
    "    raise KeyboardInterrupt\n"
    "train.planner.rules.advise = stopped\n"
    "sys.argv = ['train', *sys.argv[1:]]\n"
    "runpy.run_module('train', run_name='__main__')\n"
)


def test_ctrl_c_before_a_single_run_wrote_anything_leaves_no_run_directory(tmp_path: Path) -> None:
    # The directory was left holding only Hydra's .hydra/, which a second run then trained beside.
    run_dir = tmp_path / "outputs" / "run"
    proc = subprocess.run([sys.executable, "-c", INTERRUPTED_BEFORE_THE_RUN, *TINY_RUN, f"hydra.run.dir={run_dir}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == EXIT_INTERRUPTED and proc.stderr.strip() == "interrupted", proc.stderr[-3000:]
    assert not run_dir.exists() and (tmp_path / "outputs").is_dir()  # the user's directory above it stays
    # A directory that holds more than Hydra's (a finished run's record) stays as it is.
    run_dir.mkdir()
    (run_dir / RESULT_FILE).write_text("{}")
    proc = subprocess.run([sys.executable, "-c", INTERRUPTED_BEFORE_THE_RUN, *TINY_RUN, f"hydra.run.dir={run_dir}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == EXIT_INTERRUPTED, proc.stderr[-3000:]
    assert (run_dir / RESULT_FILE).read_text() == "{}" and (run_dir / ".hydra").is_dir()


# A sweep's composition that Ctrl-C stops, and whose cleanup then fails (as OmegaConf's did on a half-copied
# config), under Hydra's own reporting; `failing` is the same error without a Ctrl-C.
REPLACED_INTERRUPT = """
import os, signal, sys, time
from hydra._internal.utils import run_and_report
from train.__main__ import run_interruptibly

def composing():
    try:
        if sys.argv[1] == "ctrl-c":
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)
    finally:
        raise AttributeError("'NoneType' object has no attribute '_invalidate_flags_cache'")

run_interruptibly(lambda: run_and_report(composing))
"""


INTERRUPT_LOST_ON_ITS_WAY = """
import runpy, signal, sys
from train.preemption import note_interrupt

# The entry point's Ctrl-C handler notes the interrupt and raises KeyboardInterrupt; here the raise is
# lost, as when a cleanup on the way out raises another error in its place (an echo into a closed
# stdout). run_interruptibly keeps this handler: SIGINT is not at its default.
signal.signal(signal.SIGINT, lambda signum, frame: note_interrupt())
sys.argv = ["train", *sys.argv[1:]]
runpy.run_module("train", run_name="__main__")
"""
"""`python -c INTERRUPT_LOST_ON_ITS_WAY <args>` runs `python -m train <args>` where Ctrl-C is noted
and raises nothing: what follows a Ctrl-C whose KeyboardInterrupt another error replaced."""


@pytest.mark.parametrize("ctrl_c", [True, False], ids=["ctrl-c", "failing"])
def test_ctrl_c_that_another_error_replaced_on_its_way_out_is_still_interrupted(ctrl_c: bool) -> None:
    # CI, 2026-11-26: Ctrl-C while Hydra's basic sweeper composed 3000 configs ended in OmegaConf's
    # "'NoneType' object has no attribute '_invalidate_flags_cache'", printed by Hydra, exit status 1.
    proc = subprocess.run(
        [sys.executable, "-c", AS_FROM_A_TERMINAL, "-c", REPLACED_INTERRUPT, "ctrl-c" if ctrl_c else "failing"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if ctrl_c:
        assert (proc.returncode, proc.stderr) == (EXIT_INTERRUPTED, "interrupted\n"), proc.stderr[-3000:]
    else:  # no Ctrl-C: Hydra reports the error as before
        assert proc.returncode == 1 and "_invalidate_flags_cache" in proc.stderr, proc.stderr[-3000:]
        assert "interrupted" not in proc.stderr


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("hardware=h100_sxm", "hardware=h100_sxm needs CUDA, and no CUDA device is visible here"),
        # A rule (the dry run refuses it too), said as the rules say it.
        ("parallelism.optimizer=apex", "infeasible config: [apex_needs_cuda] parallelism.optimizer=apex with "
         "hardware.device_type=cpu: apex FusedAdam runs on CUDA devices only"),
        ("training.checkpoint_dir={file}", "training.checkpoint_dir={file} is a file, not a directory"),
        # Under a file: no directory can be made there (it trained save_interval steps, then a traceback).
        ("training.checkpoint_dir={file}/ckpt", "training.checkpoint_dir={file}/ckpt: cannot write there (Not a directory)"),
    ],
)
def test_what_this_machine_cannot_start_is_one_line_before_any_worker(override: str, words: str, tmp_path: Path) -> None:
    # A CPU machine (no CUDA, no apex): each of these was a traceback from setup, on every rank.
    file = tmp_path / "a_file"
    file.write_text("")
    override, words = override.format(file=file), words.format(file=file)
    proc = subprocess.run(
        [sys.executable, "-m", "train", override, "training.save_interval=2", f"hydra.run.dir={tmp_path / 'run'}",
         *TINY_RUN],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == EXIT_USAGE and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {words}"), proc.stderr
    assert not (tmp_path / "run").exists()  # nor Hydra's .hydra/ of a run that never started


@pytest.mark.parametrize(
    ("override", "words"),
    [("training.lr=-1", "training.lr=-1.0: training.lr is the peak learning rate, a finite number above 0"),
     ("training.weight_decay=-0.1", "training.weight_decay=-0.1: training.weight_decay is AdamW's decoupled decay"),
     ("training.save_interval=-2", "training.save_interval=-2: training.save_interval counts iterations"),
     ("training.profile_steps=[0]", "training.profile_steps=[0]: training.profile_steps names iterations to trace, "
                                    "each from 1 (the first) to training.train_iters=")],
)  # fmt: skip
def test_a_training_value_out_of_range_is_refused_before_training(override: str, words: str, tmp_path: Path) -> None:
    # training.lr=-1 was torch.optim's ValueError, a traceback after the model was built (exit 1), as
    # was training.profile_steps=[0]; a negative weight decay or save interval ran silently.
    proc = subprocess.run(
        [sys.executable, "-m", "train", override, f"hydra.run.dir={tmp_path / 'run'}", *TINY_RUN],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == EXIT_USAGE and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: infeasible config: [training_values] " + words)
    assert not (tmp_path / "run").exists()  # nothing ran, and Hydra's .hydra/ went with the run directory


def test_a_launchers_variable_that_is_not_a_number_is_one_line(tmp_path: Path) -> None:
    # WORLD_SIZE=abc was int()'s traceback, exit 1.
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "abc"}
    proc = subprocess.run([sys.executable, "-m", "train", f"hydra.run.dir={tmp_path / 'run'}", *TINY_RUN], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == EXIT_USAGE and proc.stderr.startswith("error: WORLD_SIZE='abc' in the environment")
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


def test_memory_advice_under_a_launcher_keeps_its_world(tmp_path: Path) -> None:
    # Under torchrun or srun the world is the launcher's: the memory rule's fixes take their devices
    # from dp (tp=2 with dp=8 kept would need 16 of the 8 devices).
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8"}
    proc = subprocess.run([sys.executable, "-m", "train", f"hydra.run.dir={tmp_path / 'run'}", "model=gpt_2.7b",
                           "hardware=a100_40gb", "parallelism.precision=bf16", "parallelism.global_batch_size=64"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == EXIT_USAGE, proc.stderr[-2000:]
    assert "parallelism.dp=8," in proc.stderr
    assert "(the world of 8 devices kept, overrides as Hydra takes them): parallelism.tp=4, parallelism.pp=4." in proc.stderr


def test_a_refused_single_run_leaves_no_run_directory(tmp_path: Path) -> None:
    # Hydra makes outputs/<date>/<time>/.hydra before the task runs: a refused run left it, and the
    # directories above it, behind; a directory that holds more than that (a finished run's) stays.
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "train", "parallelism.tp=3", *TINY_RUN], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == EXIT_USAGE and proc.stderr.startswith("error: infeasible config"), proc.stderr
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / RESULT_FILE).write_text("{}")
    proc = subprocess.run([sys.executable, "-m", "train", "parallelism.tp=3", "hydra.run.dir=done", *TINY_RUN],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == EXIT_USAGE and (tmp_path / "done" / RESULT_FILE).read_text() == "{}"
    # Never the directory the user works in, nor the one above it, even when they hold nothing else.
    (tmp_path / "done" / RESULT_FILE).unlink()
    proc = subprocess.run([sys.executable, "-m", "train", "parallelism.tp=3", "hydra.run.dir=.", *TINY_RUN],
                          cwd=tmp_path / "done", env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == EXIT_USAGE and (tmp_path / "done").is_dir()
    proc = subprocess.run([sys.executable, "-m", "train", "parallelism.tp=3", "hydra.run.dir=x/y", *TINY_RUN],
                          cwd=tmp_path / "done", env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    # Its run directory goes; the one above it, which Hydra made, stays (empty): only the default
    # outputs/<date>/ is known to be Hydra's, a directory above a run directory of the user's may be theirs.
    assert proc.returncode == EXIT_USAGE and sorted(p.name for p in (tmp_path / "done").iterdir()) == [".hydra", "x"]
    assert list((tmp_path / "done" / "x").iterdir()) == []


@pytest.mark.parametrize(
    ("override", "words", "code"),
    [("training.data_path={missing}", "error: training.data_path=", EXIT_FAILED),
     # A parent that forks asks no CUDA driver (it would poison the fork), but a torch built without CUDA
     # answers without one: refused before any worker, as a single process is. Left to the workers, rank 1
     # could fail first and the parent end rank 0 before it said why: nothing said, exit 1.
     ("hardware=h100_sxm", "error: hardware=h100_sxm needs CUDA, and no CUDA device is visible here", EXIT_USAGE)],
)  # fmt: skip
def test_what_a_spawns_workers_cannot_use_is_one_line(override: str, words: str, code: int, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "train", override.format(missing=tmp_path / "missing.bin"), "parallelism.dp=2",
         "parallelism.global_batch_size=8", f"hydra.run.dir={tmp_path / 'run'}", "training.train_iters=2",
         "training.warmup_iters=1", *TINY_RUN],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == code and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert sum(line.startswith(words) for line in proc.stderr.splitlines()) == 1, proc.stderr[-3000:]
    if code == EXIT_USAGE:
        assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("plugin", ["hydra/launcher=plan", "hydra/launcher=slurm", "hydra/launcher=local",
                                    "hydra/sweeper=layouts"])
def test_a_launcher_without_minus_m_is_refused_before_anything_trains(plugin: str, tmp_path: Path) -> None:
    # Hydra uses them only for -m: `python -m train hydra/launcher=plan` trained here, silently.
    proc = subprocess.run([sys.executable, "-m", "train", plugin, f"hydra.run.dir={tmp_path / 'run'}", *TINY_RUN],
                          cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == EXIT_USAGE, proc.stderr[-2000:]
    assert proc.stderr.strip() == (f"error: {plugin}: a launcher or sweeper runs a sweep, which -m asks for "
                                   "(python -m train -m ...); without it this one run would train here")  # fmt: skip
    assert not (tmp_path / "run").exists()


def test_hydra_mode_multirun_is_a_sweep_as_minus_m_is(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "train", "hydra.mode=MULTIRUN", "hydra/launcher=plan",
                           f"hydra.sweep.dir={tmp_path / 'plan'}"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "plan" / "plan.csv").exists()


def test_a_relative_calibration_is_recorded_against_the_directory_the_run_started_in(tmp_path: Path) -> None:
    # The analysis predicts each run from its record's config: `hardware.calibration=cal.json` (README's
    # own spelling) was recorded as given, so `python -m analysis` run from any other directory read
    # "cannot be read as a calibration file: No such file" and left every Pred s/it n/a.
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "train", "hardware.calibration=cals/cal.json", "hydra.run.dir=run",
                           "training.train_iters=3", "training.warmup_iters=1", *TINY_RUN],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    record = read_record(tmp_path / "run" / RESULT_FILE)
    assert record is not None and record["config"]["hardware"]["calibration"] == str(tmp_path / "cals" / "cal.json")
