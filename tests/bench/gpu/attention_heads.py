"""The attention core at the BLOOM notes' head sizes, as Megatron-DeepSpeed (2022) ran it (issue 12).

    python -m tests.bench.gpu.attention_heads --out attention_heads.json [--mbs 1 2 4]

Why: the time model's worst BLOOM rows (seed 001; tests/train/planner/test_perf.py) are the 20 with
hidden 14400 and 96 heads, 36% fast on average against 17% for the other 53; 13824 with 128 heads ran
34% slower per step than with 64 heads. Both have a head size whose bytes are not a multiple of 16
(150 x 2 = 300, 108 x 2 = 216). Megatron-DeepSpeed's attention splits one fused QKV output
[s, b, heads, 3 x head] into strided q, k and v views and multiplies them with baddbmm and bmm; a
head's k and v then start 300 or 216 bytes after its q, and tensor-core kernels read their operands
16 bytes at a time. The notes' own pairs would put such an attention core near 10 TFLOP/s, but that
figure comes from the table the model is checked against, so the model does not use it. This
measures it instead.

For each of the notes' (hidden, heads) at TP 8 (heads / 8 per rank), sequence 2048, bf16, it times
forward and backward of the two GEMMs of the core (scores = q k^T, context = probs v), on the
strided views as Megatron-DeepSpeed makes them and on contiguous copies of the same operands. The
ratio of the two is the cost of the layout; the head size's alignment is printed beside it. The
softmax between them is left out (the notes' fused kernel, the same for every head size here). FLOPs:
2 GEMMs x 2 b heads s^2 head forward, twice that backward. Timing: train.calibration_job.best_seconds.
`--device cpu --seq 64` runs it small on a CPU, to check the script, not to measure.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

from conf.schema import ModelConfig, Precision
from train.calibration_job import best_seconds
from train.planner.flops import layer_gemms
from train.planner.perf import ATTENTION_CORE
from train.planner.shapes import alignment_elements

NOTES = ((14400, 96), (13824, 96), (13824, 64), (13824, 128), (14336, 64), (14336, 112), (14336, 128), (14336, 256))
"""(hidden, heads) of seed 001's tables (NHIDDEN, NHEADS, the 48-node and MBS tables)."""
TP = 8


def core(s: int, b: int, heads: int, head: int, *, strided: bool, device: torch.device) -> Callable[[], None]:
    """One forward and backward of q k^T and probs v for `heads` heads of size `head`: on views of one
    fused QKV output (`strided`, their gradients assembled into its gradient, as in training) or on
    three contiguous leaves of the same shapes."""
    dtype = torch.bfloat16
    leaves: list[torch.Tensor]
    if strided:
        fused = torch.randn(s, b, heads, 3 * head, device=device, dtype=dtype, requires_grad=True)
        leaves = [fused]
    else:
        leaves = [torch.randn(b * heads, s, head, device=device, dtype=dtype, requires_grad=True) for _ in range(3)]
    probs = torch.softmax(torch.randn(b * heads, s, s, device=device), -1).to(dtype).requires_grad_(True)
    scores_out = torch.empty(b * heads, s, s, device=device, dtype=dtype)
    grad_scores = torch.randn(b * heads, s, s, device=device, dtype=dtype)
    grad_context = torch.randn(b * heads, s, head, device=device, dtype=dtype)

    def qkv() -> list[torch.Tensor]:
        if not strided:
            return leaves
        # Megatron-DeepSpeed: split_tensor_along_last_dim (views), then view [s, b * heads, head] and
        # transpose to [b * heads, s, head]: no copy, so each head's k and v start `head` elements on.
        return [t.view(s, b * heads, head).transpose(0, 1) for t in torch.split(leaves[0], head, dim=-1)]

    def step() -> None:
        q, k, v = qkv()
        scores = torch.baddbmm(scores_out, q, k.transpose(1, 2), beta=0.0, alpha=head**-0.5)
        context = torch.bmm(probs, v)
        torch.autograd.backward((scores, context), (grad_scores, grad_context))
        for leaf in (*leaves, probs):
            leaf.grad = None

    return step


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--mbs", type=int, nargs="+", default=[1, 4])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--device", default="cuda")
    p.add_argument("--min-seconds", type=float, default=0.05)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    rows: list[dict[str, object]] = []
    for hidden, heads in NOTES:
        head, per_rank = hidden // heads, heads // TP
        model = ModelConfig(name="bloom_like", num_layers=1, hidden_size=hidden, num_attention_heads=heads,
                            seq_length=args.seq)  # fmt: skip
        for b in args.mbs:
            # The planner's forward FLOPs of the two core GEMMs on one TP rank; backward twice that.
            flops = 3 * sum(g.flops for g in layer_gemms(model, micro_batch_size=b, tp=TP) if g.name in ATTENTION_CORE)
            row: dict[str, object] = {"hidden": hidden, "heads": heads, "head": head, "heads_per_rank": per_rank, "mbs": b,
                                      "head_bytes_16_aligned": head % alignment_elements(Precision.bf16) == 0}  # fmt: skip
            for strided in (True, False):
                fn = core(args.seq, b, per_rank, head, strided=strided, device=device)
                seconds = best_seconds(fn, device=device, min_seconds=args.min_seconds, trials=3)
                key = "strided" if strided else "contiguous"
                row[f"{key}_seconds"], row[f"{key}_tflops"] = seconds, flops / seconds / 1e12
                del fn
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            row["strided_over_contiguous"] = float(row["strided_seconds"]) / float(row["contiguous_seconds"])  # type: ignore[arg-type]
            rows.append(row)
            print(f"hidden {hidden} heads {heads:>3} (head {head:>3}, 16-byte aligned: {row['head_bytes_16_aligned']!s:>5}) "
                  f"mbs {b}: strided {float(row['strided_tflops']):7.1f} TFLOP/s, contiguous "  # type: ignore[arg-type]
                  f"{float(row['contiguous_tflops']):7.1f}, ratio {float(row['strided_over_contiguous']):.2f}", flush=True)  # type: ignore[arg-type]  # fmt: skip
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    args.out.write_text(json.dumps({"device": name, "torch": torch.__version__, "seq": args.seq, "tp": TP,
                                    "rows": rows}, indent=1))  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
