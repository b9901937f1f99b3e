"""conf.overrides: what every entry point says of an override the schema cannot take, before Hydra
composes it; and `python -m launchers` saying it for its own commands as `python -m train` does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conf.overrides import override_problem
from train.contract import EXIT_USAGE

REPO = Path(__file__).resolve().parents[2]


def test_a_misspelt_key_an_unknown_option_and_a_wrong_value_each_get_one_line() -> None:
    assert override_problem(["parallelism.tp=2", "model=tiny", "hardware=h100_sxm"]) is None
    key = override_problem(["parallelism.tpp=2"])
    assert key is not None and "did you mean parallelism.tp" in key and key.endswith("(override 'parallelism.tpp=2')")
    option = override_problem(["hardware=h100"])
    assert option is not None and option.startswith("hardware=h100 is not a hardware config; did you mean")
    assert "h100_sxm" in option and "options: a100_40gb" in option
    # Each value of a choice sweep is checked.
    value = override_problem(["parallelism.tp=1,two"])
    assert value == "parallelism.tp=two is not a whole number (override 'parallelism.tp=1,two')"
    assert override_problem(["~hardware"]) is not None and "a run needs a hardware config" in str(override_problem(["~hardware"]))
    # Options a search path or --config-dir may add are not judged without own_options; keys still are.
    assert override_problem(["parallelism=l_dp2"], own_options=False) is None
    assert override_problem(["parallelism.tpp=2"], own_options=False) is not None
    # Hydra's other keys and group paths are left to Hydra.
    assert override_problem(["hydra.run.dir=x", "hydra/job_logging=stdout", "+hydra.job.env_set.A=1"]) is None
    # A section given one value, a field deleted, a whole number Hydra read as a float: Hydra refused each
    # while merging, exit 1 and its hint of a stack trace.
    section = override_problem(["training=foo"])
    assert section == ("training=foo: training is a section of settings, not one value (nor a group of config "
                       "files); set its fields, e.g. training.train_iters=... (override 'training=foo')")  # fmt: skip
    # A list field given one value that is no item either: its advice was search.nodes=[abc].
    assert override_problem(["search.nodes=abc"]) == (
        "search.nodes=abc is not a list, and abc is not a whole number: write its items in brackets (search.nodes=[...]) "
        "(override 'search.nodes=abc')")  # fmt: skip
    assert override_problem(["training={lr:1e-4,seed:3}"]) is None  # merged into the section, as Hydra does
    deleted = override_problem(["~training.lr"])
    assert deleted == "~training.lr: a field of the schema cannot be deleted; set it instead (training.lr=...) (override '~training.lr')"
    assert override_problem(["training.seed=1e3"]) == (
        "training.seed=1000.0 is not a whole number written in digits (a float such as 1e3 is refused: write 1000) "
        "(override 'training.seed=1e3')")  # fmt: skip


def test_the_launcher_and_sweeper_keys_and_bad_syntax_get_one_line() -> None:
    # Hydra says each of these with exit status 1 (a failed run), and its message for a misspelt field
    # suggests adding it with '+', which the launcher's structured config then rejects.
    assert override_problem(["hydra/launcher=slurm", "hydra.launcher.append=true", "hydra/sweeper=layouts"]) is None
    assert override_problem(["+hydra.launcher.sbatch_args.exclusive=", "hydra/launcher=slurm"]) is None
    launcher = override_problem(["hydra/launcher=slurmm"])
    assert launcher is not None and launcher.startswith("hydra/launcher=slurmm is not a hydra/launcher config; did you mean slurm?")
    assert "options: basic, local, plan, slurm" in launcher  # Hydra's own option and megasweep's
    sweeper = override_problem(["hydra/sweeper=layout"])
    assert sweeper is not None and "did you mean layouts?" in sweeper
    # A field is judged against the launcher chosen on the command line, wherever it stands ...
    field = override_problem(["hydra.launcher.apend=true", "hydra/launcher=plan"])
    assert field == ("hydra.launcher.apend is not a field of hydra/launcher=plan; did you mean hydra.launcher.append? "
                     "(override 'hydra.launcher.apend=true')")  # fmt: skip
    # ... or against conf/config.yaml's choice (Hydra's basic launcher, which has no fields: the
    # message names the launchers that have one like it).
    basic = override_problem(["hydra.launcher.append=true"])
    assert basic is not None and basic.startswith("hydra.launcher.append is not a field of hydra/launcher=basic")
    assert "hydra/launcher=local, plan or slurm has a field like it" in basic
    sweeper_field = override_problem(["hydra.sweeper.max_batch=8"])
    assert sweeper_field is not None and "hydra/sweeper=megasweep; did you mean hydra.sweeper.max_batch_size?" in sweeper_field
    # With a search path another primary config's or YAML file's choice may hold: only what is named.
    assert override_problem(["hydra.sweeper.max_batch=8"], own_options=False) is None
    assert override_problem(["hydra/launcher=mine"], own_options=False) is None
    # A field's value is judged against its type there too (Hydra: "Error merging override", exit 1).
    top = override_problem(["hydra/launcher=plan", "hydra.launcher.top=abc"])
    assert top == "hydra.launcher.top=abc is not a whole number (override 'hydra.launcher.top=abc')"
    wait = override_problem(["hydra/launcher=slurm", "hydra.launcher.wait=maybe"])
    assert wait is not None and wait.startswith("hydra.launcher.wait=maybe is not true or false")
    assert override_problem(["hydra/launcher=plan", "hydra.launcher.top=null", "hydra.launcher.table=false"]) is None
    # A key of a mapping field, which Hydra refuses unless added (OmegaConf's "not in struct", exit 1) ...
    mapped = override_problem(["hydra/launcher=slurm", "hydra.launcher.sbatch_args.comment=x"])
    assert mapped == ("hydra.launcher.sbatch_args is a mapping of your own keys, which Hydra sets only with '++' "
                      "(or adds with '+'): ++hydra.launcher.sbatch_args.comment=x "
                      "(override 'hydra.launcher.sbatch_args.comment=x')")  # fmt: skip
    assert override_problem(["hydra/launcher=slurm", "+hydra.launcher.sbatch_args.comment=x"]) is None
    assert override_problem(["hydra/launcher=slurm", "++hydra.launcher.sbatch_args.comment=x"]) is None
    # A --config-dir of the user's may set the key: Hydra's to take, not refused here.
    assert override_problem(["hydra/launcher=slurm", "hydra.launcher.sbatch_args.comment=x"], own_options=False) is None
    # ... and a field the launcher lacks, added: its constructor's TypeError, exit 1.
    lacking = override_problem(["hydra/launcher=plan", "+hydra.launcher.sbatch_args.comment=x"])
    assert lacking is not None and lacking.startswith("hydra.launcher.sbatch_args is not a field of hydra/launcher=plan")
    # A list field given a bare value, or an item of the wrong type, ended in Hydra's six-line merge
    # error (exit 1); and the natural `search.nodes=1,2,4` was refused as "lists several values" alone.
    assert override_problem(["search.nodes=4"]) == (
        "search.nodes=4 is not a list: write it in brackets, e.g. search.nodes=[4] (override 'search.nodes=4')")
    item = override_problem(["search.recompute=[full,bogus]"])
    assert item is not None and "its item bogus is not one of none, selective, full" in item
    assert override_problem(["search.nodes=1,2,4"]) == (
        "search.nodes=1,2,4 gives search.nodes several values, but it is one list: write it in brackets, "
        "search.nodes=[1,2,4]")
    assert override_problem(["search.nodes=[1,2,4]", "search.recompute=[full]", "search.sequence_parallel=[true]"]) is None
    syntax = override_problem(["model=tiny", "training.lr=["])
    assert syntax is not None and syntax.startswith("cannot parse override 'training.lr=[': no viable alternative")
    assert "override_grammar" in syntax and "\n" not in syntax
    # Hydra's reason for a key without '=' spans three lines: one, as every refusal.
    bare = override_problem(["training"])
    assert bare is not None and "\n" not in bare and "missing EQUAL" in bare and "override_grammar" in bare


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("hydra/launcher=slurmm", "did you mean slurm?"),
        ("hydra.launcher.apend=true", "hydra/launcher=local, plan or slurm has a field like it"),
        ("training.lr=[", "cannot parse override 'training.lr=['"),
        ("hydra/launcher=plan hydra.launcher.top=abc", "hydra.launcher.top=abc is not a whole number"),
    ],
)
def test_python_m_train_refuses_them_in_one_line_with_exit_2(override: str, words: str, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "train", "-m", *override.split(), f"hydra.sweep.dir={tmp_path / 's'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert proc.stderr.startswith("error: ") and words in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    ("command", "words"),
    [
        (["rerun", "--failed", "/nonexistent", "parallelism.tpp=2"], "did you mean parallelism.tp"),
        (["rerun", "--failed", "/nonexistent", "parallelism.tp=two"], "parallelism.tp=two is not a whole number"),
        (["sbatch", "hardware=h100", "--name", "x"], "hardware=h100 is not a hardware config; did you mean"),
        (["calibrate", "hardware=h100", "--out", "/nonexistent/cal.json"], "is not a hardware config"),
    ],
)
def test_the_launchers_commands_refuse_them_in_one_line_with_exit_2(command: list[str], words: str) -> None:
    # Before: `rerun ... parallelism.tp=two` printed "error: Error merging override parallelism.tp=two"
    # without the reason, and `sbatch hardware=h100` Hydra's list of options without the close ones.
    proc = subprocess.run([sys.executable, "-m", "launchers", *command], cwd=REPO, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert proc.stderr.startswith("error: ") and words in proc.stderr and len(proc.stderr.splitlines()) == 1
