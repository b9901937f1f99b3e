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

from launchers.queue import is_live, read_states
from tests.conftest import SlurmClusterInfo, _cancel_stale_held_jobs

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


def test_a_failed_slurm_test_reports_what_the_cluster_was_doing(slurm_cluster: SlurmClusterInfo, tmp_path: Path) -> None:
    """CI keeps only pytest's output: a Slurm test's failure carries the queue, the queued jobs'
    records and log tails, and slurmctld's log tail (tests/conftest.py's makereport hook)."""
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import pytest_collection_modifyitems, pytest_runtest_makereport, slurm_cluster  # noqa: F401\n"
    )
    (tmp_path / "test_stuck.py").write_text(
        "import subprocess\n\n\n"
        "def test_waits_on_a_job(slurm_cluster):\n"
        "    job = subprocess.run(['sbatch', '--parsable', '-J', 'megasweep-stuck', '-o', 'stuck-%j.out',\n"
        "                          '--wrap', 'echo still working; sleep 120'],\n"
        "                         check=True, capture_output=True, text=True).stdout.strip()\n"
        "    open('job', 'w').write(job)\n"
        "    subprocess.run(['bash', '-c', f'until grep -q working stuck-{job}.out 2>/dev/null; do sleep 0.5; done'],\n"
        "                   timeout=60)\n"
        "    assert False, 'gave up waiting'\n\n\n"
        "def test_plain_failure():\n"
        "    assert False\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", str(tmp_path)],
            cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
    finally:
        job = (tmp_path / "job").read_text() if (tmp_path / "job").exists() else ""
        if job:
            subprocess.run(["scancel", job], check=False, timeout=30)
    assert proc.returncode == 1 and job, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("Slurm when the test failed") == 1, proc.stdout  # not for the plain test
    assert re.search(rf"^{job}\|RUNNING\|None\|.*\|node\d\|megasweep-stuck$", proc.stdout, re.M), proc.stdout
    assert f"scontrol show job {job}:" in proc.stdout and f"last 30 lines of {tmp_path}/stuck-{job}.out:" in proc.stdout
    assert "\nstill working\n" in proc.stdout and "slurmctld.log:" in proc.stdout


def test_held_jobs_a_killed_run_left_are_cancelled_before_the_slurm_tests(slurm_cluster: SlurmClusterInfo) -> None:
    # A held job (as bench_time_model's, of a run killed before its `finally`) stayed queued for ever,
    # and the next CI's tests that wait for an empty queue failed on it. A job merely pending stays.
    def submit(*flags: str) -> str:
        return subprocess.run(["sbatch", "--parsable", *flags, "-J", "megasweep-stale", "-o", "/dev/null", "--wrap", "true"],
                              check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip

    held, later = submit("--hold"), submit("--begin=now+1hour")
    try:
        _cancel_stale_held_jobs()
        states = read_states([held, later])
        assert not is_live(states[held]) and states[later].startswith("PENDING"), states
    finally:
        subprocess.run(["scancel", held, later], check=False, timeout=30)


def test_one_worker_modules_name_test_files_with_a_module_fixture() -> None:
    # A file renamed or a fixture made per-test would leave the list stale without a word: its tests
    # would spread over the workers again, or keep one worker busy for no shared fixture.
    from tests.conftest import ONE_WORKER_MODULES

    for name in ONE_WORKER_MODULES:
        path = REPO / name
        assert path.is_file(), f"ONE_WORKER_MODULES names {name}, which is not a file"
        assert 'scope="module"' in path.read_text(), f"{name} has no module-scoped fixture to share"
