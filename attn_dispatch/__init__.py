"""attn_dispatch: per-runner, per-phase attention kernel selection and per-call dispatch.

Each model runner owns a ``BackendSpec`` (kernel name per phase); ``bind`` checks it against
what the kernels can do for the runner's ``AttnConfig``; ``attn_scope(runner, batch)`` makes the
runner active in this context during its forward, and layers call ``attention(...)`` or
``resolve(phase)``. One runner never changes another's dispatch.

This module is what a framework uses. What a backend author needs (``Capabilities``, the
protocols, ``PlanBase``, the registry) is ``attn_dispatch.backend``; SGLang's names are
``attn_dispatch.integrations.sglang``.

The core imports no torch: importing this package is cheap. ``AttnBatch``, ``tree_mask`` and
``merge_state(s)`` load their torch-level modules on first use.

This ``__init__`` is the top of the layers (see ``tests/core/test_layers.py``): the one place
that wires the built-in backends into the default registry.
"""

from typing import TYPE_CHECKING
from typing import Any

from attn_dispatch import _dynamo_hook
from attn_dispatch import _registry
from attn_dispatch import backend as _backend_surface
from attn_dispatch._binding import bind
from attn_dispatch._binding import check
from attn_dispatch._config import AttnConfig
from attn_dispatch._errors import AttnDispatchError
from attn_dispatch._errors import BackendUnavailableError
from attn_dispatch._errors import CallError
from attn_dispatch._errors import CaptureError
from attn_dispatch._errors import DispatchTableError
from attn_dispatch._errors import DuplicateBackendError
from attn_dispatch._errors import IncompatibleBackendError
from attn_dispatch._errors import IncompatibleKVLayoutError
from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._errors import InvalidKVLayoutError
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._errors import NoActiveScopeError
from attn_dispatch._errors import NoProcessGroupError
from attn_dispatch._errors import RankFailedError
from attn_dispatch._errors import RankMismatchError
from attn_dispatch._errors import ScopeError
from attn_dispatch._errors import StaleTableError
from attn_dispatch._errors import StartupError
from attn_dispatch._errors import UnknownBackendError
from attn_dispatch._errors import UnknownPhaseError
from attn_dispatch._errors import UnsupportedModelError
from attn_dispatch._errors import UsageError
from attn_dispatch._forms import AttnForm
from attn_dispatch._frame import attn_scope
from attn_dispatch._phase import Phase
from attn_dispatch._record import DispatchEvent
from attn_dispatch._record import DispatchRecorder
from attn_dispatch._record import record_dispatch
from attn_dispatch._route import Binding
from attn_dispatch._route import Route
from attn_dispatch._route import Runner
from attn_dispatch._scope import attention
from attn_dispatch._scope import attention_form
from attn_dispatch._scope import current_batch
from attn_dispatch._scope import current_binding
from attn_dispatch._scope import resolve
from attn_dispatch._spec import BackendSpec
from attn_dispatch._spec import Buckets
from attn_dispatch._threads import carry_scope
from attn_dispatch._threads import run_in_thread
from attn_dispatch.backends import BUILTINS as _BUILTINS

if TYPE_CHECKING:
    from attn_dispatch._batch import AttnBatch
    from attn_dispatch._batch import tree_mask
    from attn_dispatch.state import merge_state
    from attn_dispatch.state import merge_states

from attn_dispatch._version import __version__ as __version__

# The wiring: the built-in backends join every registry that loads built-ins (the default one
# included), on first use. Neither the registry nor the backends import each other.
_registry.install_builtins(_BUILTINS)
# torch.compile over attention works without `import attn_dispatch.compile`: its op is
# registered when Dynamo loads (now, if it already has), never before (see _dynamo_hook).
_dynamo_hook.install()

# Names that need torch: loaded on first use, so start-up imports of the core stay small.
_LAZY = {
    "AttnBatch": "attn_dispatch._batch",
    "tree_mask": "attn_dispatch._batch",
    "merge_state": "attn_dispatch.state",
    "merge_states": "attn_dispatch.state",
}


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'attn_dispatch' has no attribute {name!r}")


def _public(obj: object, module: str = "attn_dispatch") -> None:
    # Public classes and functions name the module they are imported from, so reprs, docs
    # and pickles never show a private path (a pickled BackendSpec names attn_dispatch).
    try:
        obj.__module__ = module
    except (AttributeError, TypeError):
        pass


__all__ = [
    "AttnBatch",
    "AttnConfig",
    "AttnDispatchError",
    "AttnForm",
    "BackendSpec",
    "BackendUnavailableError",
    "Binding",
    "Buckets",
    "CallError",
    "CaptureError",
    "DispatchEvent",
    "DispatchRecorder",
    "DispatchTableError",
    "DuplicateBackendError",
    "IncompatibleBackendError",
    "IncompatibleKVLayoutError",
    "InvalidBatchError",
    "InvalidKVLayoutError",
    "InvalidSpecError",
    "NoActiveScopeError",
    "NoProcessGroupError",
    "Phase",
    "RankFailedError",
    "RankMismatchError",
    "Route",
    "Runner",
    "ScopeError",
    "StaleTableError",
    "StartupError",
    "UnknownBackendError",
    "UnknownPhaseError",
    "UnsupportedModelError",
    "UsageError",
    "attention",
    "attention_form",
    "attn_scope",
    "bind",
    "carry_scope",
    "check",
    "current_batch",
    "current_binding",
    "merge_state",
    "merge_states",
    "record_dispatch",
    "resolve",
    "run_in_thread",
    "tree_mask",
]

for _name in __all__:
    if _name not in _LAZY:
        _public(globals()[_name])
del _name, _backend_surface
