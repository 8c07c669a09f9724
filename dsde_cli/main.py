"""`dsde generate | prepare | serve | check-config | bench`: one parser, each command's handler run by run_command.

generate and prepare run in-process (dsde_cli.generate); serve and check-config reach services/ and Ray
(dsde_cli.serve); bench runs dsde_bench's benchmarks (dsde_cli.bench).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from dsde_cli import bench, generate, serve
from dsde_core import __version__
from dsde_core.errors import DSDEError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsde", description="DSDE speculative decoding: in-process or as a service")
    p.add_argument("--version", action="version", version=f"dsde {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    handlers = {**generate.add_commands(sub), **serve.add_commands(sub), **bench.add_commands(sub)}
    p.set_defaults(_handlers=handlers)
    return p


def run_command(handler: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a command's handler: a DSDEError (bad input, a missing model) is one line on stderr and exit status 2,
    Ctrl-C is 130, never a traceback."""
    try:
        return handler(args)
    except DSDEError as e:
        print(f"dsde: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return run_command(args._handlers[args.command], args)


if __name__ == "__main__":
    sys.exit(main())
