"""A GPT of 1.0B parameters on 8 local gloo workers (tp=2, pp=4): the largest model trained here.

    python -m tests.bench bench_1b

24 layers, hidden 1792, 14 heads, sequence 256, vocabulary 50304, fp32, one micro-batch of one
sequence per iteration, 2 iterations. (With 4 micro-batches, which 1F1B keeps in flight on the
first stage, the 8 workers' resident sets reached about 23 GB together and the kernel's OOM killer
ended rank 0: the planner judges each device alone, and hardware=cpu's 8 "devices" share this one
host's memory.) Each
rank builds only its stage's TP shards (train.init), so the run needs about one model's worth of
host memory in all, where the whole-model build needed 8 full copies of the weights alone (more
than this machine has; checked below from /proc/meminfo).

Checked, from the run's result.json (memory.ranks, train.contract.RankMemory):
  - status ok;
  - every rank's peak resident set below the full model's fp32 weights;
  - every rank's peak within 10% of train.planner.memory's prediction for that rank (its stage's
    model states, activations and pipeline buffers, plus hardware=cpu's measured process overhead).
Memory is asserted; time is only printed. The raw record goes to tests/bench/results/.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from train.contract import RESULT_FILE

REPO = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"
MODEL = (
    "model.name=gpt_1b",
    "model.num_layers=24",
    "model.hidden_size=1792",
    "model.num_attention_heads=14",
    "model.seq_length=256",
    "model.vocab_size=50304",
)
LAYOUT = (
    "parallelism.tp=2",
    "parallelism.pp=4",
    "parallelism.micro_batch_size=1",
    "parallelism.global_batch_size=1",
    "parallelism.precision=fp32",
)
OTHER = (
    "training.train_iters=2",
    "training.warmup_iters=1",
    "training.collective_timeout_s=1800",
    "hardware=cpu",
    # Time is not the point here; a fixed peak skips the matmul calibration.
    "hardware.peak_measured=false",
    "hardware.peak_tflops_fp32=1.0",
    "logger=disabled",
)
TOLERANCE = 0.10


def mem_total() -> int:
    """This machine's MemTotal in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def check(record: dict) -> list[str]:
    """One line per rank, and the failed checks as AssertionError."""
    weights = 4 * record["params"]
    ranks = record["memory"]["ranks"]
    assert record["status"] == "ok", record.get("message")
    assert len(ranks) == 8, f"{len(ranks)} ranks reported"
    assert 8 * weights > mem_total(), "8 whole-model copies of the weights would fit: not a test of sharding"
    lines, failures = [], []
    for r in ranks:
        peak, predicted = r["peak_measured"], r["peak_predicted"]
        ratio = predicted / peak
        lines.append(
            f"rank {r['rank']} stage {r['stage']} ({r['role']:6s}) peak {peak / 2**30:5.2f} GiB,"
            f" predicted {predicted / 2**30:5.2f} GiB, ratio {ratio:.3f}"
        )
        if peak >= weights:
            failures.append(f"rank {r['rank']} peaked at {peak / 2**30:.2f} GiB >= the fp32 weights")
        if abs(ratio - 1) > TOLERANCE:
            failures.append(f"rank {r['rank']}: predicted/measured {ratio:.3f} is off by more than 10%")
    print("\n".join(lines))
    assert not failures, "; ".join(failures)
    return lines


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "train", *MODEL, *LAYOUT, *OTHER, f"hydra.run.dir={out}"]
        tic = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600)
        wall = time.perf_counter() - tic
        print(proc.stdout[-4000:])
        if proc.returncode != 0:
            print(proc.stderr[-4000:])
        record = json.loads((out / RESULT_FILE).read_text())
    print(
        f"{record['params'] / 1e9:.2f}B parameters, full fp32 weights {4 * record['params'] / 2**30:.2f} GiB,"
        f" MemTotal {mem_total() / 2**30:.1f} GiB; wall {wall:.0f} s, exit {proc.returncode}"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_1b_cpu.json").write_text(json.dumps(record, indent=1) + "\n")
    check(record)


if __name__ == "__main__":
    main()
