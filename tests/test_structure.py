"""The code's shape, checked: no import cycles, one definition of each on-disk name, short loop
functions, the launchers independent of the analysis, and README's layout table naming every module.

Read from the source with `ast`, so these checks see what a reader sees, and import nothing.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from train import contract

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("conf", "train", "launchers", "analysis", "hydra_plugins")
LOOP_MODULES = ("train/loop.py", "train/engine.py", "train/setup.py", "train/trainer.py", "train/preemption.py")
MAX_FUNCTION_LINES = 60


def modules() -> dict[str, Path]:
    """Every project module by dotted name."""
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def module_level_imports(path: Path, known: set[str]) -> set[str]:
    """Project modules imported when `path` is imported: top-level statements only (not inside
    functions, not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node) if not isinstance(node, ast.FunctionDef | ast.ClassDef) else ():
            names: list[str] = []
            if isinstance(sub, ast.Import):
                names = [a.name for a in sub.names]
            elif isinstance(sub, ast.ImportFrom) and sub.module and sub.level == 0:
                names = [sub.module] + [f"{sub.module}.{a.name}" for a in sub.names]
            out.update(n for n in names if n in known)
    return out


def test_no_import_cycles() -> None:
    mods = modules()
    graph = {name: module_level_imports(path, set(mods)) - {name} for name, path in mods.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(name: str) -> Iterator[list[str]]:
        state[name] = 1
        stack.append(name)
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                yield stack[stack.index(dep) :] + [dep]
            elif dep not in state:
                yield from visit(dep)
        stack.pop()
        state[name] = 2

    cycles = [cycle for name in sorted(graph) if name not in state for cycle in visit(name)]
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_launchers_do_not_import_the_analysis() -> None:
    for path in sorted((REPO / "launchers").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("analysis"), f"{path.name} imports {node.module}"
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("analysis") for a in node.names), path.name


def test_on_disk_names_are_defined_once() -> None:
    names = {
        contract.RESULT_FILE,
        contract.PLAN_FILE,
        contract.SEARCH_FILE,
        contract.MANIFEST_FILE,
        contract.MULTIRUN_FILE,
        contract.STATE_DIR,
        contract.LAUNCH_FILE,
        contract.EXPORTED_JOBS_DIR,
        contract.DS_CONFIG_FILE,
        contract.TENSORBOARD_DIR,
        contract.CHECKPOINT_DIR,
        contract.LOG_FILE,
        contract.SUBMITIT_DIR,
        contract.SLURM_LOG_DIR,
        contract.CACHE_DIR_ENV,
    }
    defining = REPO / "train" / "contract.py"
    found = []
    for path in modules().values():
        if path == defining:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.value!r}")
    assert found == [], "on-disk names spelled out again (use train.contract): " + ", ".join(found)


def test_requeue_exit_code_is_defined_once() -> None:
    found = []
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value == contract.EXIT_REQUEUE and not isinstance(node.value, bool):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert found == ["train/contract.py:" + str(_line_of("EXIT_REQUEUE = "))], found


def _line_of(prefix: str) -> int:
    lines = (REPO / "train" / "contract.py").read_text().splitlines()
    return next(i for i, line in enumerate(lines, start=1) if line.startswith(prefix))


def test_the_loop_modules_functions_fit_on_a_screen() -> None:
    long = []
    for rel in LOOP_MODULES:
        tree = ast.parse((REPO / rel).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{rel}:{node.name} ({length} lines)")
    assert long == [], "functions longer than a screen: " + ", ".join(long)


LAYOUT_PACKAGES = ("train", "train/planner", "launchers", "analysis", "hydra_plugins/megasweep")


def _without_parentheses(text: str) -> str:
    out, depth = [], 0
    for ch in text:
        depth += ch == "("
        if depth == 0:
            out.append(ch)
        depth -= ch == ")" and depth > 0
    return "".join(out)


def readme_layout() -> dict[str, set[str]]:
    """Modules README's "Layout" table names, by package directory: a row's backticked names outside
    parentheses (what is inside them describes a module), and a row whose path is a module itself."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    named: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) != 2 or not cells[0].startswith("`"):
            continue
        path = cells[0].strip("`").rstrip("/")
        if path.endswith(".py"):
            named.setdefault(str(Path(path).parent), set()).add(Path(path).stem)
        else:
            named.setdefault(path, set()).update(re.findall(r"`([^`]+)`", _without_parentheses(cells[1])))
    return named


def test_readme_layout_names_every_module() -> None:
    named = readme_layout()
    for package in LAYOUT_PACKAGES:
        modules_there = {p.stem for p in (REPO / package).glob("*.py") if p.stem != "__init__"}
        listed = named.get(package, set())
        assert modules_there - listed == set(), f"README's layout table does not name {package}/ modules"
        assert listed - modules_there == set(), f"README's layout table names {package}/ modules that do not exist"


def test_package_docstrings_list_every_module() -> None:
    # Each package's docstring lists its modules one a line ("    name   what it holds"); the
    # train package names its torch-free parts (train.planner, train.contract) in its prose.
    for package in ("train", "train/planner", "launchers", "analysis"):
        doc = ast.get_docstring(ast.parse((REPO / package / "__init__.py").read_text()), clean=False) or ""
        listed = set(re.findall(r"^    (\w+) ", doc, flags=re.MULTILINE))
        dotted = set(re.findall(rf"\b{package.replace('/', '.')}\.(\w+)", doc))
        there = {p.stem for p in (REPO / package).glob("*.py") if p.stem != "__init__"}
        there |= {p.parent.name for p in (REPO / package).glob("*/__init__.py")}
        assert there - listed - dotted == set(), f"{package}/__init__.py's docstring does not list them"
        assert listed - there == set(), f"{package}/__init__.py's docstring lists modules that do not exist"


def test_the_loop_has_no_engine_branch() -> None:
    # What differs between engines is behind train.engine's interface, not an isinstance in the loop.
    tree = ast.parse((REPO / "train" / "loop.py").read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert names & {"NativeEngine", "DeepSpeedEngine", "Engine"} == set()
