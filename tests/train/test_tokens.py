"""train.tokens: a token file opened and judged without torch, for the run (train.data) and the dry run
(train.paths) alike. The samples drawn from one are tested in test_trainer.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from train.tokens import DataFileError, TokenFile

REPO = Path(__file__).resolve().parents[2]


def test_a_file_shorter_than_one_sample_is_refused_naming_the_field(tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    np.arange(40, dtype=np.uint16).tofile(path)
    file = TokenFile(path, vocab_size=1000)
    with pytest.raises(DataFileError) as refused:
        file.refuse_for(seq_length=40, vocab_size=1000)
    assert str(refused.value) == (
        f"training.data_path={str(path)!r} holds 40 tokens (read as uint16, training.data_dtype=auto), fewer than one "
        "sample of model.seq_length + 1 = 41; give a longer token file, or a shorter model.seq_length"
    )
    file.refuse_for(seq_length=39, vocab_size=1000)  # one sample: it trains, reading it over and over
    assert file.windows_of(39) == 1 and file.windows_of(3) == 13


def test_one_file_is_judged_for_several_vocabularies_from_one_read(tmp_path: Path) -> None:
    path = tmp_path / "tokens.bin"
    ids = np.arange(1000, dtype=np.uint16)
    ids[700] = 1500
    ids.tofile(path)
    file = TokenFile(path, vocab_size=2000)
    assert file.largest_scanned() == 1500
    file.refuse_for(seq_length=40, vocab_size=2000)
    with pytest.raises(DataFileError, match=r"its largest token id is 1500 .* model.vocab_size=1000 .* at token 700"):
        file.refuse_for(seq_length=40, vocab_size=1000)


def test_the_token_checks_import_without_torch() -> None:
    # The launchers open token files on login nodes, where torch may be missing.
    probe = ("import sys; sys.modules['torch'] = None; import train.tokens, train.paths; "
             "print('numpy' in sys.modules)")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr
    lazy = "import sys; import train.paths; print('numpy' in sys.modules)"  # numpy only once a file is named
    proc = subprocess.run([sys.executable, "-c", lazy], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "False", proc.stderr
