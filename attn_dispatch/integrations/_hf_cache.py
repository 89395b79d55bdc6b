"""Deprecated: the paged cache moved into ``attn_dispatch.integrations.transformers``.

Import ``PagedCache``, ``PagedLayer``, ``GroupedBatches``, ``UnsupportedModelError``,
``FP8_MAX`` and ``DEFAULT_PAGE_SIZE`` from ``attn_dispatch.integrations.transformers``. This
module keeps answering those names (and the private ones it held) for one release; each access
warns with a ``DeprecationWarning``.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_NEW = "attn_dispatch.integrations.transformers"
# name -> the module that holds it now
_MOVED = {
    "DEFAULT_PAGE_SIZE": "_common",
    "FP8_MAX": "_common",
    "UnsupportedModelError": "_common",
    "GroupedBatches": "_cache",
    "PagedCache": "_cache",
    "PagedLayer": "_layer",
    "_Step": "_layer",
    "_scale": "_layer",
    "_write": "_layer",
    "_Group": "_allocator",
}


def __getattr__(name: str) -> Any:
    where = _MOVED.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    public = not name.startswith("_")
    hint = f"import it from {_NEW}" if public else f"it is private to {_NEW}"
    warnings.warn(
        f"{__name__}.{name} moved ({hint}); {__name__} will be removed in the next release",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(f"{_NEW}.{where}"), name)
