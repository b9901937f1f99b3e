"""tests/conftest.py under `make test`'s `pytest -n N --dist loadgroup`: every test that uses the Slurm
cluster runs on one worker, one after another, while the other workers run the rest.

Both halves of that broke silently before: the group marker was added after xdist had read the
markers, and pytest 9.2 drops the group xdist writes into node ids (pytest-xdist#1386). Nothing
failed; the Slurm tests of both workers simply queued for the cluster's cores at the same time.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_slurm_tests_run_on_one_worker_under_loadgroup(tmp_path: Path) -> None:
    # The real hook, in a conftest of its own, with a stand-in fixture of the same name: nothing
    # here needs the cluster, only what the hook reads (the fixture's name).
    (tmp_path / "conftest.py").write_text(
        "import pytest\n"
        "from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n\n\n"
        "@pytest.fixture\n"
        "def slurm_cluster():\n"
        "    return None\n"
    )
    tests = [f"def test_slurm_{i}(slurm_cluster):\n    pass\n\n\n" for i in range(4)]
    tests += [f"def test_plain_{i}():\n    pass\n\n\n" for i in range(4)]
    (tmp_path / "test_grouped.py").write_text("".join(tests))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ran = re.findall(r"\[(gw\d)\] .*PASSED .*::(test_\w+?)(@\w+)? ", proc.stdout)
    assert len(ran) == 8, proc.stdout
    slurm = {(worker, group) for worker, name, group in ran if name.startswith("test_slurm")}
    assert len(slurm) == 1 and next(iter(slurm))[1] == "@slurm", proc.stdout
    assert all(not group for _, name, group in ran if name.startswith("test_plain")), proc.stdout
