"""MkDocs hook: docstring examples (``>>>`` lines) render as Python console code blocks.

Markdown reads a line that starts with ``>`` as a block quote, so the doctest examples of the
docstrings that mkdocstrings renders would show as quotes nested three deep. This hook adds a
Markdown preprocessor, used for the pages and (through mkdocstrings, which renders docstrings
with the site's extensions) for every docstring, that fences each run of example lines
(``>>>``, ``...`` and the expected output, up to a blank line) as ``pycon``, without the
``# doctest:`` directives, which are for the test runner only.
"""

from __future__ import annotations

import re
from typing import Any

from markdown import Markdown  # type: ignore[import-untyped]
from markdown.extensions import Extension  # type: ignore[import-untyped]
from markdown.preprocessors import Preprocessor  # type: ignore[import-untyped]

PROMPT = re.compile(r"^(?P<indent>[ \t]*)>>>( |$)")
FENCE = re.compile(r"^[ \t]*(```|~~~)")
DIRECTIVE = re.compile(r"\s*# doctest: [A-Z_+\-, ]+$")


def fence_examples(lines: list[str]) -> list[str]:
    """``lines`` with every run of doctest lines outside a fence wrapped in a pycon fence."""
    out: list[str] = []
    in_fence = False
    i = 0
    while i < len(lines):
        line = lines[i]
        if FENCE.match(line):
            in_fence = not in_fence
        m = None if in_fence else PROMPT.match(line)
        if m is None:
            out.append(line)
            i += 1
            continue
        indent = m["indent"]
        block = []
        while i < len(lines) and lines[i].strip() and lines[i].startswith(indent):
            block.append(DIRECTIVE.sub("", lines[i][len(indent) :]))
            i += 1
        # Blank lines around the fence: a fence may not interrupt a paragraph.
        out += ["", "```pycon", *block, "```", ""]
    return out


class _Examples(Preprocessor):  # type: ignore[misc]  # markdown ships no types
    def run(self, lines: list[str]) -> list[str]:
        return fence_examples(lines)


class PyconExamples(Extension):  # type: ignore[misc]  # markdown ships no types
    def extendMarkdown(self, md: Markdown) -> None:  # Markdown names the method
        # Before the fenced-code preprocessor (priority 25), which must see the new fences.
        md.preprocessors.register(_Examples(md), "pycon_examples", 29)


def on_config(config: Any, **kwargs: Any) -> Any:
    # mkdocstrings keeps this same list for the Markdown it renders docstrings with.
    config.markdown_extensions.append(PyconExamples())
    return config
