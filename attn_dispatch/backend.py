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
  MLA layers the forms it serves and how it picks one per batch (``AttnForm``, ``FormPolicy``).
- What it is: ``AttentionBackend`` (the protocol ``bind`` checks), ``BackendBase`` (the
  defaults of its optional members), ``Handler`` / ``ChunkedHandler`` (its per-layer kernels).
- Its plans: ``PlanBase``, ``issue_plan``, ``check_plan`` (a handler accepts only the plan
  object its backend issued).
- The batch contract at plan and call time (these need torch, loaded on first use):
  ``BatchSnapshot`` (a checked private copy of the batch's index tensors), ``TensorChecks``
  (per-call shape/dtype/device/page checks), ``refill`` (re-plan into captured CUDA-graph
  buffers).
- The registry: ``register_backend``, ``unregister_backend``, ``list_backends`` (the default
  one), ``Registry`` (your own), ``BackendEntry`` (one registered backend).

Importing this module imports no torch.
"""

from typing import TYPE_CHECKING
from typing import Any

from attn_dispatch._capabilities import Capabilities
from attn_dispatch._forms import AttnForm
from attn_dispatch._forms import FormPolicy
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

if TYPE_CHECKING:
    from attn_dispatch._snapshot import BatchSnapshot
    from attn_dispatch._snapshot import refill
    from attn_dispatch._tensor_checks import TensorChecks

# Names that need torch: loaded on first use, so that importing this module stays cheap.
_LAZY = {
    "BatchSnapshot": "attn_dispatch._snapshot",
    "refill": "attn_dispatch._snapshot",
    "TensorChecks": "attn_dispatch._tensor_checks",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'attn_dispatch.backend' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "AttentionBackend",
    "AttnForm",
    "BackendBase",
    "BackendEntry",
    "BatchSnapshot",
    "Capabilities",
    "ChunkedHandler",
    "FormPolicy",
    "Handler",
    "PlanBase",
    "Registry",
    "TensorChecks",
    "check_plan",
    "issue_plan",
    "list_backends",
    "refill",
    "register_backend",
    "unregister_backend",
]

# Public names report this module (reprs, docs, pickles), except AttnForm, which the framework
# surface exports too (model code compares attention_form() with it) and reports there. The
# torch-level ones set theirs where they are defined. register_backend is a bound method: its
# function is Registry.register, renamed with the class.
for _name in __all__:
    if _name not in _LAZY and _name != "AttnForm":
        _obj = globals()[_name]
        _obj = getattr(_obj, "__func__", _obj)
        _obj.__module__ = __name__
del _name, _obj
