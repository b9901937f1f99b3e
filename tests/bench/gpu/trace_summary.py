"""Where one profiled iteration's GPU time goes, from a torch.profiler Chrome trace (train.profiling).

    python -m tests.bench.gpu.trace_summary <trace.json> --out summary.json

The iteration's span is its "megasweep iteration N" annotation. Inside it: the GPU's busy time (the
union of kernel and copy intervals), its idle time (the span minus that), and kernel time by class,
with the 25 kernels that take longest. Classes go by kernel name: cuBLAS/CUTLASS GEMMs, attention
(flash / cuDNN / memory-efficient SDPA kernels), the optimizer's multi-tensor kernels, reductions
and norms, other element-wise kernels, and copies.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

CLASSES = (
    ("attention", re.compile(r"flash|fmha|sdpa|attention|cudnn_generated", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|sm\d+_xmma|cutlass|cublas|matmul", re.I)),
    ("optimizer", re.compile(r"multi_tensor|fused_adam|adam", re.I)),
    ("norm_reduce", re.compile(r"layer_norm|norm|reduce|softmax|cross_entropy|nll", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy", re.I)),
)


def kernel_class(name: str) -> str:
    return next((label for label, pattern in CLASSES if pattern.search(name)), "elementwise_other")


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarise(trace: dict[str, Any]) -> dict[str, Any]:
    events = trace.get("traceEvents", trace if isinstance(trace, list) else [])
    spans = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("megasweep iteration")]
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    cpu_spans = [s for s in spans if s.get("cat") != "gpu_user_annotation"] or spans
    lo = min(s["ts"] for s in cpu_spans) if cpu_spans else min(e["ts"] for e in gpu)
    hi = max(s["ts"] + s["dur"] for s in cpu_spans) if cpu_spans else max(e["ts"] + e["dur"] for e in gpu)
    inside = [e for e in gpu if lo <= e["ts"] <= hi]
    by_class: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in inside:
        cls = "copy" if e.get("cat") != "kernel" else kernel_class(e["name"])
        by_class[cls] += e["dur"]
        by_name[e["name"]][0] += e["dur"]
        by_name[e["name"]][1] += 1
    busy = union_length([(e["ts"], e["ts"] + e["dur"]) for e in inside])
    span = hi - lo
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]
    return {
        "span_ms": span / 1e3,
        "gpu_busy_ms": busy / 1e3,
        "gpu_idle_ms": (span - busy) / 1e3,
        "kernels": len(inside),
        "by_class_ms": {k: round(v / 1e3, 3) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n[:160], "ms": round(v[0] / 1e3, 3), "calls": int(v[1])} for n, v in top],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    summary = summarise(json.loads(args.trace.read_text()))
    args.out.write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "top_kernels"}, indent=1))
    return summary


if __name__ == "__main__":
    main()
