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
    # Hydra's own keys, group paths and bad syntax are left to Hydra.
    assert override_problem(["hydra.launcher.append=true", "hydra/launcher=slurm", "a=[1,"]) is None


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
