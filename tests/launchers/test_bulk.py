"""launchers.bulk: the collector paused while a batch is built, and frozen at exit."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import pytest

from launchers.bulk import bulk_allocation

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("enabled_before", [True, False])
def test_the_collector_is_paused_inside_and_its_state_comes_back(enabled_before: bool) -> None:
    was = gc.isenabled()
    try:
        (gc.enable if enabled_before else gc.disable)()
        with bulk_allocation():
            assert not gc.isenabled()
        assert gc.isenabled() is enabled_before
        with pytest.raises(KeyError), bulk_allocation():
            raise KeyError("a batch that fails half way")
        assert gc.isenabled() is enabled_before
    finally:
        (gc.enable if was else gc.disable)()


def test_a_process_that_built_a_batch_freezes_its_objects_at_exit() -> None:
    # An exit handler registered first runs last (atexit is last in, first out): it sees what
    # bulk_allocation's handler left. A process that never built a batch freezes nothing.
    code = (
        "import atexit, gc, sys\n"
        "atexit.register(lambda: print(gc.get_freeze_count() > 0))\n"
        "from launchers.bulk import bulk_allocation\n"
        "if sys.argv[1] == 'batch':\n"
        "    with bulk_allocation():\n"
        "        kept = [{'config': i} for i in range(1000)]\n"
    )
    seen = {}
    for arg in ("batch", "none"):
        proc = subprocess.run([sys.executable, "-c", code, arg], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        seen[arg] = proc.stdout.strip()
    assert seen == {"batch": "True", "none": "False"}
