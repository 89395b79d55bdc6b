"""Command line: ``python -m attn_dispatch list | matrix | explain | tune | demo`` (also the
``attn-dispatch`` script). One module per command: ``listing``, ``matrix``, ``explain``,
``tune`` (with ``model``, which reads a model config for ``explain --model``).

Exit status: 0 ok, 1 a refusal (a spec that cannot serve the config or model), 2 bad input
(usage, unknown backend, a bad value, a model config that cannot be read), 3 an internal error
(a bug: please report it), 130 interrupted, 141 the reader of the output went away (``| head``).
Whatever happens, the user sees one ``error:`` line on stderr, never a traceback; with
``--traceback`` (anywhere on the line) an internal error prints its traceback first, for the
bug report.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn
from typing import cast

from attn_dispatch._errors import AttnDispatchError
from attn_dispatch._registry import DEFAULT_REGISTRY
from attn_dispatch._registry import Registry
from attn_dispatch.cli import explain
from attn_dispatch.cli import listing
from attn_dispatch.cli import matrix
from attn_dispatch.cli import tune

__all__ = ["main"]

TRACEBACK_FLAG = "--traceback"


def cmd_demo(argv: Sequence[str]) -> int:
    demo = importlib.import_module("attn_dispatch.demo")
    return int(demo.main(list(argv)))


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error on one line like every other refusal (exit 2): the
    problem, and where the usage is (``--help``), not the usage block itself."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (for usage: {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m attn_dispatch",
        description="Per-runner attention kernel dispatch: inspect backends and bindings.",
    )
    p.add_argument(
        "--traceback",
        action="store_true",
        help="on an internal error (exit 3), print its traceback too (for a bug report); "
        "accepted anywhere on the command line",
    )
    # Every subcommand's parser is a _Parser too (one-line usage errors); typed as the
    # base class, which the command modules' add_parser functions take.
    sub = cast(
        "argparse._SubParsersAction[argparse.ArgumentParser]",
        p.add_subparsers(dest="command", required=True, parser_class=_Parser),
    )
    listing.add_parser(sub)
    matrix.add_parser(sub)
    explain.add_parser(sub)
    tune.add_parser(sub)
    sub.add_parser(
        "demo", help="run the speculative-decoding demo (see --help of demo)", add_help=False
    )
    return p


def _run(argv: list[str], registry: Registry | None) -> int:
    if argv and argv[0] == "demo":
        return cmd_demo(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command in ("explain", "tune"):
        explain.check_args(parser, args, args.command)
    registry = DEFAULT_REGISTRY if registry is None else registry
    try:
        if args.command == "list":
            return listing.cmd_list(args, registry)
        if args.command == "matrix":
            return matrix.cmd_matrix(args, registry)
        if args.command == "tune":
            return tune.cmd_tune(args, registry)
        return explain.cmd_explain(args, registry)
    except AttnDispatchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None, *, registry: Registry | None = None) -> int:
    """Run one command; returns the exit status (see the module's docstring)."""
    args = list(sys.argv[1:] if argv is None else argv)
    # Read anywhere (before or after the command's own flags), then left out of the parse.
    show_traceback = TRACEBACK_FLAG in args
    args = [a for a in args if a != TRACEBACK_FLAG]
    try:
        status = _run(args, registry)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return status
    except BrokenPipeError:
        # The reader went away (`... | head -1`): stop quietly. Point stdout at /dev/null so
        # that the interpreter's own flush at exit does not raise a second time.
        _silence_stdout()
        return 141
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug of ours: one line (exit 3), the traceback on request
        if show_traceback:
            traceback.print_exc(file=sys.stderr)
        hint = "" if show_traceback else f" (run again with {TRACEBACK_FLAG} to see where)"
        print(
            f"error: internal error, please report it: {type(exc).__name__}: {exc}{hint}",
            file=sys.stderr,
        )
        return 3


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real file descriptor (a test's capture): nothing to do
        pass
