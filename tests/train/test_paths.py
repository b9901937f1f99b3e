"""train.paths: a run's token file and checkpoint directory, judged on this machine once per distinct path,
with the run's own checks (train.tokens, the run's checkpoint_dir check)."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pytest

from conf import CONFIG_DIR
from launchers.compose import FastComposer
from train import tokens
from train.__main__ import cannot_run_here
from train.paths import PathWarnings, checkpoint_dir_problem, samples_asked, wraps_around
from train.tokens import DataFileError, TokenFile

# tiny: seq_length 256, vocab_size 8192; 10 iterations of 8 samples = 80 samples of 257 tokens.
SAMPLES = 80
LONG_ENOUGH = SAMPLES * 256 + 1


@pytest.fixture(scope="module")
def composer() -> FastComposer:
    return FastComposer.from_config_dir(CONFIG_DIR)


def ids(path: Path, count: int, *, high: int = 8000) -> Path:
    np.random.default_rng(0).integers(0, high, size=count).astype(np.uint16).tofile(path)
    return path


def warned(composer: FastComposer, *jobs: list[str]) -> list[str]:
    paths = PathWarnings()
    for job in jobs:
        paths.note(composer.run_config(["model=tiny", *job]))
    return paths.warnings()


def test_valid_paths_give_no_warning(composer: FastComposer, tmp_path: Path) -> None:
    data = ids(tmp_path / "tokens.bin", LONG_ENOUGH)
    fresh = tmp_path / "not" / "yet" / "there"
    assert warned(composer, [f"training.data_path={data}", "training.save_interval=5",
                             f"training.checkpoint_dir={fresh}"]) == []  # fmt: skip
    assert not (tmp_path / "not").exists()  # judged without making it: a dry run writes nothing there
    # A checkpoint_dir that nothing saves into (save_interval=0) is not the run's concern either.
    file = tmp_path / "a_file"
    file.write_text("")
    assert warned(composer, [f"training.checkpoint_dir={file}"], []) == []


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda d: d / "missing.bin", "cannot be read as a token file ([Errno 2] No such file or directory"),
        (lambda d: d, "cannot be read as a token file ("),  # a directory
        (lambda d: ids(d / "short.bin", 200), "holds 200 tokens (read as uint16, training.data_dtype=auto), fewer "
         "than one sample of model.seq_length + 1 = 257; give a longer token file, or a shorter model.seq_length"),
        (lambda d: ids(d / "wide.bin", LONG_ENOUGH, high=9000), "its largest token id is 8999 (read as uint16, "
         "training.data_dtype=auto), not below model.vocab_size=8192 as every id must be"),
    ],
    ids=["missing", "directory", "shorter-than-a-sample", "beyond-the-vocabulary"],
)  # fmt: skip
def test_a_token_file_the_run_refuses_is_one_warning_naming_it(composer: FastComposer, tmp_path: Path, make,
                                                                words: str) -> None:  # fmt: skip
    path = make(tmp_path)
    jobs = [[f"training.data_path={path}", f"training.lr={lr}"] for lr in (1e-4, 2e-4, 3e-4)]
    (line,) = warned(composer, *jobs)
    assert line.startswith(f"training.data_path={str(path)!r}"), line
    assert words in line, line
    # Where it was judged, that the compute nodes may see otherwise, and what the run does then.
    host = socket.gethostname()
    assert f"[checked on this machine ({host}), which may not see the file systems the runs will; a run that " \
           "finds the same refuses it at its start, after the sweep was queued; 3 config(s) name it]" in line
    # The run's own words: what the plan warns of is what the run refuses.
    with pytest.raises(DataFileError) as refused:
        TokenFile(path, vocab_size=8192).refuse_for(seq_length=256, vocab_size=8192)
    assert line.startswith(str(refused.value))


def test_a_token_file_shorter_than_the_run_reads_is_said_to_wrap_around(composer: FastComposer, tmp_path: Path) -> None:
    path = ids(tmp_path / "tokens.bin", 20 * 256 + 1)  # 20 samples of the 80 asked
    (line,) = warned(composer, [f"training.data_path={path}"], [f"training.data_path={path}", "training.train_iters=20"])
    assert line.startswith(
        f"training.data_path={str(path)!r} holds 5,121 tokens (read as uint16): 20 samples of model.seq_length=256 "
        "(+1, the last target), and the run asks for 160 (training.train_iters=20 of parallelism.global_batch_size=8): "
        "it wraps around, reading the file from its start again after sample 20 (each sample about 8.0 times); give "
        "a longer file, or fewer training.train_iters, for every sample to be new"
    ), line  # the config that reads it most often over
    assert line.endswith("which may not see the file systems the runs will; 2 config(s) name it]"), line
    # A path some configs would refuse and others read around: two lines, each counting its own configs
    # among those naming the path (one line, the refusal's, counted the wrap-around's configs as none).
    wraps, refused = warned(composer, [f"training.data_path={path}", "training.train_iters=20"],
                            [f"training.data_path={path}", "model.seq_length=8192"],
                            [f"training.data_path={path}", "model.seq_length=8192", "training.seed=2"])  # fmt: skip
    assert "it wraps around" in wraps and wraps.endswith("; 1 of the 3 config(s) naming it]"), wraps
    assert "fewer than one sample of model.seq_length + 1 = 8193" in refused
    assert refused.endswith("after the sweep was queued; 2 of the 3 config(s) naming it]"), refused
    # The local launcher's runs are this machine's: the refusal is its own, and no other file system is said.
    paths = PathWarnings()
    for overrides in ([f"training.data_path={path}", "training.train_iters=20"],
                      [f"training.data_path={path}", "model.seq_length=8192"]):  # fmt: skip
        paths.note(composer.run_config(overrides))
    (refusal,) = paths.refusals()
    assert refusal.startswith(f"training.data_path={str(path)!r}") and refusal.endswith("[1 of the 2 config(s) naming it]")
    (here,) = paths.warnings(here=True)
    assert "it wraps around" in here and "may not see" not in here and here.endswith("[1 of the 2 config(s) naming it]")


def test_each_distinct_path_is_opened_once(composer: FastComposer, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    opened: list[str] = []
    scans: list[int] = []
    real_init, real_scan = TokenFile.__init__, tokens.scan_ids

    def counting_init(self: TokenFile, path: str | Path, **kwargs: object) -> None:
        opened.append(str(path))
        real_init(self, path, **kwargs)  # type: ignore[arg-type]

    def counting_scan(*args: object, **kwargs: object) -> tuple[int, int | None]:
        scans.append(1)
        return real_scan(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(TokenFile, "__init__", counting_init)
    monkeypatch.setattr(tokens, "scan_ids", counting_scan)
    good, short = ids(tmp_path / "good.bin", LONG_ENOUGH), ids(tmp_path / "short.bin", 1000)
    jobs = [[f"training.data_path={p}", f"parallelism.tp={tp}", f"training.lr={lr}", f"model.vocab_size={v}"]
            for p in (good, short) for tp in (1, 2) for lr in (1e-4, 2e-4) for v in (8192, 8320)]  # fmt: skip
    lines = warned(composer, *jobs)
    assert opened == [str(good), str(short)]  # one width (uint16) each, whatever the vocabulary
    assert len(scans) == 2  # its largest id, read once per file
    assert len(lines) == 1 and "8 config(s) name it" in lines[0]


def test_a_checkpoint_dir_the_run_refuses_is_one_warning(composer: FastComposer, tmp_path: Path) -> None:
    file = tmp_path / "a_file"
    file.write_text("")
    jobs = [["training.save_interval=5", f"training.checkpoint_dir={where}", f"parallelism.tp={tp}"]
            for where in (file, file / "ckpt") for tp in (1, 2)]  # fmt: skip
    is_file, under_file = warned(composer, *jobs)
    assert is_file.startswith(f"training.checkpoint_dir={file} is a file, not a directory: name a directory "
                              "(made if missing) [checked on this machine (")  # fmt: skip
    assert under_file.startswith(f"training.checkpoint_dir={file / 'ckpt'}: cannot write there ({file} is a file); "
                                 "name a directory you can create and write, or leave it null for <run dir>/checkpoints")
    assert all(line.endswith("refuses it at its start, after the sweep was queued; 2 config(s) name it]")
               for line in (is_file, under_file))  # fmt: skip


def test_a_checkpoint_dir_that_cannot_be_written_is_a_warning(composer: FastComposer) -> None:
    # /sys takes no files, root's or anyone's (a read-only directory would not stop root).
    where = "/sys/megasweep-test/ckpt"
    (line,) = warned(composer, ["training.save_interval=5", f"training.checkpoint_dir={where}"])
    assert line.startswith(f"training.checkpoint_dir={where}: cannot write there ("), line
    assert "; name a directory you can create and write, or leave it null for <run dir>/checkpoints [checked" in line
    assert not Path("/sys/megasweep-test").exists()


def test_the_run_and_the_plan_judge_a_checkpoint_dir_alike(composer: FastComposer, tmp_path: Path) -> None:
    file = tmp_path / "a_file"
    file.write_text("")
    run = composer.run_config(["model=tiny", "training.save_interval=5", f"training.checkpoint_dir={file}"])
    assert cannot_run_here(run) == checkpoint_dir_problem(str(file)) == checkpoint_dir_problem(str(file), make=False)
    made = tmp_path / "made"
    assert checkpoint_dir_problem(str(made), make=False) is None and not made.exists()
    assert checkpoint_dir_problem(str(made)) is None and made.is_dir()  # the run makes it, as it will save there


def test_samples_asked_count_the_ramp_up(composer: FastComposer, tmp_path: Path) -> None:
    run = composer.run_config(["model=tiny", "training.train_iters=4", "parallelism.global_batch_size=16"])
    assert samples_asked(run.parallelism, run.training.train_iters) == 64
    ramped = composer.run_config(["model=tiny", "training.train_iters=4", "parallelism.global_batch_size=16",
                                  "parallelism.rampup_batch_size=[4,4,16]"])  # fmt: skip
    asked = samples_asked(ramped.parallelism, 4)
    assert 16 < asked < 64
    path = ids(tmp_path / "tokens.bin", 2 * 256 + 1)
    note = wraps_around(TokenFile(path, vocab_size=8192), ramped)
    assert note is not None and f"asks for {asked} (training.train_iters=4 of parallelism.global_batch_size=16 " \
                                 "after its ramp-up)" in note  # fmt: skip
    assert wraps_around(TokenFile(ids(tmp_path / "long.bin", 64 * 256 + 1), vocab_size=8192), run) is None
