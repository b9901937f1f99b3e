"""One sweep per directory: launching or exporting into a sweep is refused unless appended to,
added configs get new indices, and an unwritable directory is one paragraph, not a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from omegaconf import OmegaConf

from analysis.records import load_sweeps
from launchers.status import sweep_status
from launchers.sweepdir import (
    SweepDirError,
    check_indices_free,
    claim_sweep_dir,
    first_index,
    removed_if_refused,
    sweep_lock,
)
from tests.launchers.test_slurm_launcher import REPO, TINY, array_of, sweep
from tests.train.test_main import AS_FROM_A_TERMINAL
from train.contract import (
    EARLIER_MULTIRUN_FILE,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    LOCK_FILE,
    MULTIRUN_FILE,
    ManifestEntry,
    appended_name,
    read_manifest,
    read_record,
    write_manifest,
)

if TYPE_CHECKING:
    from tests.conftest import SlurmClusterInfo

HOLD = "+hydra.launcher.sbatch_args.hold=''"
"""Nothing runs: only what is queued matters (the jobs are cancelled after)."""
UNWRITABLE = "/sys/megasweep-test/sweep"
"""Not even root may create a directory in sysfs: an unwritable sweep directory on any machine."""


def train_multirun(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "train", "-m", *TINY, *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_claim_refuses_a_sweep_and_appends_after_its_last_index(tmp_path: Path) -> None:
    assert claim_sweep_dir(tmp_path / "new", append=False) == 0
    entries = [ManifestEntry(index=i, overrides=(), output_dir=str(i), status=s) for i, s in ((0, "skipped"), (4, "submitted"))]
    write_manifest(entries, tmp_path / "new" / "manifest.jsonl")
    with pytest.raises(SweepDirError, match="already holds a sweep .* hydra.launcher.append=true: .* from 5 on"):
        claim_sweep_dir(tmp_path / "new", append=False)
    assert first_index(tmp_path / "new", append=True) == 5
    assert read_manifest(tmp_path / "new") == entries
    # A manifest of infeasible configs only lists nothing that ran: added to, its indices stay taken;
    # launched into, it is the launch's to replace, from index 0.
    write_manifest(entries[:1], tmp_path / "new" / "manifest.jsonl")
    assert first_index(tmp_path / "new", append=True) == 1 and read_manifest(tmp_path / "new") == entries[:1]
    # A sweeper's check before Hydra writes there leaves it (that launch may yet be refused); the
    # launcher's own claim, about to write its manifest, removes it.
    assert claim_sweep_dir(tmp_path / "new", append=False) == 0 and (tmp_path / "new" / "manifest.jsonl").exists()
    assert claim_sweep_dir(tmp_path / "new", append=False, replace_skipped=True) == 0
    assert not (tmp_path / "new" / "manifest.jsonl").exists()
    # Beside a dry run's plan.csv the dry run still claims the directory, and the manifest is left as it was.
    write_manifest(entries[:1], tmp_path / "new" / "manifest.jsonl")
    (tmp_path / "new" / "plan.csv").write_text("feasible\n")
    with pytest.raises(SweepDirError, match="already holds a dry run"):
        first_index(tmp_path / "new", append=False, replace_skipped=True)
    assert read_manifest(tmp_path / "new") == entries[:1]
    # Adding to a directory that holds no sweep (a mistyped one, say) is refused: it started a sweep there.
    with pytest.raises(SweepDirError, match=r"hydra.launcher.append=true: .*empty holds no sweep to add these configs to"
                                            r".* leave hydra.launcher.append out to start a sweep there"):  # fmt: skip
        claim_sweep_dir(tmp_path / "empty", append=True)
    with pytest.raises(SweepDirError, match="cannot write there"):
        claim_sweep_dir(UNWRITABLE, append=True)
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SweepDirError, match=r"a_file: cannot write there \(it is a file, not a directory\)"):
        claim_sweep_dir(tmp_path / "a_file", append=False)  # mkdir said "File exists"


def test_a_launch_into_a_sweep_is_refused_unless_appended(slurm_cluster: SlurmClusterInfo, tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    sweep(sweep_dir, "training.lr=1e-4,2e-4", HOLD)
    first = read_manifest(sweep_dir)
    manifest, multirun = (sweep_dir / "manifest.jsonl").read_bytes(), (sweep_dir / "multirun.yaml").read_bytes()
    try:
        again = sweep(sweep_dir, "training.lr=3e-4", HOLD, check=False)
        assert again.returncode != 0 and "already holds a sweep (2 configs" in again.stderr, again.stderr
        assert "hydra.launcher.append=true" in again.stderr and "Traceback" not in again.stderr
        # Refused before anything was written: the old sweep's files are as they were.
        assert (sweep_dir / "manifest.jsonl").read_bytes() == manifest
        assert (sweep_dir / "multirun.yaml").read_bytes() == multirun

        sweep(sweep_dir, "training.lr=3e-4", HOLD, "hydra.launcher.append=true")
        # The first launch's Hydra config stays; the added one's is kept beside it.
        assert (sweep_dir / MULTIRUN_FILE).read_bytes() == multirun
        added_config = OmegaConf.load(sweep_dir / appended_name(MULTIRUN_FILE, 1))
        assert "training.lr=3e-4" in added_config.hydra.overrides.task
        entries = read_manifest(sweep_dir)
        assert entries[:2] == first
        added = entries[2]
        assert (added.index, added.output_dir, added.status) == (2, "2", "submitted")
        lr = next(o for o in added.overrides if o.startswith("training.lr="))
        assert float(lr.split("=", 1)[1]) == 3e-4
    finally:
        subprocess.run(["scancel", *sorted({array_of(e.job_id) for e in read_manifest(sweep_dir) if e.job_id})], timeout=30)


def test_status_and_analysis_do_not_take_an_old_result_for_a_new_configs(
    slurm_cluster: SlurmClusterInfo, tmp_path: Path
) -> None:
    sweep_dir = tmp_path / "sweep"
    # An earlier run in the directory config 0 will get (e.g. its manifest was deleted since).
    old = subprocess.run(
        [sys.executable, "-m", "train", *TINY, "training.train_iters=1", "training.warmup_iters=0",
         "training.lr=1e-4", f"hydra.run.dir={sweep_dir / '0'}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert old.returncode == 0, old.stderr
    record = read_record(sweep_dir / "0" / "result.json")
    assert record is not None and record["status"] == "ok" and "training.lr=1e-4" in record["overrides"]

    sweep(sweep_dir, "training.lr=2e-4", HOLD)
    (entry,) = read_manifest(sweep_dir)
    try:
        assert entry.output_dir == "0"
        (status,) = sweep_status(sweep_dir)
        assert status.state == "pending" and "is another config's" in status.detail, status
        sweeps = load_sweeps([sweep_dir])
        assert list(sweeps.table["outcome"]) == ["pending"]
        assert any("belong to no config of the manifest" in w for w in sweeps.warnings), sweeps.warnings
    finally:
        subprocess.run(["scancel", array_of(entry.job_id)], timeout=30)


@pytest.mark.parametrize("launcher", ["slurm", "local", "plan"])
def test_an_unwritable_sweep_directory_is_one_paragraph(launcher: str) -> None:
    proc = train_multirun("training.lr=1e-4,2e-4", f"hydra/launcher={launcher}", f"hydra.sweep.dir={UNWRITABLE}")
    assert proc.returncode != 0
    assert f"hydra.sweep.dir={UNWRITABLE}: cannot write there" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) <= 3, proc.stderr


def test_an_export_into_a_sweep_needs_append_and_a_new_name(tmp_path: Path) -> None:
    def export(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "launchers", "sbatch", "--out-dir", str(tmp_path / "scripts"), *args],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    sweep_dir = tmp_path / "sweep"
    unwritable = export("--name", "a", "--sweep-dir", UNWRITABLE, "training.lr=1e-4")
    assert unwritable.returncode == EXIT_USAGE and "cannot write there" in unwritable.stderr
    assert not list((tmp_path / "scripts").glob("*")), "nothing half-exported"

    missing = export("--append", "--name", "a", "--sweep-dir", str(sweep_dir), "training.lr=1e-4")
    assert missing.returncode == EXIT_USAGE and "--append: " in missing.stderr and "holds no sweep" in missing.stderr
    assert not sweep_dir.exists() and not list((tmp_path / "scripts").glob("*")), "nothing written"
    assert export("--name", "a", "--sweep-dir", str(sweep_dir), "training.lr=1e-4,2e-4").returncode == 0
    again = export("--name", "b", "--sweep-dir", str(sweep_dir), "training.lr=3e-4")
    assert again.returncode == EXIT_USAGE and "already holds a sweep" in again.stderr and "--append" in again.stderr
    same_name = export("--append", "--name", "a", "--sweep-dir", str(sweep_dir), "training.lr=3e-4")
    assert same_name.returncode == EXIT_USAGE and "a.sbatch exists" in same_name.stderr
    assert [e.index for e in read_manifest(sweep_dir)] == [0, 1]

    added = export("--append", "--name", "b", "--sweep-dir", str(sweep_dir), "training.lr=3e-4")
    assert added.returncode == 0, added.stderr
    entries = read_manifest(sweep_dir)
    assert [(e.index, e.output_dir, e.status) for e in entries] == [
        (0, "0", "exported"), (1, "1", "exported"), (2, "2", "exported")
    ]  # fmt: skip
    # The added script's task runs config 2 into directory 2.
    row = (tmp_path / "scripts" / "b.tasks.tsv").read_text().split("\t")
    assert row[:3] == ["0", "2", "2"]


@pytest.mark.parametrize(
    ("launcher", "sweeper"), [("local", "megasweep"), ("plan", "megasweep"), ("local", "basic"), ("slurm", "basic")]
)
def test_every_launcher_refuses_a_sweep_directory(launcher: str, sweeper: str, tmp_path: Path) -> None:
    # With Hydra's basic sweeper the launcher's own check is the one that answers.
    write_manifest([ManifestEntry(index=0, overrides=(), output_dir="0", status="submitted")], tmp_path / "manifest.jsonl")
    proc = train_multirun(
        "training.lr=1e-4", f"hydra/launcher={launcher}", f"hydra/sweeper={sweeper}", f"hydra.sweep.dir={tmp_path}"
    )
    # Bad input, as a single run's: exit 2 (Hydra's own would be 1, a failed run's), under either sweeper.
    assert proc.returncode == EXIT_USAGE and "already holds a sweep (1 configs" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert [e.index for e in read_manifest(tmp_path)] == [0]


def test_a_launch_whose_every_config_was_infeasible_leaves_the_directory_to_the_next(tmp_path: Path) -> None:
    # Before, its manifest of `skipped` configs claimed the directory, and the launch with the configs
    # fixed was refused: "already holds a sweep". Both launches are refused by the rules here, so Slurm
    # is never asked: the second one's manifest is its own, from index 0.
    first = train_multirun("parallelism.tp=3,5", "hydra/launcher=slurm", f"hydra.sweep.dir={tmp_path}")
    assert first.returncode == EXIT_USAGE and "Nothing was submitted: all 2 configs are infeasible" in first.stderr
    assert "a launch into the same directory replaces it" in first.stderr, first.stderr
    # tp=3 breaks three rules: each rule's line shows its own problem, not the example's three again.
    lines = [x for x in first.stderr.splitlines() if x.startswith("slurm: infeasible [")]
    assert {x.split("]")[0] for x in lines} >= {"slurm: infeasible [heads_divisible_by_tp", "slurm: infeasible [ffn_divisible_by_tp"}
    assert all("problems: (1)" not in x and x.count("does not divide") == 1 for x in lines), lines
    second = train_multirun("parallelism.tp=7", "hydra/launcher=slurm", f"hydra.sweep.dir={tmp_path}")
    assert second.returncode == EXIT_USAGE and "already holds" not in second.stderr, second.stderr
    assert [(e.index, e.overrides[-1], e.status) for e in read_manifest(tmp_path)] == [(0, "parallelism.tp=7", "skipped")]


def test_a_dry_run_directory_is_a_sweep_too(tmp_path: Path) -> None:
    # A launch into a dry run's directory would leave its rows out of the directory's analysis
    # (which reports the launched manifest) and replace its results.md: refused unless appended.
    planned = train_multirun("training.lr=1e-4,2e-4", "hydra/launcher=plan", f"hydra.sweep.dir={tmp_path}")
    assert planned.returncode == 0, planned.stderr
    plan = (tmp_path / "plan.csv").read_bytes()
    with pytest.raises(SweepDirError, match=r"already holds a dry run \(plan.csv\).*hydra.launcher.append=true"):
        claim_sweep_dir(tmp_path, append=False)
    assert first_index(tmp_path, append=True) == 0
    for launcher in ("local", "plan"):
        proc = train_multirun("training.lr=3e-4", f"hydra/launcher={launcher}", f"hydra.sweep.dir={tmp_path}")
        assert proc.returncode != 0 and "already holds a dry run" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and not (tmp_path / "manifest.jsonl").exists()
    assert (tmp_path / "plan.csv").read_bytes() == plan


def test_adding_to_a_sweep_keeps_each_launchs_hydra_config(tmp_path: Path) -> None:
    # Hydra's sweeper saves each launch's config as multirun.yaml: the configs added were composed
    # from theirs, the earlier ones from the first's, and the analysis recomposes skipped configs
    # from multirun.yaml. It used to hold the last launch's alone.
    def plan(*args: str) -> subprocess.CompletedProcess[str]:
        return train_multirun("hydra/launcher=plan", f"hydra.sweep.dir={tmp_path}", *args)

    assert plan("training.lr=1e-4").returncode == 0
    first = (tmp_path / MULTIRUN_FILE).read_bytes()
    for number, lr in ((1, "2e-4"), (2, "3e-4")):
        added = plan(f"training.lr={lr}", "hydra.launcher.append=true")
        assert added.returncode == 0, added.stderr
        assert (tmp_path / MULTIRUN_FILE).read_bytes() == first
        kept = OmegaConf.load(tmp_path / appended_name(MULTIRUN_FILE, number))
        assert f"training.lr={lr}" in kept.hydra.overrides.task and "hydra.launcher.append=true" in kept.hydra.overrides.hydra
    assert "training.lr=1e-4" in OmegaConf.load(tmp_path / MULTIRUN_FILE).hydra.overrides.task
    # Refused before anything was planned: no config of it is kept, and the first stays.
    refused = plan("training.lrr=5e-4", "hydra.launcher.append=true")
    assert refused.returncode == EXIT_USAGE and "training.lrr" in refused.stderr, refused.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        appended_name(MULTIRUN_FILE, 1), appended_name(MULTIRUN_FILE, 2), MULTIRUN_FILE, "plan.csv"
    ]  # fmt: skip
    assert (tmp_path / MULTIRUN_FILE).read_bytes() == first
    assert len((tmp_path / "plan.csv").read_text().splitlines()) == 4  # header and the three configs


def test_hydras_basic_sweeper_keeps_the_sweeps_config_too(tmp_path: Path) -> None:
    # Hydra's basic sweeper saves multirun.yaml before the launcher runs, so only the launcher can
    # keep the sweep's: refused, it used to leave the refused launch's config, appended the added one's.
    def launch(*args: str) -> subprocess.CompletedProcess[str]:
        return train_multirun("hydra/sweeper=basic", f"hydra.sweep.dir={tmp_path}", *args)

    assert launch("hydra/launcher=plan", "training.lr=1e-4").returncode == 0
    first = (tmp_path / MULTIRUN_FILE).read_bytes()
    refused = launch("hydra/launcher=plan", "training.lr=3e-4")
    assert refused.returncode == EXIT_USAGE and "already holds a dry run" in refused.stderr, refused.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [MULTIRUN_FILE, "plan.csv"]
    assert (tmp_path / MULTIRUN_FILE).read_bytes() == first

    added = launch("hydra/launcher=plan", "training.lr=2e-4", "hydra.launcher.append=true")
    assert added.returncode == 0, added.stderr
    assert (tmp_path / MULTIRUN_FILE).read_bytes() == first
    assert "training.lr=2e-4" in OmegaConf.load(tmp_path / appended_name(MULTIRUN_FILE, 1)).hydra.overrides.task
    # Launched but failed (every config infeasible, listed in the manifest): its config is kept too.
    failed = launch("hydra/launcher=local", "training.train_iters=-5", "hydra.launcher.append=true")
    assert failed.returncode != 0 and "infeasible" in failed.stderr, failed.stderr
    assert [e.status for e in read_manifest(tmp_path)] == ["skipped"]
    assert "training.train_iters=-5" in OmegaConf.load(tmp_path / appended_name(MULTIRUN_FILE, 2)).hydra.overrides.task
    assert (tmp_path / MULTIRUN_FILE).read_bytes() == first
    assert not (tmp_path / EARLIER_MULTIRUN_FILE).exists()


def test_a_launch_stopped_before_its_launcher_ran_loses_no_config(tmp_path: Path) -> None:
    # Hydra's basic sweeper composes each config in full (~50 ms each) after it saved multirun.yaml
    # and before the launcher runs: a launch stopped meanwhile must not leave its own config there.
    assert train_multirun("hydra/launcher=plan", f"hydra.sweep.dir={tmp_path}").returncode == 0
    first = (tmp_path / MULTIRUN_FILE).read_bytes()

    def stopped(signum: int) -> subprocess.CompletedProcess[str]:
        args = ["hydra/sweeper=basic", "hydra/launcher=plan", "training.seed=range(0,3000)", "hydra.launcher.append=true"]
        # Started as a terminal starts a foreground command: from a background job (SIGINT ignored,
        # inherited) the SIGINT below would be lost and the sweeper would check all 3000 configs.
        proc = subprocess.Popen(
            [sys.executable, "-c", AS_FROM_A_TERMINAL, "-m", "train", "-m", *TINY, *args, f"hydra.sweep.dir={tmp_path}"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        # Signalled once the sweeper has saved its config, while it checks the 3000 configs.
        while (tmp_path / MULTIRUN_FILE).read_bytes() == first and proc.poll() is None:
            time.sleep(0.1)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=120)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    # Ctrl-C: the launcher puts the sweep's config back as the process exits.
    interrupted = stopped(signal.SIGINT)
    assert interrupted.returncode == EXIT_INTERRUPTED, interrupted.stderr
    assert interrupted.stderr.splitlines()[-1:] == ["interrupted"], interrupted.stderr
    assert (tmp_path / MULTIRUN_FILE).read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == [MULTIRUN_FILE, "plan.csv"]
    # Killed: no code of it runs, but the copy the launcher made first stays, and the next launch puts it back.
    killed = stopped(signal.SIGTERM)
    assert killed.returncode == -signal.SIGTERM
    assert (tmp_path / EARLIER_MULTIRUN_FILE).read_bytes() == first
    refused = train_multirun("hydra/sweeper=basic", "hydra/launcher=plan", f"hydra.sweep.dir={tmp_path}")
    assert refused.returncode == EXIT_USAGE and "already holds a dry run" in refused.stderr, refused.stderr
    assert (tmp_path / MULTIRUN_FILE).read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == [MULTIRUN_FILE, "plan.csv"]


def test_directories_a_refused_command_made_go_again(tmp_path: Path) -> None:
    there = tmp_path / "there"
    there.mkdir()
    (there / "keep").write_text("x")
    with pytest.raises(SweepDirError), removed_if_refused(tmp_path / "a" / "b" / "c", there, tmp_path / "a" / "d"):
        for made in (tmp_path / "a" / "b" / "c", tmp_path / "a" / "d"):
            made.mkdir(parents=True)
        raise SweepDirError("refused")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["there"] and (there / "keep").read_text() == "x"
    # A directory something was written into meanwhile is not empty: it stays, with its file.
    with pytest.raises(SweepDirError), removed_if_refused(tmp_path / "e" / "f"):
        (tmp_path / "e" / "f").mkdir(parents=True)
        (tmp_path / "e" / "note").write_text("y")
        raise SweepDirError("refused")
    assert not (tmp_path / "e" / "f").exists() and (tmp_path / "e" / "note").read_text() == "y"
    with removed_if_refused(tmp_path / "g"):
        (tmp_path / "g").mkdir()
    assert (tmp_path / "g").is_dir()


HOLD_LOCK = """
import sys
from pathlib import Path
from launchers.sweepdir import sweep_lock
from train.contract import ManifestEntry, read_manifest, write_manifest

sweep = Path(sys.argv[1])
with sweep_lock(sweep):
    print("held", flush=True)
    sys.stdin.readline()
    if sys.argv[2:] != ["add"]:
        sys.exit()
    # What a launch holding the lock does: lists its configs at the next free index, then lets go.
    entries = read_manifest(sweep)
    index = max(e.index for e in entries) + 1
    write_manifest([*entries, ManifestEntry(index=index, overrides=("training.lr=0.9",), output_dir=str(index),
                                            status="skipped", reason="held")], sweep / "manifest.jsonl")
"""


def hold_lock(sweep_dir: Path, *args: str) -> subprocess.Popen[str]:
    """A process holding the sweep's lock (HOLD_LOCK) until let_go."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(sweep_dir), *args], cwd=REPO, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def let_go(holder: subprocess.Popen[str]) -> None:
    assert holder.stdin is not None
    holder.stdin.write("go\n")
    holder.stdin.flush()
    assert holder.wait(timeout=60) == 0


def command_text(proc: subprocess.Popen[str]) -> str:
    return " ".join(map(str, proc.args)) if isinstance(proc.args, list) else str(proc.args)


def waiting_for(
    holder: subprocess.Popen[str], tmp_path: Path, *commands: list[str]
) -> list[tuple[subprocess.Popen[str], Path]]:
    """Each command started, once each has said it waits for `holder`: (its process, its stderr file)."""
    started = []
    for n, command in enumerate(commands):
        err = tmp_path / f"waiting{n}.err"
        with err.open("w") as f:
            started.append((subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=f, text=True), err))
    deadline = time.monotonic() + 60
    for proc, err in started:
        while "waiting for another launch" not in err.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, f"{command_text(proc)} did not wait for the lock: {err.read_text()}"
        assert f"pid {holder.pid}" in err.read_text(), err.read_text()
    return started


def test_an_export_added_while_another_launch_holds_the_sweep_waits_and_takes_the_next_indices(tmp_path: Path) -> None:
    # A real second process holds the sweep's lock (as a launch does from claiming its indices until
    # the manifest lists them); the export added meanwhile must wait, say for whom, and then number
    # its configs after the ones the holder listed, instead of taking the same index.
    sweep_dir, scripts = tmp_path / "sweep", tmp_path / "scripts"
    export = [sys.executable, "-m", "launchers", "sbatch", "--out-dir", str(scripts), "--sweep-dir", str(sweep_dir)]
    first = subprocess.run([*export, "--name", "a", "training.lr=0.1,0.2"], cwd=REPO, capture_output=True,
                           text=True, timeout=120)  # fmt: skip
    assert first.returncode == 0, first.stderr
    holder = hold_lock(sweep_dir, "add")
    try:
        [(added, err)] = waiting_for(holder, tmp_path, [*export, "--append", "--name", "b", "training.lr=0.3"])
        let_go(holder)
        assert added.wait(timeout=120) == 0, err.read_text()
        assert "its lock is free; going on" in err.read_text()
    finally:
        holder.kill()
    entries = read_manifest(sweep_dir)
    assert [(e.index, e.overrides, e.status) for e in entries] == [
        (0, ("training.lr=0.1",), "exported"), (1, ("training.lr=0.2",), "exported"),
        (2, ("training.lr=0.9",), "skipped"), (3, ("training.lr=0.3",), "exported"),
    ]  # fmt: skip
    assert (scripts / "b.tasks.tsv").read_text().split("\t")[:3] == ["0", "3", "3"]


def test_the_lock_is_taken_again_inside_its_block_and_a_refused_block_leaves_no_directory(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "new" / "sweep"
    with pytest.raises(SweepDirError), sweep_lock(sweep_dir):
        assert (sweep_dir / LOCK_FILE).is_file()
        with sweep_lock(sweep_dir / ".." / "sweep"):  # the same directory, spelled otherwise: no wait
            pass
        raise SweepDirError("refused")
    assert not (tmp_path / "new").exists()
    with sweep_lock(sweep_dir):
        # Its holder is named for a process that waits, and no longer once it has let go.
        assert f"pid {os.getpid()}" in (sweep_dir / LOCK_FILE).read_text()
    assert (sweep_dir / LOCK_FILE).read_text() == ""


def test_indices_another_launch_took_between_two_batches_are_refused(tmp_path: Path) -> None:
    def entry(i: int) -> ManifestEntry:
        return ManifestEntry(index=i, overrides=(), output_dir=str(i), status="skipped")

    check_indices_free([entry(0), entry(1)], [entry(2), entry(3)], tmp_path)
    with pytest.raises(SweepDirError, match=r"indices 3 of this launch's configs were taken by another launch meanwhile"):
        check_indices_free([entry(0), entry(3)], [entry(2), entry(3)], tmp_path)


def test_two_reruns_at_once_resubmit_a_failed_config_one_after_the_other(tmp_path: Path) -> None:
    # Both wait for a held lock, then run one after the other: the second finds the failed config rerun
    # already (listed by the first, whose run, by an interpreter that fails after 5 s, is still going)
    # and queues nothing.
    sweep_dir, slow = tmp_path / "sweep", tmp_path / "slow-python"
    slow.write_text("#!/bin/sh\nsleep 5\nexit 1\n")
    slow.chmod(0o755)
    failed = train_multirun(f"hydra.launcher.python={slow}", "hydra/launcher=local", f"hydra.sweep.dir={sweep_dir}")
    assert failed.returncode != 0 and [s.state for s in sweep_status(sweep_dir, slurm_states={})] == ["failed"]
    holder = hold_lock(sweep_dir)
    try:
        rerun = [sys.executable, "-m", "launchers", "rerun", str(sweep_dir), "--failed", "training.lr=0.001"]
        reruns = waiting_for(holder, tmp_path, rerun, rerun)
        let_go(holder)
        codes = []
        for proc, err in reruns:
            codes.append(proc.wait(timeout=120))
            assert "Traceback" not in err.read_text(), err.read_text()
    finally:
        holder.kill()
    entries = read_manifest(sweep_dir)
    assert [(e.index, e.rerun_of) for e in entries] == [(0, None), (1, 0)]  # config 0 rerun once, not twice
    # The first's run failed again (exit 1); the second found nothing left to rerun (exit 0).
    assert sorted(codes) == [0, EXIT_FAILED], codes


def test_ctrl_c_of_an_export_waiting_for_the_lock_ends_it_without_a_traceback(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    holder = hold_lock(sweep_dir)
    try:
        # With Ctrl-C's default meaning: a test run from a background job inherits SIGINT ignored.
        export = [sys.executable, "-c", AS_FROM_A_TERMINAL, "-m", "launchers", "sbatch", "--out-dir",
                  str(tmp_path / "scripts"), "--sweep-dir", str(sweep_dir), "--name", "a", "training.lr=0.1"]  # fmt: skip
        [(proc, err)] = waiting_for(holder, tmp_path, export)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == EXIT_INTERRUPTED, err.read_text()
        assert "interrupted before the export finished" in err.read_text() and "Traceback" not in err.read_text()
        let_go(holder)
    finally:
        holder.kill()
    assert not (sweep_dir / "manifest.jsonl").exists() and not (tmp_path / "scripts").exists()


def test_two_launches_added_at_once_each_keep_their_own_hydra_config(tmp_path: Path) -> None:
    # Each added launch reads the sweep's multirun.yaml when Hydra sets its launcher up, and Hydra then
    # saves the launch's own over it: two at once used to read and keep each other's (the first to claim
    # kept the second's config under its number; the second's was lost). Now an added launch waits for
    # the sweep's lock before it reads, and the file is the sweep's until each has kept its own.
    sweep_dir = tmp_path / "sweep"
    local = ("hydra/launcher=local", f"hydra.sweep.dir={sweep_dir}")
    first = train_multirun(*local, "training.lr=0.001")
    assert first.returncode == 0, first.stderr
    sweeps_own = (sweep_dir / MULTIRUN_FILE).read_bytes()
    add = [sys.executable, "-m", "train", "-m", *TINY, *local, "hydra.launcher.append=true"]
    holder = hold_lock(sweep_dir)
    try:
        started = waiting_for(holder, tmp_path, [*add, "training.lr=0.002"], [*add, "training.lr=0.003"])
        # Waiting, neither has kept a config yet (each used to keep what multirun.yaml held by then, unlocked).
        assert (sweep_dir / MULTIRUN_FILE).read_bytes() == sweeps_own
        assert not list(sweep_dir.glob(appended_name(MULTIRUN_FILE, "*")))
        let_go(holder)
        for proc, err in started:
            assert proc.wait(timeout=120) == 0, err.read_text()
    finally:
        holder.kill()
    assert (sweep_dir / MULTIRUN_FILE).read_bytes() == sweeps_own
    kept = {
        o for n in (1, 2) for o in OmegaConf.load(sweep_dir / appended_name(MULTIRUN_FILE, n)).hydra.overrides.task
        if o.startswith("training.lr=")
    }
    assert kept == {"training.lr=0.002", "training.lr=0.003"}
    entries = read_manifest(sweep_dir)
    assert sorted(e.overrides[-1] for e in entries if e.overrides[-1].startswith("training.lr=")) == [
        "training.lr=0.001", "training.lr=0.002", "training.lr=0.003"
    ]  # fmt: skip
    assert [e.index for e in entries] == [0, 1, 2]
