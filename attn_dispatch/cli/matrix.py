"""``python -m attn_dispatch matrix``: what every registered backend declares, as a table;
``--update-readme`` rebuilds the generated blocks of a README."""

from __future__ import annotations

import argparse
from pathlib import Path

from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._matrix import FIELDS
from attn_dispatch._matrix import FORMATS
from attn_dispatch._matrix import format_matrix
from attn_dispatch._matrix import render_blocks
from attn_dispatch._matrix import support_matrix
from attn_dispatch._registry import Registry
from attn_dispatch.cli._files import read_regular

# A README is kilobytes; the limit only keeps a mistaken path from being read without end.
_README_BYTES_MAX = 16 << 20


def _words(text: str) -> list[str]:
    return [w.strip() for w in text.split(",") if w.strip()]


def _listed(text: str | None, flag: str) -> list[str] | None:
    """A comma-separated flag's names (None: not given). One that names nothing (``,``) is
    refused, not taken as "print an empty matrix"."""
    if text is None:
        return None
    words = _words(text)
    if not words:
        raise InvalidSpecError(flag, text, "names nothing; give comma-separated names")
    return words


def matrix_text(args: argparse.Namespace, registry: Registry) -> str:
    """What ``matrix`` prints for ``args``."""
    names = _listed(args.backends, "--backends")
    fields = _listed(args.fields, "--fields")
    return format_matrix(support_matrix(registry, backends=names), args.format, fields=fields)


def render_readme(text: str, registry: Registry) -> str:
    """``text`` (a README) with every generated matrix block rebuilt from ``registry``."""
    parser = argparse.ArgumentParser(prog="python -m attn_dispatch matrix")
    add_args(parser)
    return render_blocks(text, lambda argv: matrix_text(parser.parse_args(argv), registry))


def cmd_matrix(args: argparse.Namespace, registry: Registry) -> int:
    if args.update_readme is None:
        print(matrix_text(args, registry))
        return 0
    path = Path(args.update_readme)
    try:
        old = read_regular(path, "--update-readme", _README_BYTES_MAX, what="a README").decode()
    except FileNotFoundError as exc:
        raise InvalidSpecError("--update-readme", str(path), f"cannot read it: {exc}") from None
    except UnicodeDecodeError as exc:
        raise InvalidSpecError(
            "--update-readme",
            str(path),
            f"is not UTF-8 text (byte {exc.start}: {exc.reason}); pass the README (Markdown)",
        ) from None
    new = render_readme(old, registry)
    if new != old:
        try:
            path.write_text(new, encoding="utf-8")
        except OSError as exc:
            raise InvalidSpecError(
                "--update-readme", str(path), f"cannot write it: {exc}"
            ) from None
    print(f"{path}: {'updated' if new != old else 'up to date'}")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    m = sub.add_parser(
        "matrix",
        help="what every registered backend declares (its Capabilities), as a table",
        description="The support matrix: one row per Capabilities field, one column per "
        "registered backend (third-party ones included), read from their declarations.",
    )
    add_args(m)


def add_args(m: argparse.ArgumentParser) -> None:
    m.add_argument("--format", choices=FORMATS, default="text")
    m.add_argument("--fields", help=f"comma-separated rows, in order (any of: {', '.join(FIELDS)})")
    m.add_argument("--backends", help="comma-separated backend names (default: every one)")
    m.add_argument(
        "--update-readme",
        metavar="PATH",
        help="rewrite the generated matrix blocks of a README in place (for maintainers)",
    )
