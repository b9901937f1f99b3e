"""Training samples: deterministic synthetic tokens, or windows of a memmapped token file.

Every sample is a pure function of (seed, global sample index): its tokens, and for BERT
its masks, come from an RNG seeded with both. So the samples of a step do not depend on
how the global batch is cut into micro-batches or data-parallel ranks, which is what makes
"4 micro-batches of 2" and "1 micro-batch of 8" (or dp=2 vs dp=1) comparable bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from conf.schema import ModelConfig, ModelKind, TokenDtype
from train.model import IGNORE_INDEX
from train.tokens import SCAN_LIMIT, DataFileError, TokenFile, scan_ids, token_dtype

# The token file's checks are train.tokens' (torch-free, the dry run asks them too); the run's callers
# keep importing them from here.
__all__ = [
    "MASK_PROBABILITY",
    "DataFileError",
    "MemmapTokens",
    "SyntheticTokens",
    "TokenSource",
    "get_batch",
    "make_source",
    "mask_for_mlm",
    "scan_ids",
    "token_dtype",
]

MASK_PROBABILITY = 0.15
"""Share of positions BERT predicts (Devlin et al. 2019); of those 80% [MASK], 10% random, 10% kept."""


class TokenSource(Protocol):
    """seq_length + 1 token ids for a global sample index."""

    def sample(self, index: int) -> np.ndarray: ...


class SyntheticTokens:
    """Uniform random token ids, a pure function of (seed, sample index).

    Ids stay below vocab_size - 1: the last id is BERT's [MASK], never a real token.
    """

    def __init__(self, model: ModelConfig, *, seed: int) -> None:
        self.length = model.seq_length + 1
        self.high = model.vocab_size - 1
        self.seed = seed

    def sample(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, index])
        return rng.integers(0, self.high, size=self.length, dtype=np.int64)


class MemmapTokens(TokenFile):
    """Consecutive windows of a flat token file (.bin of uint16, or uint32: training.data_dtype).

    Sample i starts at i x seq_length (wrapping around the file), so an epoch reads every
    token once and the windows overlap by the one token that becomes the last target.

    Opening it makes train.tokens' checks for the model (TokenFile.refuse_for), before the first step;
    a window beyond the ids they read is checked when it is drawn.
    """

    def __init__(
        self, path: str | Path, model: ModelConfig, *, dtype: TokenDtype | str | None = None, scan_limit: int = SCAN_LIMIT
    ) -> None:
        super().__init__(path, vocab_size=model.vocab_size, dtype=dtype, scan_limit=scan_limit)
        self.seq_length = model.seq_length
        self.vocab_size = model.vocab_size
        self.refuse_for(seq_length=self.seq_length, vocab_size=self.vocab_size)
        self.windows = self.windows_of(self.seq_length)

    def sample(self, index: int) -> np.ndarray:
        start = (index % self.windows) * self.seq_length
        window = np.asarray(self.tokens[start : start + self.seq_length + 1], dtype=np.int64)
        if start + len(window) > self.scanned and window.max(initial=0) >= self.vocab_size:
            # Past what opening the file checked.
            self.refuse_ids(int(window.max()), start + int(np.argmax(window >= self.vocab_size)), self.vocab_size)
        return window


def make_source(
    model: ModelConfig, *, seed: int, data_path: str | None, data_dtype: TokenDtype | str = TokenDtype.auto
) -> TokenSource:
    """The memmap file if `data_path` is set (ids of `data_dtype`), else synthetic tokens."""
    return MemmapTokens(data_path, model, dtype=data_dtype) if data_path else SyntheticTokens(model, seed=seed)


def mask_for_mlm(
    tokens: np.ndarray, *, vocab_size: int, seed: int, index: int
) -> tuple[np.ndarray, np.ndarray]:
    """BERT inputs and labels for one sample: a fixed 15% of positions predicted.

    The count is fixed (not Bernoulli per position) so every sample carries the same number of
    labelled tokens; the choice is seeded by (seed, index), distinct from the token stream.
    """
    rng = np.random.default_rng([seed, index, 1])
    n = len(tokens)
    picked = rng.choice(n, size=max(1, round(MASK_PROBABILITY * n)), replace=False)
    labels = np.full(n, IGNORE_INDEX, dtype=np.int64)
    labels[picked] = tokens[picked]
    inputs = tokens.copy()
    fate = rng.random(len(picked))
    inputs[picked[fate < 0.8]] = vocab_size - 1  # [MASK]
    randomized = picked[(fate >= 0.8) & (fate < 0.9)]
    inputs[randomized] = rng.integers(0, vocab_size - 1, size=len(randomized))
    return inputs, labels


def get_batch(
    source: TokenSource, model: ModelConfig, *, indices: Sequence[int], seed: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, labels), each [len(indices), seq_length] int64, for the given global sample indices.

    GPT: labels are the next tokens. BERT: masked inputs, labels only at predicted positions.
    """
    inputs, labels = [], []
    for index in indices:
        window = source.sample(index)
        if model.kind == ModelKind.gpt:
            inputs.append(window[:-1])
            labels.append(window[1:])
        else:
            x, y = mask_for_mlm(window[:-1], vocab_size=model.vocab_size, seed=seed, index=index)
            inputs.append(x)
            labels.append(y)
    return (
        torch.from_numpy(np.stack(inputs)).to(device, non_blocking=True),
        torch.from_numpy(np.stack(labels)).to(device, non_blocking=True),
    )
