"""train.model: sizes match train.planner.sizes, masks, recompute and attention paths agree."""

from __future__ import annotations

import pytest
import torch

from conf.schema import ModelConfig, ModelKind, Recompute
from train.model import (
    BERT,
    GPT,
    IGNORE_INDEX,
    Attention,
    TransformerLM,
    build_model,
    count_params,
    lm_loss_sum,
    num_layers,
)
from train.planner.sizes import padded_vocab_size, total_params

TINY = ModelConfig(
    name="t",
    kind=ModelKind.gpt,
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    seq_length=16,
    vocab_size=100,
    make_vocab_size_divisible_by=8,
)
TINY_BERT = ModelConfig(**{**TINY.__dict__, "kind": ModelKind.bert})


def _tokens(cfg: ModelConfig, batch: int = 2, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length), generator=g)


def _model(cfg: ModelConfig, **kwargs: object) -> TransformerLM:
    torch.manual_seed(0)
    return build_model(cfg, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "cfg",
    [
        TINY,
        TINY_BERT,
        # ffn != 4h and a vocabulary that needs padding (100 -> 104)
        ModelConfig(
            name="odd",
            kind=ModelKind.gpt,
            num_layers=3,
            hidden_size=48,
            num_attention_heads=6,
            ffn_hidden_size=80,
            seq_length=8,
            vocab_size=100,
            make_vocab_size_divisible_by=8,
        ),
        ModelConfig(
            name="odd_bert",
            kind=ModelKind.bert,
            num_layers=3,
            hidden_size=48,
            num_attention_heads=6,
            ffn_hidden_size=80,
            seq_length=8,
            vocab_size=100,
            make_vocab_size_divisible_by=8,
        ),
    ],
    ids=lambda c: c.name + "-" + c.kind.value,
)
def test_parameter_count_equals_train_sizes(cfg: ModelConfig) -> None:
    model = build_model(cfg)
    assert count_params(model) == total_params(cfg, tp=1)
    assert num_layers(model) == cfg.num_layers
    assert model.wte.weight.shape[0] == padded_vocab_size(cfg)
    assert isinstance(model, GPT if cfg.kind == ModelKind.gpt else BERT)


def test_tp_plan_targets_exist_by_name() -> None:
    names = dict(_model(TINY).named_modules())
    for target in ("attn.qkv", "attn.proj", "mlp.fc_in", "mlp.fc_out"):
        assert isinstance(names[f"layers.0.{target}"], torch.nn.Linear)


def test_attention_shards_by_heads_like_tensor_parallel() -> None:
    # Emulates a 2-way column-parallel qkv and row-parallel proj without torch.distributed:
    # each rank keeps a contiguous half of qkv's output rows and of proj's input columns, and
    # the partial outputs sum (the all-reduce) to the unsharded output, with the model code as is.
    torch.manual_seed(0)
    full = Attention(32, 4, causal=True)
    x = torch.randn(2, 8, 32)
    partial = []
    for rank in range(2):
        shard = Attention(16, 2, causal=True)  # 2 of the 4 heads, same head_dim 8
        shard.qkv = torch.nn.Linear(32, 48)
        shard.proj = torch.nn.Linear(16, 32)
        with torch.no_grad():
            shard.qkv.weight.copy_(full.qkv.weight[rank * 48 : (rank + 1) * 48])
            shard.qkv.bias.copy_(full.qkv.bias[rank * 48 : (rank + 1) * 48])
            shard.proj.weight.copy_(full.proj.weight[:, rank * 16 : (rank + 1) * 16])
            shard.proj.bias.copy_(full.proj.bias if rank == 0 else torch.zeros(32))
            partial.append(shard(x))
    with torch.no_grad():
        torch.testing.assert_close(partial[0] + partial[1], full(x), rtol=1e-5, atol=1e-6)


def test_gpt_output_is_tied_to_word_embedding() -> None:
    model = _model(TINY)
    captured: list[torch.Tensor] = []
    model.norm.register_forward_hook(lambda _m, _i, out: captured.append(out))
    with torch.no_grad():
        logits = model(_tokens(TINY))
    real = TINY.vocab_size  # the padded rows' logits are -inf (test_padded_vocabulary_does_not_change_loss)
    torch.testing.assert_close(logits[..., :real], captured[0] @ model.wte.weight[:real].T, rtol=1e-5, atol=1e-5)


def test_causal_mask_future_tokens_do_not_change_past_logits() -> None:
    model = _model(TINY).eval()
    x = _tokens(TINY)
    changed = x.clone()
    t = 9
    changed[:, t + 1 :] = (changed[:, t + 1 :] + 1) % TINY.vocab_size
    with torch.no_grad():
        a, b = model(x), model(changed)
    # Exactly equal in practice; 1e-6 allows for a different reduction order.
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])


def test_bert_attends_both_ways() -> None:
    model = _model(TINY_BERT).eval()
    x = _tokens(TINY_BERT)
    changed = x.clone()
    changed[:, -1] = (changed[:, -1] + 1) % TINY_BERT.vocab_size
    with torch.no_grad():
        assert not torch.allclose(model(x)[:, 0], model(changed)[:, 0])


def _loss_and_grads(cfg: ModelConfig, **kwargs: object) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = _model(cfg, **kwargs)
    x = _tokens(cfg)
    labels = torch.roll(x, -1, dims=1)
    loss = lm_loss_sum(model(x), labels) / labels.numel()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("cfg", [TINY, TINY_BERT], ids=["gpt", "bert"])
@pytest.mark.parametrize("mode", [Recompute.selective, Recompute.full])
def test_recompute_gives_identical_loss_and_grads(cfg: ModelConfig, mode: Recompute) -> None:
    base_loss, base_grads = _loss_and_grads(cfg, recompute=Recompute.none)
    loss, grads = _loss_and_grads(cfg, recompute=mode)
    # Recompute re-runs the same fp32 kernels on the same inputs: equal up to 1e-6 relative.
    torch.testing.assert_close(loss, base_loss, rtol=1e-6, atol=1e-7)
    assert grads.keys() == base_grads.keys()
    for name in base_grads:
        torch.testing.assert_close(grads[name], base_grads[name], rtol=1e-6, atol=1e-7, msg=name)


def test_recompute_actually_checkpoints() -> None:
    # Saved-tensor count drops with full recompute: evidence that checkpointing is active.
    def saved(mode: Recompute) -> int:
        model = _model(TINY, recompute=mode)
        count = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal count
            count += 1
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(_tokens(TINY)).sum()
        return count

    assert saved(Recompute.full) < saved(Recompute.selective) < saved(Recompute.none)


@pytest.mark.parametrize("cfg", [TINY, TINY_BERT], ids=["gpt", "bert"])
def test_explicit_attention_matches_sdpa(cfg: ModelConfig) -> None:
    sdpa = _model(cfg, attention="sdpa").eval()
    explicit = _model(cfg, attention="explicit").eval()
    x = _tokens(cfg)
    with torch.no_grad():
        # fp32, different summation order in softmax and matmul: agree to 1e-5.
        torch.testing.assert_close(explicit(x), sdpa(x), rtol=1e-5, atol=1e-5)


def test_explicit_attention_is_visible_to_flop_counter() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    def attention_flops(impl: str) -> int:
        model = _model(TINY, attention=impl)
        with FlopCounterMode(display=False) as counter:
            model(_tokens(TINY, batch=1))
        return int(counter.get_total_flops())

    cfg = TINY
    # Per layer, QK^T and attention x V: 2 GEMMs of 2*s*s*h FLOPs each (batch 1).
    core = cfg.num_layers * 2 * 2 * cfg.seq_length**2 * cfg.hidden_size
    assert attention_flops("explicit") - attention_flops("sdpa") == core


def test_loss_sum_ignores_unlabelled_positions() -> None:
    logits = torch.randn(1, 4, 10)
    labels = torch.tensor([[1, IGNORE_INDEX, 3, IGNORE_INDEX]])
    expected = torch.nn.functional.cross_entropy(logits[0, [0, 2]], labels[0, [0, 2]], reduction="sum")
    torch.testing.assert_close(lm_loss_sum(logits, labels), expected)


@pytest.mark.parametrize("cfg", [TINY, TINY_BERT], ids=["gpt", "bert"])
def test_padded_vocabulary_does_not_change_loss(cfg: ModelConfig) -> None:
    """The padding to a multiple of make_vocab_size_divisible_by (x tp) is out of the softmax: its
    logits are -inf, and the loss and the real rows' gradients are those of any other padding
    (100 tokens padded to 104 and to 128; the real rows start with the same values either way)."""
    x = _tokens(cfg)
    labels = _tokens(cfg, seed=1)
    labels[:, ::3] = IGNORE_INDEX
    results = []
    for divisible in (8, 64):
        model = _model(ModelConfig(**{**cfg.__dict__, "make_vocab_size_divisible_by": divisible}))
        assert model.wte.num_embeddings == padded_vocab_size(model.config, 1) > cfg.vocab_size
        logits = model(x)
        assert torch.isneginf(logits[..., cfg.vocab_size :]).all()
        assert torch.isfinite(logits[..., : cfg.vocab_size]).all()
        loss = lm_loss_sum(logits, labels)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert grads["wte.weight"][cfg.vocab_size :].count_nonzero() == 0  # padded rows: no gradient
        if cfg.kind == ModelKind.bert:
            assert grads["lm_head.bias"][cfg.vocab_size :].count_nonzero() == 0
        results.append((loss.detach(), logits[..., : cfg.vocab_size].detach(), grads))
    (loss_a, logits_a, grads_a), (loss_b, logits_b, grads_b) = results
    torch.testing.assert_close(loss_a, loss_b)
    torch.testing.assert_close(logits_a, logits_b)
    for name, grad in grads_a.items():
        real = slice(None, cfg.vocab_size) if name in ("wte.weight", "lm_head.bias") else slice(None)
        torch.testing.assert_close(grad[real], grads_b[name][real], msg=name)
    # The same loss as a softmax over the real vocabulary only.
    expected = torch.nn.functional.cross_entropy(
        logits_a.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    torch.testing.assert_close(loss_a, expected)
