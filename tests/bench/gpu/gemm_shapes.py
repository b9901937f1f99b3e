"""Measured throughput of a layer's GEMMs against the tile and wave model (issue 14, item 3).

    python -m tests.bench.gpu.gemm_shapes --hardware h100_sxm --out gemm_shapes.json

The BLOOM notes (seed 001) chose hidden 13824 over 14400 because 13824 = 108 x 128 fills an A100's 108
SMs in whole waves of 128-wide tiles. On one GPU this times, at bf16, the four per-rank GEMMs that carry
a layer's FLOPs (qkv, attn_proj, mlp_in, mlp_out; train.planner.flops.layer_gemms, Megatron's TP split)
for hidden sizes from 13312 to 14464 in steps of 64 (multiples of 128 x TP = 1024 at TP 8, the
BLOOM pair, and the sizes between) at TP 4 and 8, one sequence of 2048 tokens. Each row has the
measured TFLOP/s, its share of the best measured row, and the planner's tile x wave efficiency of
the shape on this GPU's SM count (train.planner.shapes.gemm_efficiency), the figure the time model
divides by. Timing: train.calibration_job's GEMM (fresh operands from a pool larger than L2, the
trainer's x @ W^T layout), best of 3 means of at least 50 ms each.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from conf.schema import HardwareConfig, ModelConfig
from train.calibration_job import _gemm, best_seconds
from train.planner.flops import layer_gemms
from train.planner.perf import FORWARD_LAYOUT
from train.planner.shapes import MAIN_GEMMS, alignment_elements, gemm_efficiency

HIDDEN = tuple(range(13312, 14464 + 1, 64)) + (14400,)
TPS = (4, 8)
HEADS = 8
"""Divides every hidden size above and both TP degrees; only the attention-core GEMMs depend on it,
and they are not timed."""


def hardware(name: str) -> HardwareConfig:
    import yaml

    data = yaml.safe_load((Path(__file__).resolve().parents[3] / "conf" / "hardware" / f"{name}.yaml").read_text())
    return HardwareConfig(**data)


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hardware", default="h100_sxm")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--min-seconds", type=float, default=0.05)
    args = p.parse_args(argv)
    hw = hardware(args.hardware)
    device = torch.device("cuda")
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    base = ModelConfig(name="bloom_like", num_layers=1, hidden_size=14336, num_attention_heads=HEADS, seq_length=2048)
    rows: list[dict[str, object]] = []
    for tp in TPS:
        for h in sorted(set(HIDDEN)):
            model = replace(base, hidden_size=h)
            for g in layer_gemms(model, micro_batch_size=1, tp=tp):
                if g.name not in MAIN_GEMMS:
                    continue
                fn = _gemm(g.m, g.n, g.k, g.batch, FORWARD_LAYOUT, torch.bfloat16, device)
                seconds = best_seconds(fn, device=device, min_seconds=args.min_seconds, trials=3)
                eff = gemm_efficiency(g, num_sms=num_sms, alignment=alignment_elements("bf16"))
                rows.append({"tp": tp, "hidden": h, "gemm": g.name, "m": g.m, "n": g.n, "k": g.k,
                             "seconds": seconds, "tflops": g.flops / seconds / 1e12, "tile": list(eff.tile),
                             "tile_eff": eff.tile_efficiency, "wave_eff": eff.wave_efficiency,
                             "pred_eff": eff.efficiency, "aligned": eff.aligned})  # fmt: skip
                del fn
                torch.cuda.empty_cache()
    best = max(float(r["tflops"]) for r in rows)  # type: ignore[arg-type]
    for r in rows:
        r["measured_eff"] = float(r["tflops"]) / best  # type: ignore[arg-type]
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(device), "num_sms": num_sms,
                                    "torch": torch.__version__, "peak_tflops_bf16": hw.peak_tflops_bf16,
                                    "rows": rows}, indent=1))  # fmt: skip
    print(f"{'tp':>3} {'hidden':>6} {'gemm':>9} {'m':>5} {'n':>6} {'k':>6} {'TFLOP/s':>8} {'meas':>6} {'pred':>6}")
    for r in rows:
        print(f"{r['tp']:>3} {r['hidden']:>6} {r['gemm']:>9} {r['m']:>5} {r['n']:>6} {r['k']:>6} "
              f"{float(r['tflops']):8.1f} {float(r['measured_eff']):6.3f} {float(r['pred_eff']):6.3f}")  # type: ignore[arg-type]  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
