"""Command-line overrides checked against the schema before Hydra composes them.

Hydra's own errors for a misspelt key, a missing group option or a value of the wrong type either
suggest the wrong fix (`parallelism.tpp=2`: "add +parallelism.tpp=2", which the schema then
rejects), list every option without the close one, or come back from a composer as "Error merging
override ..." with the reason in an exception's cause. Every entry point that takes overrides
(`python -m train`, `python -m launchers rerun|sbatch|calibrate`) asks `override_problem` first and
prints its one line with exit status 2 (bad input), so they all say it alike.

The same goes for the Hydra keys a sweep is steered with: `hydra/launcher=...` and `hydra/sweeper=...`
(the options of Hydra's config store once its plugins are found), `hydra.launcher.<field>` and
`hydra.sweeper.<field>` (the chosen one's fields), and an override Hydra cannot parse: Hydra says each
with exit status 1, the code of a run that failed.

The command-line tools' own options (`python -m launchers`, `python -m analysis`) are argparse's to
parse: `argparse_hint` adds the close command or option to its one-line refusal.

Torch-free; Hydra's override parser is imported when called.
"""

from __future__ import annotations

import argparse
import difflib
import re
import typing
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from conf import CONFIG_DIR, group_options
from conf.schema import GROUP_SCHEMAS, is_field, takes_list, unknown_override, wrong_value

if TYPE_CHECKING:
    from hydra.core.override_parser.types import Override

__all__ = ["argparse_hint", "missing_option_line", "override_problem"]


def override_problem(overrides: Sequence[str], *, own_options: bool = True) -> str | None:
    """The first of `overrides` that names a key the schema lacks, an option its group lacks (when
    `own_options`: the groups' options are conf/'s own, no search path adds any) or a value its field
    cannot take, as one line with "did you mean", or that Hydra cannot parse; None when there is none.
    Of Hydra's own keys only its launcher's and sweeper's are judged (_hydra_problem)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    parsed: list[tuple[str, Override]] = []
    for text in overrides:
        try:
            (override,) = parser.parse_overrides([text])
        except HydraException as bad:
            return _unparsable(text, bad)
        parsed.append((text, override))
    for text, override in parsed:
        key = override.key_or_group
        if key.split("/", 1)[0].split(".", 1)[0] == "hydra":
            if (problem := _hydra_problem(key, override, text, parsed, own_options=own_options)) is not None:
                return problem
            continue
        if "/" in key:
            continue
        problem = unknown_override(key, text)
        if problem is None and key in GROUP_SCHEMAS and override.is_delete():
            problem = _no_group(key, text)
        elif problem is None and override.is_delete() and is_field(key):
            # Hydra refused it while merging into the schema, exit 1; a run has every field.
            problem = f"~{key}: a field of the schema cannot be deleted; set it instead ({key}=...) (override '{text}')"
        elif problem is None and own_options and key in GROUP_SCHEMAS:
            problem = _unknown_option(key, override, text)
        elif problem is None:
            problem = _wrong_values(key, override, text)
        if problem is not None:
            return problem
    return None


def _unparsable(text: str, bad: Exception) -> str:
    """One line for an override Hydra's grammar rejects: its reason and its grammar's page."""
    reason, _, rest = str(bad).strip().partition("\n")
    # Hydra's reason spans lines ("missing EQUAL at '<EOF>'", then its page): one line, as every refusal.
    see = "; ".join(line.strip() for line in rest.splitlines() if line.strip())
    return f"cannot parse override '{text}': {reason.strip()}" + (f" ({see[0].lower()}{see[1:]})" if see else "")


_HYDRA_PLUGINS = ("launcher", "sweeper")
"""Hydra's groups a megasweep sweep chooses and sets fields of (hydra/<group>=, hydra.<group>.<field>=)."""


def _hydra_problem(
    key: str, override: Override, text: str, parsed: Sequence[tuple[str, Override]], *, own_options: bool
) -> str | None:
    """One line when `hydra/launcher=` or `hydra/sweeper=` names no option, or `hydra.launcher.<field>=`
    or `hydra.sweeper.<field>=` no field of the chosen one; None for the rest of Hydra's keys, for
    an existing field's key added with + (Hydra's to refuse), and for options a search path may add (not
    own_options). A field the chosen option lacks is refused added too: the launcher's constructor
    failed on it, exit status 1."""
    parts = key.replace("/", ".").split(".")
    added = override.is_add() or override.is_force_add()
    if len(parts) < 2 or parts[1] not in _HYDRA_PLUGINS or (added and len(parts) < 3):
        return None
    group = f"hydra/{parts[1]}"
    if len(parts) == 2 and "/" in key:
        if not own_options or override.is_delete():
            return None
        return _unknown_option(group, override, text, options=_hydra_options(group))
    chosen = _chosen(group, parsed, default=own_options)
    options = _hydra_options(group)
    if len(parts) < 3 or chosen not in options:
        return None  # an unknown option is said of its own override
    field = parts[2]
    fields = _hydra_fields(group, chosen)
    if field in fields and len(parts) > 3:
        # A key of a mapping field (hydra.launcher.sbatch_args.time=5): Hydra refuses one it does not
        # have yet (their defaults have none) unless added, with OmegaConf's words and exit status 1.
        # A config of the user's (own_options false) may hold the key already: then it is Hydra's to take.
        mapping = typing.get_origin(_hydra_field_hint(group, chosen, field)) is dict
        if mapping and not added and own_options:
            return (f"hydra.{parts[1]}.{field} is a mapping of your own keys, which Hydra sets only with '++' "
                    f"(or adds with '+'): ++{text} (override '{text}')")  # fmt: skip
        return None
    if field in fields and added:
        return None
    if field in fields:
        # Hydra would refuse a value of the wrong type while composing, with exit status 1.
        return _wrong_values(key, override, text, hint=_hydra_field_hint(group, chosen, field))
    close = difflib.get_close_matches(field, fields, n=3)
    if close:
        hint = f"did you mean {' or '.join(f'hydra.{parts[1]}.{c}' for c in close)}?"
    else:
        hint = f"fields: {', '.join(fields)}" if fields else "it has no fields"
        # A field of another option (hydra.launcher.append without hydra/launcher=slurm, say): name them.
        others = [o for o in options if o != chosen and difflib.get_close_matches(field, _hydra_fields(group, o), n=1)]
        if others:
            named = ", ".join(others[:-1]) + (" or " if len(others) > 1 else "") + others[-1]
            hint += f"; {group}={named} has a field like it"
    return f"hydra.{parts[1]}.{field} is not a field of {group}={chosen}; {hint} (override '{text}')"


def _chosen(group: str, parsed: Sequence[tuple[str, Override]], *, default: bool) -> str | None:
    """The option of Hydra's `group` a run composes: the last `group=<option>` override, else (when
    `default`: no other primary config or search path may choose) conf/config.yaml's `override group:
    option`, else Hydra's `basic`; None when unknown here."""
    from omegaconf import DictConfig, OmegaConf

    given = [o.get_value_element_as_str() for _, o in parsed if o.key_or_group == group and not o.is_sweep_override()]
    if given or not default:
        return given[-1] if given else None
    primary = OmegaConf.load(CONFIG_DIR / "config.yaml")
    assert isinstance(primary, DictConfig)  # a primary config is a mapping
    for entry in primary.get("defaults", []):
        if isinstance(entry, DictConfig) and f"override {group}" in entry:
            return str(entry[f"override {group}"])
    return "basic"


def _hydra_options(group: str) -> list[str]:
    """The options of Hydra's `group` in its config store, once Hydra has found its plugins (which
    register theirs): megasweep's, Hydra's own and any installed plugin's."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins

    Plugins.instance()  # the process's one scan of hydra_plugins, which Hydra itself then reuses
    return sorted(name.removesuffix(".yaml") for name in ConfigStore.instance().list(group))


def _hydra_fields(group: str, option: str) -> list[str]:
    """The fields of option `option` of Hydra's `group` (its structured config), _target_ aside."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import DictConfig

    node = ConfigStore.instance().load(f"{group}/{option}.yaml").node
    assert isinstance(node, DictConfig)  # a structured config: its fields are its keys
    return [str(k) for k in node if str(k) != "_target_"]


def _hydra_field_hint(group: str, option: str, field: str) -> Any:
    """The annotation of `field` in the dataclass behind option `option` of Hydra's `group`."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    node = ConfigStore.instance().load(f"{group}/{option}.yaml").node
    return typing.get_type_hints(OmegaConf.get_type(node)).get(field)


def _wrong_values(key: str, override: Override, text: str, *, hint: Any = None) -> str | None:
    """One line when a value of `key=...` (each of a choice sweep's) cannot be the field's type:
    Hydra fails on it while composing and exits 1, the code of a run that failed."""
    from hydra.core.override_parser.types import ValueType

    if override.value_type == ValueType.ELEMENT:
        values = [override.get_value_element_as_str()]
    elif override.value_type in (ValueType.CHOICE_SWEEP, ValueType.SIMPLE_CHOICE_SWEEP):
        values = list(override.sweep_string_iterator())
        if takes_list(key, hint=hint):
            # `search.nodes=1,2,4` sweeps three values, each refused as no list: the list meant is bracketed.
            return f"{text} gives {key} several values, but it is one list: write it in brackets, {key}=[{','.join(values)}]"
    else:
        return None  # ranges and intervals are numbers; globs choose group options
    for value in values:
        if (problem := wrong_value(key, value, hint=hint)) is not None:
            return f"{problem} (override '{text}')"
    return None


def _no_group(group: str, text: str) -> str:
    """`~group` or `group=null`: Hydra would leave the schema's bare defaults, which no YAML file
    describes (for hardware, a CPU without peaks), or fail with a traceback."""
    options = ", ".join(group_options(group))
    return f"a run needs a {group} config: null or ~{group} leaves none; choose one of: {options} (override '{text}')"


def _unknown_option(group: str, override: Override, text: str, *, options: list[str] | None = None) -> str | None:
    """One line when `group=<option>` (or a choice sweep `a,b`) names an option conf/<group>/ lacks,
    with the closest ones; Hydra's own error for it lists the options but exits 1, the code of a
    run that failed, where bad input exits 2."""
    from hydra.core.override_parser.types import ValueType

    if override.value_type not in (ValueType.ELEMENT, ValueType.CHOICE_SWEEP, ValueType.SIMPLE_CHOICE_SWEEP):
        return None  # ranges and globs: Hydra expands them (a glob against the options it finds)
    chosen = list(override.sweep_string_iterator()) if override.is_choice_sweep() else [override.get_value_element_as_str()]
    own_group = options is None  # conf/'s group, not Hydra's
    options = group_options(group) if options is None else options
    for option in chosen:
        if option == "null" and own_group:
            return _no_group(group, text)
        if option not in options and "${" not in option:
            return _not_an_option(group, option, options, text)
    return None


def _not_an_option(group: str, option: str, options: Sequence[str], text: str) -> str:
    close = difflib.get_close_matches(option, options, n=3)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    return f"{group}={option} is not a {group} config; {hint}options: {', '.join(options)} (override '{text}')"


def missing_option_line(exc: Exception) -> str | None:
    """The one line _unknown_option gives, for Hydra's MissingConfigException of a group option its
    search path lacks: where the options are not conf/'s own (a rerun of a sweep launched with a config
    directory of its own, an export's --config-dir), only composing finds it, and Hydra's words for it
    run to thirty lines. None for any other exception."""
    from hydra.errors import MissingConfigException

    if not isinstance(exc, MissingConfigException) or not exc.options or "/" not in (exc.missing_cfg_file or ""):
        return None
    group, _, option = str(exc.missing_cfg_file).rpartition("/")
    return _not_an_option(group, option, list(exc.options), f"{group}={option}")


def argparse_hint(message: str, parser: argparse.ArgumentParser) -> str:
    """'; did you mean X?' for argparse's `message` of an invalid choice or an unrecognized option of
    `parser`, when one is close; '' otherwise (argparse suggests nothing before Python 3.14)."""
    if choice := re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message):
        word, options = choice[1], re.findall(r"'([^']*)'", choice[2])
    elif option := re.match(r"unrecognized arguments: (-\S+)", message):
        word, options = option[1].split("=")[0], [o for a in parser._actions for o in a.option_strings]
    else:
        return ""
    close = difflib.get_close_matches(word, options, n=1)
    return f"; did you mean {close[0]}?" if close else ""
