"""Built-in backends. Each lives in ``backends/<name>/``: a light ``__init__`` that declares
``CAPABILITIES`` and ``DEFAULT_FORM_POLICY`` (core imports only) and a heavy ``backend.py``
imported only at ``bind``.

This module is data only: the package's ``__init__`` installs ``BUILTINS`` into the registry
(``attn_dispatch._registry.install_builtins``), which loads the light modules on first use;
neither this module nor the registry imports the other.
"""

from __future__ import annotations

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
    "sdpa": (
        "attn_dispatch.backends.sdpa",
        "attn_dispatch.backends.sdpa.backend:SdpaBackend",
    ),
    "flashinfer": (
        "attn_dispatch.backends.flashinfer",
        "attn_dispatch.backends.flashinfer.backend:FlashInferBackend",
    ),
}
