"""Base class of the built-in backends, which all compute on torch tensors.

Importing it registers the torch.compile path (``attn_dispatch.compile``): every process that
builds one of these backends has imported torch already, so compiled model code finds
``attention`` traceable without an import of its own, and the core (``import attn_dispatch``,
``bind``) never imports torch or Dynamo as a side effect.
"""

from __future__ import annotations

import attn_dispatch.compile  # noqa: F401  (registers the op and Dynamo's substitution)
from attn_dispatch._protocol import BackendBase


class TorchBackendBase(BackendBase):
    """``BackendBase`` for backends on torch tensors (see ``attn_dispatch._protocol``)."""


__all__ = ["TorchBackendBase"]
