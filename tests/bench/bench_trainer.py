"""Trainer overhead: train.trainer against a plain single-file PyTorch loop of the identical model.

    python -m tests.bench bench_trainer

The plain loop below is its own minimal GPT (pre-LN blocks, fused per-head QKV, SDPA attention,
tied output layer), not train.model: same parameter count, same initial weights (copied from the
trainer's seeded build), same samples (train.data's synthetic tokens), the same AdamW (fused,
betas 0.9/0.95, decay on matrices only), grad clipping at 1.0 and cosine schedule, fp32, one
process. Both run in this process one after the other, alternating, ROUNDS times; each figure is
the median tokens/s over the iterations after warm-up, as the trainer's record reports it, and,
less sensitive to other load on a shared machine, the fastest iteration's tokens/s. Their
losses are printed side by side as the check that the two loops train the same model.
Figures only; nothing here asserts on time.
"""

from __future__ import annotations

import contextlib
import io
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from torch import nn

from conf import register_configs
from conf.schema import RunConfig, to_run_config

REPO = Path(__file__).resolve().parents[2]
# About 1.3M parameters and 1,024 tokens per step: a fraction of a second per iteration on 2 cores.
OVERRIDES = (
    "model=tiny",
    "model.num_layers=4",
    "model.hidden_size=128",
    "model.num_attention_heads=4",
    "model.seq_length=128",
    "model.vocab_size=4096",
    "parallelism.micro_batch_size=4",
    "parallelism.global_batch_size=8",
    "parallelism.precision=fp32",
    "parallelism.optimizer=torch_fused",
    "training.train_iters=20",
    "training.warmup_iters=4",
    "training.log_interval=1000",
    "logger=disabled",
    "hardware.peak_measured=false",
    "hardware.peak_tflops_fp32=1.0",
)
ROUNDS = 3


def compose_run() -> RunConfig:
    register_configs()  # Hydra reads the schema from its ConfigStore
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return to_run_config(compose("config", overrides=list(OVERRIDES)))


# ---------------------------------------------------------------------------------------------
# The plain loop: everything it needs, written out.


class PlainBlock(nn.Module):
    def __init__(self, h: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, h // heads
        self.ln1 = nn.LayerNorm(h)
        self.qkv, self.out = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.up, self.down = nn.Linear(h, ffn), nn.Linear(ffn, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        # [b, s, heads, (q, k, v), head_dim] -> three [b, heads, s, head_dim]
        qkv = self.qkv(self.ln1(x)).view(b, s, self.heads, 3, self.head_dim)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, s, h))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class PlainGPT(nn.Module):
    def __init__(self, vocab: int, seq: int, h: int, heads: int, ffn: int, layers: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(PlainBlock(h, heads, ffn) for _ in range(layers))
        self.ln = nn.LayerNorm(h)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln(x), self.tok.weight)


def plain_model(run: RunConfig, reference: nn.Module) -> PlainGPT:
    """The plain GPT with the reference (train.model) weights, matched by shape in definition order."""
    m = run.model
    vocab = reference.state_dict()["wte.weight"].shape[0]
    model = PlainGPT(vocab, m.seq_length, m.hidden_size, m.num_attention_heads, m.ffn, m.num_layers)
    ours, theirs = list(model.parameters()), list(reference.parameters())
    assert [p.shape for p in ours] == [p.shape for p in theirs], "the two models differ in shape"
    with torch.no_grad():
        for mine, ref in zip(ours, theirs, strict=True):
            mine.copy_(ref)
    return model


def cosine_lr(step: int, *, peak: float, total: int, floor_ratio: float = 0.1) -> float:
    frac = min((step - 1) / max(total, 1), 1.0)
    return peak * (floor_ratio + (1 - floor_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def plain_loop(run: RunConfig) -> tuple[list[float], list[float], int]:
    """(losses, seconds per iteration, params) of the plain loop over the trainer's samples."""
    from train.data import get_batch, make_source
    from train.model import build_model

    tr, par = run.training, run.parallelism
    torch.manual_seed(tr.seed)
    model = plain_model(run, build_model(run.model))
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": tr.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=tr.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=True,
    )
    source = make_source(run.model, seed=tr.seed, data_path=None)
    mbs, gbs = par.mbs, par.global_batch_size
    losses, times = [], []
    for step in range(1, tr.train_iters + 1):
        start = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, peak=tr.lr, total=tr.train_iters)
        opt.zero_grad(set_to_none=True)
        first = (step - 1) * gbs
        batches = [
            get_batch(source, run.model, indices=range(i, i + mbs), seed=tr.seed, device=torch.device("cpu"))
            for i in range(first, first + gbs, mbs)
        ]
        labelled = sum(int((y != -100).sum()) for _, y in batches)
        total = torch.zeros(())
        for x, y in batches:
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
            loss = loss / labelled
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tr.grad_clip)
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(float(total))
    return losses, times, sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------


def trainer_run(run: RunConfig, out: Path) -> tuple[list[float], float, list[float], int]:
    """(losses, median tokens/s, seconds per iteration, params) from train.trainer's own record."""
    from train.trainer import run_training

    with contextlib.redirect_stdout(io.StringIO()):
        record = run_training(run, output_dir=out, overrides=list(OVERRIDES))
    return record["losses"], record["tokens_per_s_per_device"], record["iteration_times_s"], record["params"]


def main() -> None:
    run = compose_run()
    tokens = run.parallelism.global_batch_size * run.model.seq_length
    warm = run.training.warmup_iters
    print(
        f"model: {run.model.num_layers} layers, h={run.model.hidden_size}, seq={run.model.seq_length}, "
        f"V={run.model.vocab_size}; {tokens} tokens/step, {run.training.train_iters} steps ({warm} warm-up), "
        f"fp32, {torch.get_num_threads()} threads"
    )
    trainer_rates, plain_rates, trainer_best, plain_best = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="bench_trainer_") as tmp:
        for r in range(ROUNDS):
            t_losses, t_rate, t_times, t_params = trainer_run(run, Path(tmp) / f"r{r}")
            p_losses, p_times, p_params = plain_loop(run)
            p_rate = tokens / statistics.median(p_times[warm:])
            assert t_params == p_params, f"parameter counts differ: {t_params} vs {p_params}"
            trainer_rates.append(t_rate)
            plain_rates.append(p_rate)
            trainer_best.append(tokens / min(t_times[warm:]))
            plain_best.append(tokens / min(p_times[warm:]))
            print(
                f"round {r + 1}: trainer {t_rate:,.0f} tokens/s, plain loop {p_rate:,.0f} tokens/s, "
                f"ratio {t_rate / p_rate:.3f}"
            )
            if r == 0:
                worst = max(abs(a - b) / abs(b) for a, b in zip(t_losses, p_losses, strict=True))
                print(
                    f"params {t_params:,} both; losses first {t_losses[0]:.6f} vs {p_losses[0]:.6f}, "
                    f"last {t_losses[-1]:.6f} vs {p_losses[-1]:.6f} (max relative difference {worst:.1e})"
                )
    trainer, plain = statistics.median(trainer_rates), statistics.median(plain_rates)
    print(
        f"median over {ROUNDS} rounds: trainer {trainer:,.0f} tokens/s, plain loop {plain:,.0f} tokens/s, "
        f"trainer/plain = {trainer / plain:.3f} (target >= 0.97)"
    )
    best_t, best_p = max(trainer_best), max(plain_best)
    print(
        f"fastest iteration: trainer {best_t:,.0f} tokens/s, plain loop {best_p:,.0f} tokens/s, "
        f"trainer/plain = {best_t / best_p:.3f}"
    )


if __name__ == "__main__":
    main()
