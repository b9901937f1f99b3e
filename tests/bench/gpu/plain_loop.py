"""The reference a GPU run of megasweep's trainer is held to (issue 14): a plain PyTorch loop.

    python -m tests.bench.gpu.plain_loop --model gpt_1.3b --mbs 8 --gbs 32 --recompute none

Same model code and initialisation as the trainer (train.model.build_model), the same micro-batch,
gradient accumulation, recompute mode, bf16 autocast, gradient clipping and torch's fused AdamW;
none of the trainer's machinery around them (no planner, no per-iteration metrics or memory hooks,
no power sampler, no loss all-reduce). The loss is a plain mean over tokens. Prints one JSON line:
the median seconds per iteration over the timed iterations, each ended by a device synchronisation
(the trainer's log does the same per iteration).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from conf.schema import ModelConfig, ModelKind, Recompute
from train.model import build_model


def model_config(name: str) -> ModelConfig:
    """conf/model/<name>.yaml as the dataclass (no Hydra: this loop shares only the model code)."""
    data = yaml.safe_load((Path(__file__).resolve().parents[3] / "conf" / "model" / f"{name}.yaml").read_text())
    data = {k: v for k, v in data.items() if k != "defaults"}
    return ModelConfig(**{**data, "kind": ModelKind(data.get("kind", "gpt"))})


def main(argv: list[str] | None = None) -> dict[str, float | int | str]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--mbs", type=int, required=True)
    p.add_argument("--gbs", type=int, required=True)
    p.add_argument("--recompute", default="none", choices=[r.value for r in Recompute])
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    args = p.parse_args(argv)
    cfg = model_config(args.model)
    device = torch.device("cuda")
    torch.manual_seed(1234)
    model = build_model(cfg, recompute=Recompute(args.recompute), device=device, seed=1234)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)  # fmt: skip
    step_model = torch.compile(model) if args.compile else model
    accum = args.gbs // args.mbs
    vocab = cfg.vocab_size
    times = []
    for it in range(args.iters):
        tic = time.perf_counter()
        for _ in range(accum):
            tokens = torch.randint(0, vocab, (args.mbs, cfg.seq_length + 1), device=device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = step_model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - tic)
        print(f"plain_loop iteration {it + 1}: {times[-1]:.4f} s loss {loss.item() * accum:.4f}", flush=True)
    timed = times[args.warmup:]
    out: dict[str, float | int | str] = {
        "model": args.model, "micro_batch_size": args.mbs, "global_batch_size": args.gbs,
        "recompute": args.recompute, "compile": int(args.compile), "iterations": len(timed),
        "sec_per_iter": statistics.median(timed), "sec_per_iter_min": min(timed), "sec_per_iter_max": max(timed),
        "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "max_memory_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
    }  # fmt: skip
    print("PLAIN_LOOP " + json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
