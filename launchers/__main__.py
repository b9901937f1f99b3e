"""`python -m launchers status|rerun <sweep dir>`: follow and repair a launched sweep."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from analysis.manifest import ManifestError
from launchers.status import format_status, rerun_failed, sweep_status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launchers", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="table of pending / running / done / failed / skipped configs")
    status.add_argument("sweep_dir")
    rerun = sub.add_parser("rerun", help="resubmit configs of a sweep")
    rerun.add_argument("sweep_dir")
    rerun.add_argument(
        "--failed", action="store_true", required=True, help="the failed and timed-out configs (required)"
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "status":
            print(format_status(sweep_status(args.sweep_dir)))
            return 0
        entries = rerun_failed(args.sweep_dir)
    except (FileNotFoundError, ManifestError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not entries:
        print("rerun: no failed configs")
        return 0
    for e in entries:
        what = f"job {e.job_id}" if e.status == "submitted" else f"skipped: {e.reason}"
        print(f"rerun: config {e.index}: {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
