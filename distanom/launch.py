"""Run a training script under distanom, one process per rank (started by torchrun).

Usage::

    torchrun --nproc-per-node 8 -m distanom.launch [--config my.yaml] [--run-dir runs]
             [--set section.key=value ...] train.py [script args ...]
    torchrun ... -m distanom.launch [distanom flags] -m my_package.train [script args ...]

distanom's own flags come first and end at the script (or `-m module`); everything after
belongs to the script, which runs as `__main__` with `sys.argv` set as if it had been
started directly. Before the script starts, the configuration is validated: any mistake
prints one line naming the file and key and exits with status 2, so no training time is
lost. Then the per-rank agent is installed: each `optimizer.step()` ends a step (see
`distanom.agent`). The script's own exit status is preserved.

Each rank logs to stderr with a `[distanom rR/W]` prefix; flags:

  --config FILE      YAML configuration (every key: configs/default.yaml)
  --run-dir DIR      where run directories are created (default: runs)
  --set KEY=VALUE    override one key, e.g. --set detect.multiplier=2 (repeatable)
"""

from __future__ import annotations

import argparse
import logging
import os
import runpy
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from distanom.config import Config, load_config
from distanom.errors import DistanomError
from distanom.log_lines import QuietFilter
from distanom.world import WorldInfo

log = logging.getLogger("distanom")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise DistanomError(f"{message} (see python -m distanom.launch --help)")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m distanom.launch",
        description="Run a training script with distanom's per-rank agent installed.",
        epilog="Everything after the script (or -m module) is passed to the script.",
    )
    parser.add_argument("--config", metavar="FILE", help="YAML configuration file")
    parser.add_argument(
        "--run-dir", metavar="DIR", default="runs", help="base directory of runs (default: runs)"
    )
    parser.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        dest="overrides",
        help="override one config key (repeatable)",
    )
    parser.add_argument("-m", dest="module", metavar="MODULE", help="run a module as the script")
    parser.add_argument("script", nargs="?", help="the training script, then its arguments")
    return parser


_VALUE_FLAGS = ("--config", "--run-dir", "--set")
# a rank other than a node's first waits this long before it exits on bad input: its
# exit would make torchrun stop the others, the first among them maybe before it said
# what is wrong (the one line a node prints); torchrun stops the waiting ones once the
# first has exited
QUIET_RANK_EXIT_DELAY_S = 5.0


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split at the script: distanom's flags before it, the script's arguments after it.

    argparse alone cannot do this: it would take a script option that happens to share a
    name with ours (`train.py --config x`) or refuse one it does not know after `-m mod`.
    """
    ours: list[str] = []
    position = 0
    while position < len(argv):
        token = argv[position]
        if token == "--":
            position += 1
            break
        if token in _VALUE_FLAGS or token == "-m":
            ours.extend(argv[position : position + 2])
            position += 2
            if token == "-m":
                return ours, list(argv[position:])
            continue
        if token.startswith(tuple(f"{flag}=" for flag in _VALUE_FLAGS)) or token in (
            "-h",
            "--help",
        ):
            ours.append(token)
            position += 1
            continue
        if token.startswith("-"):
            ours.append(token)  # unknown flag: argparse names it in its error
            position += 1
            continue
        break
    rest = list(argv[position:])
    if rest:
        ours.extend(["--", rest[0]])  # a script name is never an option, even "-odd.py"
    return ours, rest[1:]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """distanom's flags, with the script (or module) and its arguments as `script_args`."""
    ours, script_args = split_argv(argv)
    args = _parser().parse_args(ours)
    args.script_args = script_args
    if args.module is None and args.script is None:
        raise DistanomError("no training script given (see python -m distanom.launch --help)")
    return args


def configure_logging(config: Config, world: WorldInfo) -> None:
    """Send distanom's log to stderr with a `[distanom rR/W]` prefix, at `log.level`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[distanom {world.label}] %(levelname)s %(message)s"))
    handler.addFilter(QuietFilter(world.rank, config.log.level))
    log.handlers[:] = [handler]
    log.setLevel(config.log.level)
    log.propagate = False  # the script's own logging setup must not duplicate or swallow ours


def _check_script(args: argparse.Namespace) -> None:
    if args.script is not None:
        path = Path(args.script)
        if not path.is_file():
            raise DistanomError(f"training script {args.script}: no such file")
        return
    import importlib.util

    try:
        found = importlib.util.find_spec(args.module)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise DistanomError(f"module {args.module}: not found")


def _run_script(args: argparse.Namespace) -> None:
    if args.script is not None:
        sys.argv = [args.script, *args.script_args]
        sys.path.insert(0, str(Path(args.script).resolve().parent))
        runpy.run_path(args.script, run_name="__main__")
    else:
        sys.argv = [args.module, *args.script_args]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(args.module, run_name="__main__", alter_sys=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Validate the input, install the agent, run the script; returns its exit status."""
    world = WorldInfo.from_env()
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        config = load_config(args.config, args.overrides)
        _check_script(args)
    except DistanomError as err:
        if world.local_rank == 0:  # one line per node, not one per rank
            print(f"distanom: {err}", file=sys.stderr)
        elif world.world_size > 1:
            time.sleep(QUIET_RANK_EXIT_DELAY_S)
        return err.exit_code
    configure_logging(config, world)
    _enable_flight_recorder()
    from distanom.agent import Agent  # torch is imported only once the input is valid

    argv_for_run = [args.script or f"-m {args.module}", *args.script_args]
    agent = Agent(config, world, Path(args.run_dir), argv=argv_for_run)
    installed = True
    try:
        agent.install()
    except Exception as err:  # distanom must never keep the script from running
        log.warning("cannot install the agent (%s); running the script without distanom", err)
        installed = False
    code, outcome = 0, "failed"  # an exception leaves "failed" with Python's status 1
    try:
        _run_script(args)
        outcome = "finished"
    except SystemExit as exit_request:
        code = _exit_code(exit_request.code)
        outcome = "finished" if code == 0 else "failed"
    except KeyboardInterrupt:
        outcome, code = "interrupted", 130  # what a shell reports for SIGINT
        raise
    except BaseException:
        code = 1
        raise
    finally:
        if installed:
            agent.close(outcome=outcome, exit_code=code)
    return code


def _enable_flight_recorder() -> None:
    """Flight Recorder must be on before the script creates its process group."""
    try:
        from distanom.flight_recorder import enable_from_env

        enable_from_env()
    except Exception as err:  # distanom must never keep the script from running
        log.warning("flight recorder: not enabled (%s)", err)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
