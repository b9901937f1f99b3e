"""`hydra/sweeper=layouts`: search every layout of a model on a list of node counts, rank them by the
time model, and hand the fastest `search.top_k` to the chosen launcher (plan, local or slurm); with
`search.top_k_per_node_count=true`, the top_k of each node count (a scaling sweep).

    python -m train -m hydra/sweeper=layouts model=gpt_1.3b hardware=a100_80gb \\
        parallelism.global_batch_size=512 search.nodes=[1,2,4] search.top_k=3

The candidates are judged by train.planner (train.planner.search); once one is ranked, every feasible
one is written to search.csv in the sweep directory (plan.csv's columns, ranked), the `search.show` fastest are printed
with their time, memory and where the time goes, and the rejected ones are counted by rule. A search
added to a sweep that has one (hydra.launcher.append=true) writes search.append<N>.csv instead, N
that of its multirun.append<N>.yaml (launchers.sweepdir.EarlierConfig): the first ranking stays. A
search that ranks nothing, or whose launch is refused before the launcher writes anything (its site
check, Ctrl-C), leaves the directory as it was: a search.csv left behind held the directory against
the same search asked again.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from conf.schema import Offload, RunConfig
from launchers.compose import (
    created_by_launch,
    is_megasweep_config,
    parse_override,
    sweep_composer,
    usage_exits,
)
from launchers.sweepdir import (
    HYDRA_OPTIONS,
    EarlierConfig,
    UsageError,
    claim_sweep_dir,
    free_append_number,
    launch_files,
    writable_dir,
)
from train.contract import MULTIRUN_FILE, SEARCH_FILE, appended_name, write_plan_csv
from train.planner.search import SearchResult, format_search, search_layouts, search_problems, top_layouts

CHOSEN_BY_SEARCH = {
    "parallelism.dp": "search.nodes (every dp x tp x pp of their devices is tried)",
    "parallelism.tp": "search.nodes (every dp x tp x pp of their devices is tried)",
    "parallelism.pp": "search.nodes (every dp x tp x pp of their devices is tried)",
    "parallelism.micro_batch_size": "search.micro_batch_sizes=[N]",
    "parallelism.recompute": "search.recompute=[MODE]",
    "parallelism.zero_stage": "search.zero_stages=[N]",
    "parallelism.engine": "search.zero_stages (stages 2 and 3 run on DeepSpeed)",
    "parallelism.sequence_parallel": "search.sequence_parallel=[true|false]",
    "parallelism.virtual_stages": "search.virtual_stages=[N]",
    "parallelism.rampup_batch_size": "none: layouts are planned and launched without ramp-up",
}
"""The layout fields the search sets on every candidate (train.planner.search.layouts), with what
narrows each instead."""


class LayoutSweeper(Sweeper):
    """A sweeper whose jobs are the fastest predicted layouts of one config (module docstring)."""

    def __init__(self, csv_name: str = SEARCH_FILE) -> None:
        self.csv_name = csv_name
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.launcher: Any = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> Any:
        assert self.config is not None
        # Refused (a rule, the launcher's site check, Ctrl-C), a search into a new directory takes it
        # away again: a search.csv left there made the same search, asked again, "already held".
        with usage_exits(made=created_by_launch(Path(str(self.config.hydra.sweep.dir)))):
            return self._sweep(arguments)

    def _sweep(self, arguments: list[str]) -> Any:
        assert self.config is not None and self.hydra_context is not None
        if not is_megasweep_config(self.config):
            raise UsageError("hydra/sweeper=layouts searches megasweep configs (conf/config.yaml) only")
        sweeps = [a for a in arguments if parse_override(a).is_sweep_override()]
        if sweeps:
            raise UsageError(
                f"hydra/sweeper=layouts searches the layout of one config, but {' '.join(sweeps)} lists several "
                "values: give one value each (the layout's dp, tp, pp, micro-batch, recompute and ZeRO stage are "
                "what it searches, with sequence parallelism and virtual stages; choose them with search.nodes, "
                "search.micro_batch_sizes, search.recompute, search.zero_stages, search.sequence_parallel and "
                "search.virtual_stages), or use the default sweeper"
            )
        pinned = {a: CHOSEN_BY_SEARCH[key] for a in arguments if (key := parse_override(a).key_or_group) in CHOSEN_BY_SEARCH}
        if pinned:
            # The search replaces these on every candidate: honouring one would need a search.* list
            # of its own (conf.schema.SearchConfig), and ignoring it launched tp=1 for parallelism.tp=2.
            raise UsageError(
                f"hydra/sweeper=layouts chooses the layout itself, but it would replace {' '.join(pinned)} on every "
                "layout it tries: leave it out and narrow the search instead ("
                + "; ".join(f"{a.split('=')[0]}: {narrow}" for a, narrow in pinned.items())
                + "), or plan that one layout with the default sweeper (python -m train -m hydra/launcher=plan ...)"
            )
        world = OmegaConf.select(self.config, "hydra.launcher.world_size", default=None)
        if world is not None:
            # The launcher would plan every layout on that many devices, and refuse the search's own picks.
            raise UsageError(
                f"hydra.launcher.world_size={world} fixes the devices, but hydra/sweeper=layouts tries "
                "search.nodes x hardware.devices_per_node of them: leave hydra.launcher.world_size out and give the "
                "node counts with search.nodes=[...]"
            )
        run = sweep_composer(self.hydra_context.config_loader, self.config).run_config(arguments)
        search = run.search
        if problems := search_problems(search):
            raise UsageError("hydra/sweeper=layouts cannot search: " + "; ".join(problems))
        result = search_layouts(run, search)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        # Before search.csv and multirun.yaml are written there: an unwritable directory, or one that
        # holds a sweep (without hydra.launcher.append=true), is refused as the launcher would refuse it.
        append = OmegaConf.select(self.config, "hydra.launcher.append", default=None)
        if append is None:  # a launcher that writes no manifest (not megasweep's)
            writable_dir(sweep_dir, option=HYDRA_OPTIONS.directory)
        else:
            claim_sweep_dir(sweep_dir, append=bool(append))
        if not append and (sweep_dir / self.csv_name).exists():
            # A search that launched nothing (search.top_k=0) leaves no manifest or plan.csv to refuse on:
            # its ranking was replaced without a word.
            raise UsageError(
                f"{sweep_dir} already holds a layout search ({self.csv_name}), and a directory holds one sweep. "
                f"Nothing was written. Search into a new directory ({HYDRA_OPTIONS.directory}=...), or add this "
                f"search to it with {HYDRA_OPTIONS.append} (its ranking then goes to "
                f"{appended_name(self.csv_name, free_append_number(sweep_dir, MULTIRUN_FILE, self.csv_name))})"
            )
        print(format_search(result, search.show))
        if not result.ranked:
            raise UsageError(f"hydra/sweeper=layouts found nothing to rank: {_why_nothing_ranked(result, run)}")
        rows = [c.row for c in (*result.ranked, *result.unpredicted)]
        # Added to a sweep, the first search's ranking and Hydra config stay; this one's are kept
        # beside them under one number (search.append<N>.csv, multirun.append<N>.yaml).
        number = free_append_number(sweep_dir, MULTIRUN_FILE, self.csv_name)
        csv_path = sweep_dir / self.csv_name
        if append and csv_path.exists():
            csv_path = sweep_dir / appended_name(self.csv_name, number)
        earlier = EarlierConfig.read(sweep_dir, append=bool(append))
        OmegaConf.save(self.config, sweep_dir / MULTIRUN_FILE)
        earlier.keep(number)
        csv_path = write_plan_csv(rows, csv_path)
        print(f"search: all feasible layouts -> {csv_path}", flush=True)
        top = top_layouts(result, search)
        if not top:
            return []
        jobs = [[*arguments, *c.overrides] for c in top]
        sys.stdout.flush()
        written = launch_files(sweep_dir)
        try:
            return [self.launcher.launch(jobs, initial_job_idx=0)]
        except BaseException:
            if launch_files(sweep_dir) == written:
                # The launcher refused before it wrote a manifest or a plan: the search's ranking and
                # config go too, as a refused sweep leaves nothing (an added search: the sweep's own stay).
                csv_path.unlink(missing_ok=True)
                if earlier.text is None:  # no config was there before this search saved its own
                    (sweep_dir / MULTIRUN_FILE).unlink(missing_ok=True)
                earlier.keep_if_launched()
                print(f"search: nothing was launched, so {csv_path.name} was removed again", file=sys.stderr, flush=True)
            raise


def _why_nothing_ranked(result: SearchResult, run: RunConfig) -> str:
    """Why a search ranked no layout: the time model's reasons, or what left nothing feasible."""
    search = run.search
    if result.unpredicted:
        return f"{len(result.unpredicted)} feasible layouts, but the time model cannot predict them: " + "; ".join(
            result.unpredictable
        )
    if not result.candidates:
        # Nothing was judged, so no rule is above: the lists themselves left nothing to try.
        devices = [n * max(1, run.hardware.devices_per_node) for n in dict.fromkeys(search.nodes)]
        return (
            f"search.nodes={list(search.nodes)} ({', '.join(map(str, devices))} device(s)) with "
            f"search.zero_stages={list(search.zero_stages)} leaves no layout to try (a ZeRO stage above 0 "
            "needs dp > 1, so one device takes stage 0): add 0 to search.zero_stages, or more nodes"
        )
    tried = f"no layout of the {result.candidates:,} tried is feasible (the rules above, each with an example)"
    if "memory" in result.rejected:
        return f"{tried}; search.nodes={list(search.nodes)}: more nodes give each layout more devices"
    if {"native_offload", "offload_requires_zero"} & set(result.rejected):
        # Their words name parallelism.engine and zero_stage, which the search sets, and refuses as overrides.
        return (f"{tried}; parallelism.offload={Offload(run.parallelism.offload).value} needs ZeRO stage 2 or 3, which run on "
                "DeepSpeed: search.zero_stages=[2,3] (or offload=none)")
    # Divisibility, batch and shape rules: more devices do not help (a larger dp divides the batch less).
    return f"{tried}; change the values those rules name (the search.* lists, the global batch, the model)"
