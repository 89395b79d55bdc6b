"""What a backend author needs: the contract a backend implements and the registry it joins.

A framework imports ``attn_dispatch``; a backend imports this module:

>>> from attn_dispatch import AttnConfig, Phase, bind
>>> from attn_dispatch.backend import BackendBase, Capabilities, PlanBase, Registry
>>> from attn_dispatch.backend import check_plan, issue_plan
>>> class MyPlan(PlanBase):
...     pass
>>> class MyBackend(BackendBase):
...     name = "mine"
...     def __init__(self, config, **options): self.config = config
...     def plan(self, batch): return issue_plan(self, MyPlan())   # once per forward
...     def handler(self, phase): return self.run                  # once per phase
...     def run(self, q, k_cache, v_cache, plan, sm_scale):       # every layer
...         check_plan(plan, self, self.name)
...         return q
>>> registry = Registry(plugins=False)   # register_backend(...): the default registry
>>> caps = Capabilities(kinds={"mha"})                # what it serves: checked at bind
>>> registry.register("mine", capabilities=caps, factory=MyBackend) is MyBackend
True
>>> config = AttnConfig("mha", 4, 2, 16, dtype="float32", device="cpu", page_size=8)
>>> bind("mine", config, label="target", registry=registry)
<Binding 'target', mine kind='mha'>

- What it can serve: ``Capabilities`` (checked by ``bind`` before any factory runs), and for
  MLA layers the forms it serves and how it picks one per batch (``AttnForm``, ``FormPolicy``);
  the dtype names it may list (``COMPUTE_DTYPES``, ``FP8_DTYPES``).
- What it is: ``AttentionBackend`` (the protocol ``bind`` checks), ``BackendBase`` (the
  defaults of its optional members), ``Handler`` / ``ChunkedHandler`` (its per-layer kernels).
- Its plans: ``PlanBase``, ``issue_plan``, ``check_plan`` (a handler accepts only the plan
  object its backend issued), ``PrivatePlans`` (what a plan stands for, kept in the backend
  object where no edit of the plan reaches it).
- The batch contract at plan and call time (these need torch, loaded on first use):
  ``BatchSnapshot`` (a checked private copy of the batch's index tensors), ``TensorChecks``
  (per-call checks of the tensors and arguments, the chunked MLA form's included),
  ``check_scale`` (a per-call scale), ``refill`` (re-plan into captured CUDA-graph buffers).
- Mask folding for a kernel that takes a custom mask (torch, loaded on first use):
  ``window_tree_mask``, ``chunk_tree_mask`` on one request's mask, ``window_flat_mask``,
  ``chunk_flat_mask``, ``per_request_mask`` on a batch's flat mask.
- The registry: ``register_backend``, ``unregister_backend``, ``list_backends`` (the default
  one), ``Registry`` (your own), ``BackendEntry`` (one registered backend).
- The framework's names a backend uses, the same objects as in ``attn_dispatch``: ``AttnConfig``
  (what it is built for), ``Phase``, and the errors it raises: ``InvalidBatchError`` (a call's
  batch, tensors or arguments), ``InvalidSpecError`` (an option), ``BackendUnavailableError``
  (its library or device is missing), ``IncompatibleBackendError`` (a config it cannot serve).

The built-in backends (``attn_dispatch/backends/``) import from this module only, so what they
do an author can do with the same names (tests/core/test_layers.py keeps it so).

Importing this module imports no torch.
"""

from typing import TYPE_CHECKING
from typing import Any

from attn_dispatch._capabilities import Capabilities
from attn_dispatch._config import AttnConfig
from attn_dispatch._errors import BackendUnavailableError
from attn_dispatch._errors import IncompatibleBackendError
from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._forms import AttnForm
from attn_dispatch._forms import FormPolicy
from attn_dispatch._phase import Phase
from attn_dispatch._plans import PrivatePlans
from attn_dispatch._protocol import AttentionBackend
from attn_dispatch._protocol import BackendBase
from attn_dispatch._protocol import ChunkedHandler
from attn_dispatch._protocol import Handler
from attn_dispatch._protocol import PlanBase
from attn_dispatch._protocol import check_plan
from attn_dispatch._protocol import issue_plan
from attn_dispatch._registry import BackendEntry
from attn_dispatch._registry import Registry
from attn_dispatch._registry import list_backends
from attn_dispatch._registry import register_backend
from attn_dispatch._registry import unregister_backend
from attn_dispatch._values import check_scale
from attn_dispatch._vocab import COMPUTE_DTYPES as _COMPUTE_DTYPES
from attn_dispatch._vocab import FP8_DTYPES as _FP8_DTYPES

if TYPE_CHECKING:
    from attn_dispatch._masks import chunk_flat_mask
    from attn_dispatch._masks import chunk_tree_mask
    from attn_dispatch._masks import per_request_mask
    from attn_dispatch._masks import window_flat_mask
    from attn_dispatch._masks import window_tree_mask
    from attn_dispatch._snapshot import BatchSnapshot
    from attn_dispatch._snapshot import refill
    from attn_dispatch._tensor_checks import TensorChecks

#: The compute dtypes a config may have (``AttnConfig.dtype``), by torch's attribute name; a
#: backend serving them all lists ``dtypes=COMPUTE_DTYPES`` in its ``Capabilities``.
COMPUTE_DTYPES: tuple[str, ...] = _COMPUTE_DTYPES

#: The FP8 formats a KV cache may hold besides the compute dtypes: a backend reading FP8 pages
#: lists ``kv_dtypes={*COMPUTE_DTYPES, *FP8_DTYPES}`` (and takes ``k_scale``/``v_scale``).
FP8_DTYPES: frozenset[str] = _FP8_DTYPES

# Names that need torch: loaded on first use, so that importing this module stays cheap.
_LAZY = {
    "BatchSnapshot": "attn_dispatch._snapshot",
    "refill": "attn_dispatch._snapshot",
    "TensorChecks": "attn_dispatch._tensor_checks",
    "chunk_flat_mask": "attn_dispatch._masks",
    "chunk_tree_mask": "attn_dispatch._masks",
    "per_request_mask": "attn_dispatch._masks",
    "window_flat_mask": "attn_dispatch._masks",
    "window_tree_mask": "attn_dispatch._masks",
}

# Exported by both surfaces, the same objects: they report the framework's module
# (``attn_dispatch``), where model code and frameworks meet them first.
_FRAMEWORK = frozenset(
    {
        "AttnConfig",
        "AttnForm",
        "BackendUnavailableError",
        "IncompatibleBackendError",
        "InvalidBatchError",
        "InvalidSpecError",
        "Phase",
    }
)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'attn_dispatch.backend' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


# Plain sorted order (tests/core/test_surfaces.py), constants among the rest.
__all__ = [  # noqa: RUF022
    "AttentionBackend",
    "AttnConfig",
    "AttnForm",
    "BackendBase",
    "BackendEntry",
    "BackendUnavailableError",
    "BatchSnapshot",
    "COMPUTE_DTYPES",
    "Capabilities",
    "ChunkedHandler",
    "FP8_DTYPES",
    "FormPolicy",
    "Handler",
    "IncompatibleBackendError",
    "InvalidBatchError",
    "InvalidSpecError",
    "Phase",
    "PlanBase",
    "PrivatePlans",
    "Registry",
    "TensorChecks",
    "check_plan",
    "check_scale",
    "chunk_flat_mask",
    "chunk_tree_mask",
    "issue_plan",
    "list_backends",
    "per_request_mask",
    "refill",
    "register_backend",
    "unregister_backend",
    "window_flat_mask",
    "window_tree_mask",
]

# Public names report this module (reprs, docs, pickles), except the framework's names above
# and the constants (values, no module of their own). The torch-level ones set theirs where
# they are defined. register_backend is a bound method: its function is Registry.register,
# renamed with the class.
for _name in __all__:
    if _name not in _LAZY and _name not in _FRAMEWORK and not _name.isupper():
        _obj = globals()[_name]
        _obj = getattr(_obj, "__func__", _obj)
        _obj.__module__ = __name__
del _name, _obj
