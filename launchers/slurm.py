"""`hydra/launcher=slurm`: a sweep as one Slurm job array per allocation, infeasible configs pruned.

    python -m train -m parallelism.tp=1,2,4 training.lr=1e-4,3e-4 hydra/launcher=slurm

The Hydra launcher class: it hands the sweep to launchers.submit (rules, grouping, sbatch via
submitit, the manifest) and reports. By default it returns once the arrays are queued:
<sweep dir>/manifest.jsonl says what went where, `python -m launchers status <sweep dir>`
follows progress (also after this process has gone), and `python -m launchers rerun <sweep dir>
--failed` resubmits failures.

A sweep of any other Hydra app (a config not composed on megasweep's schema) is run the way
hydra-submitit-launcher runs it: one job array, one task per job, each task composing its
config on the node and calling the app's task function (pickled by submitit); the launcher
waits for the array and returns each job's JobReturn, as Hydra's launcher contract wants.

Torch-free, like everything a launcher imports; torch is imported only inside the jobs.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus

from launchers.allocation import chunk
from launchers.compose import (
    HydraJob,
    SweepLauncher,
    is_megasweep_config,
    job_return,
    prepare_sweep_dir,
    sweep_composer,
    usage_exits,
)
from launchers.entry import check_entry
from launchers.site import SiteOptionError, check_own_options, check_site, check_slurm_conf
from launchers.submit import (
    LaunchFailed,
    LaunchSettings,
    Submission,
    check_array_options,
    check_output_dirs,
    check_sbatch_accepts,
    entry_args_for,
    entry_for,
    failed_configs_hint,
    infeasible_summary,
    launch_failure,
    merge_entries,
    plan_configs,
    read_max_array_size,
    refuse_empty_sweep,
    save_launch_file,
    subdir_namer,
    submit_configs,
    submit_released,
)
from launchers.sweepdir import check_indices_free
from train.contract import (
    RESULT_FILE,
    SUBMITIT_DIR,
    ManifestEntry,
    manifest_path,
    read_manifest,
    read_record,
    write_manifest,
)
from train.preemption import raise_if_interrupted

__all__ = ["GENERIC_TIME_LIMIT_MIN", "SlurmLauncher", "generic_executor_parameters", "submit_hydra_jobs"]


GENERIC_TIME_LIMIT_MIN = 60
"""Slurm time limit of a generic job unless sbatch_args sets `time` (submitit's own default is 5)."""


def job_error_words(error: object) -> str:
    """The last line of a failed job's error, as submitit gives it: its trace's last line (the
    exception), not the log paths submitit appends after the trace ("- .../7631_0_0_log.out" said
    nothing of why), nor its dashed rules."""
    text = str(error).split("You can check full logs", 1)[0]
    lines = [line.strip() for line in text.splitlines() if line.strip().strip("-")]
    return lines[-1] if lines else type(error).__name__


def failed_jobs_text(failed: Sequence[tuple[ManifestEntry, JobReturn]], sweep_dir: Path, total: int) -> str:
    """The paragraph a waiting launch ends with when some of its jobs failed: each failure's reason."""
    reasons = []
    for e, r in failed[:5]:
        record = read_record(sweep_dir / e.output_dir / RESULT_FILE)
        why = record.get("message") if record else None
        if not why:  # no record (killed, or the job never started): the job's own error, last line
            # _return_value: the property raises a failed job's exception instead of returning it.
            why = job_error_words(r._return_value)
        reasons.append(f"config {e.index}: {why}")
    more = f"; {len(failed) - 5} more" if len(failed) > 5 else ""
    return f"{len(failed)} of {total} configs failed: {'; '.join(reasons)}{more}. {failed_configs_hint(sweep_dir)}"


def generic_executor_parameters(settings: LaunchSettings, array_parallelism: int | None) -> dict[str, Any]:
    """submitit parameters of a generic sweep: one task per job, one node, sbatch_args on top."""
    return {
        "job_name": settings.job_name,
        "time": GENERIC_TIME_LIMIT_MIN,
        "nodes": 1,
        "ntasks_per_node": 1,
        "array_parallelism": array_parallelism or 256,
        "stderr_to_stdout": True,
        "additional_parameters": {
            "chdir": settings.cwd,
            **{k: (v if v != "" else True) for k, v in settings.sbatch_args.items()},
        },
        **({"srun_args": list(settings.srun_args)} if settings.srun_args else {}),
    }


def submit_hydra_jobs(
    job: HydraJob,
    job_overrides: Sequence[Sequence[str]],
    initial_job_idx: int,
    settings: LaunchSettings,
    *,
    array_parallelism: int | None = None,
) -> list[JobReturn]:
    """Run a generic sweep as one job array (split at max_array_size); block until it ends.

    Hydra's own contract for a launcher: one JobReturn per job, in order, carrying the task's
    value or its failure. A job that died outside the task (killed, unpicklable) is FAILED too.
    """
    import submitit

    sweep_dir = prepare_sweep_dir(job.config).resolve()
    nums = [initial_job_idx + i for i in range(len(job_overrides))]
    queued: list[Any] = []
    for piece in chunk(list(zip(job_overrides, nums, strict=True)), settings.max_array_size):
        executor = submitit.SlurmExecutor(folder=sweep_dir / SUBMITIT_DIR / "%j", python=settings.python)
        executor.update_parameters(**generic_executor_parameters(settings, array_parallelism))
        queued.extend(submit_released(executor, executor.map_array, job, [list(o) for o, _ in piece], [n for _, n in piece]))
    returns = []
    for overrides, slurm_job in zip(job_overrides, queued, strict=True):
        try:
            value = slurm_job.result()
        except Exception as exc:  # the job's failure, reported to Hydra as its own launchers do
            raise_if_interrupted(exc)  # Ctrl-C stops the wait, whatever error it became
            value = JobReturn(
                overrides=list(overrides),
                task_name=str(job.config.hydra.job.name),
                status=JobStatus.FAILED,
                _return_value=exc,
            )
        returns.append(value)
    return returns


# ---------------------------------------------------------------------------------------------
# The Hydra launcher.


class SlurmLauncher(SweepLauncher):
    """Hydra launcher submitting one Slurm job array per allocation (`hydra/launcher=slurm`).

    Options (hydra.launcher.*): wait (block until every job ends and return their results),
    array_parallelism (the %N throttle; null: cluster.array_parallelism), max_array_size
    (null: MaxArraySize from scontrol), sbatch_args (extra sbatch options), srun_args,
    python (null: this interpreter), module (entry module of each run), job_name
    (null: hydra.job.name), append (add the configs to the sweep already in hydra.sweep.dir,
    with new indices; without it such a directory is refused: launchers.sweepdir), test_only
    (false: no sbatch --test-only before submitting).

    The partition, account and QoS, each job's shape and then each array's whole script (sbatch
    --test-only) are checked with Slurm before anything is queued (launchers.site): a launch that
    Slurm would refuse in part is refused whole, exit 2, nothing queued. The launch fails (non-zero
    exit, after the manifest is written) when sbatch still refused any config as it was queued, or
    nothing was submitted (launchers.submit.launch_failure).

    Configs that are not megasweep's run as generic Hydra jobs (see submit_hydra_jobs), always
    waited for; of the options only array_parallelism, max_array_size, sbatch_args, srun_args,
    python and job_name apply to them.
    """

    def __init__(
        self,
        wait: bool = False,
        array_parallelism: int | None = None,
        max_array_size: int | None = None,
        sbatch_args: Mapping[str, str] | None = None,
        srun_args: Sequence[str] | None = None,
        python: str | None = None,
        module: str = "train",
        job_name: str | None = None,
        append: bool = False,
        test_only: bool = True,
    ) -> None:
        super().__init__(append)
        self.test_only = test_only
        self.wait = wait
        self.array_parallelism = array_parallelism
        self.max_array_size = max_array_size
        self.sbatch_args = dict(sbatch_args or {})
        self.srun_args = list(srun_args or [])
        self.python = python
        self.module = module
        self.job_name = job_name

    def settings(self) -> LaunchSettings:
        assert self.config is not None
        hydra = self.config.hydra
        return LaunchSettings(
            python=self.python or sys.executable,
            module=self.module,
            cwd=str(hydra.runtime.cwd),
            # `python -m train` names the job `__main__`: useless in squeue.
            job_name=self.job_name or (name if (name := str(hydra.job.name)) != "__main__" else self.module),
            max_array_size=self.max_array_size or read_max_array_size(),
            entry_args=entry_args_for(self.config),
            sbatch_args={str(k): str(v) for k, v in self.sbatch_args.items()},
            srun_args=tuple(str(a) for a in self.srun_args),
            test_only=bool(self.test_only),
        )

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        # Under any sweeper (Hydra's basic one too), a refusal of the input exits as bad input.
        with self.keeping_earlier_config(), usage_exits():
            return self._launch(job_overrides, initial_job_idx)

    def _launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and self.hydra_context is not None
        check_array_options(
            array_parallelism=self.array_parallelism,
            max_array_size=self.max_array_size,
            names=("hydra.launcher.array_parallelism", "hydra.launcher.max_array_size"),
        )
        if not is_megasweep_config(self.config):
            # Any other Hydra app: no validation or shapes to group by, and Hydra's launcher
            # contract (each job's JobReturn) means waiting for the array to end.
            assert self.task_function is not None
            job = HydraJob(self.hydra_context, self.config, self.task_function, Singleton.get_state())
            return submit_hydra_jobs(
                job, job_overrides, initial_job_idx, self.settings(), array_parallelism=self.array_parallelism
            )
        if self._first_index is None:  # a sweep's first batch; a later one is never empty
            refuse_empty_sweep(job_overrides)
            entry = (self.python or sys.executable, self.module, str(self.config.hydra.runtime.cwd))
            check_entry(*entry, options=("hydra.launcher.python", "hydra.launcher.module"), here=False)
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        path = manifest_path(sweep_dir)
        entries, submission = self._submit(job_overrides, initial_job_idx, sweep_dir)
        self._report(entries, submission, path)
        try:
            returns = self._returns(entries, submission, sweep_dir)
        except KeyboardInterrupt:
            # Ctrl-C while waiting ends the wait, not the jobs: say so, and how to follow or end them.
            print(
                f"slurm: stopped waiting; the jobs stay queued: python -m launchers status {sweep_dir} follows "
                f"them, scancel {' '.join(submission.arrays)} ends them",
                file=sys.stderr,
                flush=True,
            )
            raise
        failure = launch_failure(entries, sweep_dir)
        if failure is not None:
            raise failure
        failed = [(e, r) for e, r in zip(entries, returns, strict=True) if r.status == JobStatus.FAILED]
        if failed:
            # One paragraph with each failure's own words (the run's record, else the job's error),
            # where Hydra's sweeper would print the first one's chained traceback, cause left out.
            raise LaunchFailed(failed_jobs_text(failed, sweep_dir, len(entries)))
        return returns

    def _submit(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int, sweep_dir: Path
    ) -> tuple[list[ManifestEntry], Submission]:
        """Plan and submit a batch, the sweep directory locked from the claim of its indices until the
        manifest lists them (launchers.sweepdir.sweep_lock); (its entries, the submission)."""
        assert self.config is not None and self.hydra_context is not None
        check_slurm_conf()  # before settings() asks Slurm its MaxArraySize (a 30 s wait for nothing)
        composer = sweep_composer(self.hydra_context.config_loader, self.config)
        settings = self.settings()
        path = manifest_path(sweep_dir)
        with self.claimed(sweep_dir) as first:
            specs, skipped = plan_configs(
                composer,
                job_overrides,
                first + initial_job_idx,
                array_parallelism=self.array_parallelism,
                subdir=subdir_namer(self.config, composer),
                paths=self.paths,
            )
            # Earlier batches of this sweep, or the sweep it is appended to.
            old = read_manifest(path) if path.exists() else []
            planned = [*skipped, *(entry_for(s, "submitted") for s in specs)]
            check_indices_free(old, planned, sweep_dir)
            check_output_dirs(merge_entries(old, planned))
            try:
                check_own_options(settings.sbatch_args, option="hydra.launcher.sbatch_args.{name}")
                check_site((s.key for s in specs), settings.sbatch_args, option="hydra.launcher.sbatch_args.{name}")
            except SiteOptionError as exc:
                if initial_job_idx:
                    raise SiteOptionError(
                        f"{exc} (Of this batch: the sweep's earlier batches, configs {first}-"
                        f"{first + initial_job_idx - 1}, were queued; {path} lists them.)"
                    ) from None
                raise
            # A sweeper's later batch (hydra.sweeper.max_batch_size) comes after earlier ones were queued:
            # refused whole, its configs would be listed nowhere. sbatch judges each of its arrays as it
            # queues them, and a refused one is listed `refused` for rerun --failed.
            if self.test_only and not initial_job_idx:
                check_sbatch_accepts(
                    sweep_dir, specs, settings, option="hydra.launcher.sbatch_args.{name}",
                    skip="hydra.launcher.test_only=false",
                )
            save_launch_file(sweep_dir, settings, specs)
            known = merge_entries(old, skipped)
            submission = submit_configs(
                sweep_dir,
                specs,
                settings,
                on_queued=lambda queued: write_manifest(merge_entries(known, queued), path),
            )
            entries = sorted([*skipped, *submission.entries], key=lambda e: e.index)
            # Also when nothing was submitted (every config infeasible): the manifest says so.
            write_manifest(merge_entries(old, entries), path)
        return entries, submission

    def _report(self, entries: Sequence[ManifestEntry], submission: Submission, path: Path) -> None:
        submitted = sum(1 for e in entries if e.status == "submitted")
        refused = [e for e in entries if e.status == "refused"]
        infeasible = len(entries) - submitted - len(refused)
        arrays = ", ".join(submission.arrays) or "none"
        print(
            f"slurm: {len(entries)} configs: {submitted} submitted in {len(submission.arrays)} "
            f"array(s) ({arrays}), {infeasible} infeasible, {len(refused)} refused by sbatch -> {path}",
            flush=True,
        )
        for line in infeasible_summary(entries):
            print(f"slurm: {line}", file=sys.stderr)
        for e in refused:
            print(f"slurm: config {e.index} {' '.join(e.overrides)}: {e.reason}", file=sys.stderr)

    def _returns(
        self, entries: Sequence[ManifestEntry], submission: Submission, sweep_dir: Path
    ) -> list[JobReturn]:
        assert self.config is not None
        task_name = str(self.config.hydra.job.name)
        returns = []
        for e in entries:
            status = JobStatus.COMPLETED
            value: Any = e.to_json()
            job = submission.jobs.get(e.index)
            if self.wait and job is not None:
                try:
                    # results(): one value per task (a multi-device job has several; submitit's
                    # result() refuses those). Task 0 is rank 0, which writes the record.
                    value = job.results()[0]
                except Exception as exc:  # the job's failure, as Hydra launchers report it
                    raise_if_interrupted(exc)  # Ctrl-C stops the wait, whatever error it became
                    status, value = JobStatus.FAILED, exc
            returns.append(job_return(e, sweep_dir=sweep_dir, task_name=task_name, status=status, value=value))
        return returns
