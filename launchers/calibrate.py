"""`python -m launchers calibrate [overrides]`: measure a site for the time model, on Slurm.

    python -m launchers calibrate cluster=local hardware=cpu hardware.devices_per_node=2 \\
        model=gpt_350m search.nodes=[1,2] --out calibration/cpu-local.json
    python -m train -m hydra/sweeper=layouts hardware.calibration=calibration/cpu-local.json ...

Two short jobs, one on one node and one on two, every task of them a rank as training places it
(hardware.devices_per_node tasks per node, cluster.cpus_per_task each; train.calibration_job).
They time the GEMM shapes the layouts of the search (`search.*`) run for the model, forward and
backward, its attention core as the trainer runs it (SDPA) at those layouts, a large copy, a tiny op, and the collectives by message size inside a node and across
nodes. The file (train.planner.calibration) keeps the median task's figure of each GEMM, and is
what `hardware.calibration` names.

Torch is imported by the jobs only: this runs on login nodes. `--here` measures this machine's one
device in this process instead (a workstation, or inside an allocation): no Slurm, no collectives.
"""

from __future__ import annotations

import datetime
import platform
import signal
import statistics
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from conf.schema import Engine, ModelKind, RunConfig
from launchers.allocation import Allocation, ArrayKey, core_licenses, sbatch_options, slurm_mem
from launchers.site import check_sbatch_scripts, check_site, license_totals
from launchers.submit import setup_lines, submit_released, submitit_script
from train.contract import SUBMITIT_DIR
from train.planner.calibration import (
    CALIBRATION_VERSION,
    AttentionTiming,
    Calibration,
    CollectiveTiming,
    GemmTiming,
    LayerTiming,
    NodeTiming,
)
from train.planner.flops import Gemm, head_gemms, layer_gemms
from train.planner.perf import FORWARD_LAYOUT, backward_gemm_shapes
from train.planner.search import layouts, search_layouts, search_problems
from train.planner.sizes import padded_vocab_size
from train.signals import TERMINAL_STOP_SIGNALS, signals_held, signals_to

MESSAGE_BYTES = (1 << 12, 1 << 16, 1 << 20, 1 << 22)
"""Collective message sizes timed (bytes): latency-bound to bandwidth-bound."""

JOB_TIME_LIMIT_MIN = 20
"""Slurm time limit of one calibration job (minutes)."""


def _rank_layers(run: RunConfig) -> list[tuple[int, int, list[Gemm]]]:
    """(tp, micro-batch, that rank's layer GEMMs) of every (tp, micro-batch) the search's layouts run."""
    out = []
    for tp, mbs in sorted({(par.tp, par.mbs) for _, par in layouts(run, run.search)}):
        try:
            out.append((tp, mbs, layer_gemms(run.model, micro_batch_size=mbs, tp=tp)))
        except ValueError:
            continue  # tp does not split the heads or the FFN: the planner rejects those layouts
    return out


def gemm_shapes(run: RunConfig) -> list[tuple[int, int, int, int, str]]:
    """(m, n, k, batch, layout) of every GEMM the search's layouts run on one rank, forward and backward."""
    shapes: set[tuple[int, int, int, int, str]] = set()
    for tp, mbs, layer in _rank_layers(run):
        for g in [*layer, *head_gemms(run.model, micro_batch_size=mbs, tp=tp)]:
            shapes.add((g.m, g.n, g.k, g.batch, FORWARD_LAYOUT))
            shapes.update(backward_gemm_shapes(g))
    return sorted(shapes)


def attention_shapes(run: RunConfig) -> list[tuple[int, int, int, int, bool]]:
    """(micro-batch, heads on a rank, sequence, head size, causal) of every attention core the
    search's layouts run on one rank."""
    m = run.model
    heads, head_dim = m.num_attention_heads, m.hidden_size // m.num_attention_heads
    causal = m.kind == ModelKind.gpt
    return sorted({(mbs, heads // tp, m.seq_length, head_dim, causal) for tp, mbs, _ in _rank_layers(run)})


def pointwise_shapes(run: RunConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(kind, shape) of each pointwise op at the search's largest micro-batch, on one rank at tp=1."""
    m, b = run.model, max(run.search.micro_batch_sizes)
    tokens = b * m.seq_length
    return (
        ("layer_norm", (tokens, m.hidden_size)),
        ("gelu", (tokens, m.ffn)),
        ("add", (tokens, m.hidden_size)),
        ("softmax", (b * m.num_attention_heads, m.seq_length, m.seq_length)),
        ("cross_entropy", (tokens, padded_vocab_size(m, 1))),
    )


def layer_model(run: RunConfig) -> tuple[str, int, int, int, int, int]:
    """(kind, hidden, heads, seq, vocab, micro-batch) of the narrow model whose layer is timed: a head
    per device of a node (so every TP degree up to it divides them) of 16 dimensions, 32 tokens. Its
    GEMMs take microseconds, so its layer's time is mostly what the model does not count per op."""
    heads = max(1, run.hardware.devices_per_node)
    return (run.model.kind.value, 16 * heads, heads, 32, 256, 1)


def _run_task(spec: dict[str, Any]) -> dict[str, Any]:
    """What each Slurm task runs (imports torch there, not here)."""
    from train.calibration_job import CalibrationSpec, measure

    return measure(CalibrationSpec(**spec))


def _executor_parameters(run: RunConfig, nodes: int, licenses: Mapping[str, int] | None) -> dict[str, Any]:
    """A calibration job measures, as a sweep's runs do: it asks for whole nodes and for its cores'
    licenses as they would (cluster.exclusive, cluster.core_license), so no other job times it."""
    c, hw = run.cluster, run.hardware
    tasks_per_node = max(1, hw.devices_per_node)
    params: dict[str, Any] = {
        "job_name": "megasweep-calibrate",
        "time": JOB_TIME_LIMIT_MIN,
        "nodes": nodes,
        "ntasks_per_node": tasks_per_node,
        "cpus_per_task": c.cpus_per_task,
        "stderr_to_stdout": True,
        "srun_args": ["--kill-on-bad-exit=1"],
    }
    total = licenses.get(c.core_license) if licenses and c.core_license else None
    cores = core_licenses(c.core_license, nodes * tasks_per_node * c.cpus_per_task, total)
    if cores:
        params["additional_parameters"] = {"licenses": cores}
    if c.exclusive:
        params["exclusive"] = True
    if hw.device_type == "cuda" and not c.gres:
        params["gpus_per_node"] = hw.devices_per_node
    optional = {"partition": c.partition, "account": c.account, "qos": c.qos, "constraint": c.constraint,
                "gres": c.gres, "mem": slurm_mem(c.mem_per_node_gb), "setup": setup_lines(c.setup) or None}  # fmt: skip
    params.update({k: v for k, v in optional.items() if v is not None})
    return params


def core_share(results: Sequence[dict[str, Any]]) -> float:
    """The share of a CPU core each task's thread gets when all compute: on each host (by name: an
    emulated cluster's nodes are one host), its CPUs over the threads of the tasks on it; the least
    over hosts, at most 1. 1 for GPU tasks (each computes on its own device) and for results of a job
    from before the tasks reported their host."""
    threads: dict[str, int] = {}
    cpus: dict[str, int] = {}
    for r in results:
        if "host" not in r or not str(r.get("device", "")).startswith("cpu"):
            return 1.0
        threads[r["host"]] = threads.get(r["host"], 0) + max(1, int(r["threads"]))
        cpus[r["host"]] = max(1, int(r["host_cpus"]))
    return min([1.0, *(cpus[host] / threads[host] for host in threads)])


def nodes_per_host(results: Sequence[dict[str, Any]]) -> int:
    """The most nodes of the job whose tasks run on one host (by name): 1 on a real cluster; all of the
    job's on an emulated one. 1 for results from before the tasks reported their node."""
    nodes: dict[str, set[str]] = {}
    for r in results:
        if "host" not in r or "node" not in r:
            return 1
        nodes.setdefault(r["host"], set()).add(r["node"])
    return max((len(held) for held in nodes.values()), default=1)


def node_timing(nodes: int, tasks_per_node: int, results: Sequence[dict[str, Any]]) -> NodeTiming:
    """One job's tasks reduced to one device's figures: the median task of each, and the share of a
    core its tasks got (core_share)."""
    by_shape: dict[tuple[int, int, int, int, str, str], list[float]] = {}
    for r in results:
        for g in r["gemms"]:
            key = (g["m"], g["n"], g["k"], g["batch"], g["precision"], g["layout"])
            by_shape.setdefault(key, []).append(g["seconds"])
    gemms = [
        GemmTiming(m, n, k, b, precision, statistics.median(v), layout)
        for (m, n, k, b, precision, layout), v in sorted(by_shape.items())
    ]
    return NodeTiming(
        nodes=nodes,
        tasks_per_node=tasks_per_node,
        gemms=gemms,
        memory_bw_gbs=statistics.median(r["memory_bw_gbs"] for r in results),
        op_overhead_us=statistics.median(r["op_overhead_us"] for r in results),
        pointwise={
            kind: [statistics.median(r["pointwise"][kind][i] for r in results) for i in (0, 1)]
            for kind in results[0]["pointwise"]
        },
        layers=[
            LayerTiming(**{**first, **{k: statistics.median(r["layers"][i][k] for r in results) for k in ("forward_s", "step_s")}})
            for i, first in enumerate(results[0].get("layers", []))
        ],
        attention=[
            AttentionTiming(**{**first, **{k: statistics.median(r["attention"][i][k] for r in results) for k in ("forward_s", "backward_s")}})
            for i, first in enumerate(results[0].get("attention", []))
        ],
        core_share=core_share(results),
        nodes_per_host=nodes_per_host(results),
        # The mean task: over a step, ranks that share cores take turns (sustained_rate).
        sustained_tflops=statistics.mean(r.get("sustained_tflops", 0.0) for r in results),
    )


def job_spec(run: RunConfig, *, min_seconds: float, trials: int, tasks_per_node: int) -> dict[str, Any]:
    """The CalibrationSpec (as keyword arguments) every task of a calibration job measures."""
    return {
        "gemms": tuple(gemm_shapes(run)),
        "precision": run.parallelism.precision.value,
        "device_type": run.hardware.device_type,
        "message_bytes": MESSAGE_BYTES,
        "copy_bytes": 64 << 20,
        "pointwise": pointwise_shapes(run),
        "attention": tuple(attention_shapes(run)),
        # On a CPU only: a GPU's launches run ahead of its work, so the time model adds none of it there.
        "layer_model": layer_model(run) if run.hardware.device_type == "cpu" else None,
        "layer_tp": tuple(sorted({1, tasks_per_node})),
        "min_seconds": min_seconds,
        "trials": trials,
    }


def _calibration(run: RunConfig, device: str, timings: list[NodeTiming], collectives: list[CollectiveTiming]) -> Calibration:
    return Calibration(
        version=CALIBRATION_VERSION,
        hardware=run.hardware.name,
        host=platform.node(),
        device=device,
        measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        torch=_torch_version(),
        nodes=timings,
        collectives=collectives,
    )


def calibrate(
    run: RunConfig,
    *,
    nodes: Sequence[int] = (1, 2),
    folder: Path,
    min_seconds: float = 0.05,
    trials: int = 3,
    test_only: bool = True,
) -> Calibration:
    """Submit one job per node count, wait for them, and reduce their tasks' measurements; `test_only`:
    sbatch --test-only judges the jobs first."""
    import submitit

    per_node = max(1, run.hardware.devices_per_node)
    # Before any job: one that its partition's nodes cannot hold would wait in the queue forever.
    gpus = per_node if run.hardware.device_type == "cuda" else 0
    check_site(
        ArrayKey(Allocation(nodes=n, tasks_per_node=per_node, gpus_per_node=gpus, time_limit_min=JOB_TIME_LIMIT_MIN),
                 sbatch_options(run))
        for n in nodes
    )  # fmt: skip
    spec = job_spec(run, min_seconds=min_seconds, trials=trials, tasks_per_node=per_node)
    totals = license_totals() if run.cluster.core_license else None
    executors = {}
    for n in nodes:
        executors[n] = submitit.SlurmExecutor(folder=folder / SUBMITIT_DIR / "%j", python=sys.executable)
        executors[n].update_parameters(**_executor_parameters(run, n, totals))
    # Each job as it will be queued, judged by Slurm first: the two-node job refused after the one-node
    # job had run for minutes lost those minutes.
    if test_only:
        check_sbatch_scripts(
            ((f"the {n}-node calibration job", script) for n, ex in executors.items() if (script := submitit_script(ex))),
            fix="the cluster.* fields", skip="--no-test-only", outcome="Nothing was submitted or measured",
            again="calibrate again",
        )  # fmt: skip
    # One job after the other: jobs that share a machine's cores would time each other.
    timings, collectives, device = [], [], ""
    for n, executor in executors.items():
        results = _job_results(executor, spec, f"{n} node(s)")
        timings.append(node_timing(n, max(1, run.hardware.devices_per_node), results))
        collectives += [CollectiveTiming(**c) for c in results[0]["collectives"]]
        device = results[0]["device"]
    return _calibration(run, device, timings, collectives)


def _job_results(executor: Any, spec: dict[str, Any], what: str) -> list[dict[str, Any]]:
    """Queue one calibration job and wait for its tasks' results. Its figures serve only this process, so
    a stop signal (Ctrl-C, kill, the terminal closing) cancels it before taking effect, whether it came
    while sbatch ran or while waiting."""
    with signals_held(TERMINAL_STOP_SIGNALS) as held:
        job = submit_released(executor, executor.submit, _run_task, spec)
    try:
        print(f"calibrate: {what}: job {job.job_id}, {len(spec['gemms'])} GEMM shapes", flush=True)
        if held:
            raise KeyboardInterrupt if held[0] == signal.SIGINT else SystemExit(128 + held[0])
        # Python ends on SIGTERM and SIGHUP without unwinding: a kill while waiting left the job queued.
        with signals_to(_exit_on, _unignored(TERMINAL_STOP_SIGNALS[1:])):
            results: list[dict[str, Any]] = job.results()
    except (KeyboardInterrupt, SystemExit):
        job.cancel(check=False)
        print(f"calibrate: stopped; job {job.job_id} cancelled", file=sys.stderr, flush=True)
        raise
    return results


def _exit_on(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _unignored(signals: Sequence[signal.Signals]) -> list[signal.Signals]:
    """`signals` this process does not ignore (nohup's SIGHUP stays ignored); none outside the main
    thread, where Python cannot set handlers."""
    if threading.current_thread() is not threading.main_thread():
        return []
    return [s for s in signals if signal.getsignal(s) != signal.SIG_IGN]


def calibrate_here(run: RunConfig, *, min_seconds: float = 0.05, trials: int = 3) -> Calibration:
    """Measure one device in this process, without Slurm: a workstation's GPU, or one rank's share of an
    interactive allocation. No collective is timed (one task has no peer), so the file serves layouts
    that communicate nothing: one device, or a one-node search whose links keep hardware's figures."""
    spec = job_spec(run, min_seconds=min_seconds, trials=trials, tasks_per_node=1)
    print(f"calibrate: on this machine, {len(spec['gemms'])} GEMM shapes", flush=True)
    result = _run_task(spec)
    return _calibration(run, result["device"], [node_timing(1, 1, [result])], [])


def _torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "unknown"


def format_calibration(cal: Calibration) -> str:
    """A few lines: what was measured, the best GEMM rate, bandwidths and the fitted links."""
    from train.planner.calibration import fitted_links
    from train.planner.calibration import node_timing as priced

    lines = [f"calibration of {cal.hardware} on {cal.host} ({cal.device}, torch {cal.torch}), {cal.measured_at}"]
    for t in cal.nodes:
        best = max((2 * g.m * g.n * g.k * g.batch / g.seconds for g in t.gemms), default=0.0)
        lines.append(
            f"  {t.nodes} node(s) x {t.tasks_per_node} tasks: {len(t.gemms)} GEMM shapes, best "
            f"{best / 1e12:.3g} TFLOP/s per device; copy {t.memory_bw_gbs:.3g} GB/s; op {t.op_overhead_us:.3g} us"
        )
        if t.attention:
            # The core's QK^T and attention over values, forward (x1) and backward (x2), counting the
            # whole s x s matrix as MFU does (a causal kernel skips about half of it).
            rates = [12 * a.batch * a.heads * a.seq_length**2 * a.head_dim / (a.forward_s + a.backward_s) for a in t.attention]
            lines.append(f"    attention core (SDPA): {len(rates)} shapes, {min(rates) / 1e12:.3g}-{max(rates) / 1e12:.3g} "
                         "TFLOP/s forward + backward (whole s x s matrix counted)")  # fmt: skip
        for layer in t.layers:
            lines.append(
                f"    narrow layer at tp={layer.tp}: forward {layer.forward_s * 1e3:.3g} ms, "
                f"forward + backward {layer.step_s * 1e3:.3g} ms"
            )
        if t.core_share < 1.0:
            # What the time model uses instead (train.planner.calibration.time_shared says why).
            used = priced(cal, t.nodes)
            assert used is not None
            lines.append(
                f"    its tasks time-share their host's cores ({t.core_share:.3g} of a core each by count, "
                f"{used.core_share:.3g} by the sustained GEMM): the time model prices them as the figures of tasks "
                "with a core each, divided by that"
            )
    for scope, link in fitted_links(cal).items():
        lines.append(f"  {scope}-node link: {link.latency * 1e6:.3g} us per ring step, {link.bandwidth / 1e9:.3g} GB/s")
        for op, latency, bandwidth in link.ops:
            lines.append(f"    {op}: {latency * 1e6:.3g} us per ring step, {bandwidth / 1e9:.3g} GB/s")
    return "\n".join(lines)


def main(
    overrides: Sequence[str],
    *,
    out: Path,
    nodes: Sequence[int],
    min_seconds: float,
    here: bool = False,
    test_only: bool = True,
) -> int:
    """The CLI's work: compose, calibrate (on Slurm, or `here`), write, print; returns the exit status."""
    from conf import CONFIG_DIR
    from launchers.compose import FastComposer, parse_override
    from launchers.search import CHOSEN_BY_SEARCH

    # The engine only is said to be ignored below: the jobs time GEMMs and links, whatever runs them.
    pinned = {a: key for a in overrides if (key := parse_override(a).key_or_group) in CHOSEN_BY_SEARCH
              and key != "parallelism.engine"}  # fmt: skip
    if pinned:
        # Replaced on every layout timed, as the layout search replaces them: parallelism.tp=2 timed tp=1's too.
        narrow = "; ".join(f"{key}: {CHOSEN_BY_SEARCH[key]}" for key in pinned.values())
        raise ValueError(f"calibrate times the layouts of the search, which sets {' '.join(pinned)} itself on every "
                         f"one: leave it out and narrow the search instead ({narrow}); nothing was submitted")
    run = FastComposer.from_config_dir(CONFIG_DIR, "config").run_config(list(overrides))
    if problems := search_problems(run.search):
        # What the layout search refuses: an empty list timed no GEMM (a job queued for nothing), a zero
        # micro-batch divided by zero.
        raise ValueError(f"calibrate times the layouts of the search, which cannot search: {'; '.join(problems)}; "
                         "nothing was submitted")  # fmt: skip
    if why := _nothing_feasible(run):
        raise ValueError(f"calibrate times the layouts of the search, and {why}; nothing was submitted")
    if run.parallelism.engine == Engine.deepspeed:
        print("calibrate: the engine does not matter here; measuring the GEMMs and links only", file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    if here:
        cal = calibrate_here(run, min_seconds=min_seconds)
    else:
        cal = calibrate(run, nodes=nodes, folder=out.parent, min_seconds=min_seconds, test_only=test_only)
    cal.write(out)
    print(format_calibration(cal))
    print(f"calibrate: -> {out} (use it as hardware.calibration={out})")
    return 0


def _nothing_feasible(run: RunConfig) -> str:
    """Why no layout of the search is feasible, with its rules and an example of each; '' when one is.
    Without it a search.micro_batch_sizes=[64] beside a global batch of 8 queued jobs that timed 42 GEMM
    shapes for a search that then ranked nothing."""
    from launchers.search import _why_nothing_ranked

    result = search_layouts(run, run.search)
    if result.ranked or result.unpredicted:
        return ""
    rules = "; ".join(f"[{rule}] {count:,} layout(s), e.g. {result.examples[rule]}"
                      for rule, count in result.rejected.most_common())  # fmt: skip
    return _why_nothing_ranked(result, run).replace(" (the rules above, each with an example)", f" ({rules})" if rules else "")


__all__ = [
    "attention_shapes", "calibrate", "calibrate_here", "core_share", "format_calibration", "gemm_shapes", "main",
    "node_timing", "nodes_per_host",
]
