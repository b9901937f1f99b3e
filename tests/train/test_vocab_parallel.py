"""train.parallel's vocabulary parallelism in 2 gloo processes (tp = 2), against the unsharded model,
with DTensors (apply_tp, the native engine) and with plain tensors (apply_tp_plain, for DeepSpeed).

Each worker builds the same seeded model, applies apply_tp and records what it holds and computes;
the test compares that with the one-process model: each rank holds padded_vocab / 2 rows of the
word embedding (and of BERT's decoder bias), its logits are its vocabulary slice only, and the
vocab-parallel loss and the gradients equal the unsharded ones (rel 1e-5: fp32, only the summation
order changes).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from conf.schema import ModelConfig, ModelKind
from train import distributed
from train.distributed import build_mesh
from train.model import IGNORE_INDEX, build_model, count_params, lm_loss_sum
from train.parallel import VocabParallelEmbedding, apply_tp, apply_tp_plain, lm_loss_fn
from train.planner.sizes import padded_vocab_size, total_params

from .ranks import start_ranks

TP = 2
RTOL = 1e-5
PADDED_APART = 400
"""A vocabulary padded to 448 rows on one rank and to 512 for tp = 2."""

RankRecord = dict[tuple[str, bool, int], dict[str, Any]]
"""What a worker records: (model kind, plain tensors, vocabulary size) -> its figures by name."""


def tiny(kind: ModelKind, *, vocab_size: int = 500) -> ModelConfig:
    # 500 pads to 512 (a multiple of 64 x tp) on both layouts; 400 pads to 448 unsharded and to 512
    # for tp = 2, where the padded rows (-inf logits) must leave the loss unchanged.
    return ModelConfig(
        name="tiny",
        kind=kind,
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=None,
        seq_length=16,
        vocab_size=vocab_size,
        make_vocab_size_divisible_by=64,
    )


def batch(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=gen)
    labels[:, ::3] = IGNORE_INDEX  # BERT-like unlabelled positions carry neither loss nor gradient
    return tokens, labels


def reference(cfg: ModelConfig, *, tp: int = TP) -> dict[str, Any]:
    """The one-process model's loss and gradients, its vocabulary padded as for `tp` ranks."""
    torch.manual_seed(0)
    model = build_model(cfg, tp=tp)
    tokens, labels = batch(cfg)
    loss = lm_loss_sum(model(tokens), labels)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return {"loss": float(loss.detach()), "grads": grads}


def _worker(rank: int, init_file: str, kinds: list[ModelKind], out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=TP)
    try:
        mesh = build_mesh("cpu", pp=1, dp=1, tp=TP)
        results: RankRecord = {}
        for kind in kinds:
            for plain, vocab_size in ((False, 500), (True, 500), (False, PADDED_APART), (True, PADDED_APART)):
                cfg = tiny(kind, vocab_size=vocab_size)
                torch.manual_seed(0)
                model = build_model(cfg, tp=TP)
                if plain:
                    apply_tp_plain(model, tp_group=mesh["tp"].get_group())
                else:
                    apply_tp(model, tp_mesh=mesh["tp"])
                tokens, labels = batch(cfg)
                logits = model(tokens)
                loss = lm_loss_fn(model)(logits, labels)
                loss.backward()
                wte = model.wte
                assert isinstance(wte, VocabParallelEmbedding)
                local = [(name, p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad, p)
                         for name, p in model.named_parameters() if p.grad is not None]
                bias = model.lm_head.bias if model.lm_head is not None else None
                results[(kind.value, plain, vocab_size)] = {
                    "rows": wte.weight.to_local().shape[0] if not plain else wte.weight.shape[0],
                    "start": wte.start,
                    "global_rows": wte.weight.shape[0] if not plain else wte.weight.shape[0] * TP,
                    "bias_rows": None if bias is None else (bias.shape[0] if plain else bias.to_local().shape[0]),
                    "logits_shape": tuple(logits.shape),
                    "loss": float(loss.detach()),
                    "grads": {name: g.clone() for name, g, _ in local},
                    "tmp": {name for name, _, p in local if getattr(p, "tensor_model_parallel", False)},
                }
        torch.save(results, f"{out}.{rank}")
    finally:
        distributed.destroy_process_group()  # collects first: nothing left for gloo's teardown


@pytest.fixture(scope="module")
def tp_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[RankRecord]:
    """Both model kinds on 2 TP workers: one spawn (its start-up dominates the test's time)."""
    tmp = tmp_path_factory.mktemp("vocab_tp")
    out = str(tmp / "rank")
    start_ranks(_worker, (str(tmp / "init"), [ModelKind.gpt, ModelKind.bert], out), TP)
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(TP)]


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    # Relative to the tensor's scale: single elements near zero differ by ~1e-7 absolute.
    torch.testing.assert_close(got, want, rtol=RTOL, atol=RTOL * float(want.abs().max()))


@pytest.mark.parametrize("plain", [False, True], ids=["dtensor", "plain"])
@pytest.mark.parametrize("kind", [ModelKind.gpt, ModelKind.bert])
def test_vocab_split_matches_unsharded(tp_ranks: list[RankRecord], kind: ModelKind, plain: bool) -> None:
    cfg = tiny(kind)
    vocab = padded_vocab_size(cfg, TP)
    assert vocab == 512
    ref = reference(cfg)
    ranks = [r[(kind.value, plain, 500)] for r in tp_ranks]
    rows = vocab // TP
    for r, got in enumerate(ranks):
        assert got["rows"] == rows and got["start"] == r * rows and got["global_rows"] == vocab
        assert got["bias_rows"] == (rows if kind == ModelKind.bert else None)
        assert got["logits_shape"] == (2, cfg.seq_length, rows)  # never the full vocabulary
        assert got["loss"] == pytest.approx(ref["loss"], rel=RTOL)  # every rank the whole loss
        sl = slice(r * rows, (r + 1) * rows)
        # The tied embedding's gradient (lookup + output layer) is this rank's rows of the full one.
        close(got["grads"]["wte.weight"], ref["grads"]["wte.weight"][sl])
        if kind == ModelKind.bert:
            close(got["grads"]["lm_head.bias"], ref["grads"]["lm_head.bias"][sl])
        # Replicated parameters see the whole gradient on every rank (the output's input gradient
        # was summed over TP).
        for name in ("wpe.weight", "norm.weight", "layers.0.ln_1.weight"):
            close(got["grads"][name], ref["grads"][name])
    # The two slices together are the whole embedding gradient, with nothing counted twice.
    close(torch.cat([got["grads"]["wte.weight"] for got in ranks]), ref["grads"]["wte.weight"])


@pytest.mark.parametrize("kind", [ModelKind.gpt, ModelKind.bert])
def test_plain_tp_shards_layers_like_megatron(tp_ranks: list[RankRecord], kind: ModelKind) -> None:
    """apply_tp_plain: qkv/fc_in hold output rows, proj/fc_out input columns, each rank's gradient the
    matching slice of the unsharded one; exactly the sharded tensors carry tensor_model_parallel
    (what DeepSpeed's gradient norm sums over TP), the replicated ones (row biases, norms) do not."""
    cfg = tiny(kind)
    ref = reference(cfg)["grads"]
    h = cfg.hidden_size
    for r, got in enumerate(r[(kind.value, True, 500)] for r in tp_ranks):
        grads = got["grads"]
        for name in ("qkv", "fc_in"):
            full_name = f"layers.0.{'attn' if name == 'qkv' else 'mlp'}.{name}"
            rows = ref[f"{full_name}.weight"].shape[0] // TP
            close(grads[f"{full_name}.weight"], ref[f"{full_name}.weight"][r * rows : (r + 1) * rows])
            close(grads[f"{full_name}.bias"], ref[f"{full_name}.bias"][r * rows : (r + 1) * rows])
        for name in ("attn.proj", "mlp.fc_out"):
            cols = ref[f"layers.0.{name}.weight"].shape[1] // TP
            close(grads[f"layers.0.{name}.weight"], ref[f"layers.0.{name}.weight"][:, r * cols : (r + 1) * cols])
            close(grads[f"layers.0.{name}.bias"], ref[f"layers.0.{name}.bias"])  # replicated, whole
        assert grads["layers.0.attn.qkv.weight"].shape == (3 * h // TP, h)
        sharded = {
            f"layers.{i}.{m}.{t}"
            for i in range(cfg.num_layers)
            for m, t in [("attn.qkv", "weight"), ("attn.qkv", "bias"), ("mlp.fc_in", "weight"),
                         ("mlp.fc_in", "bias"), ("attn.proj", "weight"), ("mlp.fc_out", "weight")]
        } | {"wte.weight"} | ({"lm_head.bias"} if kind == ModelKind.bert else set())
        assert got["tmp"] == sharded


def test_model_pads_vocabulary_for_tp() -> None:
    # 150 tokens: 192 rows on one rank (3 x 64), 256 for tp = 2 (a multiple of 64 x 2), as train.planner.sizes
    # and the memory model count them; the parameter count follows.
    cfg = tiny(ModelKind.bert, vocab_size=150)
    for tp, rows in ((1, 192), (2, 256)):
        model = build_model(cfg, tp=tp)
        assert model.wte.num_embeddings == rows == padded_vocab_size(cfg, tp)
        assert model.lm_head is not None and model.lm_head.bias.shape[0] == rows
        assert count_params(model) == total_params(cfg, tp)


@pytest.mark.parametrize("plain", [False, True], ids=["dtensor", "plain"])
@pytest.mark.parametrize("kind", [ModelKind.gpt, ModelKind.bert])
def test_loss_does_not_depend_on_vocabulary_padding(
    tp_ranks: list[RankRecord], kind: ModelKind, plain: bool
) -> None:
    """tp = 2 pads 400 tokens to 512 rows, one process to 448: the padded rows are out of the softmax
    (their logits -inf, in the vocab-parallel max and sum too), so the loss and the real rows'
    gradients equal the unsharded model's and the padded rows get no gradient. Rank 1's rows
    256..511 are 144 real and 112 padded ones."""
    cfg = tiny(kind, vocab_size=PADDED_APART)
    assert (padded_vocab_size(cfg, 1), padded_vocab_size(cfg, TP)) == (448, 512)
    ref = reference(cfg, tp=1)
    ranks = [r[(kind.value, plain, PADDED_APART)] for r in tp_ranks]
    rows = 512 // TP
    names = ["wte.weight"] + (["lm_head.bias"] if kind == ModelKind.bert else [])
    for got in ranks:
        assert got["loss"] == pytest.approx(ref["loss"], rel=RTOL)
        for name in ("wpe.weight", "norm.weight", "layers.0.ln_1.weight"):
            close(got["grads"][name], ref["grads"][name])
    for name in names:
        whole = torch.cat([got["grads"][name] for got in ranks])
        assert whole.shape[0] == TP * rows
        close(whole[:PADDED_APART], ref["grads"][name][:PADDED_APART])
        assert whole[PADDED_APART:].count_nonzero() == 0
        assert ref["grads"][name][PADDED_APART:].count_nonzero() == 0
