"""Compose thousands of sweep configs in seconds, with the result of one Hydra compose each.

Hydra composes every job of a sweep from scratch: defaults list, YAML loads, merges into
the typed schema (50-100 ms), and `to_run_config` adds about 25 ms more. A 10,000-config
dry run would spend many minutes there. Yet a sweep's jobs differ in few ways, so:

1. Each job's overrides are split into config-group choices (`model=gpt_13b`, also any
   `hydra/...` group) and value overrides (`a.b=c`, `+a.b=c`, `++a.b=c`, `~a.b`), parsed by
   Hydra's own OverridesParser, so quoting and types behave exactly as on the command line.
2. Hydra composes the full config once per distinct tuple of group choices (a "base"),
   and `to_run_config` converts it once; or, cheaper, a base whose group choices differ
   from an already composed base's only in options of the schema's groups (`model=...`,
   `hardware=...`) takes that base's RunConfig with those groups' nodes replaced, each node
   merged from its option's YAML as Hydra's defaults list merges it (_GroupNodes: 2 ms, not
   the 150 ms of a composition). Its full config is composed only if a job needs it.
3. Each distinct value override is evaluated once per distinct content of the top-level
   node it touches: applied with OmegaConf to a copy of a base (typed nodes still reject
   unknown keys, wrong types and bad enum values), converted with `to_run_config`, and the
   converted field at the override's key is kept, or the error.
4. A job's RunConfig is its base's RunConfig with those fields put in by
   `dataclasses.replace`: microseconds, no OmegaConf.

Step 4 is exactly what a full compose gives when a job's value overrides are independent:
no two of them reach the same field (or one inside the other), no override value and no
base value is an interpolation (which could tie one field to another). Any other job is
composed exactly instead (copy of its base, every value override in order, `to_run_config`),
which costs tens of milliseconds but is always right.

Errors are Hydra's ConfigCompositionException with a message naming the override, so
Hydra prints them as one paragraph, without a traceback.

Also here, because every megasweep launcher shares them with Hydra: `SweepLauncher` (the Hydra
context a launcher keeps), `HydraJob` (a job of any other Hydra app, run as Hydra runs it) and
`job_return` (Hydra's record of one config's outcome).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import dataclasses
import functools
import logging
import os
import shutil
import sys
import time
import typing
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra import version
from hydra.core.config_loader import ConfigLoader
from hydra.core.default_element import ConfigDefault, GroupDefault
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, run_job, setup_globals
from hydra.errors import ConfigCompositionException, HydraException, OverrideParseException
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, RunMode, TaskFunction
from omegaconf import Container, DictConfig, OmegaConf, ValueNode, flag_override, open_dict
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from conf.schema import (
    GROUP_SCHEMAS,
    RunConfig,
    register_configs,
    takes_dict,
    to_field_config,
    to_run_config,
    unknown_override,
)
from launchers.bulk import bulk_allocation
from launchers.sweepdir import (
    HYDRA_OPTIONS,
    EarlierConfig,
    RunsFailed,
    UsageError,
    claim_sweep_dir,
    missing_dirs,
    sweep_lock,
    writable_dir,
)
from train.contract import EXIT_FAILED, EXIT_USAGE, LOCK_FILE, MULTIRUN_FILE, ManifestEntry, layout_key
from train.distributed import launch_from_env, run_world
from train.paths import PathWarnings
from train.planner.layout import Layout, LayoutError
from train.planner.plan import count_by_rule, rule_example
from train.planner.rules import Violation, validate

log = logging.getLogger(__name__)

__all__ = [
    "ComposeStats",
    "FastComposer",
    "FastValidation",
    "apply_value_overrides",
    "created_by_launch",
    "is_megasweep_config",
    "parse_override",
    "sweep_composer",
]


@functools.lru_cache(maxsize=1)
def _parser() -> OverridesParser:
    return OverridesParser.create()


@functools.cache
def parse_override(text: str) -> Override:
    """Parse one command-line override with Hydra's grammar (cached: sweeps repeat them).

    Raises hydra.errors.OverrideParseException (printed by Hydra without a traceback).
    """
    try:
        return _parser().parse_overrides([text])[0]
    except OverrideParseException as ex:
        # Hydra's message may quote only the offending fragment; say which override it is in.
        if text in str(ex):
            raise
        raise OverrideParseException(override=text, message=f"Error parsing override '{text}': {ex}") from ex


def apply_value_overrides(cfg: DictConfig, overrides: Iterable[Override]) -> None:
    """Apply value overrides to a composed config in place, with Hydra's semantics.

    `key=v` must hit an existing key, `+key=v` must not (unless its value is null),
    `++key=v` sets or adds, `~key` (or `~key=v`, checked) deletes. Each failure is a
    ConfigCompositionException that names the override; the OmegaConf error (type,
    key, expected values) is its `__cause__`, which Hydra prints below it.
    """
    for override in overrides:
        line = override.input_line or override.get_key_element()
        key = override.key_or_group
        if override.is_sweep_override():
            raise ConfigCompositionException(
                f"Override '{line}' is a sweep; one config takes one value (sweep with -m)."
            )
        if override.package is not None:
            raise ConfigCompositionException(
                f"Override '{line}' has the form of a config group choice, but there is no "
                f"config group '{key}'."
            )
        value = override.value()
        try:
            if override.is_delete():
                current = OmegaConf.select(cfg, key, throw_on_missing=False)
                # Hydra refuses to delete a key whose value is null, as if it were absent.
                if current is None:
                    raise ConfigCompositionException(
                        f"Could not delete '{key}' (override '{line}'): it does not exist."
                    )
                if value is not None and value != current:
                    raise ConfigCompositionException(
                        f"Could not delete '{key}' (override '{line}'): its value is {current}, not {value}."
                    )
                parent_key, _, leaf = key.rpartition(".")
                with open_dict(cfg):
                    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
                    del parent[leaf]
            elif override.is_add():
                _check_field(key, line)
                if OmegaConf.select(cfg, key, throw_on_missing=False) is not None and not isinstance(
                    value, (dict, list)
                ):
                    raise ConfigCompositionException(
                        f"Could not add '{key}' (override '{line}'): the config already has a value "
                        f"there. Drop the '+' to change it ('{line[1:]}'), or use '++' to set it "
                        f"either way ('+{line}')."
                    )
                OmegaConf.update(cfg, key, value, merge=True, force_add=True)
            elif override.is_force_add():
                OmegaConf.update(cfg, key, value, merge=True, force_add=True)
            else:
                try:
                    OmegaConf.update(cfg, key, value, merge=True)
                except (ConfigAttributeError, ConfigKeyError) as ex:
                    _check_field(key, line)
                    if takes_dict(key):
                        # Its keys are the user's: "no such key" read as if the field itself were unknown.
                        raise ConfigCompositionException(
                            f"Could not override '{key}' (override '{line}'): {key} is a mapping, and Hydra merges "
                            f"a plain override into it, refusing keys it does not have yet. Add them with '+': "
                            f"+{line}"
                        ) from ex
                    raise ConfigCompositionException(
                        f"Could not override '{key}' (override '{line}'): no such key in the config. "
                        f"To add a new key, use +{line}"
                    ) from ex
        except OmegaConfBaseException as ex:
            raise ConfigCompositionException(f"Error merging override {line}") from ex


def _check_field(key: str, line: str) -> None:
    """A paragraph with "did you mean" for a key the schema does not have (conf.schema.unknown_override):
    adding it with '+', as Hydra suggests, would only fail later."""
    if key.split(".", 1)[0] == "hydra":
        return
    problem = unknown_override(key, line)
    if problem is not None:
        raise ConfigCompositionException(problem)


def is_megasweep_config(cfg: DictConfig) -> bool:
    """True when `cfg` was composed on megasweep's schema (its root is typed RunConfig)."""
    return OmegaConf.get_type(cfg) is RunConfig


@dataclass(frozen=True)
class ComposeStats:
    """What a FastComposer has done so far (counts of work, for the summary line)."""

    jobs: int
    """Configs returned by run_config (jobs)."""
    bases: int
    """Full Hydra compositions: at most one per distinct tuple of group choices (compositions)."""
    evaluations: int
    """Value overrides applied to a copy of a base and converted (evaluations)."""
    exact: int
    """Jobs composed exactly, override by override, because the shortcut would not be exact (jobs)."""
    seconds: float
    """Time spent inside run_config (seconds)."""
    derived: int = 0
    """Distinct tuples of group choices derived from a composed one by merging their options' nodes (bases)."""


@dataclass(frozen=True)
class _Effect:
    value: Any = None
    error: Exception | None = None


@dataclass
class _Base:
    """One composition per distinct tuple of group choices (mutable cache entry)."""

    groups: tuple[str, ...]
    cfg: DictConfig | None = None
    """The composed config; None until a job needs it for a base derived from another (FastComposer._cfg)."""
    task: DictConfig | None = None
    run: RunConfig | None = None
    error: Exception | None = None
    exact_only: bool = False
    effects: dict[str, _Effect] = dataclasses.field(default_factory=dict)
    """Converted value (or error) of each value override on this base, by override string."""
    nodes: dict[str, DictConfig] = dataclasses.field(default_factory=dict)
    """One top-level node of the task config each, alone in a root of its own (see _node_effect)."""


@dataclass(frozen=True)
class _Item:
    """One override string, parsed and classified once per sweep."""

    override: Override
    is_group: bool
    path: tuple[str, ...]
    """Where its converted value goes in a RunConfig (see _field_path)."""
    span: tuple[str, ...]
    """What it may touch, for the independence test: the path, or the top-level key outside RunConfig."""
    exact_only: bool
    """A sweep or an interpolated value: only an in-order composition is exact."""
    leaf: bool = False
    """`key=value` with a plain value on a leaf field of RunConfig (FastComposer._leaf_effect)."""


@dataclass(frozen=True)
class _Job:
    groups: tuple[str, ...]
    values: tuple[_Item, ...]
    independent: bool


class _NotIndependent(Exception):
    pass


class _Unusual(Exception):
    """An override the leaf shortcut does not handle exactly (FastComposer._leaf_effect)."""


def _contains_interpolation(value: Any) -> bool:
    if isinstance(value, str):
        return "${" in value
    if isinstance(value, dict):
        return any(_contains_interpolation(k) or _contains_interpolation(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_contains_interpolation(v) for v in value)
    return False


@functools.cache
def _field_path(key: str) -> tuple[str, ...]:
    """The longest prefix of a dotted key that names nested RunConfig dataclass fields.

    `parallelism.tp` -> (parallelism, tp); `cluster.env.X` -> (cluster, env): an override
    below a dict or list field replaces that whole field; `foo` -> () (not in RunConfig).
    """
    path: list[str] = []
    typ: Any = RunConfig
    for part in key.split("."):
        if not (isinstance(typ, type) and dataclasses.is_dataclass(typ)):
            break
        hints = typing.get_type_hints(typ)
        if part not in hints:
            break
        path.append(part)
        typ = hints[part]
    return tuple(path)


def _get_path(obj: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        obj = getattr(obj, part)
    return obj


def _replace_paths(obj: Any, updates: dict[str, Any]) -> Any:
    """obj with each (nested) field replaced; `updates` maps a field to a value or to a
    `_Nested` dict of updates below it, so each dataclass on the way is rebuilt once."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        # e.g. an Optional dataclass field that is null in this base.
        raise _NotIndependent
    changes = {
        name: _replace_paths(getattr(obj, name), sub) if isinstance(sub, _Nested) else sub
        for name, sub in updates.items()
    }
    return dataclasses.replace(obj, **changes)


class _Nested(dict):  # type: ignore[type-arg]
    """Updates below a field (distinguishes them from a dict-valued field's new value)."""


def _disjoint(spans: Sequence[tuple[str, ...]]) -> bool:
    """No span equals another or lies inside it."""
    for i, a in enumerate(spans):
        for b in spans[i + 1 :]:
            n = min(len(a), len(b))
            if a[:n] == b[:n]:
                return False
    return True


class _GroupNodes:
    """One schema group's node (`model`, `hardware`, ...) for any of its options, as Hydra composes it.

    Hydra composes a group's node by merging, in defaults-list order, what each config of the
    list puts at that package: here the schema's typed node (megasweep_schema), then the chosen
    option's YAML, then the primary config's own body if it has that key. When the defaults list
    is that simple (checked once per group by `_find_layers`: no interpolated or package-moved
    defaults, no nested defaults, no other group below this one, no search-path change), the
    node of any option is those same layers merged with that option in the middle: a YAML load
    and a merge (2 ms) instead of a composition (150 ms). Whatever is not that simple gives None,
    and the caller composes with Hydra. The reference composition keys the check: `reproduces`
    must find the reference's own option giving the reference's node.
    """

    def __init__(self, repository: Any, config_name: str | None, reference: DictConfig) -> None:
        self._repo = repository
        self._config_name = config_name
        self._reference = reference
        self._layers: dict[str, tuple[list[Container], list[Container]] | None] = {}
        self._values: dict[tuple[str, str], Any] = {}
        self._reproduced: dict[str, bool] = {}

    def value(self, group: str, option: str) -> Any:
        """The group's dataclass (e.g. ModelConfig) for this option; None when only Hydra can tell."""
        key = (group, option)
        if key not in self._values:
            self._values[key] = self._value(group, option)
        return self._values[key]

    def reproduces(self, group: str, option: str, composed: Any) -> bool:
        """Whether the reference's option, merged here, gives the node Hydra composed for it."""
        if group not in self._reproduced:
            value = self.value(group, option)
            self._reproduced[group] = value is not None and value == composed
        return self._reproduced[group]

    def _load(self, path: str) -> Any:
        """Hydra's loaded config at `path` (its ConfigResult), or None when it has a defaults list of
        its own or a package header that moves it out of its group."""
        try:
            loaded = self._repo.load_config(path)
        except HydraException:
            return None
        if loaded is None or loaded.defaults_list:
            return None
        group = path.rpartition("/")[0]
        if loaded.header.get("package") not in (None, "_group_", group.replace("/", ".") or None):
            return None
        return loaded

    def _value(self, group: str, option: str) -> Any:
        layers = self._group_layers(group)
        loaded = self._load(f"{group}/{option}") if layers is not None else None
        if layers is None or loaded is None or not isinstance(loaded.config, DictConfig):
            return None
        if _contains_interpolation(OmegaConf.to_container(loaded.config, resolve=False)):
            return None
        before, after = layers
        try:
            node = OmegaConf.merge(*before, loaded.config, *after)
            assert isinstance(node, DictConfig)
            return to_field_config(group, node)
        except Exception:  # noqa: BLE001  (Hydra's composition says what is wrong, exactly)
            return None

    def _group_layers(self, group: str) -> tuple[list[Container], list[Container]] | None:
        if group not in self._layers:
            self._layers[group] = self._find_layers(group)
        return self._layers[group]

    def _find_layers(self, group: str) -> tuple[list[Container], list[Container]] | None:
        """(nodes merged at `group` before its option, nodes merged after), or None if not that simple."""
        if (
            self._config_name is None
            or "/" in self._config_name
            or OmegaConf.select(self._reference, "hydra.searchpath", default=None)
        ):
            return None
        try:
            primary = self._repo.load_config(self._config_name)
        except HydraException:
            return None
        if primary is None or primary.defaults_list is None or primary.header.get("package") is not None:
            return None
        choices = OmegaConf.select(self._reference, "hydra.runtime.choices", default=None) or {}
        before: list[Container] = []
        after: list[Container] = []
        seen = False
        for default in primary.defaults_list:
            if isinstance(default, GroupDefault) and default.group is not None:
                name = default.group
                if name == "hydra" or name.startswith("hydra/"):
                    continue
                if (
                    not isinstance(default.value, str)
                    or default.is_interpolation()
                    or default.package is not None
                    or default.override
                    or default.deleted
                ):
                    return None
                if name == group:
                    if seen:
                        return None
                    seen = True
                elif name.startswith(f"{group}/"):
                    return None
                elif choices.get(name) is not None and self._load(f"{name}/{choices[name]}") is None:
                    return None  # another group's option, which might land in this group's package
            elif isinstance(default, ConfigDefault):
                # The primary config sits at the root of the search path (below), so paths are as written.
                if "${" in str(default.path) or default.package is not None or default.deleted:
                    return None
                if default.is_self():
                    body = primary.config
                else:
                    loaded = self._load(str(default.path))
                    if loaded is None:
                        return None
                    body = loaded.config
                if isinstance(body, DictConfig) and group in body:
                    node = body._get_node(group)
                    assert isinstance(node, Container)
                    (after if seen else before).append(node)
            else:
                return None
        return (before, after) if seen else None


class FastComposer:
    """Turns override lists into RunConfigs, composing with Hydra at most once per group choice.

    `compose_groups(group_overrides)` must return the full composed config (hydra node
    included) for those group choices, as Hydra's own composition does for a job with
    no value overrides; `is_group(key)` tells config groups from config keys, as Hydra's
    defaults list does. `repository` and `config_name` (Hydra's config repository and the
    primary config) let bases that differ in schema groups' options be derived from a
    composed one (_GroupNodes); without them every base is composed. Use `for_sweep` inside
    a Hydra sweep, `from_config_dir` elsewhere.
    """

    def __init__(
        self,
        compose_groups: Callable[[list[str]], DictConfig],
        is_group: Callable[[str], bool],
        *,
        repository: Any = None,
        config_name: str | None = None,
        config_loader: ConfigLoader | None = None,
    ) -> None:
        self.config_loader = config_loader
        """The loader the configs come from, where one is at hand: it lists a group's options for a
        sweep's glob() (None: a sweep of such overrides cannot be expanded here)."""
        self._compose_groups = compose_groups
        self._repository = repository
        self._config_name = config_name
        self._reference: _Base | None = None
        self._group_nodes: _GroupNodes | None = None
        self._compositions = 0
        self._derived = 0
        self._is_group = functools.cache(is_group)
        self._bases: dict[tuple[str, ...], _Base] = {}
        self._effects: dict[tuple[str, str, str], _Effect] = {}
        self._items: dict[str, _Item] = {}
        self._disjoint: dict[tuple[tuple[str, ...], ...], bool] = {}
        self._jobs = 0
        self._evaluations = 0
        self._exact = 0
        self._seconds = 0.0
        self._warned_interpolation = False
        # The sweeper's check and the launcher ask for the same jobs: the second time is a lookup.
        self._runs: dict[tuple[str, ...], RunConfig] = {}

    @classmethod
    def for_sweep(cls, config_loader: ConfigLoader, master_config: DictConfig) -> FastComposer:
        """Composer for the jobs of a sweep: as Hydra's `load_sweep_config` would compose them.

        The master config's Hydra overrides (e.g. `hydra/launcher=plan`) apply to every job.
        """
        known = set(OmegaConf.select(master_config, "hydra.runtime.choices", default={}) or {})

        def compose_groups(groups: list[str]) -> DictConfig:
            return config_loader.load_sweep_config(master_config=master_config, sweep_overrides=groups)

        return cls(
            compose_groups,
            _group_checker(config_loader, known),
            repository=getattr(config_loader, "repository", None),
            config_name=OmegaConf.select(master_config, "hydra.job.config_name", default=None),
        )

    @classmethod
    def from_config_dir(
        cls,
        config_dir: str | Path,
        config_name: str = "config",
        overrides: Sequence[str] = (),
        *,
        version_base: str = "1.3",
    ) -> FastComposer:
        """Composer equivalent to `hydra.compose(config_name, overrides=[*overrides, *job])`
        under `initialize_config_dir(config_dir, version_base=version_base)`.

        Sets Hydra's version base (process-wide), as `hydra.initialize_config_dir` does.
        """
        # Private to Hydra, but they are what initialize_config_dir builds; hydra-core is pinned to 1.3.
        from hydra._internal.config_loader_impl import ConfigLoaderImpl
        from hydra._internal.utils import create_config_search_path

        version.setbase(version_base)
        register_configs()  # the primary config extends megasweep_schema, read from Hydra's ConfigStore
        loader = ConfigLoaderImpl(
            config_search_path=create_config_search_path(str(Path(config_dir).resolve()))
        )
        prefix = list(overrides)

        def compose_groups(groups: list[str]) -> DictConfig:
            return loader.load_configuration(
                config_name=config_name, overrides=prefix + groups, run_mode=RunMode.RUN, from_shell=False
            )

        return cls(
            compose_groups,
            _group_checker(loader, set()),
            repository=loader.repository,
            config_name=config_name,
            config_loader=loader,
        )

    def stats(self) -> ComposeStats:
        """Counts of the work done so far."""
        return ComposeStats(
            jobs=self._jobs,
            bases=self._compositions,
            derived=self._derived,
            evaluations=self._evaluations,
            exact=self._exact,
            seconds=self._seconds,
        )

    def run_configs(self, batch: Iterable[Sequence[str]]) -> list[RunConfig]:
        """RunConfig of each job of a batch (raises at the first job that does not compose)."""
        return [self.run_config(overrides) for overrides in batch]

    def run_config(self, overrides: Sequence[str]) -> RunConfig:
        """The RunConfig that composing with these overrides and to_run_config would give.

        Raises ConfigCompositionException (or Hydra's MissingConfigException for an
        unknown group option, OverrideParseException for bad syntax) naming the override.
        """
        tic = time.perf_counter()
        key = tuple(overrides)
        try:
            done = self._runs.get(key)
            if done is not None:
                self._jobs += 1
                return done
            job = self._split(key)
            base = self._base(job.groups)
            if base.error is not None:
                raise base.error
            run = None
            if job.independent and not base.exact_only:
                try:
                    run = self._assemble(base, job)
                except _NotIndependent:
                    run = None
            if run is None:
                run = self._compose_exact(base, job)
            self._jobs += 1
            self._runs[key] = run
            return run
        finally:
            self._seconds += time.perf_counter() - tic

    def compose(self, overrides: Sequence[str]) -> DictConfig:
        """The full composed config (hydra node included) for these overrides, exactly.

        Not the fast path: a deep copy of the base plus OmegaConf work per call. The hydra
        node reflects the group choices only (`hydra.overrides.task` lacks value overrides).
        """
        job = self._split(tuple(overrides))
        base = self._base(job.groups)
        if base.error is not None:
            raise base.error
        cfg = copy.deepcopy(self._cfg(base))
        apply_value_overrides(cfg, [item.override for item in job.values])
        return cfg

    # -- internals -------------------------------------------------------------------

    def _item(self, text: str) -> _Item:
        item = self._items.get(text)
        if item is None:
            override = parse_override(text)
            key = override.key_or_group
            value = override.value()
            path = _field_path(key)
            item = _Item(
                override=override,
                # Hydra's defaults-list test: a group choice unless the key is not a group, or
                # the value is a dict (which merges into the node of that name).
                is_group=self._is_group(key) and not isinstance(value, dict),
                path=path,
                # Keys outside RunConfig still collide with each other (`++foo=1 +foo.x=2`).
                span=path or (key.split(".", 1)[0],),
                exact_only=override.is_sweep_override() or _contains_interpolation(value),
                leaf=(
                    len(path) > 1
                    and path == tuple(key.split("."))
                    and not (override.is_add() or override.is_force_add() or override.is_delete())
                    and isinstance(value, str | int | float | bool)
                ),
            )
            self._items[text] = item
        return item

    def _split(self, overrides: tuple[str, ...]) -> _Job:
        items = [self._item(text) for text in overrides]
        groups = tuple(text for text, item in zip(overrides, items, strict=True) if item.is_group)
        values = tuple(item for item in items if not item.is_group)
        spans = tuple(item.span for item in values)
        disjoint = self._disjoint.get(spans)
        if disjoint is None:
            disjoint = self._disjoint[spans] = _disjoint(spans)
        independent = disjoint and not any(item.exact_only for item in values)
        return _Job(groups=groups, values=values, independent=independent)

    def _base(self, groups: tuple[str, ...]) -> _Base:
        base = self._bases.get(groups)
        if base is not None:
            return base
        base = _Base(groups=groups)
        self._bases[groups] = base
        run = self._derived_run(groups)
        if run is not None:
            base.run = run
            self._derived += 1
            return base
        self._compositions += 1
        try:
            cfg = self._compose_groups(list(groups))
        except HydraException as ex:
            base.error = ex
            return base
        except OmegaConfBaseException as ex:
            base.error = ConfigCompositionException(f"Could not compose the config with {list(groups)}")
            base.error.__cause__ = ex
            return base
        base.cfg = cfg
        try:
            base.run = to_run_config(_task_data(cfg))
        except (OmegaConfBaseException, ValueError, TypeError):
            # A base that only converts with the job's value overrides (e.g. a '???' they fill).
            base.exact_only = True
        if _contains_interpolation(_task_data(cfg, resolve=False)):
            # An interpolation may tie a field to one a job overrides; only a full compose is exact.
            base.exact_only = True
            if not self._warned_interpolation:
                self._warned_interpolation = True
                log.warning(
                    "The config has interpolations; composing each sweep job in full (exact, but slower)."
                )
        if self._reference is None and base.run is not None and not base.exact_only:
            self._reference = base
        return base

    def _cfg(self, base: _Base) -> DictConfig:
        """The base's composed config, composed now if the base was derived (_derived_run)."""
        if base.cfg is None:
            self._compositions += 1
            base.cfg = self._compose_groups(list(base.groups))
        return base.cfg

    def _choices(self, groups: tuple[str, ...]) -> dict[str, str] | None:
        """{group: option} of plain `group=option` choices of the schema's groups; None for anything else."""
        choices: dict[str, str] = {}
        for text in groups:
            override = self._item(text).override
            key, value = override.key_or_group, override.value()
            if (
                key not in GROUP_SCHEMAS
                or key in choices
                or not isinstance(value, str)
                or override.package is not None
                or override.is_add()
                or override.is_force_add()
                or override.is_delete()
            ):
                return None
            choices[key] = value
        return choices

    def _derived_run(self, groups: tuple[str, ...]) -> RunConfig | None:
        """The RunConfig of these group choices from the reference base's, with the groups whose option
        differs replaced by their nodes (_GroupNodes); None when only a composition is exact: other
        kinds of group overrides, other groups chosen, an option whose node is not a plain merge."""
        ref = self._reference
        if ref is None or self._repository is None:
            return None
        assert ref.cfg is not None and ref.run is not None
        target, current = self._choices(groups), self._choices(ref.groups)
        if target is None or current is None or target.keys() != current.keys():
            return None
        if self._group_nodes is None:
            self._group_nodes = _GroupNodes(self._repository, self._config_name, ref.cfg)
        changes: dict[str, Any] = {}
        for group, option in target.items():
            if option == current[group]:
                continue
            if not self._group_nodes.reproduces(group, current[group], getattr(ref.run, group)):
                return None
            value = self._group_nodes.value(group, option)
            if value is None:
                return None
            changes[group] = value
        run = dataclasses.replace(ref.run, **changes)
        assert isinstance(run, RunConfig)
        return run

    def _effect(self, base: _Base, item: _Item) -> Any:
        line = item.override.input_line or ""
        effect = base.effects.get(line)
        if effect is None:
            effect = base.effects[line] = self._evaluate(base, item)
        if effect.error is not None:
            raise effect.error
        return effect.value

    def _evaluate(self, base: _Base, item: _Item) -> _Effect:
        assert base.run is not None
        override = item.override
        line = override.input_line or ""
        top = override.key_or_group.split(".", 1)[0]
        # An override's result depends only on the top-level node it touches (a base without
        # interpolations), so bases with equal nodes share it; outside RunConfig, only this base counts.
        node_id = repr(getattr(base.run, top)) if top in RunConfig.__dataclass_fields__ else repr(base.groups)
        cache_key = (top, node_id, line)
        effect = self._effects.get(cache_key)
        if effect is None:
            self._evaluations += 1
            cfg = self._cfg(base)
            if base.task is None:
                # Copies of the task part alone are 3x cheaper than copies with Hydra's own node.
                base.task = copy.deepcopy(cfg)
                with flag_override(base.task, ["struct", "readonly"], [False, False]):
                    base.task.pop("hydra", None)
            effect = self._node_effect(base, item, top) if top in RunConfig.__dataclass_fields__ else None
            if effect is None:
                cfg = copy.deepcopy(cfg if top == "hydra" else base.task)
                try:
                    apply_value_overrides(cfg, [override])
                    effect = _Effect(value=_get_path(_convert(cfg, [line]), item.path))
                except ConfigCompositionException as ex:
                    effect = _Effect(error=ex)
            self._effects[cache_key] = effect
        return effect

    def _node_effect(self, base: _Base, item: _Item, top: str) -> _Effect | None:
        """The override applied to a copy of its top-level node alone, and that node converted alone.

        The same value as on the whole task config, since a group's conversion reads nothing
        outside its node (no interpolations here: those jobs are composed in full), at a tenth of
        the cost: a sweep of 1,000 learning rates evaluates 1,000 overrides. None when anything
        goes otherwise (an error, the node replaced or deleted): the caller then evaluates the
        override on the whole config, whose outcome and messages are the reference.
        """
        assert base.task is not None
        root = base.nodes.get(top)
        if root is None:
            # Assignment copies the node; the root takes the flags (struct) it had in the whole config.
            root = OmegaConf.create({})
            root[top] = base.task._get_node(top)
            for flag in ("struct", "readonly"):
                root._set_flag(flag, base.task._get_flag(flag))
            base.nodes[top] = root
        if item.leaf:
            effect = self._leaf_effect(base, item, top, root)
            if effect is not None:
                return effect
            root = base.nodes.get(top)
            if root is None:
                return None
        expected = OmegaConf.get_type(root, top)
        cfg = copy.deepcopy(root)
        try:
            apply_value_overrides(cfg, [item.override])
            node = cfg._get_node(top)
            if not isinstance(node, DictConfig) or OmegaConf.get_type(node) is not expected:
                return None
            return _Effect(value=_get_path(to_field_config(top, node), item.path[1:]))
        except Exception:  # noqa: BLE001  (the whole-config evaluation says what is wrong, exactly)
            return None

    def _leaf_effect(self, base: _Base, item: _Item, top: str, root: DictConfig) -> _Effect | None:
        """`key=value` on a leaf field, set in place on the group's own root and read back, then undone.

        Copying even one group's node costs a millisecond; setting one value through OmegaConf
        (which checks and converts it as for the whole config) and setting the old one back costs
        a tenth of that. The value is what OmegaConf.to_object puts in the dataclass for a leaf: the
        node's own value. Anything unusual (an error, a node that is replaced rather than set, a
        missing value, an old value that does not come back) gives None, and a root that may have
        changed is dropped, to be copied afresh from the base.
        """
        key = item.override.key_or_group
        parent_key, _, name = key.rpartition(".")
        parent = OmegaConf.select(root, parent_key, throw_on_missing=False)
        node = parent._get_node(name) if isinstance(parent, DictConfig) else None
        if not isinstance(node, ValueNode) or node._is_missing() or node._is_interpolation():
            return None
        old = node._value()
        try:
            apply_value_overrides(root, [item.override])
            if parent._get_node(name) is not node or node._is_missing() or node._is_interpolation():
                raise _Unusual
            value = node._value()
            OmegaConf.update(root, key, old, merge=True)
            if parent._get_node(name) is not node or type(node._value()) is not type(old) or node._value() != old:
                raise _Unusual
        except Exception:  # noqa: BLE001  (see the docstring: the slower ways decide)
            del base.nodes[top]
            return None
        return _Effect(value=value)

    def _assemble(self, base: _Base, job: _Job) -> RunConfig:
        # Every override is evaluated first, in order, so that the first bad one is the one reported.
        effects = [self._effect(base, item) for item in job.values]
        updates: dict[str, Any] = {}
        for item, value in zip(job.values, effects, strict=True):
            if not item.path:
                continue  # outside RunConfig: to_run_config drops it
            node = updates
            for part in item.path[:-1]:
                node = node.setdefault(part, _Nested())
            node[item.path[-1]] = value
        run = _replace_paths(base.run, updates) if updates else base.run
        assert isinstance(run, RunConfig)
        return run

    def _compose_exact(self, base: _Base, job: _Job) -> RunConfig:
        self._exact += 1
        cfg = copy.deepcopy(self._cfg(base))
        overrides = [item.override for item in job.values]
        apply_value_overrides(cfg, overrides)
        return _convert(cfg, [o.input_line or "" for o in overrides])


def _task_data(cfg: DictConfig, *, resolve: bool = True) -> dict[str, Any]:
    """The RunConfig nodes of a composed config as plain containers.

    What to_run_config keeps of the whole config, without resolving (or copying) Hydra's
    own node, whose interpolations may need a running Hydra app.
    """
    data: dict[str, Any] = {}
    for key in RunConfig.__dataclass_fields__:
        if key in cfg:
            value = cfg._get_node(key)
            data[key] = (
                OmegaConf.to_container(value, resolve=resolve) if OmegaConf.is_config(value) else cfg[key]
            )
    return data


def _convert(cfg: DictConfig, lines: Sequence[str]) -> RunConfig:
    try:
        return to_run_config(_task_data(cfg))
    except (OmegaConfBaseException, ValueError, TypeError) as ex:
        shown = " ".join(lines) if lines else "(none)"
        # Hydra prints an OmegaConf cause below the message (key, expected type); any other, we must.
        detail = "" if isinstance(ex, OmegaConfBaseException) else f": {ex}"
        raise ConfigCompositionException(
            f"The config with value overrides {shown} does not fit the megasweep schema (conf/schema.py){detail}"
        ) from ex


def _group_checker(config_loader: ConfigLoader, known: set[str]) -> Callable[[str], bool]:
    # Hydra lists groups by scanning the config search path anew (tens of ms a call), and a
    # sweep asks about every key it overrides: one listing per parent group is enough.
    list_groups = functools.cache(config_loader.list_groups)

    def is_group(key: str) -> bool:
        if key in known:
            return True
        parent, _, name = key.rpartition("/")
        return name in list_groups(parent)

    return is_group


_shared: tuple[ConfigLoader, DictConfig, FastComposer] | None = None


@contextlib.contextmanager
def usage_exits(*, made: Path | None = None) -> Iterator[None]:
    """A sweep refused for its input (UsageError) or an override that does not compose ends as a
    single run's bad input does: its paragraph on stderr and EXIT_USAGE. Hydra's run_and_report
    would exit 1, a failed run's status, for any exception; SystemExit passes it by. A launch whose
    configs failed (RunsFailed) ends with its paragraph and EXIT_FAILED, without the hint Hydra adds
    to every error it prints (set HYDRA_FULL_ERROR for a stack trace), as if megasweep had crashed. `made`: the
    top directory this launch created (the sweep directory or one above it); refused, it goes again
    with the multirun.yaml Hydra's sweeper wrote there first, so that "nothing was written" holds."""
    try:
        yield
    except (UsageError, ConfigCompositionException, OverrideParseException) as exc:
        _forget_sweep_dir(made)
        # The prefix every other refusal carries (bad overrides, `launchers`, `analysis`): a script
        # that greps stderr for it finds this one too.
        text = str(exc).strip()
        print(text if text.startswith("error:") else f"error: {text}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USAGE)
    except RunsFailed as exc:
        # What ran is written (the manifest, each run's record): nothing to forget, only to say.
        print(str(exc).strip(), file=sys.stderr, flush=True)
        sys.exit(EXIT_FAILED)
    except SystemExit as done:
        if done.code == EXIT_USAGE:  # a launcher's own usage_exits has said why
            _forget_sweep_dir(made)
        raise
    except KeyboardInterrupt:
        # Stopped before anything was written (Ctrl-C while Slurm is asked about the site, say): a new
        # directory holding Hydra's multirun.yaml alone would pass for a sweep that never was.
        _forget_sweep_dir(made)
        raise


def _forget_sweep_dir(made: Path | None) -> None:
    # Only a tree that holds nothing but Hydra's multirun.yaml, or nothing (a layout search refused
    # before it saved that): a refusal after a plan.csv or a manifest was written (every config
    # infeasible) leaves them, and the config they were made of.
    # `made` is the top directory the launch created: the default multirun/<date>/<time> makes the
    # date's too, which was left behind, empty.
    with contextlib.suppress(OSError):
        if made is not None and [p.name for p in made.rglob("*") if not p.is_dir()] in ([], [MULTIRUN_FILE]):
            shutil.rmtree(made)


def created_by_launch(sweep_dir: Path) -> Path | None:
    """The top directory of `sweep_dir`'s that does not exist yet (None: it exists): what the launch
    will create, and what a refusal removes again."""
    missing = missing_dirs(sweep_dir)
    return missing[-1] if missing else None


def sweep_composer(config_loader: ConfigLoader, master_config: DictConfig) -> FastComposer:
    """The FastComposer of this sweep, shared by the sweeper and the launcher.

    The sweeper validates every job before the launcher sees the batch; sharing one
    composer means each base and each override is composed and evaluated only once.
    """
    global _shared
    if _shared is not None and _shared[0] is config_loader and _shared[1] is master_config:
        return _shared[2]
    composer = FastComposer.for_sweep(config_loader, master_config)
    _shared = (config_loader, master_config, composer)
    return composer


class FastValidation:
    """Mixin for Hydra's BasicSweeper: check each batch with the FastComposer.

    BasicSweeper composes every job in full before launching (about 50 ms each: eight
    minutes for 10,000 jobs). On megasweep configs this check composes once per distinct
    group choice instead, and also proves each job converts to a RunConfig; other configs
    get BasicSweeper's own check.

    A mixin, not a subclass: Hydra's plugin scan re-executes basic_sweeper.py, and
    BasicSweeper's `super(BasicSweeper, self)` then names the new class, which a subclass
    defined here, before the scan, would not derive from. The plugin module
    (hydra_plugins/megasweep/sweeper.py) combines this mixin with the current BasicSweeper.
    """

    hydra_context: HydraContext | None
    config: DictConfig | None

    def __init__(self, *, progress_every: int = 2000, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.progress_every = progress_every

    def sweep(self, arguments: list[str]) -> Any:
        # Before BasicSweeper writes multirun.yaml there: a refused directory is left as it was. (An
        # earlier multirun.yaml of a sweep added to is kept by megasweep's launcher: SweepLauncher.)
        assert self.config is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        append = OmegaConf.select(self.config, "hydra.launcher.append", default=None)
        with usage_exits(made=created_by_launch(sweep_dir)):
            searched = [a for a in arguments if parse_override(a).key_or_group.startswith("search.")]
            if searched and is_megasweep_config(self.config):
                # Only the layout search reads them: planned or launched without it, they did nothing.
                raise UsageError(
                    f"{' '.join(searched)}: search.* options configure the layout search, which this sweep does not "
                    "run: add hydra/sweeper=layouts to search, or leave them out to sweep the overrides given"
                )
            if append is None:  # a launcher that writes no manifest (not megasweep's)
                writable_dir(sweep_dir, option=HYDRA_OPTIONS.directory)
            else:
                claim_sweep_dir(sweep_dir, append=bool(append))
            return super().sweep(arguments)  # type: ignore[misc]

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None:
        assert self.hydra_context is not None and self.config is not None
        if not is_megasweep_config(self.config):
            super().validate_batch_is_legal(batch)  # type: ignore[misc]
            return
        composer = sweep_composer(self.hydra_context.config_loader, self.config)
        tic = time.perf_counter()
        # A launcher that writes no manifest (Hydra's basic one) has nowhere to list an infeasible
        # config as skipped: each job would fail in turn, and the sweep end in a traceback after the
        # feasible ones ran. The rules judge every config of every batch here, at the first batch,
        # before any of them runs (BasicSweeper.overrides holds the batches; batch_index counts those
        # given), and the later batches, checked then, are not composed again. Checkpoint directories are
        # compared across every batch too, under any launcher: two configs of one layout in one directory
        # a batch apart (hydra.sweeper.max_batch_size) were each checked alone and queued.
        judged = OmegaConf.select(self.config, "hydra.launcher.append", default=None) is None
        if getattr(self, "batch_index", 1) > 1:
            return
        jobs = [job for b in (getattr(self, "overrides", None) or [batch]) for job in b]
        total = len(jobs)
        every = self.progress_every
        infeasible = []
        checkpoints = CheckpointPlaces()
        with bulk_allocation():
            for done, overrides in enumerate(jobs, start=1):
                run = composer.run_config(overrides)
                saves = checkpoints.wanted(run)
                if judged or saves:
                    world = _local_world(run)
                    violations = validate(run, **world)
                    if judged and violations:
                        infeasible.append((done - 1, overrides, violations))
                    # A config its rules keep from running (skipped or refused) shares nothing.
                    if saves and not violations:
                        checkpoints.add(f"config {done - 1}", overrides, run, world["world_size"])
                # Long batches say they are alive: the first jobs of each group choice are the slow ones.
                if every > 0 and total > every and (done % every == 0 or done == total):
                    stats = composer.stats()
                    sys.stderr.write(
                        f"check: {done:,}/{total:,} configs compose ({time.perf_counter() - tic:.1f} s, "
                        f"{stats.bases} Hydra compositions)\n"
                    )
                    sys.stderr.flush()
        if infeasible:
            raise UsageError(_refusal(infeasible, total))
        checkpoints.refuse_clashes(outcome="nothing was run")
        log.debug(f"Checked that {total} configs compose in {time.perf_counter() - tic:.2f} s")


CHECKPOINT_FIX = (
    "Leave training.checkpoint_dir out (each config then checkpoints in its own run directory), or give each "
    "config its own (sweep it with the configs)"
)
"""CheckpointPlaces' advice where the configs come from a sweep's overrides (a launch, an export)."""


class CheckpointPlaces:
    """The configs of one launch (a sweep, an export, a changed rerun) that checkpoint into a
    training.checkpoint_dir of the user's, by where their layout's checkpoints go: two configs in one
    place would save into one directory and each resume from the other's, so such a launch is refused."""

    def __init__(self) -> None:
        self._places: dict[str, list[tuple[str, Sequence[str]]]] = {}

    @staticmethod
    def wanted(run: RunConfig) -> bool:
        """Whether the config checkpoints into a training.checkpoint_dir of the user's (not its run's own)."""
        tr = run.training
        return bool(tr.checkpoint_dir) and isinstance(tr.save_interval, int) and tr.save_interval > 0

    def add(self, name: str, overrides: Sequence[str], run: RunConfig, world_size: int | None) -> None:
        """Note a feasible config (one its rules keep from running shares nothing) of `world_size` ranks,
        `name` as the refusal names it ('config 3')."""
        if self.wanted(run) and (place := _checkpoint_place(run, world_size)):
            self._places.setdefault(place, []).append((name, overrides))

    def refuse_clashes(self, *, outcome: str, fix: str = CHECKPOINT_FIX) -> None:
        """UsageError when two configs noted share a place; `outcome`: what the refusal left undone,
        `fix`: what the user can change in the command refused."""
        if clashes := [configs for configs in self._places.values() if len(configs) > 1]:
            raise UsageError(_checkpoint_refusal(clashes, outcome, fix))


def _checkpoint_place(run: RunConfig, world_size: int | None) -> str | None:
    """Where such a config keeps its layout's checkpoints (<checkpoint_dir>/<layout_key>), None where its
    layout has no dp. A relative directory is taken from where the sweep is launched, as the jobs
    start there."""
    tr, par = run.training, run.parallelism
    try:
        dp = Layout.of(par, world_size).dp
    except (LayoutError, TypeError):
        return None
    root = Path(str(tr.checkpoint_dir)).expanduser().absolute()
    return str(root / layout_key(dp=dp, tp=par.tp, pp=par.pp, zero_stage=par.zero_stage,
                                 virtual_stages=par.virtual_stages))  # fmt: skip


def _checkpoint_refusal(clashes: Sequence[Sequence[tuple[str, Sequence[str]]]], outcome: str, fix: str) -> str:
    """One paragraph for configs of a sweep that would save into, and resume from, one directory."""
    (first, first_overrides), (second, second_overrides) = clashes[0][:2]
    more = sum(len(c) for c in clashes) - 2
    return (
        f"{first} ({' '.join(first_overrides) or 'no overrides'}) and {second} "
        f"({' '.join(second_overrides) or 'no overrides'}) have one training.checkpoint_dir and one layout, "
        "so they would save their checkpoints into one directory and each resume from the other's (a run "
        "of more iterations would train on from a shorter one's last step; one of another lr or batch "
        f"would refuse to start on them){f', and {more} more config(s) alike' if more else ''}; {outcome}. {fix}."
    )


def _local_world(run: RunConfig) -> dict[str, Any]:
    """validate's world for a job started by a launcher without its own allocation, as `python -m
    train` judges it (train.distributed.run_world): the sweep's own launcher's (fixed: a fix keeps it),
    else the workers it forks."""
    try:
        launch = launch_from_env(os.environ)
    except ValueError:  # each job refuses the variable in its own words
        launch = None
    return {"world_size": run_world(run.parallelism, launch), "world_fixed": launch is not None}


def _refusal(infeasible: Sequence[tuple[int, Sequence[str], list[Violation]]], total: int) -> str:
    """One paragraph for a sweep refused by the rules before any job ran: per rule broken, how many
    configs and one of them with its problem (counted as the dry run counts them)."""
    by_rule = count_by_rule(((i, o, v), [x.rule for x in v]) for i, o, v in infeasible)
    said = " ".join(
        rule_example(rule, n, i, o, next(x.message for x in v if x.rule == rule).rstrip(".")) + "."
        for rule, n, (i, o, v) in by_rule
    )
    return (
        f"{len(infeasible)} of {total} configs are infeasible, and this launcher lists none as skipped, so "
        f"nothing was run. {said} Leave them out of the sweep (hydra/launcher=plan shows every one), or "
        "launch with hydra/launcher=local or slurm, which run the others and list these as skipped."
    )


class SweepLauncher(Launcher):
    """What megasweep's launchers share: the sweep's Hydra context, kept by setup() for launch(),
    the claim on the sweep directory (launchers.sweepdir), made once per sweep, and the sweep's
    earlier multirun.yaml, kept through the launch (`keeping_earlier_config`).

    Any sweeper saves the launch's config as multirun.yaml before it launches (Hydra's basic one
    too), over that of the sweep the directory holds, even when the launcher then refuses the
    directory. Hydra sets the launcher up before that: setup() reads the earlier one (and copies it
    into the state directory), and the first launch puts it back or keeps the added launch's beside
    it (launchers.sweepdir.EarlierConfig). A sweep that ends before its first launch (a sweeper's
    error, Ctrl-C) puts it back at exit; one killed meanwhile leaves the copy, which the next launch
    into the directory puts back.
    """

    def __init__(self, append: bool = False) -> None:
        super().__init__()
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None
        self.append = append
        self._first_index: int | None = None
        # The sweep's, not a batch's: a sweeper's batches (hydra.sweeper.max_batch_size) say each path once.
        self.paths = PathWarnings()
        self._earlier: EarlierConfig | None = None
        self._held: contextlib.ExitStack | None = None

    def first_index(self, sweep_dir: Path) -> int:
        """Index of this sweep's first config: 0, or after the configs of the sweep appended to.

        Claimed at the first batch only: a sweeper's later batches find this sweep's own manifest.
        """
        if self._first_index is None:
            self._first_index = claim_sweep_dir(sweep_dir, append=self.append, replace_skipped=True)
        return self._first_index

    @contextlib.contextmanager
    def claimed(self, sweep_dir: Path) -> Iterator[int]:
        """first_index(sweep_dir), with the sweep directory locked (launchers.sweepdir.sweep_lock)
        until the block has written this batch's configs into the manifest."""
        try:
            with sweep_lock(sweep_dir):
                yield self.first_index(sweep_dir)
        finally:
            self._let_go()

    def _hold(self, sweep_dir: Path) -> None:
        """The sweep's lock, from setup to the first batch's claim, for a launch added to a sweep.

        Such a launch reads the sweep's multirun.yaml at setup, and Hydra then writes the launch's
        own over it before the first batch claims its indices: a second launch added meanwhile would
        read that one as the sweep's, or have its own kept under the first's number and lost. Only
        where a launch has locked the sweep before (its LOCK_FILE exists: a Slurm, local or exported
        sweep), so that a dry-run directory gains no state directory."""
        self._let_go()
        if self.append and (sweep_dir / LOCK_FILE).is_file():
            held = contextlib.ExitStack()
            held.enter_context(sweep_lock(sweep_dir))
            self._held = held
            # A sweep that never launched lets go at exit: registered before the earlier config's exit
            # handler (setup, below), it runs after it, so that the config is put back under the lock.
            atexit.register(self._let_go)

    def _let_go(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            atexit.unregister(self._let_go)
            held.close()

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function
        if self._earlier is not None:  # set up again before it launched
            atexit.unregister(self._earlier.keep_if_launched)
            self._earlier = None
        # Another app's launch neither claims nor refuses the directory: its config is the directory's.
        if is_megasweep_config(config):
            sweep_dir = Path(str(config.hydra.sweep.dir))
            self._hold(sweep_dir)
            self._earlier = EarlierConfig.read(sweep_dir, append=self.append, copy=True)
            if self._earlier.text is not None:
                atexit.register(self._earlier.keep_if_launched)

    @contextlib.contextmanager
    def keeping_earlier_config(self) -> Iterator[None]:
        """Around a launch: at the first, the sweep's earlier multirun.yaml is kept (see the class
        docstring) before anything is launched, and put back if the launch is refused."""
        earlier, self._earlier = self._earlier, None
        try:
            if earlier is None:
                yield
                return
            atexit.unregister(earlier.keep_if_launched)
            earlier.keep()
            try:
                yield
            except BaseException:
                earlier.keep_if_launched()
                raise
        finally:
            self._let_go()  # a launcher that claims no indices (the plan's) holds it until here


# ---------------------------------------------------------------------------------------------
# Jobs of any Hydra app, and Hydra's record of a job: shared by the slurm and local launchers.


@dataclass(frozen=True, eq=False)
class HydraJob:
    """The task function of a Hydra app, run on one job's overrides as Hydra's launchers run it.

    Picklable: submitit ships it to the node with cloudpickle, which carries a task function
    defined in __main__ or in a closure by value. `singletons` is Hydra's global state at
    submission (ConfigStore, registered resolvers), which a fresh interpreter lacks.
    """

    hydra_context: HydraContext
    config: DictConfig
    """The sweep's master config (each job's config is composed from it on the node)."""
    task_function: TaskFunction
    singletons: Any = None

    def __call__(self, overrides: Sequence[str], job_num: int, job_id: str | None = None) -> JobReturn:
        if self.singletons is not None:
            Singleton.set_state(self.singletons)
        setup_globals()
        if job_id is None:
            import submitit

            job_id = str(submitit.JobEnvironment().job_id)
        config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(config.hydra.job):
            config.hydra.job.id = job_id
            config.hydra.job.num = job_num
        return run_job(
            hydra_context=self.hydra_context,
            task_function=self.task_function,
            config=config,
            job_dir_key="hydra.sweep.dir",
            job_subdir_key="hydra.sweep.subdir",
        )


def prepare_sweep_dir(config: DictConfig) -> Path:
    """hydra.sweep.dir, created (with hydra.sweep.mode when the config sets one)."""
    sweep_dir = Path(str(config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    if OmegaConf.select(config, "hydra.sweep.mode", default=None) is not None:
        os.chmod(sweep_dir, mode=int(str(config.hydra.sweep.mode), 8))
    return sweep_dir


def job_return(
    entry: ManifestEntry, *, sweep_dir: Path, task_name: str, status: JobStatus, value: Any
) -> JobReturn:
    """Hydra's record of one config's outcome, as the slurm and local launchers hand it back."""
    return JobReturn(
        overrides=list(entry.overrides),
        working_dir=str(sweep_dir / entry.output_dir),
        task_name=task_name,
        status=status,
        _return_value=value,
    )
