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
TIP_CALLS = ("call9", "call10")
"""An H200 again, a day later and at 55861aa: call 9 ran call 6's seven layouts, call 10 a memory grid of
gpt_350m and the attention heads, call 11 calibrated gpt_350m and gpt_1.3b."""


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
        cal: list[str] = []
        if calibrated_in:
            path, used = _calibration_file(calibrated_in, tag, model)
            cal = [f"hardware.calibration={path}", "parallelism.precision=bf16"]
            layout += f" (calibrated on {used})" if used != model else ""
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


def _calibration_file(call: str, tag: str, model: str) -> tuple[Path, str]:
    """The calibration `call` wrote for `model`, or where it calibrated none for that model, the one of
    its largest calibrated model: the calibration times one model's GEMM shapes, and the time model
    prices a shape it did not time at its class's achieved fraction, so this is a held-out model."""
    own = RESULTS / call / f"calibration_{tag}_{model}.json"
    if own.exists():
        return own, model
    files = sorted((RESULTS / call).glob(f"calibration_{tag}_*.json"), key=lambda p: _model_size(p.stem.split("_", 2)[2]))
    if not files:
        raise FileNotFoundError(f"{call} holds no calibration for {tag}")
    return files[-1], files[-1].stem.split("_", 2)[2]


def _model_size(name: str) -> float:
    """gpt_350m -> 0.35, gpt_1.3b -> 1.3 (billions of parameters, from the config's name)."""
    size = name.rsplit("_", 1)[1]
    return float(size[:-1]) / (1000 if size.endswith("m") else 1)


def repeat_table(before: str = "call6", after: str = "call9") -> list[str]:
    """The same layouts on two lent machines of one kind, a day and 40 commits apart: sec/it and the
    allocator's peak, to tell a regression of the trainer from the spread between machines."""
    runs = {c: {_layout(r): r for _, _, r in records("layouts/*/result.json", (c,)) if r["status"] == "ok"} for c in (before, after)}
    lines = [f"| layout | {before} sec/it | {after} sec/it | {after} / {before} | {before} peak GiB | {after} peak GiB |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    ratios = []
    for layout in sorted(runs[before].keys() & runs[after].keys()):
        a, b = runs[before][layout], runs[after][layout]
        ratios.append(b["sec_per_iter"] / a["sec_per_iter"])
        lines.append(f"| {layout} | {a['sec_per_iter']:.3f} | {b['sec_per_iter']:.3f} | {ratios[-1]:.3f} | "
                     f"{a['max_mem_gib']:.2f} | {b['max_mem_gib']:.2f} |")  # fmt: skip
    if ratios:
        lines.append(f"\n{len(ratios)} layouts: {after} / {before} sec/it {min(ratios):.3f}-{max(ratios):.3f} "
                     f"(median {statistics.median(ratios):.3f})")  # fmt: skip
    return lines


def calibration_repeat_table(before: str = "call6", after: str = "call11") -> list[str]:
    """Two calibrations of one device kind on two machines: each measured figure of `after` over the same
    figure of `before` (GEMMs matched by shape and layout, attention by shape)."""
    lines = ["| model | GEMM seconds (median, min-max) | attention seconds (median, min-max) | memory bandwidth | "
             "op overhead | point-wise seconds per byte (median) |", "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for path in sorted((RESULTS / after).glob("calibration_*.json")):
        old = RESULTS / before / path.name
        if not old.exists():
            continue
        a, b = (json.loads(p.read_text())["nodes"][0] for p in (old, path))
        gemm = _matched(a["gemms"], b["gemms"], ("m", "n", "k", "batch", "layout", "precision"), ("seconds",))
        attn = _matched(a["attention"], b["attention"], ("batch", "heads", "seq_length", "head_dim", "causal"), ("forward_s", "backward_s"))
        point = [y / x for op in a["pointwise"] for x, y in zip(a["pointwise"][op], b["pointwise"][op], strict=True)]
        lines.append(f"| {path.stem.split('_', 2)[2]} | {_spread(gemm)} ({len(gemm)}) | {_spread(attn)} ({len(attn)}) | "
                     f"{b['memory_bw_gbs'] / a['memory_bw_gbs']:.3f} | {b['op_overhead_us'] / a['op_overhead_us']:.3f} | "
                     f"{statistics.median(point):.3f} |")  # fmt: skip
    return lines


def _matched(a: list[dict[str, Any]], b: list[dict[str, Any]], key: tuple[str, ...], values: tuple[str, ...]) -> list[float]:
    old = {tuple(r[k] for k in key): r for r in a}
    return [r[v] / old[k][v] for r in b if (k := tuple(r[f] for f in key)) in old for v in values]


def _spread(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.3f}, {min(ratios):.3f}-{max(ratios):.3f}" if ratios else "none matched"


CALIBRATED = (("call5", "h100"), ("call6", "h200"), ("call11", "h200"))
"""The device calls that calibrated more than one model (tag of their files)."""


def attention_transfer_table() -> list[str]:
    """Each calibrated model's attention core (one layer's SDPA forward and backward, the layout's
    micro-batch on one GPU) priced from another model's calibration of the same call, against its own
    file's timing: the head size the other file timed stands in for this one (train.planner.perf,
    _measured_attention). "GEMM rule" prices it as the time model did before, from the same file
    without its attention timings (its batched GEMMs' achieved fractions, FlashAttention's causal half)."""
    import tempfile
    from dataclasses import replace

    from train.planner.calibration import load_calibration

    lines = ["| call | model (head) | mbs | priced from | own timing ms | from the other file ms | ratio | GEMM rule ratio |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    ratios, gemm_rule = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for call, tag in CALIBRATED:
            files = {p.stem.split("_", 2)[2]: p for p in sorted((RESULTS / call).glob(f"calibration_{tag}_*.json"), key=lambda p: _model_size(p.stem.split("_", 2)[2]))}
            for target in files:
                hw = "h100_sxm" if tag == "h100" else tag
                for mbs in (1, 4, 16):
                    own = _attention_per_layer(target, hw, mbs, files[target])
                    head = _composer().run_config([f"model={target}"]).model
                    for other, path in files.items():
                        if other == target:
                            continue
                        cal = load_calibration(str(path))
                        bare = replace(cal, nodes=[replace(n, attention=[]) for n in cal.nodes]).write(Path(tmp) / f"{call}_{other}_bare.json")
                        priced, rule = (_attention_per_layer(target, hw, mbs, p) for p in (path, bare))
                        ratios.append(priced / own)
                        gemm_rule.append(rule / own)
                        lines.append(f"| {call} | {target} ({head.hidden_size // head.num_attention_heads}) | {mbs} | {other} | "
                                     f"{1e3 * own:.2f} | {1e3 * priced:.2f} | {ratios[-1]:.2f} | {gemm_rule[-1]:.2f} |")  # fmt: skip
    lines.append(f"\n{len(ratios)} cores: from another model's timed head size {min(ratios):.2f}-{max(ratios):.2f}x the own "
                 f"timing (mean |error| {100 * statistics.mean(abs(r - 1) for r in ratios):.0f}%); by the GEMM rule "
                 f"{min(gemm_rule):.2f}-{max(gemm_rule):.2f}x (mean |error| {100 * statistics.mean(abs(r - 1) for r in gemm_rule):.0f}%)")  # fmt: skip
    return lines


def _attention_per_layer(model: str, hardware: str, mbs: int, calibration: Path) -> float:
    """Seconds of one layer's attention core (forward and backward) at `mbs` on one device, as the time
    model prices it with the calibration file `calibration`."""
    from train.planner.perf import predict_time

    run = _composer().run_config([f"model={model}", f"hardware={hardware}", "hardware.devices_per_node=1",
                                  "parallelism.precision=bf16", f"parallelism.micro_batch_size={mbs}",
                                  f"parallelism.global_batch_size={mbs}", f"hardware.calibration={calibration}"])  # fmt: skip
    return predict_time(run.model, run.parallelism, run.hardware, dp=1).parts["attention"] / run.model.num_layers


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


def heads_table(call: str = "call8", name: str = "attention_heads_mbs.json") -> list[str]:
    """The attention core at the BLOOM notes' head sizes (tests.bench.gpu.attention_heads), and what its
    measured cost could change in the time model's BLOOM predictions (tests/train/planner/test_perf.py)."""
    from tests.train.planner.test_perf import BLOOM_SEC_PER_ITER, bloom_time

    data = json.loads((RESULTS / call / name).read_text())
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
        ("H200 at 55861aa (calls 9-11): device", [f"`{_device('call9', 'NVIDIA H200')}` (call9/env.log; another machine "
                                                   "than call 6's, same kind); torch 2.11.0+cu130"]),  # fmt: skip
        ("H200 at 55861aa: call 6's seven layouts again (call 9), against call 6", repeat_table()),
        ("H200: call 11's calibration over call 6's, figure by figure", calibration_repeat_table()),
        ("H200 at 55861aa: time model with call 6's calibration against call 9's runs",
         time_table("call6", ("call9",), "layouts/*/result.json")),
        ("H200 at 55861aa: time model with call 11's calibration (another machine, a day later) against call 9's "
         "runs; gpt_2.7b was not calibrated in call 11", time_table("call11", ("call9",), "layouts/*/result.json")),
        ("An attention head size no calibration timed, priced from another model's file (calls 5, 6, 11)",
         attention_transfer_table()),
        ("H200 at 55861aa: memory, call 10's grid (gpt_350m, gbs 8) against today's planner", memory_today_table(("call10",))),
        ("H200 (call 10): the attention core at the BLOOM notes' head sizes", heads_table("call10", "attention_heads.json")),
    ]
    out = ["# GPU runs on an H100 (calls 1-5, 8) and an H200 (calls 6-7, 9-11): derived from the raw outputs beside this file", "",
           "Generated by `python -m tests.bench.gpu.report --write` from call1..call11/ (each the archive one device",
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
