"""``compare``: two or more JSON reports in one report: a table, the plots and an HTML page.

Typically the same workload against the governor and against the queueing baseline::

    python -m loadtest mix ... --out runs/governor
    python -m loadtest mix ... --openai http://127.0.0.1:8000 --out runs/baseline
    python -m loadtest compare runs/governor/report.json runs/baseline/report.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from clients.helptext import RawDescriptionDefaultsHelpFormatter

from ..support.options import print_json
from ..support.render import output_dir, write_outputs
from ..support.report import table

NAME = "compare"


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        NAME,
        help="put two or more JSON reports in one report",
        description=__doc__,
        formatter_class=RawDescriptionDefaultsHelpFormatter,
    )
    parser.add_argument("reports", nargs="+", type=Path, metavar="REPORT", help="report.json files")
    parser.add_argument(
        "--name",
        action="append",
        default=[],
        help="a name per report, in order (default: its folder's name)",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="write compare.json, the plots and report.html here "
        "(default: loadtest-out/compare-TIME)",
    )
    parser.add_argument("--no-plots", action="store_true", help="write compare.json only")


def load(paths: list[Path], names: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """(name, report) per path; raises ValueError for a file that is not a report."""
    if names and len(names) != len(paths):
        raise ValueError(f"{len(names)} --name for {len(paths)} reports")
    out = []
    for i, path in enumerate(paths):
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: {exc}") from None
        if not isinstance(report, dict) or not isinstance(report.get("steps"), list):
            raise ValueError(f"{path}: not a load-test report (no steps)")
        out.append((names[i] if names else path.resolve().parent.name, report))
    return out


def lines(reports: list[tuple[str, dict[str, Any]]]) -> list[str]:
    out = []
    for name, report in reports:
        for s in report["steps"]:
            out.append(
                f"{name} ({report['target']} {report['addr']}), {s['label']}: offered "
                f"{s['offered']} ({s['offered_rps']}/s), goodput {s['goodput_rps']}/s"
            )
            out += ["  " + row for row in table(s)]
    return out


def run(args: argparse.Namespace) -> int:
    try:
        reports = load(args.reports, args.name)
    except ValueError as exc:
        print(f"loadtest compare: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines(reports)))
    out = output_dir(args.out, NAME)
    try:
        data = {"reports": [{"name": n, "report": r} for n, r in reports]}
        write_outputs(
            out, "compare.json", data, reports, plots=not args.no_plots, title="loadtest compare"
        )
    except OSError as exc:
        print(f"loadtest compare: cannot write {out}: {exc}", file=sys.stderr)
        return 1
    print(f"report: {out / 'compare.json'}" + ("" if args.no_plots else f", {out / 'report.html'}"))
    brief = [
        {
            "name": name,
            "target": report["target"],
            "goodput_rps": [s["goodput_rps"] for s in report["steps"]],
            "offered_rps": [s["offered_rps"] for s in report["steps"]],
        }
        for name, report in reports
    ]
    print_json(args, {"command": NAME, "reports": brief})
    return 0
