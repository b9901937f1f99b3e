"""Command-line overrides checked against the schema before Hydra composes them.

Hydra's own errors for a misspelt key, a missing group option or a value of the wrong type either
suggest the wrong fix (`parallelism.tpp=2`: "add +parallelism.tpp=2", which the schema then
rejects), list every option without the close one, or come back from a composer as "Error merging
override ..." with the reason in an exception's cause. Every entry point that takes overrides
(`python -m train`, `python -m launchers rerun|sbatch|calibrate`) asks `override_problem` first and
prints its one line with exit status 2 (bad input), so they all say it alike.

Torch-free; Hydra's override parser is imported when called.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from conf import group_options
from conf.schema import GROUP_SCHEMAS, unknown_override, wrong_value

if TYPE_CHECKING:
    from hydra.core.override_parser.types import Override

__all__ = ["override_problem"]


def override_problem(overrides: Sequence[str], *, own_options: bool = True) -> str | None:
    """The first of `overrides` that names a key the schema lacks, an option its group lacks (when
    `own_options`: the groups' options are conf/'s own, no search path adds any) or a value its field
    cannot take, as one line with "did you mean"; None when there is none. Bad syntax and `hydra.*`
    keys are left to Hydra."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for text in overrides:
        try:
            (override,) = parser.parse_overrides([text])
        except HydraException:
            return None  # Hydra reports bad syntax itself
        key = override.key_or_group
        if "/" in key or key.split(".", 1)[0] == "hydra":
            continue
        problem = unknown_override(key, text)
        if problem is None and key in GROUP_SCHEMAS and override.is_delete():
            problem = _no_group(key, text)
        elif problem is None and own_options and key in GROUP_SCHEMAS:
            problem = _unknown_option(key, override, text)
        elif problem is None:
            problem = _wrong_values(key, override, text)
        if problem is not None:
            return problem
    return None


def _wrong_values(key: str, override: Override, text: str) -> str | None:
    """One line when a value of `key=...` (each of a choice sweep's) cannot be the field's type:
    Hydra fails on it while composing and exits 1, the code of a run that failed."""
    from hydra.core.override_parser.types import ValueType

    if override.value_type == ValueType.ELEMENT:
        values = [override.get_value_element_as_str()]
    elif override.value_type in (ValueType.CHOICE_SWEEP, ValueType.SIMPLE_CHOICE_SWEEP):
        values = list(override.sweep_string_iterator())
    else:
        return None  # ranges and intervals are numbers; globs choose group options
    for value in values:
        if (problem := wrong_value(key, value)) is not None:
            return f"{problem} (override '{text}')"
    return None


def _no_group(group: str, text: str) -> str:
    """`~group` or `group=null`: Hydra would leave the schema's bare defaults, which no YAML file
    describes (for hardware, a CPU without peaks), or fail with a traceback."""
    options = ", ".join(group_options(group))
    return f"a run needs a {group} config: null or ~{group} leaves none; choose one of: {options} (override '{text}')"


def _unknown_option(group: str, override: Override, text: str) -> str | None:
    """One line when `group=<option>` (or a choice sweep `a,b`) names an option conf/<group>/ lacks,
    with the closest ones; Hydra's own error for it lists the options but exits 1, the code of a
    run that failed, where bad input exits 2."""
    from hydra.core.override_parser.types import ValueType

    if override.value_type not in (ValueType.ELEMENT, ValueType.CHOICE_SWEEP, ValueType.SIMPLE_CHOICE_SWEEP):
        return None  # ranges and globs: Hydra expands them (a glob against the options it finds)
    chosen = list(override.sweep_string_iterator()) if override.is_choice_sweep() else [override.get_value_element_as_str()]
    options = group_options(group)
    for option in chosen:
        if option == "null":
            return _no_group(group, text)
        if option not in options and "${" not in option:
            close = difflib.get_close_matches(option, options, n=3)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            return f"{group}={option} is not a {group} config; {hint}options: {', '.join(options)} (override '{text}')"
    return None
