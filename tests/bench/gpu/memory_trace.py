"""What is live on the GPU at a run's peak: python -m train under the CUDA allocator's history.

    python -m tests.bench.gpu.memory_trace --out trace.json -- model=gpt_350m hardware=h100_sxm ...

Runs `python -m train <overrides>` in this process with torch.cuda.memory._record_memory_history on,
replays the allocator's alloc and free events to find the moment the allocated bytes peaked, and
writes what was live then, grouped by the code that allocated it (the innermost frame in megasweep's
own files, and the innermost frame of all), largest first. The question it answers: which tensors
make the measured peak exceed the planner's prediction.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

REPO = str(Path(__file__).resolve().parents[3])


def _where(frames: list[dict[str, Any]], *, own: bool) -> str:
    for f in frames:
        name = str(f.get("filename", ""))
        if not own or (name.startswith(REPO) and "/tests/bench/gpu/" not in name):
            return f"{name.removeprefix(REPO + '/')}:{f.get('line')} {f.get('name')}"
    return "?"


def peak_live(trace: list[dict[str, Any]]) -> tuple[int, int, dict[int, dict[str, Any]]]:
    """(peak bytes, event index of the peak, live blocks at the peak) from one device's trace."""
    live: dict[int, dict[str, Any]] = {}
    total = top = top_at = 0
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > top:
                top, top_at = total, i
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
    live = {}
    for e in trace[: top_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    return top, top_at, live


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=500_000)
    sys.argv = ["train", *args.overrides]
    try:
        runpy.run_module("train", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        print(f"memory_trace: train exited with {exc.code}", flush=True)
    snap = torch.cuda.memory._snapshot()
    trace = snap["device_traces"][0]
    top, top_at, live = peak_live(trace)
    by_own: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    by_any: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for e in live.values():
        frames = e.get("frames", [])
        for table, own in ((by_own, True), (by_any, False)):
            row = table[_where(frames, own=own)]
            row[0] += e["size"]
            row[1] += 1
    out = {
        "events": len(trace),
        "peak_allocated_gib": top / 2**30,
        "peak_event": top_at,
        "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "live_by_megasweep_frame": [{"where": k, "gib": v[0] / 2**30, "blocks": v[1]}
                                    for k, v in sorted(by_own.items(), key=lambda kv: -kv[1][0])[:40]],
        "live_by_innermost_frame": [{"where": k, "gib": v[0] / 2**30, "blocks": v[1]}
                                    for k, v in sorted(by_any.items(), key=lambda kv: -kv[1][0])[:40]],
        "live_sizes_gib": sorted((e["size"] / 2**30 for e in live.values()), reverse=True)[:60],
    }  # fmt: skip
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("events", "peak_allocated_gib", "max_memory_allocated_gib")}))
    for row in out["live_by_megasweep_frame"][:20]:  # type: ignore[index]
        print(f"{row['gib']:8.3f} GiB {row['blocks']:6d}  {row['where']}")
    return out


if __name__ == "__main__":
    main()
