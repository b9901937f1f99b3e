"""Parameter counts and padded vocabulary, shared by FLOPs, memory, validation and the trainer.

Conventions: GPT layers as Megatron-LM builds them (pre-LayerNorm, biases on every linear,
learned absolute positions, output layer tied to the word embedding). BERT adds a pooler-free
masked-LM head: a dense h x h transform with its LayerNorm, and an output bias of V.
"""

from __future__ import annotations

from conf.schema import ModelConfig, ModelKind


def padded_vocab_size(model: ModelConfig, tp: int = 1) -> int:
    """Vocabulary padded up to a multiple of make_vocab_size_divisible_by x tp, as Megatron pads.

    The padding makes the vocabulary split evenly over TP ranks and keeps the logits GEMM
    tile-aligned; the extra rows are never the target of a token.
    """
    multiple = model.make_vocab_size_divisible_by * tp
    return -(-model.vocab_size // multiple) * multiple


def layer_params(model: ModelConfig) -> int:
    """Parameters of one transformer layer (weights and biases, both LayerNorms)."""
    h, f = model.hidden_size, model.ffn
    attention = 3 * h * h + 3 * h + h * h + h  # QKV and output projection
    mlp = h * f + f + f * h + h
    norms = 2 * 2 * h
    return attention + mlp + norms


def embedding_params(model: ModelConfig, tp: int = 1) -> int:
    """Word (padded vocabulary) and position embeddings."""
    return padded_vocab_size(model, tp) * model.hidden_size + model.seq_length * model.hidden_size


def head_params(model: ModelConfig, tp: int = 1) -> int:
    """Parameters after the last layer: final LayerNorm, plus BERT's LM-head transform and bias.

    The GPT output layer is tied to the word embedding, so it adds nothing here.
    """
    h = model.hidden_size
    final_norm = 2 * h
    if model.kind == ModelKind.bert:
        return final_norm + (h * h + h) + 2 * h + padded_vocab_size(model, tp)
    return final_norm


def total_params(model: ModelConfig, tp: int = 1) -> int:
    """All parameters of the model, counted once (tied output weight not double counted)."""
    return model.num_layers * layer_params(model) + embedding_params(model, tp) + head_params(model, tp)
