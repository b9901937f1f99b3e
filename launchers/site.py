"""What the cluster accepts, asked before anything is submitted: partitions, accounts, QoS, licenses.

sbatch refuses an unknown partition only job by job, and a cluster that does not enforce its
associations (AccountingStorageEnforce=none) queues a job under an account or QoS that does not
exist. So the launchers ask Slurm first: `sinfo` for the partitions, `sacctmgr` for the accounts
and QoS this user's associations allow (every one the cluster defines when the user has none),
`scontrol show licenses` for cluster.core_license (and its total, the most one job may ask for).
A value that is not among them is refused before a single job is queued, naming the valid ones.

Each job's shape is checked too (`scontrol show partition`, `scontrol show node`): a job that asks
for more nodes than its partition has of its CPUs and GPUs per node would otherwise be queued and
wait forever (squeue reason PartitionConfig or PartitionNodeLimit, sbatch's "CPU count per node
can not be satisfied" at best), so it is refused first, naming the fields that size it.

Last, each job is given to `sbatch --test-only` as it will be submitted (its whole script, the
sbatch options the user added included): Slurm judges it as it would the real one, and queues
nothing. What the checks above do not know (an option sbatch lacks, a gres, feature or memory no
node has, a job_submit plugin's rule) is then refused before the first array is queued, not
array by array, with the arrays before it already in the queue. Two answers are not refusals: a job
the nodes up now cannot start while a node is drained or down (the real sbatch queues it to wait for
that node), and a controller that does not answer (asked once; one warning says the jobs go unchecked).

A tool that is missing or fails (no accounting, the controller down) answers nothing, and the
option is not checked: sbatch then has the last word, as before.

Torch-free.
"""

from __future__ import annotations

import dataclasses
import difflib
import getpass
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from launchers.allocation import ArrayKey, SbatchOptions
from launchers.sweepdir import UsageError

__all__ = [
    "NodeShape",
    "PartitionInfo",
    "SbatchVerdict",
    "SiteOptionError",
    "check_slurm_conf",
    "check_own_options",
    "check_sbatch_scripts",
    "check_site",
    "check_site_options",
    "check_site_shapes",
    "license_totals",
    "partition_nodes",
    "sbatch_test_only",
    "site_choices",
]

TIMEOUT_S = 30


class SiteOptionError(UsageError):
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


def check_site_options(options: Iterable[SbatchOptions], *, fields: Mapping[str, str] | None = None) -> None:
    """Raise SiteOptionError for the first partition, account, QoS or license the cluster does not offer;
    `fields` names an option set elsewhere than in the cluster config (name -> how the user set it)."""
    options = list(options)
    for name, option in _OPTIONS.items():
        if fields and name in fields:
            option = dataclasses.replace(option, field=fields[name])
        # sbatch takes a list of partitions (--partition=a,b: the first that can start the job).
        wanted = sorted({part for o in options if (v := getattr(o, name)) is not None for part in _given_names(name, v)})
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


def _given_names(option: str, value: str) -> list[str]:
    """The names an option's value gives: each of a partition list's, else the value itself."""
    return [p.strip() for p in value.split(",") if p.strip()] if option == "partition" else [value]


@dataclass(frozen=True)
class NodeShape:
    """What one node of a partition offers a job."""

    cpus: int
    """CPUs Slurm schedules on it (CPUTot) (CPUs)."""
    gpus: int
    """GPUs its Gres lists (GPUs)."""
    up: bool
    """Whether it is up and schedulable now (its State: not drained, down, failing or not responding)."""


@dataclass(frozen=True)
class PartitionInfo:
    """A partition as a job sees it: its nodes, whether it is the default, its MaxNodes."""

    nodes: tuple[NodeShape, ...]
    """Its nodes, as `scontrol show node` lists them."""
    default: bool
    """Whether sbatch uses it when no partition is given."""
    max_nodes: int | None
    """MaxNodes; None: unlimited."""
    up: bool
    """Whether the partition itself is up (State=UP; down, drained or inactive ones queue jobs to wait)."""


def _fields(line: str) -> dict[str, str]:
    return dict(item.partition("=")[::2] for item in line.split())


def _gres_gpus(gres: str) -> int:
    """GPUs in a Gres string: 'gpu:8', 'gpu:a100:4(S:0-1),gpu:v100:2', '(null)'."""
    total = 0
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and len(parts) > 1 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def partition_nodes() -> dict[str, PartitionInfo] | None:
    """Each partition's nodes, whether it is the default one, and its MaxNodes; None when Slurm cannot say."""
    partitions = _lines(["scontrol", "show", "partition", "--oneliner"])
    nodes = _lines(["scontrol", "show", "node", "--oneliner"])
    if partitions is None or nodes is None:
        return None
    members: dict[str, list[NodeShape]] = {}
    for line in nodes:
        f = _fields(line)
        if not f.get("CPUTot", "").isdigit():
            continue
        shape = NodeShape(cpus=int(f["CPUTot"]), gpus=_gres_gpus(f.get("Gres", "")), up=_schedulable(f.get("State", "")))
        for name in f.get("Partitions", "").split(","):
            if name:
                members.setdefault(name, []).append(shape)
    out = {}
    for line in partitions:
        f = _fields(line)
        if "PartitionName" not in f:
            continue
        name, limit = f["PartitionName"], f.get("MaxNodes", "UNLIMITED")
        out[name] = PartitionInfo(
            nodes=tuple(members.get(name, [])),
            default=f.get("Default") == "YES",
            max_nodes=int(limit) if limit.isdigit() else None,
            up=f.get("State") == "UP",
        )
    return out


_UP_STATES = frozenset({"IDLE", "MIXED", "ALLOCATED", "COMPLETING", "PLANNED"})
"""`scontrol show node` base states of a node that is up (State=<base>[+<flag>...])."""
_UP_FLAGS = frozenset({"COMPLETING", "POWERED_DOWN", "CLOUD", "PLANNED"})
"""Flags that leave a node schedulable: a node powered down to save energy is started for a job. Any
other (DRAIN, NOT_RESPONDING, MAINTENANCE, REBOOT_REQUESTED, POWERING_UP, ...) makes it not up now."""


def _schedulable(state: str) -> bool:
    base, *flags = state.split("+")
    return base in _UP_STATES and all(flag in _UP_FLAGS for flag in flags)


def check_site_shapes(keys: Iterable[ArrayKey]) -> None:
    """Raise SiteOptionError for the first job shape that no set of nodes of its partition can hold."""
    partitions: dict[str, PartitionInfo] | None = None
    for key in dict.fromkeys(keys):
        if partitions is None:
            partitions = partition_nodes()
            if partitions is None:
                return
        a, o = key.allocation, key.options
        name = o.partition or next((p for p, part in partitions.items() if part.default), None)
        part = partitions.get(name) if name is not None else None
        if part is None or not part.nodes:
            continue  # no default partition, or one check_site_options refuses: sbatch judges
        cpus = a.tasks_per_node * o.cpus_per_task
        fit = sum(1 for n in part.nodes if n.cpus >= cpus and n.gpus >= a.gpus_per_node)
        usable = fit if part.max_nodes is None else min(fit, part.max_nodes)
        if a.nodes <= usable:
            continue
        most_cpus = max(n.cpus for n in part.nodes)
        most_gpus = max(n.gpus for n in part.nodes)
        cpt = max(1, o.cpus_per_task)
        # Node by node: the largest CPU count and the largest GPU count may be different nodes'.
        per_node = max(1, max(min(n.gpus, n.cpus // cpt) if a.gpus_per_node else n.cpus // cpt for n in part.nodes))
        cap = most_cpus // a.tasks_per_node  # CPUs per task with which this many tasks fit the largest node
        limit = f", MaxNodes={part.max_nodes}" if part.max_nodes is not None and part.max_nodes < fit else ""
        fewer = f"Use fewer devices, set hardware.devices_per_node to what a node runs (at most {per_node} here)"
        if cpus > most_cpus and cap >= 1 and a.gpus_per_node <= most_gpus:
            if o.cpus_per_task > most_cpus:
                # One task is more than a node: fewer devices per node would not help (GPU jobs too).
                fix = (f"Set cluster.cpus_per_task to at most {cap} ({most_cpus} CPUs of a node here over its "
                       f"{a.tasks_per_node} task(s))")  # fmt: skip
            else:  # the tasks' CPUs together: fewer tasks, or fewer CPUs each
                fix = f"{fewer}, or set cluster.cpus_per_task to at most {cap}"
        elif o.cpus_per_task > most_cpus:  # more tasks than a node has CPUs, or GPUs short too
            fix = f"{fewer}, and cluster.cpus_per_task to at most {most_cpus}"
        else:
            fix = fewer
        raise SiteOptionError(
            f"A job of {a.nodes} node(s) x {a.tasks_per_node} task(s) x cluster.cpus_per_task={o.cpus_per_task} "
            f"CPU(s){f' and {a.gpus_per_node} GPU(s)' if a.gpus_per_node else ''} per node ({a.tasks} devices: "
            f"dp x tp x pp, placed hardware.devices_per_node to a node) cannot start in partition {name!r}: "
            f"{fit} of its {len(part.nodes)} nodes hold {cpus} CPUs{f' and {a.gpus_per_node} GPUs' if a.gpus_per_node else ''}"
            f"{limit} (the largest has {most_cpus} CPUs, {most_gpus} GPUs). Nothing was submitted. {fix}, or "
            f"choose another partition (cluster.partition; partitions: {', '.join(sorted(partitions))})."
        )


def _asked(options: SbatchOptions, given: Mapping[str, str]) -> SbatchOptions:
    """`options` with the partition, account and QoS a launcher's own sbatch options put over them."""
    return dataclasses.replace(
        options,
        partition=given.get("partition", options.partition),
        account=given.get("account", options.account),
        qos=given.get("qos", options.qos),
    )


_TIME = "from cluster.time_limit_min (the USR1 checkpoint warning is timed before it): set that instead"
_SHAPE = "from the layout (dp x tp x pp ranks, hardware.devices_per_node per node)"
_LOG = "into the sweep's Slurm log directory, where status and rerun find each task's log"
MEGASWEEPS_OWN: dict[str, str] = {
    "array": "one task per config, throttled by cluster.array_parallelism (tasks past the configs had no row)",
    "a": "one task per config, throttled by cluster.array_parallelism",
    "time": _TIME, "t": _TIME,
    "nodes": _SHAPE, "N": _SHAPE, "ntasks": _SHAPE, "n": _SHAPE, "ntasks-per-node": _SHAPE, "tasks-per-node": _SHAPE,
    "gpus-per-node": _SHAPE, "gpus": _SHAPE, "G": _SHAPE,
    "cpus-per-task": "from cluster.cpus_per_task: set that instead", "c": "from cluster.cpus_per_task: set that instead",
    "output": _LOG, "o": _LOG, "error": _LOG, "e": _LOG,
    "chdir": "to where the sweep was launched from, which each config's overrides are relative to",
    "D": "to where the sweep was launched from",
}  # fmt: skip
"""sbatch options a launcher's own (hydra.launcher.sbatch_args, --sbatch-arg) may not set: megasweep
derives them, and one given too took the place of megasweep's (a --time=1 below the 20 minutes said,
with the USR1 warning 120 s before a 60 s limit; an --array past the configs), each with why."""


def check_own_options(sbatch_args: Mapping[str, Any] | None, *, option: str) -> None:
    """SiteOptionError for an sbatch option (a launch's hydra.launcher.sbatch_args, an export's --sbatch-arg,
    each named by `option`) that megasweep derives itself (MEGASWEEPS_OWN), however it is spelled
    (submitit writes cpus_per_task as --cpus-per-task). Asked where the user gives the options, not of a
    rerun, which takes the ones its launch recorded and cannot leave one out."""
    for name in sbatch_args or {}:
        if (why := MEGASWEEPS_OWN.get(str(name).lstrip("-").replace("_", "-"))) is not None:
            raise SiteOptionError(f"{option.format(name=name)}: megasweep sets this sbatch option itself, {why}. Leave it out.")


def check_slurm_conf() -> None:
    """SiteOptionError when SLURM_CONF names no file: each Slurm command then retries until its timeout
    (a launch waited five minutes, then called every config refused by sbatch)."""
    path = os.environ.get("SLURM_CONF")
    if path and not os.path.isfile(path):
        raise SiteOptionError(
            f"SLURM_CONF={path}: no such file, so no Slurm command can read the cluster's configuration; "
            "point it at this cluster's slurm.conf, or unset it for Slurm's default; nothing was queued or written"
        )


def check_site(
    keys: Iterable[ArrayKey], sbatch_args: Mapping[str, Any] | None = None, *, option: str = "--sbatch-arg {name}"
) -> None:
    """check_site_options, then check_site_shapes, for the jobs of `keys`; a partition, account or QoS
    among `sbatch_args` (the launcher's own sbatch options, each named by `option`) is what the jobs ask for,
    over the cluster config's, and is checked as such (it went to sbatch unchecked)."""
    check_slurm_conf()
    given = {name: str(v) for name in ("partition", "account", "qos") if (v := (sbatch_args or {}).get(name))}
    keys = [dataclasses.replace(k, options=_asked(k.options, given)) for k in keys] if given else list(keys)
    check_site_options((k.options for k in keys), fields={name: option.format(name=name) for name in given})
    check_site_shapes(keys)


_UNANSWERED = re.compile(
    r"unable to contact|timed out|not responding|temporarily unable|connection refused|try again", re.IGNORECASE
)
"""sbatch's words when the controller did not judge the job (down, busy, unreachable): no refusal."""
_NOT_NOW = re.compile(r"not available", re.IGNORECASE)
"""sbatch --test-only's words for a job the nodes or partition up now cannot start ("Requested node
configuration is not available", "... partition configuration not available now"). It judges against
the nodes up now: with every node up no node can ever hold the job (memory more than any has: the real
sbatch queues it to wait for ever), but a drained or down node makes it refuse a job the real sbatch
queues to wait for that node, so then it is no refusal (_all_up)."""
_PARTITION = re.compile(r"^#SBATCH[ \t]+(?:--partition[= ]|-p[ \t]*)['\"]?([^\s'\"]+)", re.MULTILINE)
"""A batch script's partition directive; sbatch takes the last one given."""


def _all_up(script: str) -> bool:
    """Whether the partitions `script` asks for (its #SBATCH --partition list; none: the cluster's default)
    and each of their nodes are up and schedulable now (partition_nodes; False when Slurm cannot say).
    Another partition's state says nothing of this job."""
    partitions = partition_nodes()
    if not partitions:
        return False
    given = _PARTITION.findall(script)
    wanted = given[-1].split(",") if given else [name for name, p in partitions.items() if p.default]
    found = [partitions.get(name) for name in wanted]
    return bool(found) and all(p is not None and p.up and p.nodes and all(n.up for n in p.nodes) for p in found)


@dataclass(frozen=True)
class SbatchVerdict:
    """What `sbatch --test-only` said of one script."""

    refusal: str | None = None
    """Slurm's words, on one line, when it refuses the job."""
    unanswered: str | None = None
    """Why Slurm did not judge it (no sbatch, no answer from the controller): the real sbatch decides."""


def sbatch_test_only(script: str) -> SbatchVerdict:
    """What `sbatch --test-only` (which queues nothing) says of `script`, a batch script's text."""
    if shutil.which("sbatch") is None:
        return SbatchVerdict(unanswered="no sbatch on this machine")
    try:
        proc = subprocess.run(
            ["sbatch", "--test-only"], input=script, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return SbatchVerdict(unanswered=f"no answer within {TIMEOUT_S} s")
    except (OSError, subprocess.SubprocessError) as exc:
        return SbatchVerdict(unanswered=str(exc))
    if proc.returncode == 0:
        return SbatchVerdict()
    said = " | ".join(line.strip() for line in (proc.stderr + proc.stdout).splitlines() if line.strip())
    if _UNANSWERED.search(said):
        return SbatchVerdict(unanswered=said)
    if _NOT_NOW.search(said) and not _all_up(script):
        return SbatchVerdict()
    return SbatchVerdict(refusal=said or f"sbatch --test-only ended with exit status {proc.returncode} and no message")


def check_sbatch_scripts(
    jobs: Iterable[tuple[str, str]],
    *,
    fix: str,
    skip: str,
    outcome: str = "Nothing was submitted",
    again: str = "launch again",
) -> None:
    """Raise SiteOptionError naming every job that `sbatch --test-only` refuses; `jobs`: (what the job
    is, in words; its script), `fix`: which settings make the script, for the user to change; `skip`:
    the option that leaves the check out; `outcome` and `again`: what the refusal left undone, and what
    to do once it is fixed.

    A controller that does not answer is asked once, not once per job (each would wait TIMEOUT_S), and
    one warning says the jobs go unchecked; a machine without sbatch is not asked, without a word."""
    if shutil.which("sbatch") is None:
        return
    refused = []
    for what, script in jobs:
        said = sbatch_test_only(script)
        if said.unanswered is not None:
            print(f"warning: Slurm did not judge the jobs before they are queued (sbatch --test-only: "
                  f"{said.unanswered}); sbatch has the last word as each is queued", file=sys.stderr, flush=True)
            break
        if said.refusal is not None:
            refused.append(f"{what}: {said.refusal}")
    if refused:
        raise SiteOptionError(
            f"Slurm refuses {len(refused)} job(s) (asked with sbatch --test-only, which queues nothing): "
            f"{'; '.join(refused)}. {outcome}. Change {fix}, then {again}. (Where a site's sbatch --test-only "
            f"refuses jobs that sbatch itself would queue, {skip} leaves this check out.)"
        )
