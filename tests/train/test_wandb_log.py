"""train.wandb_log against a real wandb client: a W&B failure moves the run to offline, with its
history, and one warning line with the `wandb sync` command; nothing is mocked.

There is no W&B server here: an online run is pointed at a closed port on 127.0.0.1, where the
connection is refused for real (only loopback is ever contacted). A failure in the middle of a
run is wandb's own service process dying (killed by its pid, a process this test started).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.wandb_io import find_offline_run_files, read_offline_run
from tests.train.test_trainer import REPO, SMALL, compose_run
from train.wandb_log import WandbLogger

SYNC_HINT = re.compile(r"upload it later with: wandb sync (\S+)$")


def _wandb_env(root: Path) -> dict[str, str]:
    """Isolated wandb caches and settings, no error reporting: nothing leaves this machine."""
    env = {"WANDB_SILENT": "true", "WANDB_ERROR_REPORTING": "false"}
    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        env[name] = str(root / name.lower())
    return env


def _closed_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _warning_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("warning: wandb")]


def test_online_init_failure_falls_back_to_offline_with_a_sync_hint(tmp_path: Path) -> None:
    # A real `python -m train` with logger=online and an unreachable server; the API key is a dummy.
    port = _closed_loopback_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(_wandb_env(tmp_path), WANDB_BASE_URL=f"http://127.0.0.1:{port}", WANDB_API_KEY="0" * 40)
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "train", *SMALL, "logger=online", "logger.wandb_init_timeout_s=2",
         f"hydra.run.dir={out}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    record = json.loads((out / "result.json").read_text())
    assert record["status"] == "ok"

    # One warning line: the error (the refused connection to the port) and the exact command.
    (line,) = _warning_lines(proc.stderr)
    assert line.startswith("warning: wandb init failed (online): ") and f"127.0.0.1:{port}" in line, line
    hint = SYNC_HINT.search(line)
    assert hint is not None, line
    offline_dir = Path(hint.group(1))
    assert offline_dir.parent == out / "wandb" and offline_dir.name.startswith("offline-run-")
    assert line.removeprefix("warning: ") in record["warnings"]

    # The offline run holds the whole history and the summary; the failed attempt left no stub behind.
    [(run_file, _)] = find_offline_run_files([out])
    assert run_file.parent == offline_dir
    run = read_offline_run(run_file, root=out)
    assert run.state == "finished" and run.config["logger"]["wandb_mode"] == "online"
    assert [h["_step"] for h in run.history] == [1, 2, 3]
    assert [h["lm_loss"] for h in run.history] == pytest.approx(record["losses"])
    assert run.summary["sec_per_iter"] == pytest.approx(record["sec_per_iter"])


def _wandb_services() -> list[int]:
    """Pids of this process's wandb-core children (wandb starts one service per process)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name, rest = text[text.index("(") + 1: text.rindex(")")], text[text.rindex(")") + 2:].split()
        if name == "wandb-core" and int(rest[1]) == os.getpid():
            pids.append(int(stat.parent.name))
    return pids


def test_a_failure_mid_run_moves_the_run_to_a_new_offline_run_with_its_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    for name, value in _wandb_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    logger = WandbLogger(compose_run("logger=offline").logger, config={"answer": 42}, output_dir=out, name="mid")
    assert logger.enabled
    first_dir = Path(logger.run.settings.sync_dir)
    logger.log({"lm_loss": 3.0}, step=1)
    logger.log({"lm_loss": 2.5}, step=2)
    services = _wandb_services()
    assert services, "wandb started no service process"
    for pid in services:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)

    logger.log({"lm_loss": 2.0}, step=3)  # wandb's service is gone: this call fails for real
    logger.log({"lm_loss": 1.5}, step=4)
    logger.summary({"sec_per_iter": 0.25, "mfu": None})
    logger.finish()

    said = capfd.readouterr()
    (line,) = _warning_lines(said.err)
    assert line.startswith("warning: wandb log failed (offline): "), line
    hint = SYNC_HINT.search(line)
    assert hint is not None and Path(hint.group(1)) == logger.offline_dir != first_dir
    # The sync command once, in the warning (finish printed it a second time).
    assert (said.out + said.err).count("wandb sync ") == 1, said
    assert logger.error == line.removeprefix("warning: ")
    # One run on disk for the job: the broken one's directory is gone, the new one has it all.
    assert not first_dir.exists()
    [(run_file, _)] = find_offline_run_files([out])
    assert run_file.parent == logger.offline_dir
    run = read_offline_run(run_file, root=out)
    assert run.state == "finished" and run.name == "mid" and run.config["answer"] == 42
    assert [(h["_step"], h["lm_loss"]) for h in run.history] == [(1, 3.0), (2, 2.5), (3, 2.0), (4, 1.5)]
    assert run.summary["sec_per_iter"] == 0.25 and "mfu" not in run.summary


def _one_offline_row(tmp_path: Path, out: Path) -> WandbLogger:
    """A logger=offline run into `out` (isolated wandb directories) that logs one row and finishes."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in _wandb_env(tmp_path).items():
            mp.setenv(name, value)
        mp.setenv("WANDB_MODE", "offline")
        logger = WandbLogger(compose_run("logger=offline").logger, config={}, output_dir=out)
        logger.log({"lm_loss": 1.0}, step=1)
        logger.finish()
    return logger


def test_offline_that_fails_too_switches_wandb_off_once(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # The offline run cannot be written: its directory is a file. Offline init fails for real,
    # and there is nothing left to fall back to.
    out = tmp_path / "run"
    out.mkdir()
    (out / "wandb").write_text("not a directory")
    logger = _one_offline_row(tmp_path, out)
    assert not logger.enabled and logger.offline_dir is None
    (line,) = _warning_lines(capfd.readouterr().err)
    assert line.startswith("warning: wandb init failed (offline): ")
    assert line.endswith("W&B logging is off for the rest of this run")


def test_an_offline_run_says_where_it_is_and_how_to_upload_it(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # wandb's own closing hint is quiet (quiet=True keeps its lines off Slurm's log): the run says it once.
    out = tmp_path / "run"
    _one_offline_row(tmp_path, out)
    [line] = [x for x in capfd.readouterr().out.splitlines() if x.startswith("W&B: offline run in ")]
    local = Path(line.split("wandb sync ", 1)[1])
    assert local.parent == out / "wandb" and local.name.startswith("offline-run-") and local.is_dir(), line


def test_an_auto_micro_batch_is_the_size_chosen_in_the_wandb_run(tmp_path: Path) -> None:
    # micro_batch_size=auto is sized once the run has started: its W&B run kept "auto" (config and name),
    # and an analysis of W&B runs found no layout for it.
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "train", *(o for o in SMALL if not o.startswith(("logger=", "parallelism.micro"))),
         "logger=offline", "parallelism.micro_batch_size=auto", f"hydra.run.dir={out}"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, **_wandb_env(tmp_path)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    mbs = json.loads((out / "result.json").read_text())["config"]["parallelism"]["micro_batch_size"]
    assert isinstance(mbs, int)
    [(run_file, root)] = find_offline_run_files([out])
    run = read_offline_run(run_file, root=root)
    assert run.config["parallelism"]["micro_batch_size"] == mbs, run.config
    assert run.name is not None and run.name.endswith(f"-mbs{mbs}-gbs4"), run.name
