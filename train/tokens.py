"""A flat token file (training.data_path), opened and judged without torch.

The run refuses what these checks find before its first step (train.data reads its samples from a
TokenFile); the dry run and the launchers ask the same checks before anything is queued, as warnings
(train.paths). One set of checks, so both say the same thing in the same words.

The file has no header: ids of one width (uint16, or uint32: training.data_dtype), back to back. A file
of the other width reads as other tokens without any error, so opening it is checked: uint32 ids read as
uint16 (their zero high halves), and any id at or above the vocabulary in its first SCAN_LIMIT ids, are
refused; a window beyond those is checked when it is drawn (train.data.MemmapTokens.sample).

Torch-free (numpy only): the launchers import it on a login node, and only for a config that names a file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from conf.schema import TokenDtype


class DataFileError(ValueError):
    """training.data_path names no usable token file: the user's input, said in one line, not a crash."""


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
    name = dtype_setting(setting)
    if name == TokenDtype.auto:
        return np.dtype(np.uint16 if vocab_size <= UINT16_IDS else np.uint32)
    return np.dtype(name)


def dtype_setting(setting: TokenDtype | str | None) -> str:
    """training.data_dtype's value as a string ('auto' for None)."""
    return str(TokenDtype(getattr(setting, "value", setting) or TokenDtype.auto).value)


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


class TokenFile:
    """The ids of a flat token file read as one width: opened (DataFileError when it cannot be), then
    judged for a model by `refuse_for`.

    What depends on the file alone (its largest id among the first `scan_limit`) is read once, however
    many models it is judged for: a dry run judges many configs against one file.
    """

    def __init__(
        self, path: str | Path, *, vocab_size: int, dtype: TokenDtype | str | None = None, scan_limit: int = SCAN_LIMIT
    ) -> None:
        """`vocab_size` chooses the width of `auto` (token_dtype)."""
        self.setting = dtype_setting(dtype)
        self.dtype = token_dtype(self.setting, vocab_size)
        self.path = str(path)
        try:
            self.tokens = np.memmap(path, dtype=self.dtype, mode="r")
        except (OSError, ValueError) as exc:  # missing, a directory, unreadable, empty
            raise DataFileError(
                f"training.data_path={self.path!r} cannot be read as a token file ({exc}); give a flat file of "
                f"{self.dtype.name} token ids (training.data_dtype={self.setting}: auto | uint16 | uint32), "
                "or null for synthetic tokens"
            ) from None
        self.scanned = min(len(self.tokens), scan_limit)
        self._largest: int | None = None

    def refuse_for(self, *, seq_length: int, vocab_size: int) -> None:
        """DataFileError when a model of `seq_length` and `vocab_size` cannot train on the file: shorter than
        one sample, uint32 ids read as uint16, or an id of the first `scan_limit` at or past the vocabulary."""
        if len(self.tokens) < seq_length + 1:
            raise DataFileError(
                f"training.data_path={self.path!r} holds {len(self.tokens)} tokens ({self._read_as()}), fewer than "
                f"one sample of model.seq_length + 1 = {seq_length + 1}; give a longer token file, or a shorter "
                "model.seq_length"
            )
        self._refuse_uint32_read_as_uint16()
        largest = self.largest_scanned()
        if largest >= vocab_size:
            self.refuse_ids(largest, scan_ids(self.tokens[: self.scanned], vocab_size)[1] or 0, vocab_size)

    def windows_of(self, seq_length: int) -> int:
        """Distinct samples of seq_length + 1 tokens the file holds: consecutive windows that overlap by the
        one token that becomes the last target."""
        return max((len(self.tokens) - 1) // seq_length, 1)

    def largest_scanned(self) -> int:
        """The largest id among the first `scan_limit`, read once."""
        if self._largest is None:
            self._largest = scan_ids(self.tokens[: self.scanned], np.iinfo(self.dtype).max + 1)[0]
        return self._largest

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

    def refuse_ids(self, largest: int, first_bad: int, vocab_size: int) -> None:
        """DataFileError for an id (`largest`, the first out of range at `first_bad`) at or past the vocabulary."""
        raise DataFileError(
            f"training.data_path={self.path!r}: its largest token id is {largest} ({self._read_as()}), not "
            f"below model.vocab_size={vocab_size} as every id must be (the first out of range is at token "
            f"{first_bad}); {self._wider_or_narrower(vocab_size)}"
        )

    def _wider_or_narrower(self, vocab_size: int) -> str:
        """What to change when ids exceed the vocabulary: the width, where the other one fits."""
        if self.dtype == np.uint32:
            narrow = np.asarray(self.tokens[: SIGNATURE_PREFIX // 2]).view(np.uint16)
            if int(narrow.max()) < vocab_size:
                return "its first ids fit as uint16: set training.data_dtype=uint16 (choices: auto | uint16 | uint32)"
        return (
            "give the model whose vocabulary the file was tokenized with (model.vocab_size), or set "
            "training.data_dtype to the width it was written with (auto | uint16 | uint32)"
        )
