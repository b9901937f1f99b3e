"""launchers.submit's check before anything is submitted (plan_configs), as the slurm and local launchers,
`python -m launchers sbatch` and `rerun --failed` ask it; the submitting itself is tested with a real
cluster in test_slurm_launcher.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from conf import CONFIG_DIR
from launchers.compose import FastComposer
from launchers.submit import entry_for, launched_layout, plan_configs, with_layouts
from train.planner.sizes import total_params


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


def test_each_feasible_config_keeps_the_layout_it_was_composed_with_for_its_manifest_entry() -> None:
    composer = FastComposer.from_config_dir(CONFIG_DIR)
    jobs = [["parallelism.tp=2", "parallelism.dp=2", "parallelism.zero_stage=1", "parallelism.micro_batch_size=auto"],
            ["parallelism.pp=2", "parallelism.recompute=full", "model.seq_length=128"], ["parallelism.tp=3"]]  # fmt: skip
    specs, skipped = plan_configs(composer, jobs, 0)
    assert [s.index for s in specs] == [0, 1] and [e.index for e in skipped] == [2]
    runs = [composer.run_config(job) for job in jobs[:2]]
    assert [s.layout for s in specs] == [launched_layout(run) for run in runs]
    first, second = (s.layout for s in specs if s.layout is not None)
    assert (first.dp, first.tp, first.pp, first.micro_batch_size, first.zero_stage) == (2, 2, 1, "auto", 1)
    # A null dp counts as 1, as the allocation counts it; the size is the planner's count for the tp.
    assert (second.dp, second.pp, second.recompute, second.seq_length) == (1, 2, "full", 128)
    assert second.params == total_params(runs[1].model, 1) and second.model == runs[1].model.name
    # Written into the entry of every status a launch gives a feasible config; a skipped one has none.
    assert [entry_for(specs[0], status).layout for status in ("submitted", "refused")] == [first.to_json()] * 2
    assert skipped[0].layout == {}
    # A spec read back from the launch record has none: a plain rerun takes its entry's.
    bare = [dataclasses.replace(s, layout=None) for s in specs]
    entries = [entry_for(specs[0], "submitted"), dataclasses.replace(entry_for(specs[1], "submitted"), layout={"tp": 0})]
    assert [s.layout for s in with_layouts(bare, entries)] == [first, None]  # a damaged one: none, not a failure
