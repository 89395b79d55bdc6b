"""The error tree: two kinds (start-up, per call) under ``AttnDispatchError``, every class
defined in ``attn_dispatch._errors``, the tree drawn in its docstring true to the classes."""

from __future__ import annotations

import ast
import builtins
import inspect
import re
from pathlib import Path

import pytest

import attn_dispatch
import attn_dispatch._errors as errors_module
from attn_dispatch import AttnDispatchError
from attn_dispatch import CallError
from attn_dispatch import StartupError

PACKAGE = Path(attn_dispatch.__file__).resolve().parent
DEFINED = {
    name: obj
    for name, obj in vars(errors_module).items()
    if inspect.isclass(obj) and issubclass(obj, AttnDispatchError)
}


def _drawn_tree() -> dict[str, tuple[str | None, str | None]]:
    """name -> (parent in the drawing, builtin named in parentheses)."""
    doc = errors_module.__doc__ or ""
    out: dict[str, tuple[str | None, str | None]] = {}
    stack: list[tuple[int, str]] = []
    drawing = doc.split("::\n", 1)[1].strip("\n").split("\n\n", 1)[0]  # the block after "::"
    for line in drawing.splitlines():
        m = re.match(r"^(\s*)(?:[│ ]*[├└]── )?(\w+Error)\b(?:\s+\((\w+)\))?", line)
        if not m or "Error" not in line:
            continue
        depth = line.index(m.group(2))
        while stack and stack[-1][0] >= depth:
            stack.pop()
        out[m.group(2)] = (stack[-1][1] if stack else None, m.group(3))
        stack.append((depth, m.group(2)))
    return out


def test_the_drawn_tree_is_the_class_tree() -> None:
    drawn = _drawn_tree()
    assert set(drawn) == set(DEFINED), set(drawn) ^ set(DEFINED)
    for name, (parent, builtin) in drawn.items():
        cls = DEFINED[name]
        if parent is None:
            assert cls is AttnDispatchError
            continue
        assert cls.__bases__[0] is DEFINED[parent], (name, parent)
        if builtin is not None:
            assert getattr(builtins, builtin) in cls.__bases__, (name, builtin)


def test_every_error_is_of_one_kind() -> None:
    for name, cls in DEFINED.items():
        if cls in (AttnDispatchError, StartupError, CallError):
            continue
        assert issubclass(cls, StartupError) != issubclass(cls, CallError), name
        # And refines a builtin besides our own classes (``except ValueError`` keeps working).
        assert any(not issubclass(b, AttnDispatchError) for b in cls.__bases__), name


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("UnknownBackendError", StartupError),
        ("IncompatibleBackendError", StartupError),
        ("InvalidSpecError", StartupError),
        ("BackendUnavailableError", StartupError),
        ("DuplicateBackendError", StartupError),
        ("UnsupportedModelError", StartupError),
        ("RankMismatchError", StartupError),
        ("RankFailedError", StartupError),
        ("InvalidBatchError", CallError),
        ("NoActiveScopeError", CallError),
        ("ScopeError", CallError),
        ("UnknownPhaseError", CallError),
        ("CaptureError", CallError),
        ("UsageError", CallError),
    ],
)
def test_the_kinds_of_the_issue(name: str, kind: type) -> None:
    assert issubclass(getattr(attn_dispatch, name), kind)


def test_every_public_error_is_exported_from_the_core() -> None:
    for name, cls in DEFINED.items():
        if name == "CacheFullError":  # the demo's own
            continue
        assert name in attn_dispatch.__all__, name
        assert getattr(attn_dispatch, name) is cls
        assert cls.__module__ == "attn_dispatch"


def test_no_error_class_is_defined_outside_errors() -> None:
    # One home for the tree (the integrations re-export the core's classes).
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_errors.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and any(
                (isinstance(b, ast.Name) and b.id.endswith("Error"))
                or (isinstance(b, ast.Attribute) and b.attr.endswith("Error"))
                for b in node.bases
            ):
                found.append(f"{path.relative_to(PACKAGE)}:{node.name}")
    assert found == []


def test_the_integrations_share_the_core_classes() -> None:
    import attn_dispatch.distributed as distributed
    import attn_dispatch.integrations.transformers as tf

    assert tf.UnsupportedModelError is attn_dispatch.UnsupportedModelError
    assert distributed.RankMismatchError is attn_dispatch.RankMismatchError
    # The vLLM integration raises the core's class: it imports nothing of transformers'.
    vllm = sorted((PACKAGE / "integrations" / "vllm").rglob("*.py"))
    assert vllm
    for path in vllm:
        assert "attn_dispatch.integrations.transformers" not in path.read_text(), path
