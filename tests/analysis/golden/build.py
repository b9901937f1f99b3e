"""Build sweep directories from the golden fixture (sweep.json): real result.json files in the
RunRecord format, plus plan.csv and manifest.jsonl, the way the trainer and launchers write them.

Each fixture run gives its layout and outcome; everything else a RunRecord holds is derived
here (config via conf.schema.to_plain_dict, FLOPs via train.planner.flops) so that records are complete.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from conf.schema import (
    ClusterConfig,
    Engine,
    HardwareConfig,
    ModelConfig,
    Offload,
    OptimizerImpl,
    ParallelismConfig,
    Recompute,
    RunConfig,
    to_plain_dict,
)
from train.contract import (
    ManifestEntry,
    PlanRow,
    RunRecord,
    write_json_atomic,
    write_manifest,
    write_plan_csv,
)
from train.planner.plan import plan_run

GOLDEN = Path(__file__).resolve().parent
FIXTURE = GOLDEN / "sweep.json"
EXPECTED_MD = GOLDEN / "results.md"


def fixture() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


def run_config(
    model: dict[str, Any], hardware: dict[str, Any], layout: dict[str, Any], cluster: dict[str, Any] | None = None
) -> RunConfig:
    """The config a fixture run records; `cluster` the fields of the cluster config it ran under (the
    schema's defaults without: a cluster 'local' on whole nodes, which is neither conf/cluster file)."""
    par = ParallelismConfig(
        tp=layout["tp"], pp=layout["pp"], dp=layout["dp"], micro_batch_size=layout["mbs"],
        global_batch_size=layout["gbs"], zero_stage=layout.get("zero_stage", 1), recompute=Recompute.full,
        engine=Engine(layout.get("engine", "native")), offload=Offload(layout.get("offload", "none")),
        sequence_parallel=layout.get("sequence_parallel", False), virtual_stages=layout.get("virtual_stages", 1),
        optimizer=OptimizerImpl(layout.get("optimizer", "auto")),
    )
    return RunConfig(
        model=ModelConfig(**model), parallelism=par, hardware=HardwareConfig(**hardware),
        cluster=ClusterConfig(**(cluster or {})),
    )  # fmt: skip


def overrides_of(layout: dict[str, Any], model: str, extra: list[str] | None = None) -> list[str]:
    return [
        f"model={model}",
        f"parallelism.dp={layout['dp']}",
        f"parallelism.tp={layout['tp']}",
        f"parallelism.pp={layout['pp']}",
        f"parallelism.micro_batch_size={layout['mbs']}",
        f"parallelism.global_batch_size={layout['gbs']}",
        *(extra or []),
    ]


def make_record(run: RunConfig, spec: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A complete RunRecord for one fixture run (figures from the spec, the rest consistent with them)."""
    layout = spec["layout"]
    world = layout["dp"] * layout["tp"] * layout["pp"]
    status = spec.get("status", "ok")
    sec = spec.get("sec_per_iter")
    cv = spec.get("sec_cv", 0.0)
    tflops = spec.get("tflops")
    peak = run.hardware.peak_tflops_bf16
    flops = tflops * 1e12 * sec * world if (sec and tflops) else 1.0e18
    mem = spec.get("mem_gib")
    gbs = layout["gbs"]
    # A stopped run's counts come from its spec (it measured some of its iterations); the others' are
    # three run, one warm-up and two measured, or one run and none measured without figures.
    ran = spec.get("iterations_run", 3 if sec else 1)
    record = RunRecord(
        status=status,
        message=spec.get("message"),
        config=to_plain_dict(run),
        overrides=overrides,
        world={"world_size": world, "dp": layout["dp"], "tp": layout["tp"], "pp": layout["pp"]},
        hardware=run.hardware.name,
        device="NVIDIA A100-SXM4-80GB",
        versions={"python": "3.11.2", "torch": "2.4.0"},
        git_commit="0" * 40,
        params=spec.get("params"),
        optimizer="apex.FusedAdam",
        precision="bf16",
        flops_per_iteration={"model": flops, "hardware": flops * 4 / 3, "megatron_eq3": flops * 4 / 3},
        flops_conventions={"model": "per-GEMM", "hardware": "with recompute", "megatron_eq3": "Eq. 3"},
        iterations_run=ran,
        warmup_iters=1,
        measured_iterations=spec.get("measured_iterations", 2 if sec else 0),
        skipped_iterations=0,
        final_loss=None if status == "nan" else 11.5,
        sec_per_iter=sec,
        # The two measured iterations below (after the 1.2x warm-up) take the same time: no spread,
        # unless the spec gives one (None: a spread nobody recorded).
        sec_per_iter_min=sec * (1 - cv) if sec and cv is not None else None,
        sec_per_iter_max=sec * (1 + cv) if sec and cv is not None else None,
        sec_per_iter_cv=cv if sec else None,
        neighbours=spec.get("neighbours", {}),
        samples_per_s=gbs / sec if sec else None,
        tokens_per_s_per_device=gbs * run.model.seq_length / sec / world if sec else None,
        tflops_per_device=tflops,
        tflops_per_device_hardware=tflops * 4 / 3 if tflops else None,
        tflops_per_device_megatron_eq3=tflops * 4 / 3 if tflops else None,
        mfu=tflops / peak if (tflops and peak) else None,
        hfu=tflops * 4 / 3 / peak if (tflops and peak) else None,
        max_mem_gib=mem,
        max_mem_gib_per_rank=[] if mem is None else [mem - 3.0, mem],
        max_mem_source="torch.cuda.max_memory_allocated" if mem else None,
        peak_tflops=peak,
        peak_source="datasheet",
        losses=([11.9, 11.7, 11.5] if ran == 3 else [11.5] * ran) if sec else [float("nan")],
        iteration_times_s=[sec * 1.2] + [sec] * (ran - 1) if sec else [],
        env={"SLURM_JOB_ID": "1000", "SLURM_NNODES": str(spec["nodes"])} if "nodes" in spec else {},
        started_at=spec.get("started_at", "2022-02-25T10:00:00+00:00"),
        wall_s=600.0,
    )
    data = record.to_dict()
    if "train_iters" in spec:
        data["config"]["training"]["train_iters"] = spec["train_iters"]
    return data


def build_sweep(root: Path, data: dict[str, Any] | None = None, *, drop: tuple[str, ...] = ()) -> Path:
    """Write the fixture as a sweep under root: runs/<i>/result.json, plan.csv, manifest.jsonl.

    Runs whose name is in `drop` get no result.json (a sweep still in progress).
    """
    data = data or fixture()
    model, hardware = data["model"], data["hardware"]
    root.mkdir(parents=True, exist_ok=True)
    entries, plan_rows = [], []
    for index, spec in enumerate(data["runs"]):
        layout = spec["layout"]
        run = run_config(model, hardware, layout, data.get("cluster"))
        overrides = overrides_of(layout, model["name"], spec.get("extra_overrides"))
        out_dir = f"runs/{index}"
        shape = {"nodes": spec["nodes"], "tasks_per_node": 8}
        if spec.get("status") == "skipped":
            entries.append(ManifestEntry(index, tuple(overrides), out_dir, "skipped", spec["message"], None, shape))
            plan_rows.append(_plan_row(run, spec, overrides, feasible=False))
            continue
        entries.append(ManifestEntry(index, tuple(overrides), out_dir, "submitted", None, f"1000_{index}", shape))
        plan_rows.append(_plan_row(run, spec, overrides, feasible=True))
        if spec["name"] in drop or spec.get("pending"):
            continue
        (root / out_dir).mkdir(parents=True, exist_ok=True)
        write_json_atomic(root / out_dir / "result.json", make_record(run, spec, overrides))
    write_manifest(entries, root / "manifest.jsonl")
    write_plan_csv(plan_rows, root / "plan.csv")
    return root


def _plan_row(run: RunConfig, spec: dict[str, Any], overrides: list[str], *, feasible: bool) -> PlanRow:
    layout = spec["layout"]
    return PlanRow(
        feasible=feasible, reasons=[] if feasible else [spec["message"]], model=run.model.name,
        hardware=run.hardware.name, nodes=spec["nodes"], devices=layout["dp"] * layout["tp"] * layout["pp"],
        dp=layout["dp"], tp=layout["tp"], pp=layout["pp"], micro_batch_size=layout["mbs"],
        global_batch_size=layout["gbs"], params=spec.get("params") or 0, mem_gib=float("nan"),
        mem_capacity_gib=run.hardware.memory_gib - run.hardware.memory_reserve_gib, quant_efficiency=1.0,
        model_flops_per_iter=float("nan"), hardware_flops_per_iter=float("nan"), overrides=" ".join(overrides),
    )




# ---------------------------------------------------------------------------------------------
# Sweeps the time model predicts: the real conf/hardware figures, layouts the planner accepts.

CONF = GOLDEN.parents[2] / "conf"
GPT = {"name": "gpt_1.3b", "num_layers": 24, "hidden_size": 2048, "num_attention_heads": 16, "seq_length": 2048}
"""A GPT whose 24 layers split evenly over the pipeline stages of PREDICTED_LAYOUTS."""
PREDICTED_LAYOUTS = (
    {"dp": 8, "tp": 1, "pp": 1, "mbs": 2, "gbs": 512},
    {"dp": 4, "tp": 2, "pp": 1, "mbs": 4, "gbs": 512},
    {"dp": 2, "tp": 2, "pp": 2, "mbs": 4, "gbs": 512},
    {"dp": 4, "tp": 1, "pp": 2, "mbs": 2, "gbs": 512},
    {"dp": 8, "tp": 2, "pp": 1, "mbs": 4, "gbs": 512},
)
"""One and two nodes of eight A100s, all training the same work (GPT, GBS 512)."""


def hardware_conf(name: str, group: str = "hardware") -> dict[str, Any]:
    """conf/<group>/<name>.yaml as a dict: the figures (or cluster settings) a user's sweep records."""
    data = OmegaConf.to_container(OmegaConf.load(CONF / group / f"{name}.yaml"))
    assert isinstance(data, dict)
    return {str(k): v for k, v in data.items()}


def predicted_sweep_data(factors: list[float]) -> tuple[dict[str, Any], list[float]]:
    """PREDICTED_LAYOUTS on a100_80gb as fixture data, run i measured at factors[i] x the dry run's
    prediction (plan_run, as `python -m train --dry-run` plans the config); and those predictions."""
    hardware = hardware_conf("a100_80gb")
    runs, predicted = [], []
    for i, (layout, factor) in enumerate(zip(PREDICTED_LAYOUTS, factors, strict=True)):
        world = layout["dp"] * layout["tp"] * layout["pp"]
        row = plan_run(run_config(GPT, hardware, layout), world_size=world)
        assert row.feasible, row.reasons
        sec = factor * row.pred_sec_per_iter
        predicted.append(row.pred_sec_per_iter)
        runs.append({
            "name": f"layout{i}", "nodes": row.nodes, "layout": layout, "params": row.params, "sec_per_iter": sec,
            "tflops": row.model_flops_per_iter / (sec * world) / 1e12, "mem_gib": 20.0,
        })  # fmt: skip
    return {"model": GPT, "hardware": hardware, "runs": runs}, predicted


STOPPED_RUNS = {
    # Faster than every finished run: a stopped run's figures must not be the recommendation.
    "n48_pp12_mbs2": {"status": "timeout", "message": "received SIGTERM; stopped before the end of training",
                      "sec_per_iter": 150.0, "sec_cv": 0.02, "tflops": 110.0, "mem_gib": 38.6,
                      "iterations_run": 48, "measured_iterations": 47, "train_iters": 100},
    "n44_pp11_mbs2": {"status": "interrupted",
                      "message": "stopped by SIGINT (Ctrl-C) after 10 iterations; every worker was stopped",
                      "sec_per_iter": 180.0, "tflops": 99.0, "mem_gib": 41.0,
                      "iterations_run": 10, "measured_iterations": 9, "train_iters": 100},
    # One iteration after the warm-up: too few to show (records.MIN_PARTIAL_ITERATIONS).
    "n40_pp10_mbs4": {"status": "timeout", "message": "received SIGTERM; stopped before the end of training",
                      "sec_per_iter": 200.0, "tflops": 100.0, "mem_gib": 55.0,
                      "iterations_run": 2, "measured_iterations": 1, "train_iters": 100},
}  # fmt: skip
"""Three of the golden sweep's layouts as runs stopped before their end, each record keeping the figures
of the iterations it measured after its warm-up (as train.trainer writes them on SIGTERM and Ctrl-C)."""


def stopped_sweep_data() -> dict[str, Any]:
    """The golden sweep's two finished seed layouts (n40_pp10_mbs2, n48_pp6_mbs2) and STOPPED_RUNS."""
    data = fixture()
    finished = [r for r in data["runs"] if r["name"] in ("n40_pp10_mbs2", "n48_pp6_mbs2")]
    stopped = [{**r, **STOPPED_RUNS[r["name"]]} for r in data["runs"] if r["name"] in STOPPED_RUNS]
    data["runs"] = finished + stopped
    return data
