"""Built-in backends. Each lives in ``backends/<name>/``: a light ``__init__`` that declares
``CAPABILITIES`` (core imports only) and a heavy ``backend.py`` imported only at ``bind``."""

from __future__ import annotations

import importlib

from attn_dispatch._registry import register_backend

# name -> (light module, factory path). A module that is absent (a partial install) is skipped.
BUILTINS: dict[str, tuple[str, str]] = {
    "torch": (
        "attn_dispatch.backends.reference",
        "attn_dispatch.backends.reference.backend:TorchBackend",
    ),
    "native": (
        "attn_dispatch.backends.native",
        "attn_dispatch.backends.native.backend:NativeBackend",
    ),
    "triton": (
        "attn_dispatch.backends.triton",
        "attn_dispatch.backends.triton.backend:TritonBackend",
    ),
    "flashinfer": (
        "attn_dispatch.backends.flashinfer",
        "attn_dispatch.backends.flashinfer.backend:FlashInferBackend",
    ),
}


def register_builtins() -> None:
    """Register every built-in backend whose light module is present (the registry calls this
    once, on first use)."""
    for name, (module, factory) in BUILTINS.items():
        try:
            light = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name == module:
                continue
            raise
        register_backend(name, capabilities=light.CAPABILITIES, factory=factory, replace=True)
