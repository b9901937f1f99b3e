"""The fast composer gives exactly what a full Hydra compose + to_run_config gives, and fails the same way."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.utils import create_config_search_path
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import open_dict

from conf.schema import GROUP_SCHEMAS, Precision, Recompute, RunConfig, to_run_config
from launchers.compose import FastComposer
from train.contract import EXIT_USAGE

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


@pytest.fixture(scope="module")
def composer() -> FastComposer:
    return FastComposer.from_config_dir(CONF_DIR)


@pytest.fixture(scope="module")
def reference() -> Iterator[object]:
    """`reference(overrides)`: RunConfig by hydra.compose, the slow way the composer must match."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):

        def run(overrides: list[str]) -> RunConfig:
            return to_run_config(compose("config", overrides=overrides))

        yield run


SAME_AS_HYDRA = [
    pytest.param([], id="defaults"),
    pytest.param(["model=gpt_1.3b"], id="one-group"),
    pytest.param(["model=gpt_13b", "hardware=a100_80gb", "parallelism=megatron_3d"], id="three-groups"),
    pytest.param(["parallelism.tp=2", "model=gpt_1.3b", "parallelism.pp=4"], id="groups-and-values"),
    pytest.param(["parallelism.rampup_batch_size=[16,16,1000]"], id="list"),
    pytest.param(["parallelism.recompute=full", "parallelism.precision=bf16"], id="enums"),
    pytest.param(["parallelism=megatron_3d", "parallelism.dp=null"], id="null"),
    pytest.param(["parallelism.dp=8", "model.ffn_hidden_size=1000"], id="optional-set"),
    pytest.param(["model.name='my model'", "parallelism.tp='2'"], id="quoted"),
    pytest.param(["hardware=h100_sxm", "hardware.memory_gib=40"], id="int-into-float"),
    pytest.param(
        ["cluster=generic_gpu", "cluster.env.NCCL_DEBUG=INFO", "++cluster.env.NEW=1"], id="dict-field"
    ),
    pytest.param(["cluster.setup=[module load cuda,source venv/bin/activate]"], id="list-of-str"),
    pytest.param(["parallelism={tp:2,pp:2}"], id="dict-merge"),
    pytest.param(["cluster=generic_gpu", "~cluster.env.NCCL_DEBUG"], id="delete"),
    pytest.param(["++foo=1", "training.lr=0.1"], id="outside-schema"),
    pytest.param(
        ["logger=disabled", "training.train_iters=100", "training.data_path=/data/x.bin"], id="logger"
    ),
    # Each group's value overrides, evaluated on that group's node alone (FastComposer._node_effect).
    pytest.param(
        ["training.lr=1.000000e-06", "search.top_k=3", "logger.wandb_project=x", "hardware.num_sms=132",
         "model.kind=bert", "cluster.exclusive=false", "parallelism.optimizer=torch"],
        id="every-group",
    ),
    pytest.param(["training={lr:0.5,train_iters:7}"], id="group-node-merge"),
    pytest.param(["~training"], id="group-node-deleted"),  # the schema's defaults, as to_run_config fills them
    # Not independent: the composer must notice and compose these in order.
    pytest.param(["parallelism.tp=2", "parallelism.tp=4"], id="same-key-twice"),
    pytest.param(["parallelism={tp:2}", "parallelism.pp=4"], id="nested-keys"),
    pytest.param(
        ["model=gpt_1.3b", "model.ffn_hidden_size=${model.hidden_size}", "model.hidden_size=1024"],
        id="interpolation",
    ),
]


@pytest.mark.parametrize("overrides", SAME_AS_HYDRA)
def test_same_run_config_as_hydra_compose(composer: FastComposer, reference, overrides: list[str]) -> None:
    assert composer.run_config(overrides) == reference(overrides)


def test_values_land(composer: FastComposer) -> None:
    # Guards against a composer and a reference that agree on ignoring an override.
    run = composer.run_config(
        ["model=gpt_1.3b", "parallelism.tp=4", "parallelism.recompute=selective", "parallelism.dp=null"]
    )
    assert run.model.name == "gpt_1.3b" and run.model.hidden_size == 2048
    assert run.parallelism.tp == 4
    assert run.parallelism.recompute is Recompute.selective
    assert run.parallelism.dp is None
    interpolated = composer.run_config(
        ["model.ffn_hidden_size=${model.hidden_size}", "model.hidden_size=512"]
    )
    assert interpolated.model.ffn_hidden_size == 512
    assert composer.run_config(["parallelism.tp=2", "parallelism.tp=4"]).parallelism.tp == 4


def test_sweep_composes_once_per_group_choice() -> None:
    composer = FastComposer.from_config_dir(CONF_DIR)
    batch = [
        [
            f"model={m}",
            f"parallelism.tp={tp}",
            f"parallelism.micro_batch_size={mbs}",
            f"parallelism.precision={p}",
        ]
        for m, tp, mbs, p in itertools.product(["tiny", "gpt_1.3b"], [1, 2, 4], [1, 2], ["bf16", "fp16"])
    ]
    runs = composer.run_configs(batch)
    stats = composer.stats()
    assert stats.jobs == len(batch) == 24
    # One Hydra composition: the other model's node is merged from its YAML (_GroupNodes).
    assert (stats.bases, stats.derived) == (1, 1)
    assert stats.exact == 0
    # 3 tp + 2 mbs + 2 precision values; the parallelism node is the same for both models.
    assert stats.evaluations == 7
    for overrides, run in zip(batch, runs, strict=True):
        model, tp, mbs, precision = (o.split("=", 1)[1] for o in overrides)
        assert run.model.name == model
        assert (run.parallelism.tp, run.parallelism.micro_batch_size) == (int(tp), int(mbs))
        assert run.parallelism.precision is Precision(precision)
        # Untouched fields keep their base's values.
        assert run.hardware == runs[0].hardware and run.training == runs[0].training


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@pytest.mark.parametrize("group", sorted(GROUP_SCHEMAS))
def test_every_group_option_derived_as_hydra_composes_it(reference, group: str) -> None:
    # A base that differs from a composed one in a group's option takes that option's node merged
    # from its YAML, without composing: every option of conf/<group>/ must give Hydra's own config.
    options = _options(group)
    assert len(options) >= 2, f"conf/{group}/ needs two options for this test to mean something"
    composer = FastComposer.from_config_dir(CONF_DIR)
    for option in options:
        overrides = [f"{group}={option}"]
        assert composer.run_config(overrides) == reference(overrides), overrides
    stats = composer.stats()
    assert (stats.bases, stats.derived) == (1, len(options) - 1)


def test_two_groups_derived_and_a_value_override_on_a_derived_base(reference) -> None:
    composer = FastComposer.from_config_dir(CONF_DIR)
    batch = [
        [f"model={m}", f"hardware={h}", "parallelism.tp=2"]
        for m, h in itertools.product(["gpt_13b", "tiny", "bloom_176b"], ["h100_sxm", "cpu"])
    ]
    # A value override on a node that differs between bases (hardware) needs the derived base's
    # composed config: it is composed then, and the result is still Hydra's.
    batch.append(["model=tiny", "hardware=cpu", "hardware.memory_gib=40"])
    for overrides, run in zip(batch, composer.run_configs(batch), strict=True):
        assert run == reference(overrides), overrides
    stats = composer.stats()
    assert (stats.bases, stats.derived) == (2, 5)


def test_sampled_sweep_matches_hydra(composer: FastComposer, reference) -> None:
    # Every job of a small mixed sweep (group choices x values, shared bases), composed both ways.
    batch = [
        [f"model={m}", f"hardware={h}", f"parallelism.zero_stage={z}"]
        for m, h, z in itertools.product(["tiny", "gpt_350m"], ["cpu", "a100_40gb"], [0, 3])
    ]
    for overrides, run in zip(batch, composer.run_configs(batch), strict=True):
        assert run == reference(overrides), overrides


def test_values_set_on_a_shared_node_do_not_leak_between_jobs(reference) -> None:
    # Leaf values are set in place on one node per group and set back (FastComposer._leaf_effect):
    # each job, before and after others, must still compose exactly as Hydra composes it alone.
    batch = [
        ["parallelism.tp=2", "parallelism.dp=8"],
        ["parallelism.tp=4", "parallelism.recompute=full", "cluster.exclusive=false"],
        # Whole-node merges read every field of the node the leaves were set on.
        ["parallelism={pp:2}", "training={train_iters:7}", "cluster={partition:x}"],
        ["parallelism.tp=x"],  # refused: the node it was tried on must come back intact
        ["model.name='a b'", "model.ffn_hidden_size=100", "hardware.memory_gib=40"],
        ["parallelism.precision=fp16", "training.lr=1.000000e-06"],
        ["model={num_layers:3}", "hardware={num_sms:7}", "parallelism={zero_stage:1}"],
    ]
    for order in (batch, batch[::-1]):
        composer = FastComposer.from_config_dir(CONF_DIR)
        for overrides in order:
            if overrides == ["parallelism.tp=x"]:
                with pytest.raises(HydraException):
                    composer.run_config(overrides)
                continue
            assert composer.run_config(overrides) == reference(overrides), overrides


BAD = [
    pytest.param(["model.foo=1"], "model.foo", id="unknown-key"),
    pytest.param(["parallelism.tp=abc"], "parallelism.tp=abc", id="wrong-type"),
    pytest.param(["parallelism.recompute=xx"], "parallelism.recompute=xx", id="bad-enum"),
    pytest.param(["model=nosuch"], "nosuch", id="missing-option"),
    pytest.param(["+training.lr=0.1"], "training.lr", id="add-existing"),
    pytest.param(["+model.foo=1"], "+model.foo=1", id="add-unknown"),
    pytest.param(["parallelism.tp=[1,"], "parallelism.tp=[1,", id="syntax"),
    pytest.param(["~training.data_path"], "training.data_path", id="delete-null"),
    pytest.param(["~parallelism.zero_stage"], "parallelism.zero_stage", id="delete-schema-field"),
    # The bad override among good ones, in an independent job and in one composed in order.
    pytest.param(
        ["model=gpt_1.3b", "parallelism.tp=2", "parallelism.pp=x"], "parallelism.pp=x", id="among-good"
    ),
    pytest.param(["parallelism.tp=2", "parallelism.tp=x"], "parallelism.tp=x", id="in-order-path"),
    # A group's whole node replaced or deleted: not a value of the group, refused as Hydra refuses it.
    pytest.param(["training=5"], "training", id="node-replaced"),
    pytest.param(["training=null"], "training", id="node-null"),
]


@pytest.mark.parametrize(("overrides", "named"), BAD)
def test_bad_override_is_rejected_by_name(composer: FastComposer, reference, overrides, named: str) -> None:
    # Hydra (compose, then to_run_config) rejects it too: the composer must not be more lenient...
    with pytest.raises(Exception):  # noqa: B017  (Hydra's or OmegaConf's, depending on the stage)
        reference(overrides)
    for _ in range(2):  # ...and must keep rejecting it once the error is cached.
        with pytest.raises(HydraException) as error:
            composer.run_config(overrides)
        message = str(error.value)
        assert named in message, message
        assert "Traceback" not in message


def test_wrong_type_error_explains_the_type(composer: FastComposer) -> None:
    with pytest.raises(HydraException) as error:
        composer.run_config(["parallelism.tp=abc"])
    # As on Hydra's command line: the message names the override, its cause says what was wrong.
    assert "could not be converted to Integer" in str(error.value.__cause__)
    with pytest.raises(HydraException) as error:
        composer.run_config(["parallelism.recompute=xx"])
    assert "none, selective, full" in str(error.value.__cause__)


def test_a_new_key_of_a_mapping_field_is_told_to_use_plus(composer: FastComposer) -> None:
    # cluster.env is the user's own mapping: "no such key in the config" read as if cluster.env were unknown.
    with pytest.raises(HydraException) as error:
        composer.run_config(["cluster.env={A:'1'}"])
    assert "cluster.env is a mapping" in str(error.value) and "+cluster.env={A:'1'}" in str(error.value)
    assert composer.run_config(["+cluster.env={A:'1'}"]).cluster.env == {"A": "1"}


def test_compose_returns_the_full_config(composer: FastComposer) -> None:
    cfg = composer.compose(["model=gpt_1.3b", "parallelism.tp=2"])
    assert cfg.model.name == "gpt_1.3b" and cfg.parallelism.tp == 2
    assert "hydra" in cfg


def test_group_options_that_are_not_a_plain_merge_are_composed(tmp_path: Path) -> None:
    # Options whose node is not schema + YAML: the primary config's own body after the option, an
    # option moved to the global package, one with a defaults list. Each must still be Hydra's config.
    conf_dir = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf_dir, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    (conf_dir / "model" / "moved.yaml").write_text("# @package _global_\nmodel:\n  name: moved\n  num_layers: 2\n")
    (conf_dir / "hardware" / "nested.yaml").write_text("defaults:\n  - h100_sxm\n  - _self_\n\nname: nested\n")
    with_body = conf_dir / "config.yaml"
    with_body.write_text(with_body.read_text() + "cluster:\n  time_limit_min: 7\n")
    cases = [["model=gpt_13b", "hardware=cpu", "cluster=local"]] + [
        ["model=gpt_13b", "hardware=cpu", "cluster=local", *changed]
        for changed in (["model=moved"], ["hardware=nested"], ["cluster=generic_gpu"])
    ]
    composer = FastComposer.from_config_dir(conf_dir)
    # Hydra's own composition (what hydra.compose runs), without the global Hydra the module's fixture holds.
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(str(conf_dir)))
    for overrides in cases:
        # The later choice of a group wins (a dict keeps the last).
        jobs = list({o.split("=")[0]: o for o in overrides}.values())
        hydra_cfg = loader.load_configuration("config", overrides=jobs, run_mode=RunMode.RUN, from_shell=False)
        with open_dict(hydra_cfg):
            del hydra_cfg["hydra"]  # as hydra.compose returns it
        assert composer.run_config(jobs) == to_run_config(hydra_cfg), jobs
    stats = composer.stats()
    # cluster's node has a layer after the option (the body): still derived, with that layer.
    assert (stats.bases, stats.derived) == (3, 1)
    assert composer.run_config(["model=gpt_13b", "hardware=cpu", "cluster=generic_gpu"]).cluster.time_limit_min == 7


def test_a_refused_launch_leaves_no_directory_above_its_sweep_directory(tmp_path: Path) -> None:
    # The default hydra.sweep.dir, multirun/<date>/<time>: the refusal removed the sweep directory
    # (with Hydra's multirun.yaml) but left multirun/<date>/ behind, empty.
    repo = Path(__file__).resolve().parents[2]
    refused = ("-m", "model=tiny", "hydra/launcher=plan", "hydra.launcher.top=-1")
    for where in ([], ["hydra.sweep.dir=a/b/c"]):
        proc = subprocess.run([sys.executable, "-m", "train", *refused, *where], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(repo)})  # fmt: skip
        assert proc.returncode == EXIT_USAGE and "hydra.launcher.top=-1" in proc.stderr, proc.stderr
        assert list(tmp_path.iterdir()) == []


def test_configs_that_would_share_a_checkpoint_directory_are_refused_before_anything_runs(tmp_path: Path) -> None:
    # A sweep of train_iters=4,8 (or two lrs) with one training.checkpoint_dir: the second config resumed
    # from the first's last step and was recorded ok, 4 of its iterations and all its figures another's.
    repo = Path(__file__).resolve().parents[2]

    def sweep(*overrides: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "train", "-m", "model=tiny", "training.save_interval=2",
                               *overrides, "hydra/launcher=plan", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                              cwd=repo, capture_output=True, text=True, timeout=120)  # fmt: skip

    shared = f"training.checkpoint_dir={tmp_path / 'ckpt'}"
    for swept in ("training.train_iters=4,8", "training.lr=1e-4,3e-4"):
        proc = sweep(shared, swept)
        assert proc.returncode == EXIT_USAGE, proc.stderr
        assert proc.stderr.startswith("error: config 0 (") and "have one training.checkpoint_dir and one layout" in proc.stderr
        assert ") and config 1 (" in proc.stderr and "; nothing was run." in proc.stderr
        assert not (tmp_path / "sweep").exists()
    # Other layouts keep their checkpoints apart under one directory; without one, each run has its own;
    # a config its rules keep from running (a negative lr) shares nothing.
    assert sweep(shared, "parallelism.pp=1,2").returncode == 0
    shutil.rmtree(tmp_path / "sweep")
    assert sweep(shared, "training.lr=1e-4,-1.0").returncode == 0
    shutil.rmtree(tmp_path / "sweep")
    assert sweep("training.train_iters=4,8").returncode == 0


def test_hydras_basic_launcher_runs_no_config_of_a_sweep_that_has_an_infeasible_one(tmp_path: Path) -> None:
    # It has no manifest to list an infeasible config as skipped: before, the feasible configs ran, then
    # the sweep ended in the infeasible one's traceback and exit status 1. The rules judge each config
    # before any runs: one paragraph by rule, exit 2, nothing left in the directory.
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "train", "-m", "model=tiny", "parallelism.tp=3,1,5", "training.train_iters=3",
         "logger.wandb_mode=disabled", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        cwd=repo, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == EXIT_USAGE and "Traceback" not in proc.stderr, proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert line.startswith("error: 2 of 3 configs are infeasible, and this launcher lists none as skipped, so "
                           "nothing was run. [heads_divisible_by_tp] 2 config(s), e.g. config 0 "
                           "(model=tiny parallelism.tp=3 "), line  # fmt: skip
    assert "hydra/launcher=local or slurm" in line and "Launching" not in proc.stdout + proc.stderr
    assert not (tmp_path / "sweep").exists()
    # In batches of one: the infeasible third config is found before the first batch runs, by its index.
    batched = subprocess.run(
        [sys.executable, "-m", "train", "-m", "model=tiny", "parallelism.tp=1,2,3", "training.train_iters=3",
         "logger.wandb_mode=disabled", "hydra.sweeper.max_batch_size=1", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        cwd=repo, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert batched.returncode == EXIT_USAGE and "Launching" not in batched.stdout + batched.stderr, batched.stderr
    assert "error: 1 of 3 configs are infeasible" in batched.stderr and "e.g. config 2 (" in batched.stderr
    assert not (tmp_path / "sweep").exists()
