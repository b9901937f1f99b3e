"""GPT and BERT as Megatron-LM shapes them, in plain single-device PyTorch.

There is no parallel logic here on purpose: tensor, pipeline and data parallelism are
applied afterwards by functions that take `(model, *, mesh)`, torchtitan-style, and find
their targets by module name. The names they rely on are stable:

    wte, wpe                       word and position embeddings
    layers["0"] ... layers["L-1"]  Block (a ModuleDict, so a pipeline stage can drop layers
                                   and keep the others' names)
    layers[i].attn.qkv, .attn.proj the attention projections (column / row parallel)
    layers[i].mlp.fc_in, .fc_out   the MLP projections (column / row parallel)
    norm                           final LayerNorm
    lm_head                        BERT only: dense + GELU + LayerNorm, decoder bias

The output layer reuses `wte.weight` (tied), as train.planner.sizes counts it, so the parameter
count equals train.planner.sizes.total_params exactly. Both uses of the word embedding go through its
module (`wte(tokens)` and `wte.logits(x, bias)`), the one hook vocabulary parallelism needs:
train.parallel swaps `wte` for a module that holds a slice of the vocabulary. Activation recompute is a switch on the
modules (`set_recompute`), not a wrapper, so that it does not rename anything.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from conf.schema import ModelConfig, ModelKind, Recompute
from train.init import initialize
from train.planner.sizes import padded_vocab_size

AttentionImpl = Literal["sdpa", "explicit"]
"""sdpa: F.scaled_dot_product_attention. explicit: matmul + softmax + matmul, which
FlopCounterMode can count on CPU (it counts CPU SDPA as 0 FLOPs)."""

IGNORE_INDEX = -100
"""Label of positions that carry no loss (BERT's unmasked tokens)."""



class Attention(nn.Module):
    """Multi-head self-attention: fused QKV projection, attention core, output projection."""

    def __init__(self, hidden: int, heads: int, *, causal: bool, impl: AttentionImpl = "sdpa") -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}")
        self.head_dim = hidden // heads
        self.causal = causal
        self.impl: AttentionImpl = impl
        self.checkpoint_core = False
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # QKV features are laid out per head ([head, q|k|v, head_dim]) and the head count is
        # inferred, so that a column-parallel qkv hands each TP rank whole heads and this code
        # runs unchanged on the shard.
        q, k, v = self.qkv(x).view(b, s, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        if self.checkpoint_core and torch.is_grad_enabled():
            out = checkpoint(self._core, q, k, v, use_reentrant=False)
        else:
            out = self._core(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.impl == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        if self.causal:
            s = q.shape[-2]
            future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        return torch.softmax(scores, dim=-1).to(v.dtype) @ v


class MLP(nn.Module):
    """Two linear layers with GELU between them (h -> ffn -> h)."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc_in = nn.Linear(hidden, ffn)
        self.fc_out = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer layer: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig, *, causal: bool, attention: AttentionImpl = "sdpa") -> None:
        super().__init__()
        h = cfg.hidden_size
        self.ln_1 = nn.LayerNorm(h)
        self.attn = Attention(h, cfg.num_attention_heads, causal=causal, impl=attention)
        self.ln_2 = nn.LayerNorm(h)
        self.mlp = MLP(h, cfg.ffn)
        self.checkpoint_block = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_block and torch.is_grad_enabled():
            out: torch.Tensor = checkpoint(self._forward, x, use_reentrant=False)
            return out
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class OutputLayer(Protocol):
    """What the LM head needs of the word embedding (the plain one or a vocabulary slice)."""

    def logits(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...


def exclude_padding(bias: torch.Tensor | None, *, rows: int, real: int, like: torch.Tensor) -> torch.Tensor | None:
    """The output layer's bias for `rows` vocabulary rows of which the first `real` are real tokens
    and the rest the padding to a multiple of make_vocab_size_divisible_by x tp: -inf there, so that
    the padded rows' logits are -inf and drop out of the softmax (the loss and its gradient do not
    depend on the padding, hence not on tp). A [rows] tensor, not a logit-sized one: the matmul adds
    it as its bias. `bias` unchanged (None included) when there is no padding; `like` gives dtype
    and device."""
    real = max(real, 0)
    if real >= rows:
        return bias
    pad = torch.zeros(rows, dtype=like.dtype, device=like.device)
    pad[real:] = float("-inf")
    return pad if bias is None else bias + pad


class WordEmbedding(nn.Embedding):
    """The word embedding, which is also the (tied) output layer. Its rows from `vocab_size` on
    are padding: their logits are -inf (exclude_padding)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, vocab_size: int | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.vocab_size = num_embeddings if vocab_size is None else vocab_size

    def logits(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [b, s, h] -> logits [b, s, vocab rows held], -inf in the padded rows."""
        bias = exclude_padding(bias, rows=self.num_embeddings, real=self.vocab_size, like=self.weight)
        return F.linear(x, self.weight, bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, vocab_size={self.vocab_size}"


class MaskedLMHead(nn.Module):
    """BERT's LM-head transform (dense, GELU, LayerNorm) and the decoder's own bias."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.bias = nn.Parameter(torch.zeros(vocab))

    def forward(self, x: torch.Tensor, decoder: OutputLayer) -> torch.Tensor:
        return decoder.logits(self.norm(F.gelu(self.dense(x))), self.bias)


class TransformerLM(nn.Module):
    """Embeddings, `num_layers` Blocks and a tied output layer; GPT and BERT differ only in the
    attention mask and the head. forward(tokens [b, s]) returns logits [b, s, padded V], -inf in
    the padded rows (the loss does not depend on the padding).

    `tp` only pads the vocabulary (to a multiple of make_vocab_size_divisible_by x tp, as
    train.planner.sizes does), so that a TP run's embedding splits evenly over its ranks."""

    causal: bool = True

    def __init__(self, cfg: ModelConfig, *, attention: AttentionImpl = "sdpa", tp: int = 1) -> None:
        super().__init__()
        self.config = cfg
        vocab = padded_vocab_size(cfg, tp)
        self.wte = WordEmbedding(vocab, cfg.hidden_size, vocab_size=cfg.vocab_size)
        self.wpe = nn.Embedding(cfg.seq_length, cfg.hidden_size)
        self.layers = nn.ModuleDict(
            {str(i): Block(cfg, causal=self.causal, attention=attention) for i in range(cfg.num_layers)}
        )
        self.norm = nn.LayerNorm(cfg.hidden_size)
        self.lm_head: MaskedLMHead | None = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for layer in self.layers.values():
            x = layer(x)
        x = self.norm(x)
        if self.lm_head is not None:
            return self.lm_head(x, self.wte)
        return self.wte.logits(x)


class GPT(TransformerLM):
    """Decoder-only causal LM."""

    causal = True


class BERT(TransformerLM):
    """Bidirectional encoder with a masked-LM head (no pooler, no token types: as train.planner.sizes counts)."""

    causal = False

    def __init__(self, cfg: ModelConfig, *, attention: AttentionImpl = "sdpa", tp: int = 1) -> None:
        super().__init__(cfg, attention=attention, tp=tp)
        self.lm_head = MaskedLMHead(cfg.hidden_size, self.wte.num_embeddings)


def model_class(cfg: ModelConfig) -> type[TransformerLM]:
    """GPT or BERT, by cfg.kind."""
    return GPT if cfg.kind == ModelKind.gpt else BERT


def build_model(
    cfg: ModelConfig,
    *,
    recompute: Recompute = Recompute.none,
    attention: AttentionImpl = "sdpa",
    device: torch.device | str | None = None,
    tp: int = 1,
    seed: int | None = None,
) -> TransformerLM:
    """The model of `cfg.kind` on `device`, with the vocabulary padded for `tp` tensor-parallel ranks.

    Parameters are filled by train.init from `seed` (default: the seed torch's generator was last
    set to), the same values whatever later splits the model. On the meta device nothing is
    allocated or filled: split and shard it first, then `to_empty` and train.init.initialize.
    """
    on_meta = device is not None and torch.device(device).type == "meta"
    with torch.device("meta"):
        model = model_class(cfg)(cfg, attention=attention, tp=tp)
    set_recompute(model, recompute)
    if on_meta:
        return model
    model.to_empty(device=device if device is not None else "cpu")
    initialize(model, seed=torch.initial_seed() if seed is None else seed, num_layers=cfg.num_layers)
    return model


def set_recompute(model: nn.Module, mode: Recompute) -> None:
    """Activation recompute: none, selective (attention core only) or full (every Block).

    Selective keeps the cheap-to-recompute, memory-hungry part (scores, softmax) out of
    the saved activations; full saves only each Block's input and reruns its forward.
    """
    mode = Recompute(mode)
    for module in model.modules():
        if isinstance(module, Block):
            module.checkpoint_block = mode == Recompute.full
        elif isinstance(module, Attention):
            module.checkpoint_core = mode == Recompute.selective


def count_params(model: nn.Module) -> int:
    """Parameters counted once (the tied output weight is the embedding's)."""
    return sum(p.numel() for p in model.parameters())


def num_layers(model: TransformerLM) -> int:
    """Blocks this model (or pipeline stage) holds."""
    return len(model.layers)


LossSum = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(logits, labels) -> summed token cross-entropy (lm_loss_sum, or train.parallel's vocab-parallel twin)."""


def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies over the labelled positions (fp32).

    A sum, not a mean: the trainer divides by the labelled-token count of the whole global
    batch, so that gradient accumulation over micro-batches equals one large batch exactly
    even when micro-batches hold different numbers of BERT masks.
    """
    return F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
