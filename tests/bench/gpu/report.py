"""Issue 14's report, derived from the raw GPU outputs committed under tests/bench/results/gpu/.

    python -m tests.bench.gpu.report            # prints the tables; --write also updates REPORT.md there

Torch-free: it reads the records the device calls wrote (tests.bench.gpu.issue14) and asks the
planner (train.planner) for the predictions it compares them with, so every figure in the README's
GPU section can be recomputed from the committed files. Nothing here is measured.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results" / "gpu"
CALLS = ("call1", "call2", "call3", "call4")
"""The H100's trainer runs (call 5 is its second calibration)."""
H200_CALLS = ("call6", "call7")
"""The H200's: call 6 calibrated it and ran seven layouts at global batch 32, call 7 a memory grid."""


def records(pattern: str, calls: tuple[str, ...] = CALLS) -> list[tuple[str, Path, dict[str, Any]]]:
    out = []
    for call in calls:
        for path in sorted((RESULTS / call).glob(pattern)):
            out.append((call, path, json.loads(path.read_text())))
    return out


def _layout(rec: dict[str, Any]) -> str:
    par = rec["config"]["parallelism"]
    fp16 = " fp16" if par["precision"] == "fp16" else ""  # every H100 run was bf16
    return f"{rec['config']['model']['name']} mbs {par['micro_batch_size']} {par['recompute']}{fp16} gbs {par['global_batch_size']}"


def mfu_table(calls: tuple[str, ...] = CALLS, pattern: str = "mfu/*/result.json") -> list[str]:
    lines = ["| call | layout | micro-batch chosen by | sec/it | TFLOP/s | MFU | HFU | peak allocated GiB | optimizer |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for call, _, rec in records(pattern, calls):
        chosen = "auto" if rec.get("micro_batch", {}).get("requested") == "auto" else "fixed"
        if rec["status"] != "ok":
            lines.append(f"| {call} | {_layout(rec)} | {chosen} | {rec['status']} | | | | | |")
            continue
        lines.append(f"| {call} | {_layout(rec)} | {chosen} | {rec['sec_per_iter']:.3f} | {rec['tflops_per_device']:.0f} | "
                     f"{100 * rec['mfu']:.1f}% | {100 * rec['hfu']:.1f}% | {rec['max_mem_gib']:.1f} | {rec['optimizer']} |")  # fmt: skip
    return lines


def plain_table() -> list[str]:
    lines = ["| call | model | layout | plain loop sec/it | trainer sec/it | plain / trainer |", "| --- | --- | --- | --- | --- | --- |"]
    for call in CALLS:
        path = RESULTS / call / "summary.json"
        if not path.exists():
            continue
        plain = json.loads(path.read_text())["stages"].get("plain")
        for model, rec in (plain.items() if isinstance(plain, dict) else ()):
            if isinstance(rec, dict) and "trainer_over_plain" in rec:
                lines.append(f"| {call} | {model} | mbs {rec['micro_batch_size']} {rec['recompute']} gbs {rec['global_batch_size']} | "
                             f"{rec['sec_per_iter']:.4f} | {rec['trainer_sec_per_iter']:.4f} | {rec['trainer_over_plain']:.3f} |")  # fmt: skip
    return lines


def memory_rows() -> list[tuple[str, str, float, float]]:
    """(call, layout, predicted, measured) peak allocated bytes of every run that recorded both."""
    rows = []
    for call, _, rec in records("*/*/result.json"):
        ranks = (rec.get("memory") or {}).get("ranks") or []
        if rec.get("status") == "ok" and ranks and ranks[0].get("peak_measured"):
            rows.append((call, _layout(rec), float(ranks[0]["peak_predicted"]), float(ranks[0]["peak_measured"])))
    return rows


@functools.lru_cache(maxsize=1)
def _composer() -> Any:
    from conf import CONFIG_DIR, register_configs
    from launchers.compose import FastComposer

    register_configs()
    return FastComposer.from_config_dir(CONFIG_DIR, "config")


def _run_of(rec: dict[str, Any], *extra: str) -> Any:
    """The RunConfig of a record's layout as the device calls ran it (its hardware config, one device);
    `extra` overrides come last."""
    par = rec["config"]["parallelism"]
    return _composer().run_config([
        f"model={rec['config']['model']['name']}", f"hardware={rec['config']['hardware']['name']}",
        "hardware.devices_per_node=1", f"parallelism.precision={par['precision']}",
        f"parallelism.micro_batch_size={par['micro_batch_size']}", f"parallelism.recompute={par['recompute']}",
        f"parallelism.global_batch_size={par['global_batch_size']}", *extra,
    ])  # fmt: skip


def memory_today_table(calls: tuple[str, ...] = ("call4",)) -> list[str]:
    """The runs of `calls` (call 4: after the trainer's memory fixes) against today's planner: the
    records keep the prediction of the planner they ran with, so a later change shows here."""
    from train.planner.memory import estimate_memory

    lines = ["| layout | micro-batches per step | recorded prediction GiB | today's prediction GiB | measured GiB | "
             "today / measured |", "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    ratios = []
    for _, _, rec in records("*/*/result.json", calls):
        ranks = (rec.get("memory") or {}).get("ranks") or []
        if rec.get("status") != "ok" or not ranks or not ranks[0].get("peak_measured"):
            continue
        par = rec["config"]["parallelism"]
        run = _run_of(rec)
        today = estimate_memory(run.model, run.parallelism, dp=1, hardware=run.hardware).allocated
        measured = float(ranks[0]["peak_measured"])
        ratios.append(today / measured)
        steps = par["global_batch_size"] // par["micro_batch_size"]
        lines.append(f"| {_layout(rec)} | {steps} | {float(ranks[0]['peak_predicted']) / 2**30:.2f} | "
                     f"{today / 2**30:.2f} | {measured / 2**30:.2f} | {today / measured:.3f} |")  # fmt: skip
    if ratios:
        lines.append(f"\ntoday's planner: {len(ratios)} runs, predicted/measured median {statistics.median(ratios):.3f}, "
                     f"min {min(ratios):.3f}, max {max(ratios):.3f}")  # fmt: skip
    return lines


def memory_table() -> list[str]:
    lines = ["| call | layout | predicted GiB | measured GiB | predicted / measured |", "| --- | --- | --- | --- | --- |"]
    for call, layout, pred, meas in memory_rows():
        lines.append(f"| {call} | {layout} | {pred / 2**30:.2f} | {meas / 2**30:.2f} | {pred / meas:.3f} |")
    for label, calls in (("before the fix (calls 1-3)", {"call1", "call2", "call3"}), ("after it (call 4)", {"call4"})):
        ratios = [p / m for c, _, p, m in memory_rows() if c in calls]
        if ratios:
            lines.append(f"\n{label}: {len(ratios)} runs, predicted/measured median {statistics.median(ratios):.3f}, "
                         f"min {min(ratios):.3f}, max {max(ratios):.3f}")  # fmt: skip
    return lines


def time_table(calibrated_in: str | None = "call1", calls: tuple[str, ...] = CALLS, pattern: str = "mfu/*/result.json") -> list[str]:
    """The time model with the GPU's own calibration (the files `calibrated_in` wrote; None: the
    datasheet figures and default efficiencies of the record's conf/hardware config) against every
    gbs-32 run of `calls` that ran. The calibrations time bf16 GEMMs only, so an fp16 run is priced
    with them (the datasheets give both precisions the same tensor-core peak)."""
    from train.planner.perf import predict_time

    lines = ["| layout | measured sec/it | predicted sec/it | error | gemm | attention | memory-bound | other |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    errors = []
    seen: set[str] = set()
    for _, _, rec in sorted(records(pattern, calls), key=lambda r: r[0], reverse=True):
        layout = _layout(rec)
        if rec["status"] != "ok" or layout in seen:
            continue
        seen.add(layout)  # the latest call's measurement of a layout
        model = rec["config"]["model"]["name"]
        tag = rec["config"]["hardware"]["name"].split("_")[0]
        cal = [f"hardware.calibration={RESULTS / calibrated_in / f'calibration_{tag}_{model}.json'}",
               "parallelism.precision=bf16"] if calibrated_in else []  # fmt: skip
        run = _run_of(rec, *cal)
        pred = predict_time(run.model, run.parallelism, run.hardware, dp=1)
        err = pred.sec_per_iter / rec["sec_per_iter"] - 1
        errors.append(abs(err))
        parts = pred.parts
        other = pred.sec_per_iter - parts.get("gemm", 0) - parts.get("attention", 0) - parts.get("memory_bound", 0)
        lines.append(f"| {layout} | {rec['sec_per_iter']:.3f} | {pred.sec_per_iter:.3f} | {100 * err:+.1f}% | "
                     f"{parts.get('gemm', 0):.3f} | {parts.get('attention', 0):.3f} | {parts.get('memory_bound', 0):.3f} | {other:.3f} |")  # fmt: skip
    if errors:
        lines.append(f"\nmean absolute error {100 * statistics.mean(errors):.1f}% over {len(errors)} layouts")
    return lines


def _corr(a: list[float], b: list[float]) -> float:
    ma, mb = statistics.mean(a), statistics.mean(b)
    den = math.sqrt(sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b))
    return sum((x - ma) * (y - mb) for x, y in zip(a, b, strict=True)) / den if den else math.nan


def gemm_table(call: str = "call3") -> list[str]:
    data = json.loads((RESULTS / call / "gemm_shapes.json").read_text())
    rows = data["rows"]
    lines = [f"{data['device']}, {data['num_sms']} SMs, torch {data['torch']}, bf16, m = 2048 tokens; hidden "
             f"{min(r['hidden'] for r in rows)}-{max(r['hidden'] for r in rows)}",
             "", "| TP | GEMM | measured TFLOP/s (min-max) | tile x wave efficiency predicted (min-max) | correlation |",
             "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for tp in sorted({r["tp"] for r in rows}):
        for g in ("qkv", "attn_proj", "mlp_in", "mlp_out"):
            sel = [r for r in rows if r["tp"] == tp and r["gemm"] == g]
            t, p = [r["tflops"] for r in sel], [r["pred_eff"] for r in sel]
            lines.append(f"| {tp} | {g} | {min(t):.0f}-{max(t):.0f} | {min(p):.3f}-{max(p):.3f} | {_corr(t, p):+.2f} |")
    lines.append("")
    for tp in sorted({r["tp"] for r in rows}):
        rate = {}
        for h in (13824, 14400):
            sel = [r for r in rows if r["tp"] == tp and r["hidden"] == h]
            # FLOPs over seconds of the four together: each GEMM weighted by its time, as in a layer.
            rate[h] = sum(r["tflops"] * r["seconds"] for r in sel) / sum(r["seconds"] for r in sel)
        lines.append(f"TP {tp}: the four GEMMs together at hidden 13824 run at {rate[13824]:.0f} TFLOP/s, at 14400 at "
                     f"{rate[14400]:.0f} TFLOP/s")  # fmt: skip
    return lines


ALIGNED_NEIGHBOUR = {150: 144, 108: 112}
"""The BLOOM notes' two head sizes whose rows are not 16-byte multiples, each with the nearest one that is."""


def heads_table(call: str = "call8") -> list[str]:
    """The attention core at the BLOOM notes' head sizes (tests.bench.gpu.attention_heads), and what its
    measured cost could change in the time model's BLOOM predictions (tests/train/planner/test_perf.py)."""
    from tests.train.planner.test_perf import BLOOM_SEC_PER_ITER, bloom_time

    data = json.loads((RESULTS / call / "attention_heads_mbs.json").read_text())
    rows = data["rows"]
    lines = [f"{data['device']}, torch {data['torch']}, bf16, seq {data['seq']}, the heads of one rank at TP {data['tp']}; "
             "forward and backward of q k^T and probs v", "",
             "| hidden | heads | head | 16-byte rows | mbs | strided views TFLOP/s | contiguous TFLOP/s | strided / contiguous time |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['hidden']} | {r['heads']} | {r['head']} | {'yes' if r['head_bytes_16_aligned'] else 'no'} | "
                     f"{r['mbs']} | {r['strided_tflops']:.0f} | {r['contiguous_tflops']:.0f} | {r['strided_over_contiguous']:.2f} |")  # fmt: skip
    ratios = [r["strided_over_contiguous"] for r in rows]
    lines += ["", f"Strided views against contiguous copies, every head size: {min(ratios):.2f}-{max(ratios):.2f}x the time "
              f"(median {statistics.median(ratios):.2f}), misaligned or not."]  # fmt: skip
    slowest = 1.0
    for head, aligned in ALIGNED_NEIGHBOUR.items():
        neighbour = {r["mbs"]: r["strided_tflops"] for r in rows if r["head"] == aligned}
        speed = [neighbour[r["mbs"]] / r["strided_tflops"] for r in rows if r["head"] == head]
        slowest = max(slowest, *speed)
        lines.append(f"Head {head} (rows not 16-byte multiples) against head {aligned}, as Megatron-DeepSpeed runs them "
                     f"(strided): {min(speed):.2f}-{max(speed):.2f}x the time per FLOP.")  # fmt: skip
    share = [(t := bloom_time(r)).parts["attention"] / t.sec_per_iter for r in BLOOM_SEC_PER_ITER]
    lines.append(f"In today's time model the attention core is {min(share):.1%}-{max(share):.1%} of each BLOOM row's predicted "
                 f"time (A100 defaults), so even the slowest ratio here ({slowest:.2f}x) would add at most "
                 f"{max(share) * (slowest - 1):.1%} to a row: misaligned heads do not explain the 14400-hidden rows' gap.")  # fmt: skip
    return lines


def profile_lines() -> list[str]:
    data = json.loads((RESULTS / "call3" / "profile_summary.json").read_text())
    span = data["span_ms"]
    lines = [f"one iteration of gpt_1.3b (mbs 4, no recompute, gbs 32): {span:.0f} ms, GPU busy {data['gpu_busy_ms']:.0f} ms, "
             f"idle {data['gpu_idle_ms']:.0f} ms ({100 * data['gpu_idle_ms'] / span:.1f}%)", ""]  # fmt: skip
    for cls, ms in data["by_class_ms"].items():
        lines.append(f"- {cls}: {ms:.0f} ms ({100 * ms / span:.1f}%)")
    return lines


def _device(call: str, name: str) -> str:
    env = (RESULTS / call / "env.log").read_text().splitlines()
    return next((ln for ln in env if ln.startswith(name + ",")), "").strip()


def report() -> str:
    layouts = (H200_CALLS, "layouts/*/result.json")
    sections = [
        ("Device", [f"`{_device('call1', 'NVIDIA H100 80GB HBM3')}` (nvidia-smi and torch, call1/env.log)"]),
        ("Trainer runs (bf16, seq 2048, one GPU)", mfu_table()),
        ("Against a plain PyTorch loop", plain_table()),
        ("Memory: the planner's peak against the CUDA allocator's max allocated", memory_table()),
        ("Memory: call 4's runs against today's planner", memory_today_table()),
        ("Time model with this GPU's calibration (call 1: the attention core priced as two batched GEMMs) against "
         "the measured runs", time_table("call1")),
        ("Time model with this GPU's calibration (call 5: the attention core timed as the trainer runs it, SDPA) "
         "against the same runs", time_table("call5")),
        ("Time model without a calibration (the datasheet and conf/hardware/h100_sxm.yaml's default efficiencies) "
         "against the same runs", time_table(None)),
        ("GEMM shapes against the tile and wave model", gemm_table()),
        ("Where one iteration's GPU time goes", profile_lines()),
        ("H200 (calls 6 and 7): device", [f"`{_device('call6', 'NVIDIA H200')}` (nvidia-smi and torch, call6/env.log); "
                                           "torch 2.11.0+cu130, cuDNN 9.19, no NVIDIA apex"]),  # fmt: skip
        ("H200: trainer runs (seq 2048, one GPU, fixed micro-batches)", mfu_table(*layouts)),
        ("H200: time model with this GPU's calibration (call 6) against its runs; none of them, nor gpt_2.7b, "
         "was measured when the model last changed", time_table("call6", *layouts)),
        ("H200: time model without a calibration (the datasheet and conf/hardware/h200.yaml's default "
         "efficiencies) against the same runs", time_table(None, *layouts)),
        ("H200: memory, every run against today's planner", memory_today_table(H200_CALLS)),
        ("H200: GEMM shapes against the tile and wave model", gemm_table("call7")),
        ("H100 (call 8): the attention core at the BLOOM notes' head sizes (issue 12)", heads_table()),
    ]
    out = ["# GPU runs on an H100 (calls 1-5, 8) and an H200 (calls 6-7): derived from the raw outputs beside this file", "",
           "Generated by `python -m tests.bench.gpu.report --write` from call1..call8/ (each the archive one device",
           "call of `python -m tests.bench.gpu.issue14` returned, unpacked, or for call5 the calibration files of",
           "`python -m launchers calibrate --here`; their commands are in the .log files and COMMAND.txt).", ""]  # fmt: skip
    for title, lines in sections:
        out += [f"## {title}", "", *lines, ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true", help="write REPORT.md beside the results")
    args = p.parse_args(argv)
    text = report()
    print(text)
    if args.write:
        (RESULTS / "REPORT.md").write_text(text)
    return text


if __name__ == "__main__":
    main()
