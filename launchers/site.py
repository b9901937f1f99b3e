"""What the cluster accepts, asked before anything is submitted: partitions, accounts, QoS, licenses.

sbatch refuses an unknown partition only job by job, and a cluster that does not enforce its
associations (AccountingStorageEnforce=none) queues a job under an account or QoS that does not
exist. So the launchers ask Slurm first: `sinfo` for the partitions, `sacctmgr` for the accounts
and QoS this user's associations allow (every one the cluster defines when the user has none),
`scontrol show licenses` for cluster.core_license (and its total, the most one job may ask for).
A value that is not among them is refused before a single job is queued, naming the valid ones.

A tool that is missing or fails (no accounting, the controller down) answers nothing, and the
option is not checked: sbatch then has the last word, as before.

Torch-free.
"""

from __future__ import annotations

import difflib
import getpass
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hydra.errors import CompactHydraException

from launchers.allocation import SbatchOptions

__all__ = ["SiteOptionError", "check_site_options", "license_totals", "site_choices"]

TIMEOUT_S = 30


class SiteOptionError(CompactHydraException):
    """A partition, account or QoS that this cluster does not offer (the message names the valid ones)."""


@dataclass(frozen=True)
class _Option:
    field: str
    """The config field, e.g. 'cluster.partition'."""
    noun: str
    """What it is, in words."""
    plural: str
    """What the list of valid values is called."""


_OPTIONS = {
    "partition": _Option("cluster.partition", "a partition of this cluster", "partitions"),
    "account": _Option("cluster.account", "an account you may charge on this cluster", "accounts"),
    "qos": _Option("cluster.qos", "a QoS you may use on this cluster", "QoS"),
    "core_license": _Option(
        "cluster.core_license", "a license of this cluster (slurm.conf Licenses)", "licenses"
    ),
}


def _lines(argv: Sequence[str]) -> list[str] | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    return [line.strip() for line in proc.stdout.splitlines() if line.strip()]


def _names(cells: Iterable[str]) -> list[str]:
    return sorted({name for cell in cells for name in cell.split(",") if name})


def license_totals() -> dict[str, int] | None:
    """Each license slurmctld keeps (slurm.conf Licenses) and its total; None when Slurm cannot say."""
    lines = _lines(["scontrol", "show", "licenses", "--oneliner"])
    if lines is None:
        return None
    totals = {}
    for line in lines:
        # LicenseName=cores Total=2 Used=0 Free=2 Reserved=0 Remote=no
        fields = dict(item.partition("=")[::2] for item in line.split())
        if "LicenseName" in fields and fields.get("Total", "").isdigit():
            totals[fields["LicenseName"]] = int(fields["Total"])
    return totals


def site_choices(option: str) -> list[str] | None:
    """The values of sbatch's --partition, --account, --qos or --licenses (a name) this cluster
    accepts from this user; None when Slurm cannot say (see the module docstring)."""
    if option == "core_license":
        totals = license_totals()
        return None if totals is None else sorted(totals)
    if option == "partition":
        # -a: hidden partitions and those of other groups too; sbatch is the judge of access.
        lines = _lines(["sinfo", "-h", "-a", "-o", "%R"])
        return None if lines is None else _names(lines)
    field = {"account": "account", "qos": "qos"}[option]
    user = getpass.getuser()
    own = _lines(["sacctmgr", "-n", "-P", "show", "assoc", f"user={user}", f"format={field}"])
    if own is None:
        return None
    if _names(own):
        return _names(own)
    every = {"account": ["show", "account", "format=account"], "qos": ["show", "qos", "format=name"]}[option]
    lines = _lines(["sacctmgr", "-n", "-P", *every])
    return None if lines is None else _names(lines)


def check_site_options(options: Iterable[SbatchOptions]) -> None:
    """Raise SiteOptionError for the first partition, account, QoS or license the cluster does not offer."""
    options = list(options)
    for name, option in _OPTIONS.items():
        wanted = sorted({v for o in options if (v := getattr(o, name)) is not None})
        if not wanted:
            continue
        choices = site_choices(name)
        if choices is None:
            continue
        for value in wanted:
            if value in choices:
                continue
            close = difflib.get_close_matches(value, choices, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise SiteOptionError(
                f"{option.field}={value!r} is not {option.noun}; {option.plural}: "
                f"{', '.join(choices) or 'none'}{hint}. "
                "Nothing was submitted."
            )
