"""Analysis benchmark: `python -m analysis` on 10,000 synthetic result records.

    python -m tests.bench bench_analysis

Writes 10,000 result.json files in the RunRecord format (one template record, varied layout and
figures), a manifest with 100 more configs still pending, then times loading, the tables and the
recommendation in-process, and the whole CLI (plots included) in a subprocess. Figures only.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECORDS = 10_000
PENDING = 100


def _template() -> dict:
    from conf.schema import HardwareConfig, ModelConfig, ParallelismConfig, RunConfig, to_plain_dict
    from train.contract import RunRecord

    run = RunConfig(
        model=ModelConfig(name="gpt_1.3b", num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048),
        parallelism=ParallelismConfig(global_batch_size=1024),
        # The figures the time model needs (conf/hardware/a100_80gb.yaml's), so that every record is
        # predicted as well as loaded.
        hardware=HardwareConfig(name="a100_80gb", device_type="cuda", peak_tflops_bf16=312.0, memory_gib=79.15,
                                devices_per_node=8, num_sms=108, memory_bw_gbs=2039.0, intra_node_bw_gbs=300.0,
                                inter_node_bw_gbs=200.0),
    )
    return RunRecord(
        status="ok", message=None, config=to_plain_dict(run), overrides=[], world={}, hardware="a100_80gb",
        device="NVIDIA A100", versions={"torch": "2.4.0"}, git_commit=None, params=1_300_000_000,
        optimizer="apex.FusedAdam", precision="bf16", flops_per_iteration={"model": 1e16}, flops_conventions={},
        iterations_run=10, warmup_iters=2, measured_iterations=8, skipped_iterations=0, final_loss=10.0,
        sec_per_iter=None, samples_per_s=None, tokens_per_s_per_device=None, tflops_per_device=None,
        tflops_per_device_hardware=None, tflops_per_device_megatron_eq3=None, mfu=None, hfu=None,
        max_mem_gib=None, max_mem_gib_per_rank=[], max_mem_source="torch.cuda", peak_tflops=312.0,
        peak_source="datasheet", losses=[10.0] * 10, iteration_times_s=[1.0] * 10,
        started_at="2026-01-01T00:00:00+00:00",
    ).to_dict()


def write_sweep(root: Path) -> None:
    from train.contract import ManifestEntry, write_manifest

    template = _template()
    layouts = [(tp, pp, mbs, nodes) for tp in (1, 2, 4, 8) for pp in (1, 2, 4) for mbs in (1, 2, 4, 8)
               for nodes in (1, 2, 4, 8, 16, 32)]
    entries = []
    for i in range(RECORDS + PENDING):
        tp, pp, mbs, nodes = layouts[i % len(layouts)]
        devices, dp = nodes * 8, nodes * 8 // (tp * pp)
        overrides = [f"parallelism.tp={tp}", f"parallelism.pp={pp}", f"parallelism.micro_batch_size={mbs}",
                     f"+nodes={nodes}", f"+seed={i}"]
        out = f"runs/{i}"
        entries.append(ManifestEntry(i, tuple(overrides), out, "submitted", None, f"42_{i}", {"nodes": nodes}))
        if i >= RECORDS:
            continue
        rec = dict(template)
        rec["config"] = json.loads(json.dumps(template["config"]))
        rec["config"]["parallelism"].update(tp=tp, pp=pp, dp=dp, micro_batch_size=mbs)
        sec = 10.0 / devices ** 0.9 * (1 + 0.1 * tp + 0.05 * pp) * (1 + (i % 97) / 1000)
        status = "oom" if i % 50 == 0 else "ok"
        tflops = 1e16 / sec / devices / 1e12
        rec.update(status=status, overrides=overrides, world={"world_size": devices, "dp": dp, "tp": tp, "pp": pp},
                   sec_per_iter=sec if status == "ok" else None, tflops_per_device=tflops if status == "ok" else None,
                   mfu=tflops / 312.0 if status == "ok" else None, samples_per_s=1024 / sec,
                   max_mem_gib=20.0 + mbs * 5 / tp, max_mem_gib_per_rank=[20.0 + mbs * 5 / tp])
        (root / out).mkdir(parents=True)
        (root / out / "result.json").write_text(json.dumps(rec))
    write_manifest(entries, root / "manifest.jsonl")


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="bench_analysis_") as tmp:
        root = Path(tmp) / "sweep"
        tic = time.perf_counter()
        write_sweep(root)
        print(f"wrote {RECORDS:,} result.json + manifest ({RECORDS + PENDING:,} configs) in {time.perf_counter() - tic:.1f} s")

        from analysis.recommend import format_recommendations, recommend
        from analysis.records import load_sweeps
        from analysis.tables import results_markdown, scaling_frame, scaling_markdown

        tic = time.perf_counter()
        loaded = load_sweeps([root], queue=None)
        load_s = time.perf_counter() - tic
        df = loaded.table
        tic = time.perf_counter()
        rec = format_recommendations(recommend(df))
        md = results_markdown(df, labels=loaded.labels, recommendation=rec, scaling=scaling_markdown(scaling_frame(df)))
        report_s = time.perf_counter() - tic
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"in-process: load {load_s:.2f} s ({len(df):,} rows x {len(df.columns)} columns), "
              f"tables + recommendation {report_s:.2f} s ({len(md.splitlines()):,} lines), peak RSS {peak:.0f} MiB")

        tic = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "analysis", str(root), "--no-queue"], cwd=REPO,
                              capture_output=True, text=True, timeout=1800)
        wall = time.perf_counter() - tic
        if proc.returncode != 0:
            raise RuntimeError(f"python -m analysis failed ({proc.returncode}): {proc.stderr[-2000:]}")
        child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        print(f"CLI end to end (plots included): {wall:.2f} s, peak RSS {child:.0f} MiB")


if __name__ == "__main__":
    main()
