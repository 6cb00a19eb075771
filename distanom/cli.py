"""The `distanom` command: look at runs, traces and running jobs.

    distanom report RUN_DIR [RUN_DIR ...] [--json] [--html OUT.html]
                                              the run: steps, threshold, captures, per-rank
                                              tables, verdicts, kernel diffs; --html writes
                                              a self-contained page (and its PNGs) instead
                                              of the text; several RUN_DIRs: each node's
                                              copy of one run, reported as one
    distanom analyze TRACE [--json]           gpu_timeline and kernel_summary of one trace
    distanom status RUN_DIR [--json] [--watch] live state of a running job (or the final one)
    distanom capture RUN_DIR [--steps N] [--ranks 0,3-5]
                                              ask a running job to capture its next steps
    distanom config [--defaults | --check FILE] [--set KEY=VALUE ...]
    distanom hosts [RUNS_DIR ...] [--json] [--top N]
                                              the hosts and GPUs most often blamed (culprit,
                                              straggler, hang) over every run in the folders

RUN_DIR may be a run directory or the base directory (its `latest` run is used). Every
user mistake (a missing file, a damaged trace, a bad flag) prints one line and exits
with status 2; `main(argv)` returns the exit status, so tests call it in-process. This
module never imports torch.distributed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from distanom.errors import DistanomError
from distanom.sanitize import terminal_safe

if TYPE_CHECKING:
    from distanom.analysis.model import Report


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # `main` prints "distanom: " before every error; a subcommand names itself
        command = self.prog.removeprefix("distanom").strip()
        raise DistanomError(f"{command}: {message}" if command else message)


# launch's --run-dir default: run from where the job started, no argument is needed
_RUN_DIR_DEFAULT: dict[str, Any] = {
    "nargs": "?",
    "default": "runs",
    "help": "a run, or a folder of runs (its latest); default: runs",
}


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="distanom", description="Inspect distanom runs, traces and live jobs.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    report = commands.add_parser("report", help="summarise a run directory")
    report.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        nargs="*",
        default=["runs"],
        help="a run, or a folder of runs (its latest); several: every node's copy of one "
        "run, reported as one (docs/multinode.md); default: runs",
    )
    report.add_argument("--json", action="store_true", help="machine-readable output")
    report.add_argument(
        "--html",
        metavar="OUT.html",
        help="write one self-contained HTML page instead of the text (charts as PNG when "
        "matplotlib is installed, also written beside it as OUT_<chart>.png; else inline "
        "SVG); with --json, the JSON still goes to stdout",
    )

    analyze = commands.add_parser("analyze", help="tables of one trace file")
    analyze.add_argument("trace", metavar="TRACE")
    analyze.add_argument("--json", action="store_true", help="machine-readable output")
    analyze.add_argument(
        "--engine", choices=("auto", "builtin", "tracelens"), default="auto", help="table engine"
    )

    status = commands.add_parser("status", help="live state of a (running) job")
    status.add_argument("run_dir", metavar="RUN_DIR", **_RUN_DIR_DEFAULT)
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument(
        "--watch", nargs="?", type=float, const=2.0, metavar="SECONDS", help="refresh in place"
    )

    capture = commands.add_parser("capture", help="ask a running job to capture steps now")
    capture.add_argument("run_dir", metavar="RUN_DIR", **_RUN_DIR_DEFAULT)
    capture.add_argument("--steps", type=int, default=1, help="how many steps (default 1)")
    capture.add_argument("--ranks", default=None, help="e.g. 0,3-5 (default: every rank)")
    capture.add_argument(
        "--timeout", type=float, default=120.0, help="seconds to wait for the files (default 120)"
    )

    config = commands.add_parser("config", help="print or check a configuration")
    group = config.add_mutually_exclusive_group()
    group.add_argument("--defaults", action="store_true", help="print every key at its default")
    group.add_argument("--check", metavar="FILE", help="validate a YAML file")
    config.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")

    hosts = commands.add_parser("hosts", help="hosts and GPUs most often blamed, over many runs")
    hosts.add_argument(
        "folders",
        metavar="RUNS_DIR",
        nargs="*",
        default=["runs"],
        help="folders of runs, or runs (several nodes' copies of one run count once); "
        "default: runs",
    )
    hosts.add_argument("--json", action="store_true", help="machine-readable output")
    hosts.add_argument("--top", type=int, default=10, help="rows shown per table (default 10)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `distanom` command with `argv` (default sys.argv[1:]); returns the exit status."""
    try:
        args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
        handler = _COMMANDS[args.command]
        return handler(args)
    except DistanomError as err:
        print(terminal_safe(f"distanom: {err}"), file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=1, allow_nan=False, default=str))


def _cmd_report(args: argparse.Namespace) -> int:
    from distanom.analysis.report import build_report, render_text, report_json, write_outputs
    from distanom.analysis.run import load_run

    # the page's folder (often the run's, through the runs/latest link) is resolved once,
    # before the run is read: a link swapped meanwhile cannot send the page elsewhere
    html_out = _resolved_out(args.html) if args.html else None
    data = load_run(args.run_dir)
    report = write_outputs(data, build_report(data, step_times=bool(args.html)))
    if html_out is not None:
        _write_html(report, html_out, args.html, sys.stderr if args.json else sys.stdout)
        if not args.json:
            return 0
    if args.json:
        _print_json(report_json(report))
    else:
        sys.stdout.write(terminal_safe(render_text(report)))
    return 0


def _resolved_out(out: str) -> Path:
    """`--html OUT`: its folder resolved (it may be reached through runs/latest)."""
    return Path(out).parent.resolve() / Path(out).name


def _write_html(report: Report, target: Path, out: str, stream: TextIO) -> None:
    from distanom.analysis.html_report import render_html, write_html

    page = render_html(report)
    try:
        written = write_html(page, target)
    except OSError as err:
        raise DistanomError(f"{out}: cannot write the page: {err.strerror or err}") from None
    print(f"wrote {', '.join(str(p) for p in written)}", file=stream)


def _cmd_analyze(args: argparse.Namespace) -> int:
    from distanom.analysis.tables_io import analyze_for_cli

    output = analyze_for_cli(args.trace, args.engine)
    if args.json:
        _print_json(output.as_json())
    else:
        sys.stdout.write(terminal_safe(output.as_text()))
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from distanom.live import render_status, status_json
    from distanom.records.status import read_status
    from distanom.rundir import RunDir

    run = RunDir.open(args.run_dir)
    while True:
        status = read_status(run)
        if status is None and not run.run_json.exists() and (run.path / "nodes").is_dir():
            raise DistanomError(
                f"{run.path}: another node's copy of the run; rank 0 writes status.json "
                "into node 0's copy (docs/multinode.md)"
            )
        if status is None:
            raise DistanomError(f"{run.path}: no status.json yet (has the job started?)")
        if args.json:
            _print_json(status_json(run, status))
        else:
            text = terminal_safe(render_status(run, status))
            if args.watch:
                sys.stdout.write("\x1b[H\x1b[2J")  # clear and redraw in place
            sys.stdout.write(text)
        sys.stdout.flush()
        if not args.watch or status.get("state") != "running":
            return 0
        time.sleep(max(0.2, args.watch))


def _cmd_capture(args: argparse.Namespace) -> int:
    from distanom.live import request_capture

    return request_capture(args.run_dir, args.steps, args.ranks, args.timeout)


def _cmd_hosts(args: argparse.Namespace) -> int:
    from distanom.analysis.fleet_runs import scan_runs
    from distanom.analysis.hosts import hosts_json, hosts_text, rank_suspects

    if args.top < 1:
        raise DistanomError("hosts: --top must be at least 1")
    scan = scan_runs(args.folders)
    if not scan.runs:
        problems = "; ".join(scan.problems[:3])
        raise DistanomError(f"hosts: no runs read ({problems})")
    suspects = rank_suspects(scan)
    if args.json:
        _print_json(hosts_json(suspects))
    else:
        sys.stdout.write(terminal_safe(hosts_text(suspects, top=args.top)))
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from distanom.config import load_config, render_config_yaml, render_defaults_yaml

    if args.check or args.overrides:
        config = load_config(args.check, args.overrides)
        if args.check:  # what was checked: the file, and the overrides on top of it
            changed = "".join(f" --set {text}" for text in args.overrides)
            print(f"{args.check}{changed}: valid")
        else:  # the resolved config, in the form --config takes
            changed = " ".join(f"--set {text}" for text in args.overrides)
            sys.stdout.write(render_config_yaml(config, changed_by=changed))
        return 0
    sys.stdout.write(render_defaults_yaml())
    return 0


_COMMANDS = {
    "report": _cmd_report,
    "analyze": _cmd_analyze,
    "status": _cmd_status,
    "capture": _cmd_capture,
    "config": _cmd_config,
    "hosts": _cmd_hosts,
}
