"""Tables in the seeds' format: results.md (BLOOM notes, seed 001), scaling and ZeRO comparison tables
(DeepSpeed, seed 004).

Formatting conventions, as the seeds write them:
- Mem: the measured peak per device (max over ranks and iterations) in GiB (2**30 bytes), written
  'GB' like the seeds: whole GiB from 10 GiB up ('47GB'), one decimal below ('0.4GB') so that
  small and CPU runs do not all read '0GB'. A failed or skipped config shows its outcome there
  instead (OOM, NaN, timeout, fail, skipped), with Sec/it and TFLOPs empty, as the seeds' OOM rows.
- Size: parameters as papers write them (1.3B, 181B); Sec/it two decimals (three below 1 s); CV
  (the measured iterations' std / mean, in percent, one decimal) beside it, so that a difference
  between two rows can be read against their noise; Notes say when other Slurm jobs shared a run's
  nodes;
  TFLOPs per device two decimals (four below 1); MFU in percent, one decimal.
- Pred s/it (as Sec/it) and Err (predicted over measured - 1, signed percent, one decimal: negative
  when the model predicted the run faster than it ran) beside each finished run: the time model
  against the measurement, with the sign `python -m analysis calibrate` and the GPU report use. A run the model cannot predict reads 'n/a',
  and why is said once under the table, not on every row.
- Rows: fastest first (seconds per iteration), then finished runs without a measurement, then
  failures by kind (OOM, NaN, timeout, fail, skipped) in a fixed order of their layout.
- A run stopped before its end (timeout, cancelled, interrupted: records.PARTIAL_OUTCOMES) that measured
  at least records.MIN_PARTIAL_ITERATIONS iterations shows what it measured: Mem says 'timeout (partial)', Sec/it,
  CV, TFLOPs and MFU are those of its measured iterations alone, Notes say how many, where it stopped
  and its peak memory so far, and a footnote says what they are. It keeps its place among the failures, and no Pred s/it or
  Err (those judge the time model by finished runs). One that measured fewer says so in Notes.
- A run that resumed from its checkpoint (records.resumed_rows) says so in Notes, with how many iterations
  a finished one's figures cover (its last attempt's), and a footnote says what they are.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from analysis.records import (
    MIN_PARTIAL_ITERATIONS,
    MISSING,
    NOT_RUN,
    PARTIAL_OUTCOMES,
    outcome_counts,
    prediction_error,
    value_texts,
    whole_number_columns,
)
from train.planner.plan import format_params

SEED_COLUMNS = (
    "Nodes", "Size", "DP", "TP", "PP", "MBS", "GBS", "Mem", "Sec/it", "CV", "Pred s/it", "Err", "TFLOPs", "MFU",
    "Notes",
)  # fmt: skip
"""The seeds' columns, plus CV (the spread of a run's timed iterations) and Pred s/it and Err (the time
model's prediction and predicted / measured - 1), which the seeds did not show."""
RESUMED_TEXT = "resumed"
"""The word that opens a resumed run's Notes ('resumed at step 16: ...') and its footnote."""
PARTIAL_TEXT = " (partial)"
"""What follows a stopped run's outcome in Mem when its row shows the figures it measured before the stop."""
NOT_PREDICTED = "n/a"
"""Pred s/it of a finished run the time model cannot predict (results.md says why, once)."""
OUTCOME_TEXT = {
    "ok": "ok",
    "oom": "OOM",
    "nan": "NaN",
    "timeout": "timeout",
    "cancelled": "cancelled",
    "fail": "fail",
    "interrupted": "interrupted",
    "refused": "refused",
    "skipped": "skipped",
    "pending": "pending",
    "running": "running",
    "planned": "planned, not run",
}
_ORDER = {
    "ok": 0, "oom": 2, "nan": 3, "timeout": 4, "cancelled": 4.5, "fail": 5, "interrupted": 5.2, "refused": 5.5,
    "skipped": 6, "pending": 7, "running": 8,
    "planned": 8.5,
}
# Overrides whose value has its own column (key -> column): repeating them in Notes would be noise,
# except in a row where that column is blank (a config that did not compose, say).
_SHOWN_KEYS = {
    "parallelism.dp": "dp",
    "parallelism.tp": "tp",
    "parallelism.pp": "pp",
    "parallelism.micro_batch_size": "mbs",
    "parallelism.global_batch_size": "gbs",
}
_MAX_REASON = 120
TIE_BREAK = ("nodes", "dp", "tp", "pp", "mbs", "gbs", "sweep", "run_dir", "config_key")


def narrow(df: pd.DataFrame, names: Sequence[str]) -> pd.DataFrame:
    """The columns of `names` that df has, in that order: a table's rows are selected, copied and
    sorted many times over, which costs in proportion to its ~160 columns, and a report reads a few."""
    return df[[name for name in dict.fromkeys(names) if name in df.columns]]


# ---------------------------------------------------------------------------------------------
# Cells


def _missing(v: float | None) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def format_mem(gib: float | None) -> str:
    """'47GB' (whole GiB, the seeds' rounding) or '0.4GB' below 10 GiB; '' when not measured."""
    if _missing(gib):
        return ""
    assert gib is not None
    return f"{gib:.0f}GB" if gib >= 10 else f"{gib:.1f}GB"


def format_size(params: float | None) -> str:
    """'1.3B', '181B'; '' when unknown."""
    if _missing(params) or not params or params <= 0:
        return ""
    return format_params(int(params))


def format_sec(sec: float | None) -> str:
    if _missing(sec):
        return ""
    assert sec is not None
    return f"{sec:.2f}" if sec >= 1 else f"{sec:.3f}"


def format_tflops(tflops: float | None) -> str:
    if _missing(tflops):
        return ""
    assert tflops is not None
    return f"{tflops:.2f}" if tflops >= 1 else f"{tflops:.4f}"


def format_cv(cv: float | None) -> str:
    """'3.2%': the spread of a run's measured iterations; '' when unknown (fewer than two)."""
    if _missing(cv):
        return ""
    assert cv is not None
    return f"{100 * cv:.1f}%"


def format_mfu(mfu: float | None) -> str:
    if _missing(mfu):
        return ""
    assert mfu is not None
    return f"{100 * mfu:.1f}%"


def format_err(err: float | None) -> str:
    """'+12.3%': predicted over measured seconds per iteration - 1 (-: predicted too fast); '' when unknown."""
    if _missing(err):
        return ""
    assert err is not None
    # + 0.0 turns a rounded -0.0 into 0.0: '+0.0%', not '-0.0%'.
    return f"{round(100 * err, 1) + 0.0:+.1f}%"


def _int_text(s: pd.Series) -> pd.Series:
    if isinstance(s.dtype, np.dtype) and s.dtype.kind in "fiu":
        # Once per distinct count (a sweep has a few node counts and degrees), not per row.
        codes, uniques = pd.factorize(s, use_na_sentinel=True)
        texts = np.array([*(str(int(v)) for v in uniques.tolist()), ""], dtype=object)
        return pd.Series(texts[codes].tolist(), index=s.index)  # the dtype map() would give
    return s.map(lambda v: "" if _missing(v) else str(int(v)))


def _texts(s: pd.Series) -> pd.Series:
    """s.map(_text), computed once per distinct value."""
    return pd.Series(value_texts(s), index=s.index)  # the dtype map() would give


def _escape(s: pd.Series) -> pd.Series:
    return s.astype(str).str.replace("|", "\\|", regex=False).str.replace("\n", " ", regex=False)


# ---------------------------------------------------------------------------------------------
# results.md


def sort_results(df: pd.DataFrame) -> pd.DataFrame:
    """Fastest first; finished runs without a measurement next; failures after, in a stable order."""
    rank = df["outcome"].map(_ORDER).fillna(9).astype(float)
    rank = rank.where(~((df["outcome"] == "ok") & df["sec_per_iter"].isna()), 1.0)
    by = ["_rank", "sec_per_iter", *[c for c in TIE_BREAK if c in df.columns]]
    # The sort keys alone are sorted, and the rows taken once in their order.
    keys = df[by[1:]].assign(_rank=rank).reset_index(drop=True)
    order = keys.sort_values(by, kind="mergesort", na_position="last").index.to_numpy()
    return df.take(order)


def varying_overrides(df: pd.DataFrame) -> pd.Series:
    """Per row, its overrides that differ across the table and have no column ('' when none).

    The seeds add a column (NHIDDEN, NHEADS) when they vary something the columns do not show;
    a generic table puts those overrides in Notes instead.
    """
    if "overrides" not in df.columns or df.empty:
        return pd.Series("", index=df.index, dtype=object)
    # Plain Python over the rows: pandas' explode, str.split and groupby took most of a report's
    # time on 10,000 rows (five overrides each) for what is a few dict look-ups per override.
    rows: list[list[str]] = []
    key_of: dict[str, str] = {}  # item -> its key: a sweep repeats the same few items
    items_of: dict[str, set[str]] = {}
    row_keys: dict[tuple[str, ...], int] = {}  # the keys of a row -> how many rows have them
    for overrides in df["overrides"].tolist():
        items: list[str] = []
        if isinstance(overrides, list | tuple):
            keys = []
            for item in overrides:
                if type(item) is not str:
                    if _missing(item) or item is pd.NA:
                        continue
                    item = str(item)
                key = key_of.get(item)
                if key is None:
                    key = key_of[item] = item.split("=", 1)[0].lstrip("+~")
                    items_of.setdefault(key, set()).add(item)
                items.append(item)
                keys.append(key)
            together = tuple(keys)
            row_keys[together] = row_keys.get(together, 0) + 1
        rows.append(items)
    rows_of: dict[str, int] = {}
    for together, n in row_keys.items():
        for key in set(together):  # a row that repeats a key counts once
            rows_of[key] = rows_of.get(key, 0) + n
    varies = {k for k, items in items_of.items() if (len(items) > 1 or rows_of[k] < len(df)) and k not in _SHOWN_KEYS}
    shown = {item for item, key in key_of.items() if key in varies}
    # Per row, the own-column overrides whose column it leaves blank: nowhere else would they show.
    blank_cols = [(key, pd.to_numeric(df[col], errors="coerce").isna().tolist())
                  for key, col in _SHOWN_KEYS.items() if key in items_of and col in df.columns]  # fmt: skip
    joined = []
    for i, items in enumerate(rows):
        extra = {key for key, blank in blank_cols if blank[i]}
        joined.append(" ".join([item for item in items if item in shown or (extra and key_of[item] in extra)]))
    return pd.Series(joined, index=df.index, dtype=object)


def _col_text(df: pd.DataFrame, name: str) -> list[str]:
    """A text column's cells ('' where missing: frames built before the column existed)."""
    if name not in df.columns:
        return [""] * len(df)
    return df[name].fillna("").astype(str).tolist()


def _numbers(df: pd.DataFrame, name: str) -> list[float]:
    """A numeric column's values (NaN where missing: frames built before the column existed)."""
    if name not in df.columns:
        return [math.nan] * len(df)
    return pd.to_numeric(df[name], errors="coerce").astype(float).tolist()


def partial_flags(df: pd.DataFrame) -> pd.Series:
    """records.partial_rows' verdict of each row (False where the table has no such column)."""
    if "partial" not in df.columns:
        return pd.Series(False, index=df.index, dtype=bool)
    return df["partial"].fillna(False).astype(bool)


def _count(n: float, what: str) -> str:
    return f"{int(n)} {what}" + ("" if n == 1 else "s")


def _stop_notes(df: pd.DataFrame) -> list[str]:
    """For a stopped run (records.PARTIAL_OUTCOMES) that ran iterations: how many it measured, where it
    stopped and, when its figures are shown, its peak memory so far (Mem says its outcome instead); or
    why its figures are blank: fewer measured than records.MIN_PARTIAL_ITERATIONS. '' for other rows."""
    stopped = df["outcome"].isin(PARTIAL_OUTCOMES).tolist()
    partial = partial_flags(df).tolist()
    columns = (_numbers(df, name) for name in ("measured_iterations", "iterations_run", "resumed_from_step",
                                                "config.training.train_iters", "mem_gib"))  # fmt: skip
    notes = []
    for is_stopped, is_partial, measured, run, resumed, total, mem in zip(stopped, partial, *columns, strict=True):
        ran = not _missing(run) and run > 0
        if not is_stopped or _missing(measured) or not (ran or is_partial):
            notes.append("")  # not stopped, or nothing ran: the reason says all there is
            continue
        # A resumed attempt counts its own iterations from its checkpoint's step. A record rebuilt from
        # W&B's summary does not say how many iterations it ran.
        at = f", stopped after {int(run + (0 if _missing(resumed) else resumed))}" if ran else ""
        at += f" of {int(total)}" if ran and not _missing(total) else ""
        if is_partial:
            peak = f", peak {format_mem(mem)} so far" if not _missing(mem) else ""
            notes.append(f"partial: {_count(measured, 'iteration')} measured{at}{peak}")
        else:
            notes.append(f"no figures: {_count(measured, 'iteration')} measured ({MIN_PARTIAL_ITERATIONS} needed){at}")
    return notes


def resumed_flags(df: pd.DataFrame) -> pd.Series:
    """records.resumed_rows' verdict of each row (False where the table has no such column)."""
    if "resumed" not in df.columns:
        return pd.Series(False, index=df.index, dtype=bool)
    return df["resumed"].fillna(False).astype(bool)


def _resume_notes(df: pd.DataFrame) -> list[str]:
    """For a run that went on from its checkpoint: the step it resumed at and, for a finished run, how
    many iterations its figures cover (a stopped run's stop notes say that already); '' for other rows.
    Without it a resumed run's few iterations (its warm-up spent again) read as a whole run's."""
    resumed = resumed_flags(df).tolist()
    ok = (df["outcome"] == "ok").tolist()
    steps, measured = _numbers(df, "resumed_from_step"), _numbers(df, "measured_iterations")
    notes = []
    for is_resumed, is_ok, step, count in zip(resumed, ok, steps, measured, strict=True):
        if not is_resumed or _missing(step):
            notes.append("")
            continue
        since = f": {_count(count, 'iteration')} measured after it" if is_ok and not _missing(count) else ""
        notes.append(f"{RESUMED_TEXT} at step {int(step)}{since}")
    return notes


def _notes(df: pd.DataFrame, multi_sweep: bool) -> pd.Series:
    reason = df["reason"].fillna("").astype(str).tolist()
    reason = [r if len(r) <= _MAX_REASON else r[: _MAX_REASON - 3] + "..." for r in reason]
    neighbours = pd.to_numeric(df["neighbour_jobs"], errors="coerce").fillna(0).astype(int).tolist()
    beside = [f"beside {n} other job(s)" if n else "" for n in neighbours]
    # Its first sentence: which config, which device (results.csv keeps what it means for the figures).
    mismatch = [m.split(". ", 1)[0] for m in _col_text(df, "device_mismatch")]
    # A failed config rerun with changed fields is dealt with (status says it too): said before its reason.
    rerun_as = pd.to_numeric(df["rerun_as"], errors="coerce") if "rerun_as" in df.columns else pd.Series(math.nan, df.index)
    rerun = [f"rerun as config {int(r)}" if r == r else "" for r in rerun_as.tolist()]
    parts = [df["date"].fillna("").astype(str).tolist(), beside, mismatch, varying_overrides(df).tolist(), rerun,
             _resume_notes(df), _stop_notes(df), reason]  # fmt: skip
    if multi_sweep:
        parts.insert(0, df["sweep"].astype(str).tolist())
    # The non-empty parts of each row, joined: one Python pass, not a pandas where() per part.
    notes = ["; ".join([p for p in row if p]) for row in zip(*parts, strict=True)]
    return pd.Series(notes, index=df.index, dtype=object)


def _layout_cells(frame: pd.DataFrame) -> dict[str, pd.Series]:
    """The seeds' first columns, which say what ran: nodes, model size, degrees and batch sizes."""
    return {
        "Nodes": _int_text(frame["nodes"]),
        "Size": frame["size_params"].map(format_size),
        "DP": _int_text(frame["dp"]),
        "TP": _int_text(frame["tp"]),
        "PP": _int_text(frame["pp"]),
        "MBS": _int_text(frame["mbs"]),
        "GBS": _int_text(frame["gbs"]),
    }


_RESULTS_COLUMNS = (
    "outcome", "sec_per_iter", *TIE_BREAK, "size_params", "mem_gib", "sec_cv", "pred_sec_per_iter",
    "tflops", "mfu", "peak_tflops", "reason", "neighbour_jobs", "device_mismatch", "date", "overrides", "rerun_as",
    "partial", "resumed", "measured_iterations", "iterations_run", "resumed_from_step", "config.training.train_iters",
)  # fmt: skip
"""What results_table reads."""


def _mfu_cells(done: pd.DataFrame) -> pd.Series:
    """MFU as recorded; where the record left it out because the run beat its device's peak (the
    trainer's above-peak warning: the peak is too low, a CPU's calibrated under load, say), the
    ratio itself marked as such, never an empty cell that reads as 'not measured'. A recorded MFU
    above 100% (a record not written by this trainer, which leaves it out) is marked alike."""
    recorded = pd.to_numeric(done["mfu"], errors="coerce")
    cells = recorded.map(format_mfu)
    # Marked where above the peak only: a text per row, of which most are thrown away, took a
    # report's time too (10,000 rows).
    over = recorded > 1.0
    cells[over] = recorded[over].map(above_peak_text)
    if "peak_tflops" not in done.columns:
        return cells
    ratio = pd.to_numeric(done["tflops"], errors="coerce") / pd.to_numeric(done["peak_tflops"], errors="coerce")
    above = (cells == "") & (ratio > 1.0)
    cells[above] = ratio[above].map(above_peak_text)
    return cells


def above_peak_text(mfu: float) -> str:
    """An MFU above 100%: the peak (or the FLOPs count) is wrong, not the run's figures."""
    return f"{100 * mfu:.0f}% (above peak)"


def results_table(df: pd.DataFrame) -> pd.DataFrame:
    """The finished and skipped configs as the seeds' columns (strings), sorted; configs not run left out."""
    # Narrowed before the rows are selected: a selection copies every column of what it selects from.
    done = sort_results(narrow(df, _RESULTS_COLUMNS)[~df["outcome"].isin(NOT_RUN)])
    ok = done["outcome"] == "ok"
    # A stopped run's partial figures: shown, its outcome kept in Mem and marked there (PARTIAL_TEXT).
    shown = ok | partial_flags(done)
    outcome = done["outcome"].map(OUTCOME_TEXT)
    mem = done["mem_gib"].map(format_mem).where(ok, outcome.where(~shown, outcome + PARTIAL_TEXT))
    table = pd.DataFrame(
        {
            **_layout_cells(done),
            "Mem": mem,
            "Sec/it": done["sec_per_iter"].map(format_sec).where(shown, ""),
            "CV": done["sec_cv"].map(format_cv).where(shown, ""),
            "Pred s/it": done["pred_sec_per_iter"].map(format_sec).replace("", NOT_PREDICTED).where(ok, ""),
            "Err": prediction_error(done).map(format_err).where(ok, ""),
            "TFLOPs": done["tflops"].map(format_tflops).where(shown, ""),
            "MFU": _mfu_cells(done).where(shown, ""),
            "Notes": _escape(_notes(done, done["sweep"].nunique() > 1)),
        }
    )
    return table.reset_index(drop=True)


def markdown_table(table: pd.DataFrame, *, left: Sequence[str] = ()) -> str:
    """A padded markdown table; columns right-aligned as the seeds do, except those in `left`."""
    cols = [str(c) for c in table.columns]
    # A column at a time: its cells' widths and padding in one pass each, not a call per cell.
    cells = [[str(v) for v in table.iloc[:, i].tolist()] for i in range(len(cols))]
    widths = [max([len(c), 3, *map(len, column)]) for c, column in zip(cols, cells, strict=True)]
    padded = [
        [v.ljust(w) for v in column] if c in left else [v.rjust(w) for v in column]
        for c, w, column in zip(cols, widths, cells, strict=True)
    ]
    header = [c.ljust(w) if c in left else c.rjust(w) for c, w in zip(cols, widths, strict=True)]
    rule = ["-" * (w - 1) + ":" if c not in left else ":" + "-" * (w - 1) for w, c in zip(widths, cols, strict=True)]
    rows = ("| " + " | ".join(row) + " |" for row in zip(*padded, strict=True))
    return "\n".join(["| " + " | ".join(header) + " |", "| " + " | ".join(rule) + " |", *rows])


def _more_line(rows: int, limit: int | None, where: str) -> str:
    return f"\n... {rows - limit:,} more in {where}" if limit is not None and rows > limit else ""


def missing_markdown(df: pd.DataFrame, *, limit: int | None = None) -> str:
    """What is not there yet: the configs still pending or running, with their job ids, directories and
    layouts (as the launch composed them: records.py reads them from the manifest) and, where the launch
    knows it, why they have no job or record yet (the first `limit` of them, and how many more; None: all)."""
    missing = df[df["outcome"].isin(MISSING)]
    if missing.empty:
        planned = int((df["outcome"] == "planned").sum())
        if planned:
            return f"Nothing launched and unfinished: the {planned} planned config(s) were never launched."
        return "Nothing missing: no config is pending or running (what failed is in the results above)."
    missing = missing.sort_values(["sweep", "manifest_index", "run_dir", "config_key"], kind="mergesort")
    more = _more_line(len(missing), limit, "results.md")
    missing = missing if limit is None else missing.head(limit)
    table = pd.DataFrame(
        {
            "State": missing["outcome"].where(missing["queue_state"] == "", missing["queue_state"]),
            "Job": missing["job_id"].astype(str),
            "Dir": missing["run_dir"].astype(str),
            **_layout_cells(missing),
            "Overrides": _escape(missing["config_key"].astype(str)),
        }
    )
    # Why a config has no job or record, where the launch knows (an exported script nobody submitted yet,
    # a local config queued behind another): it read `pending` beside an empty Job cell, where status
    # said "no job started yet (exported to <script>, array task 0)". Slurm's pending jobs have their state.
    why = missing["reason"].fillna("").astype(str) if "reason" in missing.columns else pd.Series("", index=missing.index)
    if (why != "").any():
        table["Why"] = _escape(why.map(lambda r: r if len(r) <= _MAX_REASON else r[: _MAX_REASON - 3] + "..."))
    if df["sweep"].nunique() > 1:
        table.insert(0, "Sweep", missing["sweep"].astype(str).to_numpy())
    left = ("Sweep", "State", "Job", "Dir", "Overrides", "Why")
    return markdown_table(table.reset_index(drop=True), left=tuple(c for c in table.columns if c in left)) + more


PLANNED_SHOWN = 100
"""Planned configs results.md lists (fastest predicted first); results.csv has all of them (rows)."""


_PLANNED_COLUMNS = (
    "outcome", "sweep", "pred_sec_per_iter", "pred_mfu", *TIE_BREAK, "size_params", "mem_pred_gib", "config_key",
)  # fmt: skip
"""What planned_markdown reads."""


def planned_markdown(df: pd.DataFrame, *, limit: int | None = PLANNED_SHOWN) -> str:
    """The configs a dry run planned and nobody ran, with the plan's predictions: what to launch, and
    what to expect of it. '' when there are none. Work by work (launchers.plan.shown_in_turn's order):
    each work's fastest predicted first, and within `limit` every work's fastest in turn, then every
    work's second...: ranked over all, a small model's layouts filled the table and a large one's
    fastest was not in it."""
    from analysis.recommend import work_ids  # it builds on this module's formatting
    # Narrowed before columns are added: the loaded table has ~200 columns in as many blocks, and a
    # column added to it made pandas print a PerformanceWarning (a highly fragmented frame) on the
    # console of an analysis that mixes a plan directory with result sweeps.
    planned = narrow(df, _PLANNED_COLUMNS)[df["outcome"] == "planned"]
    if planned.empty:
        return ""
    pred = planned["pred_sec_per_iter"] if "pred_sec_per_iter" in planned.columns else pd.Series(math.nan, planned.index)
    mfu = planned["pred_mfu"] if "pred_mfu" in planned.columns else pd.Series(math.nan, planned.index)
    planned = planned.assign(_pred=pred.astype(float), _mfu=mfu.astype(float))
    planned = planned.sort_values(["_pred", *[c for c in TIE_BREAK if c in planned.columns]], kind="mergesort",
                                  na_position="last")
    work = work_ids(df).reindex(planned.index).fillna(-1)
    # Predicted rows turn by turn (a work's n-th fastest in the n-th turn); an unpredicted row only
    # where no predicted one is left.
    turn = planned.groupby(work, sort=False).cumcount().where(planned["_pred"].notna(), len(planned))
    chosen = turn.sort_values(kind="mergesort").index[: len(planned) if limit is None else limit]
    several = work.nunique() > 1
    more = _more_line(len(planned), limit, "results.csv")
    if more and several:
        unseen = work.nunique() - work[chosen].nunique()
        what = f" ({unseen} work(s) have no row here)" if unseen else ""
        more = more.replace("more in", f"more, each slower than its work's shown ones or unpredicted{what}, in")
    # Listed work by work, in the order of the works' fastest rows.
    order = planned.groupby(work, sort=False).ngroup()
    planned = planned.loc[planned.index.isin(chosen)]
    planned = planned.iloc[np.argsort(order[planned.index].to_numpy(), kind="stable")]
    table = pd.DataFrame(
        {
            **_layout_cells(planned),
            "Pred mem": planned["mem_pred_gib"].map(format_mem),
            "Pred sec/it": planned["_pred"].map(format_sec),
            "Pred MFU": planned["_mfu"].map(format_mfu),
            "Overrides": _escape(planned["config_key"].astype(str)),
        }
    )
    if df["sweep"].nunique() > 1:
        table.insert(0, "Sweep", planned["sweep"].astype(str).to_numpy())
    return markdown_table(table.reset_index(drop=True), left=("Overrides", "Sweep")) + more


def summary_line(df: pd.DataFrame) -> str:
    """'11 configs: 5 ok, 1 OOM, ..., 1 pending' in the outcomes' order, and how many stopped runs
    show partial figures when some do."""
    counts = outcome_counts(df)
    parts = ", ".join(f"{n} {OUTCOME_TEXT[o]}" for o, n in counts.items())
    partial = int(partial_flags(df).sum())
    stopped = f"; {partial} stopped run(s) with partial figures, not ranked" if partial else ""
    return f"{len(df)} configs: {parts}{stopped}"


MEM_FOOTNOTE = (  # {peaks}: peak_summary of the table
    "* Mem = measured peak memory per device (max over ranks and iterations), GiB (2^30 bytes) written GB "
    "as the seeds do: whole GiB from 10 GiB, one decimal below. Sec/it = median seconds per iteration after "
    "warm-up. CV = their spread (std / mean): differences smaller than the CVs are noise. TFLOPs = model "
    "TFLOP/s per device (per-GEMM count, no recompute). MFU = TFLOPs / peak ({peaks}). Pred s/it = the time model's "
    "seconds per iteration for the run's recorded config (train.planner.perf, as the dry run predicts it). "
    "Err = Pred s/it / Sec/it - 1, the prediction's error: negative when the model predicted the run faster "
    "than it ran."
)


PARTIAL_FOOTNOTE = (
    "* {outcomes}: a run stopped before its end (Slurm's time limit or a preemption, SIGTERM; scancel; Ctrl-C) "
    "that measured at least {least} iterations after warm-up. Its Sec/it, CV, TFLOPs and MFU come from those "
    "iterations alone, not from a finished run (Notes: how many, where it stopped, its peak memory so far): "
    "left out of the recommendation, the scaling and ZeRO tables, compare and the plots of speed; "
    "results.csv marks its row partial=True."
)


RESUMED_FOOTNOTE = (
    "* {word} at step N: the run went on from its checkpoint of step N (a Slurm requeue, or the same command run "
    "again); results.csv marks its row resumed=True. Its Sec/it, CV, TFLOPs and MFU are those of the iterations its "
    "last attempt measured after its own warm-up (Notes: how many), not of the whole run: the checkpoint keeps the "
    "earlier attempts' losses, not their times (a Slurm requeue keeps each stopped attempt's record beside it, "
    "as result.attempt<N>.json)."
)


def resumed_footnote(df: pd.DataFrame) -> list[str]:
    """The footnote on resumed runs' figures, when the table shows a resumed run (else none)."""
    shown = resumed_flags(df) & ~df["outcome"].isin(NOT_RUN)
    return [RESUMED_FOOTNOTE.format(word=RESUMED_TEXT)] if shown.any() else []


def partial_footnote(df: pd.DataFrame) -> list[str]:
    """The footnote on stopped runs' partial figures, when the table shows some (else none)."""
    partial = partial_flags(df)
    if not partial.any():
        return []
    shown = [o for o in PARTIAL_OUTCOMES if (partial & (df["outcome"] == o)).any()]
    outcomes = " and ".join(f"{OUTCOME_TEXT[o]}{PARTIAL_TEXT}" for o in shown)
    return [PARTIAL_FOOTNOTE.format(outcomes=outcomes, least=MIN_PARTIAL_ITERATIONS)]


def _peak_text(v: float) -> str:
    return f"{v:.4g}"


_PEAK_READ = ("outcome", "peak_tflops", "hardware", "precision", "peak_source", "config.hardware.tf32")
"""Every column peak_summary reads: the table is narrowed to these first, so one left out reads as absent."""


def peak_summary(df: pd.DataFrame) -> str:
    """The peaks the finished runs' MFU divides by, per hardware and precision, with where each came
    from: 'h100_sxm bf16: 989.4 TFLOP/s, datasheet'. A measured peak differs from run to run (a CPU's
    matmul calibration): its range is given. 'no finished run recorded its peak' when none did."""
    needed = ("outcome", "peak_tflops")
    if any(c not in df.columns for c in needed):
        return "no finished run recorded its peak"
    # A stopped run's partial MFU divides by its peak too.
    shown = (df["outcome"] == "ok") | partial_flags(df)
    runs = narrow(df, _PEAK_READ)[shown & (pd.to_numeric(df["peak_tflops"], errors="coerce") > 0)]
    if runs.empty:
        return "no finished run recorded its peak"
    unknown = pd.Series("", index=runs.index, dtype=object)
    hardware = _texts(runs["hardware"]) if "hardware" in runs.columns else unknown
    precision = _texts(runs["precision"]) if "precision" in runs.columns else unknown
    if "config.hardware.tf32" in runs.columns:
        # fp32 matmuls on a tensor-core GPU run as TF32 (hardware.tf32): its fp32 peak is TF32's.
        tf32 = runs["config.hardware.tf32"].map(lambda v: v is True or v == 1.0)
        precision = precision.where(~(tf32 & (precision == "fp32")), "fp32 (TF32 tensor cores)")
    source = _texts(runs["peak_source"]) if "peak_source" in runs.columns else unknown
    peaks = pd.to_numeric(runs["peak_tflops"], errors="coerce").astype(float)
    keys = pd.DataFrame({"hardware": hardware, "precision": precision, "source": source, "peak": peaks})
    parts = []
    for (hw, prec, src), group in keys.groupby(["hardware", "precision", "source"], sort=True):
        low, high = float(group["peak"].min()), float(group["peak"].max())
        value = _peak_text(low) if _peak_text(low) == _peak_text(high) else f"{_peak_text(low)}-{_peak_text(high)}"
        name = " ".join(str(p) for p in (hw, prec) if p) or "unnamed hardware"
        parts.append(f"{name}: {value} TFLOP/s, {src or 'source not recorded'}")
    return "; ".join(parts)


def prediction_notes(df: pd.DataFrame) -> list[str]:
    """Why finished runs read 'n/a' in Pred s/it: one line per distinct reason, with how many runs."""
    done = df[(df["outcome"] == "ok") & df["pred_sec_per_iter"].isna()]
    reasons = done["pred_reason"].fillna("").astype(str).replace("", "no prediction recorded")
    counts = sorted(reasons.value_counts().items(), key=lambda item: (-item[1], item[0]))
    return [f"* {NOT_PREDICTED} in Pred s/it ({n} run(s)): {why}" for why, n in counts]


def results_markdown(
    df: pd.DataFrame,
    *,
    labels: Sequence[str],
    recommendation: str,
    scaling: str | None = None,
    zero: str | None = None,
) -> str:
    """The whole results.md: table, recommendation, scaling and ZeRO comparison (when given), what is missing."""
    parts = [
        f"# Sweep results: {', '.join(labels)}",
        "",
        summary_line(df) + ".",
        "",
        markdown_table(results_table(df), left=("Notes",)),
        "",
        MEM_FOOTNOTE.format(peaks=peak_summary(df)),
        *partial_footnote(df),
        *resumed_footnote(df),
        *prediction_notes(df),
        "",
        "## Recommendation",
        "",
        recommendation.rstrip(),
        "",
    ]
    if scaling:
        parts += ["## Scaling", "", scaling.rstrip(), ""]
    if zero:
        parts += ["## ZeRO comparison", "", zero.rstrip(), ""]
    planned = planned_markdown(df)
    if planned:
        parts += [
            "## Planned, not run",
            "",
            f"{int((df['outcome'] == 'planned').sum())} feasible config(s) a dry run planned (plan.csv) and nobody "
            "launched: no measurement, only the planner's predictions (Pred: memory per device, seconds per "
            "iteration, MFU; empty where the hardware's figures are measured at run time). Launch the same "
            "sweep with hydra/launcher=slurm or local to measure them.",
            "",
            planned,
            "",
        ]
    parts += ["## Missing", "", missing_markdown(df), ""]
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------
# Scaling (seed 004)

_WORK_FIELDS = (
    ("config.model.kind", "{}"),
    ("seq_length", "seq={}"),
    ("config.model.num_layers", "layers={}"),
    ("config.model.hidden_size", "hidden={}"),
)
"""What makes runs of one model name other work (the recommendation keeps them apart): named in a
row's label when the runs differ in it, so that no cell takes the fastest of two pieces of work."""
_VARIANT_FIELDS = (
    *_WORK_FIELDS,
    ("hardware", "{}"),
    ("config.parallelism.zero_stage", "zero{}"),
    ("config.parallelism.offload", "offload={}"),
    ("config.parallelism.recompute", "recompute={}"),
    ("config.parallelism.precision", "{}"),
    ("config.parallelism.engine", "{}"),
    # Layouts of the same degrees (compare.py keeps them apart too): one row of both would take its
    # efficiency from a sequence-parallel run at one scale and a plain one at the next.
    ("config.parallelism.sequence_parallel", "sp={}"),
    ("config.parallelism.virtual_stages", "vpp={}"),
)


def _text(v: object) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def _with_varying(runs: pd.DataFrame, label: pd.Series, fields: Sequence[tuple[str, str]]) -> pd.Series:
    """`label` plus each (name, format) of `fields` whose value differs between the runs: what else
    tells two rows of a table apart. A run that does not know a value (no record: a launched config
    Slurm ended before it started) neither makes the field vary nor is labelled with it: it read
    'layers= hidden=' and took a row of its own beside its layout's."""
    for name, fmt in fields:
        if name not in runs.columns:
            continue
        texts = _texts(runs[name])
        if texts[texts != ""].nunique() > 1:
            label = label + texts.map(lambda t, f=fmt: " " + f.format(t) if t else "")
    return label


def _cells_of(runs: pd.DataFrame, variant: pd.Series) -> pd.DataFrame:
    """The runs with their row (`variant`), column (`scale`: nodes*devices per node) and whether they
    have a throughput to show (`_ok`), as the scaling and ZeRO tables place them."""
    # A record that does not say its nodes (copied out of its sweep, no Slurm, no whole layout) is
    # placed by its devices alone: "nodes*per node" would read "*" for every such device count.
    placed = _texts(runs["nodes"]) + "*" + _texts(runs["devices"] / runs["nodes"])
    return runs.assign(
        variant=variant,
        scale=placed.where(runs["nodes"].notna(), _texts(runs["devices"]) + " devices"),
        _ok=(runs["outcome"] == "ok") & runs["samples_per_s"].notna(),
    )


_CELL_FIGURES = ("samples_per_s", "tflops", "pflops", "mfu", "sec_per_iter", "mem_gib")
"""The measured figures of a scaling or ZeRO cell: a finished run's only."""
_SCALING_COLUMNS = (
    "outcome", "model", "tp", "pp", "mbs", "gbs", "nodes", "devices", "samples_per_s", "tflops", "pflops", "mfu",
    "mem_gib", "mem_capacity_gib", *(name for name, _ in _VARIANT_FIELDS),
)  # fmt: skip
"""What scaling_frame reads."""


def _split_by_gbs(runs: pd.DataFrame) -> pd.Series:
    """runs' variant, with ' gbs=N' added for the variants that have two GBS at one device count.

    Two runs of one variant and scale with different global batches are different work: one cell
    kept the faster and dropped the other silently (call4's gpt_1.3b mbs 8 at GBS 8 and 32). A
    variant whose GBS only grows with its devices (weak scaling) keeps one row, its scales compared.
    """
    if "gbs" not in runs.columns:
        return runs["variant"]
    gbs = _texts(runs["gbs"])
    per_cell = gbs.groupby([runs["variant"], runs["devices"]], dropna=False).transform("nunique")
    clashing = set(runs.loc[per_cell > 1, "variant"])
    return runs["variant"].where(~runs["variant"].isin(clashing), runs["variant"] + " gbs=" + gbs)


def scaling_frame(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (variant, scale): throughput, TFLOPs, aggregate PFLOPs and parallel efficiency.

    A variant is everything but the data-parallel degree (model, tp, pp, mbs and the options
    that vary in the sweep), so that a row of the table follows one layout as it scales out; and
    its GBS where it ran two at one scale (_split_by_gbs), so that neither is dropped.
    Efficiency = per-device throughput relative to the variant's smallest successful run
    (1.0 = perfect scaling). Cells with several runs of the same work (repeats, other overrides)
    keep the fastest.
    """
    runs = _placed(narrow(df, _SCALING_COLUMNS)[df["outcome"].isin(_RAN)]).copy()
    if runs.empty:
        return pd.DataFrame()
    label = runs["model"].astype(str) + " (tp=" + _texts(runs["tp"]) + " pp=" + _texts(runs["pp"])
    label = label + " mbs=" + _texts(runs["mbs"]) + ")"
    runs = _cells_of(runs, _with_varying(runs, label, _VARIANT_FIELDS))
    runs["variant"] = _split_by_gbs(runs)
    runs = runs.sort_values(["variant", "devices", "_ok", "samples_per_s"], ascending=[True, True, False, False],
                            kind="mergesort")
    # By scale, not devices: 2 nodes x 1 device and 1 node x 2 devices are two cells (one was dropped).
    cells = runs.drop_duplicates(["variant", "scale"], keep="first").copy()
    per_device = cells["samples_per_s"] / cells["devices"]
    base = per_device.where(cells["_ok"]).groupby(cells["variant"]).transform("first")
    cells["efficiency"] = per_device.where(cells["_ok"]) / base
    # A cell without a finished run says its outcome: a stopped run's partial figures (or a diverged
    # one's) in scaling.csv would read as that scale's throughput.
    for name in _CELL_FIGURES:
        if name in cells.columns:
            cells[name] = cells[name].where(cells["_ok"])
    cols = ["variant", "scale", "nodes", "devices", "gbs", "outcome", "samples_per_s", "tflops", "pflops", "mfu",
            "mem_gib", "mem_capacity_gib", "efficiency"]
    cells = narrow(cells, cols)
    # Counts as integers in scaling.csv ('48', not '48.0'; a row without a record made them floats).
    return cells.astype({c: "Int64" for c in whole_number_columns(cells)}).reset_index(drop=True)


def _scaling_cell(row: pd.Series) -> str:
    if row["outcome"] != "ok" or _missing(row["samples_per_s"]):
        return OUTCOME_TEXT.get(str(row["outcome"]), str(row["outcome"]))
    parts = [f"{row['samples_per_s']:.2f} samples/s", f"{format_tflops(row['tflops'])} TFLOPs/dev"]
    if not _missing(row["pflops"]):
        parts.append(f"{row['pflops']:.2f} PFLOPs")
    if not _missing(row["mem_gib"]):
        cap = "" if _missing(row["mem_capacity_gib"]) else f"/{row['mem_capacity_gib']:.1f}"
        parts.append(f"{row['mem_gib']:.1f}{cap}GB")
    if not _missing(row["efficiency"]):
        parts.append(f"{100 * row['efficiency']:.0f}%")
    return "<br>".join(parts)


def scaling_markdown(frame: pd.DataFrame) -> str | None:
    """Seed 004's layout: variants down, nodes*devices across; None when the sweep has one scale only."""
    if frame.empty or frame["devices"].nunique() < 2:
        return None
    frame = frame.assign(cell=frame.apply(_scaling_cell, axis=1))
    order = frame.drop_duplicates("scale").sort_values("devices")["scale"].tolist()
    wide = frame.pivot(index="variant", columns="scale", values="cell").reindex(columns=order).fillna("")
    wide = wide.reset_index().rename(columns={"variant": "layout \\ nodes*devices"})
    wide.columns = [str(c) for c in wide.columns]
    note = (
        "Cells: samples/s, model TFLOP/s per device, aggregate PFLOP/s (TFLOPs x devices / 1024), "
        "peak/usable memory per device, parallel efficiency (per-device throughput vs the row's smallest run)."
    )
    return markdown_table(wide, left=(wide.columns[0],)) + "\n\n" + note


# ---------------------------------------------------------------------------------------------
# ZeRO comparison (seed 004's first tables: one row per engine setting, nodes*devices across)

_RAN = ("ok", "oom", "nan", "timeout", "cancelled", "fail")


def _placed(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs whose layout and size are known: a config that failed before its record, in a sweep
    without a dry run's plan of it, has neither, and no place in a table of layouts (its row of blanks
    widened every variant's label by the fields it seemed to vary)."""
    return runs[runs["tp"].notna() & runs["pp"].notna() & runs["devices"].notna()]
_ZERO_SETTINGS = ("engine", "zero_stage", "offload")
_ENGINE_RANK = {"native": 0, "deepspeed": 1}
_OFFLOAD_RANK = {"none": 0, "optimizer": 1, "params": 2}
# Shown only when they vary: the rows are per engine setting, yet a bf16 and an fp32 run (or two
# hardware kinds) must not meet in one cell, where only the faster would survive.
_ZERO_EXTRA_FIELDS = (
    *_WORK_FIELDS,
    ("hardware", "{}"),
    ("config.parallelism.precision", "{}"),
    ("config.parallelism.recompute", "recompute={}"),
)
ZERO_COLUMNS = (
    "variant", "model", "tp", "pp", "engine", "zero_stage", "offload", "scale", "nodes", "devices",
    "outcome", "samples_per_s", "tflops", "sec_per_iter", "mem_gib", "run_dir",
)
ZERO_FOOTNOTE = (
    "Cells: samples/sec and model TFLOP/s per device of the fastest run of each cell; failed runs show "
    "their outcome. Rows without 'with' are the native engine (the baseline); 'native zero1' is "
    "megasweep's own sharded optimizer (parallelism.engine=native), not DeepSpeed's ZeRO-1; "
    "+offload(optimizer) / +offload(params) is what DeepSpeed moves to host memory."
)


def _override_values(overrides: pd.Series, key: str) -> pd.Series:
    """The value a run's overrides give `key` (the last one wins, as in Hydra), NaN when none does."""

    def value(o: object) -> object:
        found: object = math.nan
        if isinstance(o, list | tuple):
            for item in o:
                name, sep, v = str(item).partition("=")
                if sep and name.lstrip("+~") == key:
                    found = v
        return found

    return overrides.map(value)


def _zero_setting(runs: pd.DataFrame, name: str) -> pd.Series:
    """parallelism.<name> of each run as text: the record's config, else its explicit override
    (a job Slurm ended before it wrote a record), else '' (unknown)."""
    column = f"config.parallelism.{name}"
    values = runs[column] if column in runs.columns else pd.Series(math.nan, index=runs.index, dtype=object)
    text = _texts(values)
    unknown = text == ""
    if "overrides" in runs.columns and unknown.any():
        # Only the runs without a recorded value: reading every run's overrides took most of the table.
        found = _override_values(runs.loc[unknown, "overrides"], f"parallelism.{name}").map(_text)
        text = text.where(~unknown, found)
    return text


def _engine_label(engine: pd.Series, zero: pd.Series, offload: pd.Series) -> pd.Series:
    """'' for the native baseline, ' with native zero1', ' with deepspeed zero3+offload(optimizer)'."""
    offloaded = ("+offload(" + offload + ")").where(offload != "none", "")
    baseline = (engine == "native") & (zero == "0") & (offloaded == "")
    return (" with " + engine + " zero" + zero + offloaded).where(~baseline, "")


_ZERO_READ = (
    *ZERO_COLUMNS, "overrides", *(f"config.parallelism.{name}" for name in _ZERO_SETTINGS),
    *(name for name, _ in _ZERO_EXTRA_FIELDS),
)  # fmt: skip
"""What zero_frame reads."""


def zero_frame(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (ZeRO variant, nodes*devices) of the runs, when the sweep varies engine, ZeRO or offload.

    A variant is (model, tp, pp, engine, zero_stage, offload), labelled as seed 004 labels its
    rows ('tiny (mp=1) with deepspeed zero3+offload(optimizer)'; pp appears when some run has
    pp > 1; hardware, precision and recompute when they vary). Empty when no run ran or every
    run has the same engine, stage and offload: then there is nothing to compare. Runs whose
    engine setting is unknown (no record, no override naming it) are left out. Cells with
    several runs (e.g. different batch sizes) keep the fastest; rows come in the seed's order,
    per model the baseline first, then by engine, stage, offload and model parallelism.
    """
    runs = _placed(narrow(df, _ZERO_READ)[df["outcome"].isin(_RAN)]).copy()
    if runs.empty:
        return pd.DataFrame(columns=list(ZERO_COLUMNS))
    for name in _ZERO_SETTINGS:
        runs[name] = _zero_setting(runs, name)
    runs = runs[(runs["engine"] != "") & (runs["zero_stage"] != "") & (runs["offload"] != "")]
    if runs[list(_ZERO_SETTINGS)].drop_duplicates().shape[0] < 2:
        return pd.DataFrame(columns=list(ZERO_COLUMNS))
    tp, pp = _texts(runs["tp"]), _texts(runs["pp"])
    pp_text = (" pp=" + pp) if (runs["pp"].fillna(1) != 1).any() else ""
    label = runs["model"].astype(str) + " (mp=" + tp + pp_text + ")"
    label = label + _engine_label(runs["engine"], runs["zero_stage"], runs["offload"])
    runs = _cells_of(runs, _with_varying(runs, label, _ZERO_EXTRA_FIELDS))
    runs["_engine"] = runs["engine"].map(_ENGINE_RANK).fillna(len(_ENGINE_RANK))
    runs["_zero"] = pd.to_numeric(runs["zero_stage"], errors="coerce")
    runs["_offload"] = runs["offload"].map(_OFFLOAD_RANK).fillna(len(_OFFLOAD_RANK))
    order = ["model", "_engine", "_zero", "_offload", "pp", "tp", "variant", "devices", "nodes", "_ok",
             "samples_per_s"]
    runs = runs.sort_values(order, ascending=[True] * 9 + [False, False], kind="mergesort", na_position="last")
    cells = runs.drop_duplicates(["variant", "scale"], keep="first").copy()
    for name in _CELL_FIGURES:  # as in scaling_frame: a failed cell's figures are no cell's
        if name in cells.columns:
            cells[name] = cells[name].where(cells["_ok"])
    cells = cells[list(ZERO_COLUMNS)]
    # Counts as integers in zero.csv ('2', not '2.0'); NaN stays empty.
    cells = cells.astype({c: "Int64" for c in ("tp", "pp", "nodes", "devices")})
    return cells.reset_index(drop=True)


def _seed_figure(v: float) -> str:
    """Two decimals as seed 004 writes its cells ('349.86', '0.72'); below 0.1 three significant
    figures instead ('2.82e-05', '1.09e-02'): a tiny model on a CPU does ~1e-5 TFLOP/s, which two
    decimals would print as a zero that reads as 'not measured', and 0.0109 beside 0.00923 printed
    as '0.01' beside '9.23e-03', one significant figure against three."""
    return f"{v:.2f}" if v == 0 or abs(v) >= 0.1 else f"{v:.2e}"


def _zero_cell(row: pd.Series) -> str:
    if row["outcome"] != "ok" or _missing(row["samples_per_s"]):
        return OUTCOME_TEXT.get(str(row["outcome"]), str(row["outcome"]))
    cell = f"{_seed_figure(float(row['samples_per_s']))} samples/sec"
    if not _missing(row["tflops"]):
        # Two spaces between the figures, as seed 004 writes its cells.
        cell += f"  {_seed_figure(float(row['tflops']))} tflops/dev"
    return cell


def zero_markdown(frame: pd.DataFrame) -> str | None:
    """Seed 004's ZeRO table from zero_frame: variants down, nodes*devices across, even for one scale.

    None when the frame is empty (the sweep does not vary engine, zero_stage or offload).
    """
    if frame.empty:
        return None
    frame = frame.assign(cell=frame.apply(_zero_cell, axis=1))
    rows = frame["variant"].drop_duplicates().tolist()
    scales = frame.drop_duplicates("scale").sort_values(["devices", "nodes"], kind="mergesort")["scale"].tolist()
    wide = frame.pivot(index="variant", columns="scale", values="cell").reindex(index=rows, columns=scales)
    wide = wide.fillna("").reset_index().rename(columns={"variant": "model \\ nodes*devices"})
    wide.columns = [str(c) for c in wide.columns]
    return markdown_table(wide, left=(wide.columns[0],)) + "\n\n" + ZERO_FOOTNOTE


def pflops_aggregate(tflops_per_device: pd.Series | float, devices: pd.Series | float) -> pd.Series | float:
    """Aggregate PetaFLOP/s as the BLOOM notes write it: TFLOPs per device x devices / 1024."""
    return tflops_per_device * devices / 1024


__all__ = [
    "MEM_FOOTNOTE",
    "OUTCOME_TEXT",
    "PARTIAL_FOOTNOTE",
    "PARTIAL_TEXT",
    "PLANNED_SHOWN",
    "SEED_COLUMNS",
    "ZERO_COLUMNS",
    "NOT_PREDICTED",
    "ZERO_FOOTNOTE",
    "above_peak_text",
    "format_cv",
    "format_err",
    "format_mem",
    "format_mfu",
    "format_sec",
    "format_size",
    "format_tflops",
    "markdown_table",
    "missing_markdown",
    "partial_flags",
    "partial_footnote",
    "resumed_flags",
    "resumed_footnote",
    "pflops_aggregate",
    "peak_summary",
    "planned_markdown",
    "prediction_error",
    "prediction_notes",
    "results_markdown",
    "results_table",
    "scaling_frame",
    "scaling_markdown",
    "sort_results",
    "summary_line",
    "varying_overrides",
    "zero_frame",
    "zero_markdown",
]
