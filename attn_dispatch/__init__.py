"""attn_dispatch: per-runner, per-phase attention kernel selection and per-call dispatch.

Each model runner owns a ``BackendSpec`` (kernel name per phase); ``bind`` checks it against
what the kernels can do for the runner's ``AttnConfig``; ``attn_scope(runner, batch)`` makes the
runner active in this context during its forward, and layers call ``attention(...)`` or
``resolve(phase)``. One runner never changes another's dispatch.

The core imports no torch: importing this package is cheap. ``AttnBatch`` needs torch only
when it is constructed.
"""

from typing import TYPE_CHECKING
from typing import Any

from attn_dispatch._binding import Binding
from attn_dispatch._binding import bind
from attn_dispatch._capabilities import Capabilities
from attn_dispatch._config import AttnConfig
from attn_dispatch._errors import AttnDispatchError
from attn_dispatch._errors import BackendUnavailableError
from attn_dispatch._errors import DuplicateBackendError
from attn_dispatch._errors import IncompatibleBackendError
from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._errors import NoActiveScopeError
from attn_dispatch._errors import ScopeError
from attn_dispatch._errors import UnknownBackendError
from attn_dispatch._errors import UnknownPhaseError
from attn_dispatch._forms import AttnForm
from attn_dispatch._forms import FormPolicy
from attn_dispatch._phase import Phase
from attn_dispatch._protocol import AttentionBackend
from attn_dispatch._protocol import BackendBase
from attn_dispatch._protocol import ChunkedHandler
from attn_dispatch._protocol import Handler
from attn_dispatch._protocol import PlanBase
from attn_dispatch._protocol import Runner
from attn_dispatch._protocol import check_plan
from attn_dispatch._protocol import issue_plan
from attn_dispatch._record import DispatchEvent
from attn_dispatch._record import DispatchRecorder
from attn_dispatch._record import record_dispatch
from attn_dispatch._registry import Registry
from attn_dispatch._registry import list_backends
from attn_dispatch._registry import register_backend
from attn_dispatch._registry import unregister_backend
from attn_dispatch._scope import attention
from attn_dispatch._scope import attention_form
from attn_dispatch._scope import attn_scope
from attn_dispatch._scope import current_batch
from attn_dispatch._scope import current_binding
from attn_dispatch._scope import resolve
from attn_dispatch._spec import BackendSpec
from attn_dispatch._threads import carry_scope
from attn_dispatch._threads import run_in_thread
from attn_dispatch.integrations._sglang_rules import phase_of

if TYPE_CHECKING:
    from attn_dispatch._batch import AttnBatch
    from attn_dispatch._batch import tree_mask
    from attn_dispatch.state import merge_state
    from attn_dispatch.state import merge_states

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Modules that need torch are loaded on first use: start-up imports of the core stay small.
    if name in ("AttnBatch", "tree_mask"):
        from attn_dispatch import _batch

        return getattr(_batch, name)
    if name in ("merge_state", "merge_states"):
        from attn_dispatch import state

        return getattr(state, name)
    raise AttributeError(f"module 'attn_dispatch' has no attribute {name!r}")


__all__ = [
    "AttentionBackend",
    "AttnBatch",
    "AttnConfig",
    "AttnDispatchError",
    "AttnForm",
    "BackendBase",
    "BackendSpec",
    "BackendUnavailableError",
    "Binding",
    "Capabilities",
    "ChunkedHandler",
    "DispatchEvent",
    "DispatchRecorder",
    "DuplicateBackendError",
    "FormPolicy",
    "Handler",
    "IncompatibleBackendError",
    "InvalidBatchError",
    "InvalidSpecError",
    "NoActiveScopeError",
    "Phase",
    "PlanBase",
    "Registry",
    "Runner",
    "ScopeError",
    "UnknownBackendError",
    "UnknownPhaseError",
    "attention",
    "attention_form",
    "attn_scope",
    "bind",
    "carry_scope",
    "check_plan",
    "current_batch",
    "current_binding",
    "issue_plan",
    "list_backends",
    "merge_state",
    "merge_states",
    "phase_of",
    "record_dispatch",
    "register_backend",
    "resolve",
    "run_in_thread",
    "tree_mask",
    "unregister_backend",
]
