"""Issue 14's measurements on one lent GPU, in as few device calls as a lease allows.

    python -m tests.bench.gpu.issue14 --stages env smoke calibrate mfu plain profile --deadline 540

Each stage runs megasweep's own commands (python -m train, python -m launchers calibrate --here,
the local launcher) or the two scripts beside this one, logs to <work>/<stage>.log, and goes on
after a failure; a stage that would not finish before --deadline (seconds from start) is skipped
and said so. Everything lands in one archive under $OUT (the device tool returns at most 8 files),
which tests/bench/results/gpu/ keeps unpacked. No figure here is computed: each comes from a
process that ran on the GPU named in env.txt.

Stages:
- env: nvidia-smi, torch, CUDA, cuDNN, NCCL and whether NVIDIA apex imports.
- smoke: the tiny model through python -m train on the GPU.
- calibrate: `python -m launchers calibrate --here` for gpt_350m and gpt_1.3b (the time model's file).
- mfu: python -m train, bf16, seq 2048, micro_batch_size=auto, each recompute mode, both models.
- plain: tests.bench.gpu.plain_loop at each model's fastest trainer layout (the 0.97x reference).
- profile: one profiled iteration of gpt_1.3b's fastest layout, summarised by kernel class.
- gemm: tests.bench.gpu.gemm_shapes (measured GEMM throughput against the tile and wave model).
- memory: the local launcher over mbs 1, 2, 4, 8 x three recompute modes x both models (gbs 8).
- best: python -m train at the two layouts per model that the memory stage measured fastest.
- trace: the CUDA allocator's live tensors at gpt_350m's peak (tests.bench.gpu.memory_trace).
- heads: tests.bench.gpu.attention_heads (the attention core at the BLOOM notes' head sizes, on
  Megatron-DeepSpeed's strided q, k, v views and on contiguous copies).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

MODELS = ("gpt_350m", "gpt_1.3b")
RECOMPUTE = ("none", "selective", "full")
MFU_GBS = 32
"""Global batch of the MFU runs: 4 to 32 micro-batches, so the optimizer step is a small share."""
ESTIMATE_S = {"env": 15, "smoke": 40, "calibrate": 90, "mfu": 300, "plain": 70, "profile": 50, "gemm": 60, "memory": 360, "best": 100, "trace": 40, "layouts": 280, "heads": 40}
"""Rough seconds per stage on an H100, to skip a stage that cannot end before the deadline."""


class Driver:
    def __init__(self, work: Path, deadline_s: float, grid: Path | None = None) -> None:
        self.work, self.start, self.deadline = work, time.monotonic(), deadline_s
        self.grid = grid or work / "memory"
        self.memory_models = MODELS
        self.hardware = "h100_sxm"
        self.calibrate_models: tuple[str, ...] = MODELS
        self.summary: dict[str, Any] = {"stages": {}}

    def common(self, precision: str = "bf16") -> tuple[str, ...]:
        return (f"hardware={self.hardware}", f"parallelism.precision={precision}", "logger=disabled")

    def left(self) -> float:
        return self.deadline - (time.monotonic() - self.start)

    def sh(self, stage: str, argv: list[str], *, timeout: float | None = None) -> tuple[int, str]:
        """Run argv, appending its output to <stage>.log; (exit code, output). 124 on timeout."""
        limit = max(5.0, min(timeout or 1e9, self.left() - 20))
        tic = time.monotonic()
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=limit, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            rc, out = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc = 124
            out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            out += f"\n[timed out after {limit:.0f} s]"
        with open(self.work / f"{stage}.log", "a") as log:
            log.write(f"$ {' '.join(argv)}\n{out}\n[exit {rc} after {time.monotonic() - tic:.1f} s]\n\n")
        print(f"[{stage}] exit {rc} in {time.monotonic() - tic:.1f} s: {' '.join(argv)[:160]}", flush=True)
        return rc, out


def result(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "result.json"
    return json.loads(path.read_text()) if path.exists() else None


def brief(rec: dict[str, Any] | None) -> dict[str, Any]:
    if rec is None:
        return {"status": "no result.json"}
    keys = ("status", "message", "sec_per_iter", "sec_per_iter_cv", "tflops_per_device", "mfu", "hfu",
            "max_mem_gib", "optimizer", "peak_tflops", "peak_source")  # fmt: skip
    out = {k: rec.get(k) for k in keys}
    out["micro_batch_size"] = rec.get("config", {}).get("parallelism", {}).get("micro_batch_size")
    return out


def env(d: Driver) -> None:
    d.sh("env", ["nvidia-smi"])
    d.sh("env", ["nvidia-smi", "--query-gpu=name,memory.total,clocks.max.sm,clocks.sm,power.limit,driver_version", "--format=csv"])
    code = ("import torch, importlib.util as u; p = torch.cuda.get_device_properties(0); "
            "print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version(), torch.cuda.nccl.version(), "
            "p.name, p.multi_processor_count, p.total_memory); print('apex', u.find_spec('apex') is not None); "
            "print('flash sdp', torch.backends.cuda.flash_sdp_enabled(), 'cudnn sdp', torch.backends.cuda.cudnn_sdp_enabled())")  # fmt: skip
    d.sh("env", [sys.executable, "-c", code])


def smoke(d: Driver) -> None:
    rc, _ = d.sh("smoke", [sys.executable, "-m", "train", "model=tiny", *d.common(), "training.train_iters=3",
                           f"hydra.run.dir={d.work / 'smoke'}"])  # fmt: skip
    d.summary["stages"]["smoke"] = {"exit": rc, **brief(result(d.work / "smoke"))}


def calibrate(d: Driver) -> None:
    for m in d.calibrate_models:
        rc, _ = d.sh("calibrate", [sys.executable, "-m", "launchers", "calibrate", "--here", f"model={m}", *d.common(),
                                   "hardware.devices_per_node=1", "--out", str(d.work / f"calibration_{d.hardware.split('_')[0]}_{m}.json")])  # fmt: skip
        d.summary["stages"].setdefault("calibrate", {})[m] = rc


def mfu(d: Driver) -> None:
    out = d.summary["stages"].setdefault("mfu", {})
    for m in MODELS:
        for r in RECOMPUTE:
            run_dir = d.work / "mfu" / f"{m}_{r}"
            rc, _ = d.sh("mfu", [sys.executable, "-m", "train", f"model={m}", *d.common(), "parallelism.micro_batch_size=auto",
                                 f"parallelism.global_batch_size={MFU_GBS}", f"parallelism.recompute={r}",
                                 "training.train_iters=12", "training.warmup_iters=2", f"hydra.run.dir={run_dir}"])  # fmt: skip
            out[f"{m}_{r}"] = {"exit": rc, **brief(result(run_dir))}


def fastest(d: Driver, model: str) -> dict[str, Any] | None:
    runs = [(k, v) for k, v in d.summary["stages"].get("mfu", {}).items() if k.startswith(model + "_") and v.get("sec_per_iter")]
    if not runs:
        return None
    key, top = min(runs, key=lambda kv: kv[1]["sec_per_iter"])
    return {"recompute": key.rsplit("_", 1)[1], **top}


def plain(d: Driver) -> None:
    out = d.summary["stages"].setdefault("plain", {})
    for m in MODELS:
        best = fastest(d, m)
        if best is None:
            out[m] = "no trainer run to match"
            continue
        rc, text = d.sh("plain", [sys.executable, "-m", "tests.bench.gpu.plain_loop", "--model", m, "--mbs",
                                  str(best["micro_batch_size"]), "--gbs", str(MFU_GBS), "--recompute", best["recompute"]])  # fmt: skip
        line = next((ln for ln in text.splitlines() if ln.startswith("PLAIN_LOOP ")), None)
        rec = json.loads(line.split(" ", 1)[1]) if line else {"exit": rc}
        if line:
            rec["trainer_sec_per_iter"] = best["sec_per_iter"]
            rec["trainer_over_plain"] = rec["sec_per_iter"] / best["sec_per_iter"]
        out[m] = rec


def profile(d: Driver) -> None:
    best = fastest(d, "gpt_1.3b")
    if best is None:
        d.summary["stages"]["profile"] = "no trainer run to profile"
        return
    run_dir = d.work / "profile_run"
    rc, _ = d.sh("profile", [sys.executable, "-m", "train", "model=gpt_1.3b", *d.common(),
                             f"parallelism.micro_batch_size={best['micro_batch_size']}",
                             f"parallelism.global_batch_size={MFU_GBS}", f"parallelism.recompute={best['recompute']}",
                             "training.train_iters=6", "training.warmup_iters=2", "training.profile_steps=[5]",
                             f"hydra.run.dir={run_dir}"])  # fmt: skip
    traces = sorted(run_dir.glob("profile/*.json"))
    if traces:
        rc2, _ = d.sh("profile", [sys.executable, "-m", "tests.bench.gpu.trace_summary", str(traces[0]),
                                  "--out", str(d.work / "profile_summary.json")])  # fmt: skip
        for t in traces:  # too large to bring back; the summary keeps what it says
            t.unlink()
    d.summary["stages"]["profile"] = {"exit": rc, "traces": len(traces)}


def gemm(d: Driver) -> None:
    rc, _ = d.sh("gemm", [sys.executable, "-m", "tests.bench.gpu.gemm_shapes", "--out", str(d.work / "gemm_shapes.json")])
    d.summary["stages"]["gemm"] = rc


def memory(d: Driver) -> None:
    rc, _ = d.sh("memory", [sys.executable, "-m", "train", "-m", "hydra/launcher=local", f"model={','.join(d.memory_models)}",
                            *d.common(), "parallelism.micro_batch_size=1,2,4,8", "parallelism.recompute=none,selective,full",
                            "parallelism.global_batch_size=8", "training.train_iters=4", "training.warmup_iters=2",
                            f"hydra.sweep.dir={d.work / 'memory'}"])  # fmt: skip
    d.summary["stages"]["memory"] = rc


LAYOUTS = (
    ("gpt_1.3b", 8, "none", "bf16"),  # the H100's fastest layouts, again on another device
    ("gpt_350m", 16, "none", "bf16"),
    ("gpt_1.3b", 4, "selective", "fp16"),  # fp16 with its loss scaler: no GPU had run it
    ("gpt_2.7b", 4, "none", "bf16"),  # a model no earlier record or calibration saw
    ("gpt_2.7b", 16, "full", "bf16"),
    ("gpt_1.3b", 16, "none", "bf16"),  # beyond an H100's memory
    ("gpt_350m", 32, "full", "fp16"),
)
"""(model, micro-batch, recompute, precision) of the layouts stage, most wanted first: held-out checks of
the time and memory models (none of these was measured when they were last changed)."""


def layouts(d: Driver) -> None:
    out = d.summary["stages"].setdefault("layouts", {})
    for m, mbs, r, prec in LAYOUTS:
        name = f"{m}_mbs{mbs}_{r}_{prec}"
        run_dir = d.work / "layouts" / name
        rc, _ = d.sh("layouts", [sys.executable, "-m", "train", f"model={m}", *d.common(prec),
                                 f"parallelism.micro_batch_size={mbs}", f"parallelism.global_batch_size={MFU_GBS}",
                                 f"parallelism.recompute={r}", "training.train_iters=8", "training.warmup_iters=2",
                                 f"hydra.run.dir={run_dir}"])  # fmt: skip
        out[name] = {"exit": rc, **brief(result(run_dir))}


def _grid_rank(d: Driver) -> dict[str, list[dict[str, Any]]]:
    """The memory stage's ok runs of each model, fastest per sample first."""
    ranked: dict[str, list[dict[str, Any]]] = {m: [] for m in MODELS}
    for path in sorted(d.grid.glob("*/result.json")):
        rec = json.loads(path.read_text())
        if rec.get("status") != "ok" or not rec.get("sec_per_iter"):
            continue
        par = rec["config"]["parallelism"]
        ranked[rec["config"]["model"]["name"]].append(
            {"mbs": par["micro_batch_size"], "recompute": par["recompute"],
             "sec_per_sample": rec["sec_per_iter"] / par["global_batch_size"]})  # fmt: skip
    return {m: sorted(v, key=lambda r: r["sec_per_sample"]) for m, v in ranked.items()}


def best(d: Driver) -> None:
    """MFU runs at the layouts the memory grid measured fastest (two per model), at MFU_GBS."""
    out = d.summary["stages"].setdefault("mfu", {})
    for m, ranked in _grid_rank(d).items():
        for cand in ranked[:2]:
            run_dir = d.work / "mfu" / f"{m}_mbs{cand['mbs']}_{cand['recompute']}"
            rc, _ = d.sh("best", [sys.executable, "-m", "train", f"model={m}", *d.common(),
                                  f"parallelism.micro_batch_size={cand['mbs']}", f"parallelism.global_batch_size={MFU_GBS}",
                                  f"parallelism.recompute={cand['recompute']}", "training.train_iters=12",
                                  "training.warmup_iters=2", f"hydra.run.dir={run_dir}"])  # fmt: skip
            out[f"{m}_mbs{cand['mbs']}_{cand['recompute']}"] = {"exit": rc, "recompute": cand["recompute"], **brief(result(run_dir))}


def trace(d: Driver) -> None:
    """The allocator's live tensors at the peak of gpt_350m, mbs 4, no recompute (tests.bench.gpu.memory_trace)."""
    rc, _ = d.sh("trace", [sys.executable, "-m", "tests.bench.gpu.memory_trace", "--out", str(d.work / "memory_trace.json"),
                           "model=gpt_350m", *d.common(), "parallelism.micro_batch_size=4", "parallelism.global_batch_size=4",
                           "training.train_iters=2", "training.warmup_iters=1", f"hydra.run.dir={d.work / 'trace_run'}"])  # fmt: skip
    d.summary["stages"]["trace"] = rc


def heads(d: Driver) -> None:
    rc, _ = d.sh("heads", [sys.executable, "-m", "tests.bench.gpu.attention_heads", "--out", str(d.work / "attention_heads.json"),
                          "--mbs", "1", "2", "4", "8"])  # the BLOOM notes' micro-batch sizes
    d.summary["stages"]["heads"] = rc


STAGES = {"env": env, "smoke": smoke, "calibrate": calibrate, "mfu": mfu, "plain": plain, "profile": profile,
          "gemm": gemm, "memory": memory, "best": best, "trace": trace, "layouts": layouts, "heads": heads}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", nargs="+", choices=list(STAGES), default=list(STAGES))
    p.add_argument("--deadline", type=float, default=540.0, help="seconds from start by which to stop")
    p.add_argument("--work", type=Path, default=Path("/tmp/issue14"))
    p.add_argument("--label", default="run")
    p.add_argument("--grid", type=Path, default=None, help="an earlier memory stage's sweep dir, for 'best'")
    p.add_argument("--memory-models", nargs="+", default=list(MODELS), help="the memory stage's models")
    p.add_argument("--hardware", default="h100_sxm", help="the conf/hardware config the runs name")
    p.add_argument("--calibrate-models", nargs="+", default=list(MODELS), help="the calibrate stage's models")
    args = p.parse_args(argv)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    d = Driver(args.work, args.deadline, args.grid)
    d.memory_models = tuple(args.memory_models)
    d.hardware, d.calibrate_models = args.hardware, tuple(args.calibrate_models)
    try:
        for name in args.stages:
            if d.left() < ESTIMATE_S[name] * 0.6:
                d.summary["stages"][name] = f"skipped: {d.left():.0f} s left, needs ~{ESTIMATE_S[name]} s"
                print(f"[{name}] skipped ({d.left():.0f} s left)", flush=True)
                continue
            tic = time.monotonic()
            try:
                STAGES[name](d)
            except Exception as exc:  # one stage's bug must not cost the others their device time
                d.summary["stages"][f"{name}_error"] = repr(exc)
            d.summary.setdefault("seconds", {})[name] = round(time.monotonic() - tic, 1)
    finally:
        (args.work / "summary.json").write_text(json.dumps(d.summary, indent=1, default=str))
        print(json.dumps(d.summary, indent=1, default=str), flush=True)
        out = Path(os.environ.get("OUT", "/tmp"))
        with tarfile.open(out / f"issue14_{args.label}.tar.gz", "w:gz") as tar:
            for path in sorted(args.work.rglob("*")):
                if path.is_file() and path.stat().st_size < 8 << 20 and "wandb" not in path.parts:
                    tar.add(path, arcname=str(path.relative_to(args.work)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
