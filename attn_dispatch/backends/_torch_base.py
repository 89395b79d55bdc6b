"""Base class of the built-in backends, which all compute on torch tensors.

Building one registers the torch.compile path (``attn_dispatch.compile``): every process that
builds one of these backends has imported torch already, so compiled model code finds
``attention`` traceable without an import of its own, while the core (``import attn_dispatch``,
``bind`` itself) never imports torch or Dynamo as a side effect. It happens at construction,
not at import of this module: Dynamo imports triton, which must not load before a test or a
user has chosen ``TRITON_INTERPRET`` (importing a backend module stays cheap).
"""

from __future__ import annotations

from typing import Any

from attn_dispatch._protocol import BackendBase

_compile_registered = False


def _register_compile() -> None:
    global _compile_registered
    if not _compile_registered:
        import attn_dispatch.compile  # noqa: F401  (registers the op and Dynamo's substitution)

        _compile_registered = True


class TorchBackendBase(BackendBase):
    """``BackendBase`` for backends on torch tensors (see ``attn_dispatch._protocol``)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> TorchBackendBase:
        # In __new__, so subclasses need not call super().__init__().
        _register_compile()
        return super().__new__(cls)


__all__ = ["TorchBackendBase"]
