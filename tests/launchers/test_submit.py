"""launchers.submit's check before anything is submitted (plan_configs), as the slurm and local launchers,
`python -m launchers sbatch` and `rerun --failed` ask it; the submitting itself is tested with a real
cluster in test_slurm_launcher.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conf import CONFIG_DIR
from launchers.compose import FastComposer
from launchers.submit import plan_configs


def test_paths_the_runs_would_refuse_are_warned_of_once_per_path_before_submitting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    composer = FastComposer.from_config_dir(CONFIG_DIR)
    missing, file = tmp_path / "missing.bin", tmp_path / "a_file"
    file.write_text("")
    jobs = [
        *([f"training.data_path={missing}", f"training.lr={lr}"] for lr in (1e-4, 2e-4, 3e-4)),
        ["training.save_interval=5", f"training.checkpoint_dir={file}"],
        # Infeasible (3 divides none of tiny's heads): skipped, so its path is none of the launch's concern.
        ["parallelism.tp=3", f"training.data_path={tmp_path / 'other.bin'}"],
    ]
    specs, skipped = plan_configs(composer, [["model=tiny", *job] for job in jobs], 0)
    assert (len(specs), len(skipped)) == (4, 1)  # warnings, not refusals: the nodes may see other files
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"warning: training.data_path={str(missing)!r} cannot be read as a token file (")
    assert lines[0].endswith("refuses it at its start, after the sweep was queued; 3 config(s) name it]"), lines[0]
    assert lines[1].startswith(f"warning: training.checkpoint_dir={file} is a file, not a directory"), lines[1]
    assert "[checked on this machine (" in lines[1]
    # A token file that holds every sample the runs read: nothing to say.
    good = tmp_path / "tokens.bin"
    np.zeros(80 * 256 + 1, dtype=np.uint16).tofile(good)
    plan_configs(composer, [["model=tiny", f"training.data_path={good}"]], 0)
    assert capsys.readouterr().err == ""
