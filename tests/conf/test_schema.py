"""Every YAML composes onto the typed schema; every field is documented; bad input fails clearly."""

from __future__ import annotations

import ast
import dataclasses
import enum
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from conf import schema
from conf.schema import GROUP_SCHEMAS, RunConfig, to_field_config, to_run_config

REPO = Path(__file__).resolve().parents[2]
CONF_DIR = REPO / "conf"
SCHEMA_PY = CONF_DIR / "schema.py"

GROUP_FILES = sorted(
    (path.parent.name, path.stem) for group in GROUP_SCHEMAS for path in (CONF_DIR / group).glob("*.yaml")
)


@pytest.fixture(scope="module")
def hydra_conf() -> Iterator[None]:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield


def test_every_group_has_options() -> None:
    for group in GROUP_SCHEMAS:
        assert any(g == group for g, _ in GROUP_FILES), f"conf/{group}/ has no YAML"


@pytest.mark.usefixtures("hydra_conf")
@pytest.mark.parametrize(("group", "option"), GROUP_FILES, ids=[f"{g}={o}" for g, o in GROUP_FILES])
def test_every_yaml_composes_and_its_values_land(group: str, option: str) -> None:
    run = to_run_config(compose("config", overrides=[f"{group}={option}"]))
    node = getattr(run, group)
    assert isinstance(node, GROUP_SCHEMAS[group])
    written = OmegaConf.to_container(OmegaConf.load(CONF_DIR / group / f"{option}.yaml"))
    assert isinstance(written, dict) and written, f"conf/{group}/{option}.yaml is empty"
    for key, value in written.items():
        assert isinstance(key, str)
        actual = getattr(node, key)
        if isinstance(actual, enum.Enum):
            actual = actual.value
        assert actual == value, f"{group}.{key}: YAML says {value!r}, RunConfig has {actual!r}"


@pytest.mark.usefixtures("hydra_conf")
def test_primary_config_values_land() -> None:
    run = to_run_config(compose("config"))
    primary = OmegaConf.load(CONF_DIR / "config.yaml")
    for key, value in primary.training.items():
        assert getattr(run.training, str(key)) == value


# --------------------------------------------------------------------------------------
# Field docstrings


def _field_docs() -> list[tuple[str, str, str, str | None]]:
    """(class, field, annotation, docstring or None) for every field of every dataclass in schema.py."""
    out = []
    for cls in ast.parse(SCHEMA_PY.read_text()).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        if not any(
            ast.unparse(d).split("(")[0] in ("dataclass", "dataclasses.dataclass") for d in cls.decorator_list
        ):
            continue
        body = cls.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                nxt = body[i + 1] if i + 1 < len(body) else None
                doc = None
                if (
                    isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)
                ):
                    doc = nxt.value.value
                out.append((cls.name, stmt.target.id, ast.unparse(stmt.annotation), doc))
    return out


FIELD_DOCS = _field_docs()

# Numeric fields that are plain counts or labels: no unit to state.
UNITLESS = {"num_layers", "num_attention_heads", "max_retries", "seed"}


def test_docstring_parser_sees_every_field() -> None:
    # The AST walk must find exactly the runtime dataclass fields, or the checks below prove little.
    for name in (
        "ModelConfig",
        "ParallelismConfig",
        "HardwareConfig",
        "ClusterConfig",
        "LoggerConfig",
        "TrainingConfig",
        "RunConfig",
    ):
        runtime = [f.name for f in dataclasses.fields(getattr(schema, name))]
        parsed = [field for cls, field, _, _ in FIELD_DOCS if cls == name]
        assert parsed == runtime, name


@pytest.mark.parametrize(
    ("cls", "name", "annotation", "doc"), FIELD_DOCS, ids=[f"{c}.{n}" for c, n, _, _ in FIELD_DOCS]
)
def test_every_field_has_a_one_line_docstring(cls: str, name: str, annotation: str, doc: str | None) -> None:
    assert doc is not None, f"{cls}.{name} has no docstring"
    assert doc.strip() and "\n" not in doc.strip(), f"{cls}.{name}: docstring must be one non-empty line"
    # Scalars only: a list's docstring describes its elements instead (rampup_batch_size).
    numeric = annotation in ("int", "float", "Optional[int]", "Optional[float]", "int | None", "float | None")
    if numeric and name not in UNITLESS:
        # A unit or a range in parentheses, e.g. "(GiB)", "(tokens)", "(1)".
        assert "(" in doc and ")" in doc, f"{cls}.{name}: numeric field, docstring gives no unit: {doc!r}"
    enum_type = getattr(schema, annotation, None)
    if isinstance(enum_type, type) and issubclass(enum_type, enum.Enum):
        missing = [m.value for m in enum_type if m.value not in doc]
        assert not missing, f"{cls}.{name}: docstring does not list the choices {missing}"


# --------------------------------------------------------------------------------------
# Frozen results


@pytest.mark.usefixtures("hydra_conf")
def test_to_run_config_returns_frozen_dataclasses() -> None:
    run = to_run_config(compose("config", overrides=["model=gpt_1.3b"]))
    assert isinstance(run, RunConfig)
    for obj in (run, *(getattr(run, f.name) for f in dataclasses.fields(run))):
        assert dataclasses.is_dataclass(obj)
        first = dataclasses.fields(obj)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, first, getattr(obj, first))


@pytest.mark.usefixtures("hydra_conf")
def test_a_group_converts_alone_as_in_the_whole_config() -> None:
    cfg = compose("config", overrides=["model=gpt_1.3b", "cluster=generic_gpu", "parallelism.tp=2"])
    run = to_run_config(cfg)
    for f in dataclasses.fields(RunConfig):
        node = cfg._get_node(f.name)
        assert isinstance(node, DictConfig), f.name  # every RunConfig field is a group
        # The typed node as composed, and the same content as a plain, untyped node (merged onto the schema).
        plain = OmegaConf.create(OmegaConf.to_container(node, resolve=True))
        assert isinstance(plain, DictConfig), f.name
        for given in (node, plain):
            assert to_field_config(f.name, given) == getattr(run, f.name), f.name
    model = cfg._get_node("model")
    assert isinstance(model, DictConfig)
    with pytest.raises(KeyError):
        to_field_config("hydra", model)


# --------------------------------------------------------------------------------------
# `python -m train` with bad input: a clear message naming it, no traceback


CLI_CASES = {
    "unknown-key": (["model.foo=1"], "model.foo"),
    "wrong-type": (["parallelism.tp=abc"], "parallelism.tp=abc"),
    "bad-enum": (["parallelism.recompute=xx"], "parallelism.recompute=xx"),
    "missing-option": (["model=nosuch"], "model=nosuch is not a model config; options: bert_345m,"),
    "infeasible": (["model=tiny", "parallelism.tp=3"], "parallelism.tp=3"),
    "add-unknown-key": (["+model.foo=1"], "model.foo"),
}


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess[str]]:
    # All at once: each is a Python start-up plus a Hydra composition.
    procs = {}
    for case, (overrides, _) in CLI_CASES.items():
        run_dir = tmp_path_factory.mktemp(case)
        procs[case] = subprocess.Popen(
            [sys.executable, "-m", "train", *overrides, f"hydra.run.dir={run_dir}"],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    results = {}
    for case, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        results[case] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return results


@pytest.mark.parametrize(
    "case",
    [
        "unknown-key",
        "wrong-type",
        "bad-enum",
        "missing-option",
        "add-unknown-key",
    ],
)
def test_bad_override_fails_with_a_clear_message(cli_results, case: str) -> None:
    proc = cli_results[case]
    named = CLI_CASES[case][1]
    assert proc.returncode != 0
    assert named in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def test_infeasible_layout_exits_2_with_one_paragraph(cli_results) -> None:
    proc = cli_results["infeasible"]
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    message = proc.stderr.strip()
    assert "parallelism.tp=3" in message
    assert message.count("\n") == 0, "one paragraph"
    assert "model.num_attention_heads=4" in message  # says what tp must divide


def test_unknown_field_suggests_the_closest_fields() -> None:
    from conf.schema import unknown_field

    assert unknown_field("parallelism.tpp") == (
        "parallelism.tpp is not a field of parallelism; did you mean parallelism.tp or parallelism.pp?"
    )
    assert unknown_field("modle.hidden_size") is not None and "did you mean model" in str(unknown_field("modle"))
    assert "fields: parallelism.tp, parallelism.pp" in str(unknown_field("parallelism.zzzzzz"))
    # Fields, and anything below a dict or list field, are not unknown.
    for key in ("parallelism.tp", "model", "cluster.env.NCCL_DEBUG", "training.profile_steps"):
        assert unknown_field(key) is None, key


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("parallelism.tp", "abc", "parallelism.tp=abc is not a whole number"),
        ("parallelism.tp", "2.5", "parallelism.tp=2.5 is not a whole number"),
        ("training.lr", "fast", "training.lr=fast is not a number"),
        ("logger.tensorboard", "maybe", "logger.tensorboard=maybe is not true or false"),
        ("parallelism.precision", "bf61", "parallelism.precision=bf61 is not one of bf16, fp16, fp32 (did you mean bf16?)"),
        ("parallelism.tp", "null", "parallelism.tp=null: the field needs a value"),
    ],
)
def test_a_value_that_cannot_be_its_fields_type_is_named(key: str, value: str, problem: str) -> None:
    from conf.schema import wrong_value

    assert wrong_value(key, value) == problem or str(wrong_value(key, value)).startswith(problem)


@pytest.mark.parametrize(
    ("key", "value"),
    [("parallelism.tp", "8"), ("training.lr", "1e-4"), ("training.lr", "3"), ("logger.tensorboard", "True"),
     ("parallelism.precision", "fp32"), ("parallelism.dp", "null"), ("parallelism.micro_batch_size", "auto"),
     ("parallelism.tp", "${oc.env:TP}"), ("cluster.partition", "anything")],
)  # fmt: skip
def test_a_value_its_field_takes_passes(key: str, value: str) -> None:
    from conf.schema import wrong_value

    assert wrong_value(key, value) is None
