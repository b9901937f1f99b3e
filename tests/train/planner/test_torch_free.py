"""train.planner (and the on-disk contract) import and plan with torch made unimportable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

BLOCK_TORCH = """
import importlib, importlib.abc, pkgutil, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is blocked: {name} imported")
        return None

sys.meta_path.insert(0, NoTorch())
import train.planner, train.contract
names = [m.name for m in pkgutil.walk_packages(train.planner.__path__, "train.planner.")]
for name in names:
    importlib.import_module(name)
from conf.schema import HardwareConfig, RunConfig
from train.planner.plan import plan_run
row = plan_run(RunConfig(hardware=HardwareConfig(peak_measured=True)))
assert row.feasible, row.reasons
assert "torch" not in sys.modules
print(len(names), "modules")
"""


def test_the_planner_imports_and_plans_without_torch() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.split()[0]) >= 9  # every module of the package was imported
