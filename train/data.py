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

MASK_PROBABILITY = 0.15
"""Share of positions BERT predicts (Devlin et al. 2019); of those 80% [MASK], 10% random, 10% kept."""


class DataFileError(ValueError):
    """training.data_path names no usable token file: the user's input, said in one line, not a crash."""


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


UINT16_IDS = 2**16
"""Ids a uint16 file can hold: `auto` reads uint16 up to this vocabulary, uint32 above it."""

SIGNATURE_PREFIX = 2**20
"""uint16 values read to spot uint32 ids read as uint16: the signature shows in any stretch of the
file, so a bounded prefix keeps opening a large file cheap (2 MiB)."""

SIGNATURE_MIN_PAIRS = 32
"""Fewest (low, high) pairs the signature is judged on: below it a run of zeros is chance."""

MAX_CHUNK = 2**24
"""Token ids per read of the range check (32 MiB of uint16): bounded memory on any file size."""

SCAN_LIMIT = 2**28
"""Token ids the range check reads when the file is opened (512 MiB of uint16, a fraction of a second
from the page cache): every rank opens the file, and reading a corpus of hundreds of GB from a shared
filesystem on each of them would cost minutes and load the filesystem. Windows past it are checked
as they are drawn."""


def token_dtype(setting: TokenDtype | str | None, vocab_size: int) -> np.dtype:
    """The numpy dtype training.data_dtype names; `auto` (or None) by the vocabulary's size."""
    name = TokenDtype(getattr(setting, "value", setting) or TokenDtype.auto).value
    if name == TokenDtype.auto:
        return np.dtype(np.uint16 if vocab_size <= UINT16_IDS else np.uint32)
    return np.dtype(name)


def scan_ids(tokens: np.ndarray, vocab_size: int, *, chunk: int = MAX_CHUNK) -> tuple[int, int | None]:
    """(largest id, position of the first id >= vocab_size or None) of `tokens`, read `chunk` ids at a
    time so that a memmap of any size costs bounded memory."""
    largest, first_bad = 0, None
    for start in range(0, len(tokens), chunk):
        part = tokens[start : start + chunk]
        largest = max(largest, int(part.max()))
        if first_bad is None and largest >= vocab_size:
            first_bad = start + int(np.argmax(part >= vocab_size))
    return largest, first_bad


class MemmapTokens:
    """Consecutive windows of a flat token file (.bin of uint16, or uint32: training.data_dtype).

    Sample i starts at i x seq_length (wrapping around the file), so an epoch reads every
    token once and the windows overlap by the one token that becomes the last target.

    The file has no header, so a file of the other width reads as other tokens without any error.
    Opening it therefore checks it: uint32 ids read as uint16 (their zero high halves), and any id at
    or above the vocabulary in its first SCAN_LIMIT ids, are refused before the first step; a window
    beyond those is checked when it is drawn.
    """

    def __init__(
        self, path: str | Path, model: ModelConfig, *, dtype: TokenDtype | str | None = None, scan_limit: int = SCAN_LIMIT
    ) -> None:
        self.setting = TokenDtype(getattr(dtype, "value", dtype) or TokenDtype.auto).value
        self.dtype = token_dtype(self.setting, model.vocab_size)
        self.path = str(path)
        try:
            self.tokens = np.memmap(path, dtype=self.dtype, mode="r")
        except (OSError, ValueError) as exc:  # missing, a directory, unreadable, empty
            raise DataFileError(
                f"training.data_path={self.path!r} cannot be read as a token file ({exc}); give a flat file of "
                f"{self.dtype.name} token ids (training.data_dtype={self.setting}: auto | uint16 | uint32), "
                "or null for synthetic tokens"
            ) from None
        self.seq_length = model.seq_length
        self.vocab_size = model.vocab_size
        if len(self.tokens) < self.seq_length + 1:
            raise DataFileError(
                f"token file {path} holds {len(self.tokens)} tokens, fewer than seq_length + 1 = "
                f"{self.seq_length + 1}"
            )
        self._refuse_uint32_read_as_uint16()
        self.scanned = min(len(self.tokens), scan_limit)
        self._refuse_ids_beyond_vocabulary()
        self.windows = max((len(self.tokens) - 1) // self.seq_length, 1)

    def _read_as(self) -> str:
        return f"read as {self.dtype.name}, training.data_dtype={self.setting}"

    def _refuse_uint32_read_as_uint16(self) -> None:
        """Little-endian uint32 ids below 65536 read as uint16 alternate (id, 0): odd positions are
        nearly all 0 while even ones are not, which no real uint16 token stream does."""
        if self.dtype != np.uint16 or self.tokens.nbytes % 4:
            return  # a uint32 file is a whole number of 4-byte ids
        prefix = np.asarray(self.tokens[: min(len(self.tokens), SIGNATURE_PREFIX) // 2 * 2])
        low, high = prefix[0::2], prefix[1::2]
        if len(high) < SIGNATURE_MIN_PAIRS:
            return
        high_zero, low_zero = float(np.mean(high == 0)), float(np.mean(low == 0))
        if high_zero >= 0.95 and low_zero <= 0.5:
            raise DataFileError(
                f"training.data_path={self.path!r} looks like uint32 token ids {self._read_as()}: in its first "
                f"{len(prefix)} uint16 values {high_zero:.0%} of the odd positions are 0 (the high halves of "
                f"uint32 ids) against {low_zero:.0%} of the even ones; set training.data_dtype=uint32 "
                "(choices: auto | uint16 | uint32; the file has no header to say its width)"
            )

    def _refuse_ids_beyond_vocabulary(self) -> None:
        """Every id of the first SCAN_LIMIT below model.vocab_size: an id beyond the vocabulary would
        fail the embedding only when its window is drawn, perhaps hours in."""
        largest, first_bad = scan_ids(self.tokens[: self.scanned], self.vocab_size)
        if first_bad is not None:
            self._refuse_ids(largest, first_bad)

    def _refuse_ids(self, largest: int, first_bad: int) -> None:
        raise DataFileError(
            f"training.data_path={self.path!r}: its largest token id is {largest} ({self._read_as()}), not "
            f"below model.vocab_size={self.vocab_size} as every id must be (the first out of range is at token "
            f"{first_bad}); {self._wider_or_narrower()}"
        )

    def _wider_or_narrower(self) -> str:
        """What to change when ids exceed the vocabulary: the width, where the other one fits."""
        if self.dtype == np.uint32:
            narrow = np.asarray(self.tokens[: SIGNATURE_PREFIX // 2]).view(np.uint16)
            if int(narrow.max()) < self.vocab_size:
                return "its first ids fit as uint16: set training.data_dtype=uint16 (choices: auto | uint16 | uint32)"
        return (
            "give the model whose vocabulary the file was tokenized with (model.vocab_size), or set "
            "training.data_dtype to the width it was written with (auto | uint16 | uint32)"
        )

    def sample(self, index: int) -> np.ndarray:
        start = (index % self.windows) * self.seq_length
        window = np.asarray(self.tokens[start : start + self.seq_length + 1], dtype=np.int64)
        if start + len(window) > self.scanned and window.max(initial=0) >= self.vocab_size:
            # Past what opening the file checked.
            self._refuse_ids(int(window.max()), start + int(np.argmax(window >= self.vocab_size)))
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
