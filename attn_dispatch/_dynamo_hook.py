"""``torch.compile`` over ``attention`` after a plain ``import attn_dispatch``.

``attention`` reads a ContextVar, which Dynamo cannot trace; ``attn_dispatch.compile``
registers the opaque op that it traces instead. Importing that module eagerly would load torch
and Dynamo (and Dynamo loads triton, which must not load before ``TRITON_INTERPRET`` is
chosen) with the torch-free core. So the package waits for Dynamo: ``install()`` (called by the
package ``__init__``) registers the compile path at once when ``torch._dynamo`` is already
loaded, and otherwise puts a finder on ``sys.meta_path`` that sees only the import of
``torch._dynamo`` (``torch.compile`` makes it) and registers right after that module has run.
Nothing is imported before the user's own code imports Dynamo, and the finder removes itself
after that one import.

When the registration fails, Dynamo's import still succeeds (a failure here must not break
``torch.compile`` for everything else): a ``RuntimeWarning`` names the failure and the one line
that reports it in full, ``import attn_dispatch.compile``.

This module imports no torch.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any

WATCHED = "torch._dynamo"
COMPILE_MODULE = "attn_dispatch.compile"

_lock = threading.Lock()


def install() -> None:
    """Register the compile path now if Dynamo is loaded, else when it loads."""
    if WATCHED in sys.modules:
        _register()
        return
    with _lock:
        if not any(isinstance(f, _DynamoFinder) for f in sys.meta_path):
            sys.meta_path.insert(0, _DynamoFinder())


def _register() -> None:
    try:
        importlib.import_module(COMPILE_MODULE)
    except Exception as exc:  # reported, never raised into Dynamo's own import
        warnings.warn(
            f"attn_dispatch could not register attention for torch.compile "
            f"({type(exc).__name__}: {exc}); compiled code that calls attn_dispatch.attention "
            f"will fail in Dynamo. Add `import {COMPILE_MODULE}` before torch.compile to see "
            "the full error.",
            RuntimeWarning,
            stacklevel=2,
        )


def _remove(finder: _DynamoFinder) -> None:
    with _lock:
        try:
            sys.meta_path.remove(finder)
        except ValueError:
            pass


class _DynamoFinder(importlib.abc.MetaPathFinder):
    """Answers nothing but the import of ``torch._dynamo``: for that one, the spec the other
    finders give, with a loader that registers the compile path after the module ran."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != WATCHED:
            return None
        _remove(self)  # one import only; the finders below answer it
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec: importlib.machinery.ModuleSpec | None = (
                find(fullname, path, target) if find is not None else None
            )
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenRegister(spec.loader)
        return spec


class _ThenRegister(importlib.abc.Loader):
    """The real loader of ``torch._dynamo``; registers the compile path once it has run.
    Every other attribute (``get_source``, ``get_filename``, ...) is the real loader's."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        result: ModuleType | None = self._loader.create_module(spec)
        return result

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _register()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
