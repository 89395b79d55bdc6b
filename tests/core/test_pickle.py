"""Every public error and value type survives pickling: the same type, fields and message.

A server runs workers in other processes (multiprocessing, a process pool, ranks); an error a
worker raises is pickled to the parent. An error that cannot be unpickled there surfaced as
``BrokenProcessPool``, or made ``multiprocessing.Pool.map`` wait forever, and one rebuilt from
its message alone wrapped that message twice.

The test is over *every* class: the public surfaces (``attn_dispatch``,
``attn_dispatch.backend``, ``attn_dispatch.distributed``, ``attn_dispatch.testing``) and every
error class of ``attn_dispatch._errors``; a new class must join a table below (a value or
error with an example, or a non-value with the reason) before the suite passes.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import multiprocessing
import pickle
from collections.abc import Callable
from typing import Any

import pytest

import attn_dispatch
import attn_dispatch._errors as errors_module
import attn_dispatch.backend as backend_surface
from attn_dispatch import AttnConfig
from attn_dispatch import BackendSpec
from attn_dispatch import Phase
from attn_dispatch._errors import AttnDispatchError
from attn_dispatch.backend import Capabilities
from attn_dispatch.backend import list_backends as _list_backends

torch = pytest.importorskip("torch")

import attn_dispatch.distributed as distributed  # noqa: E402
import attn_dispatch.testing as testing  # noqa: E402

SURFACES = (attn_dispatch, backend_surface, distributed, testing)
BUILTINS = ("flashinfer", "native", "sdpa", "torch", "triton")


def list_backends() -> dict[str, Capabilities]:
    # The built-ins only: other tests of the session register backends with lambdas as checks
    # (a lambda pickles by name, so those test-local capabilities would not).
    found = _list_backends()
    return {name: found[name] for name in BUILTINS}


MHA = AttnConfig("mha", 4, 2, 16, dtype="float32", page_size=4)


def _check(c: AttnConfig, p: Phase) -> list[str]:  # a module-level check pickles by name
    return []


#: Every error class -> an instance with each of its fields set.
ERRORS: dict[type[AttnDispatchError], Callable[[], AttnDispatchError]] = {
    errors_module.AttnDispatchError: lambda: errors_module.AttnDispatchError("plain"),
    errors_module.StartupError: lambda: errors_module.StartupError("refuse to start"),
    errors_module.CallError: lambda: errors_module.CallError("fail one request"),
    errors_module.UnknownBackendError: lambda: errors_module.UnknownBackendError(
        "natve", ["native", "torch"], context="runner 'target'"
    ),
    errors_module.IncompatibleBackendError: lambda: errors_module.IncompatibleBackendError(
        "target", {Phase.DECODE: ("native", ["kind 'mla' is not supported"])}, config=MHA
    ),
    errors_module.NoActiveScopeError: lambda: errors_module.NoActiveScopeError("attention"),
    errors_module.BackendUnavailableError: lambda: errors_module.BackendUnavailableError(
        "triton", "needs CUDA", runner="draft"
    ),
    errors_module.UnknownPhaseError: lambda: errors_module.UnknownPhaseError(
        "EXTEND2", ("PREFILL", "DECODE"), hint="map it first"
    ),
    errors_module.InvalidBatchError: lambda: errors_module.InvalidBatchError(
        "kv_lens", "must be >= q_len", request=3
    ),
    errors_module.ScopeError: lambda: errors_module.ScopeError("exited twice"),
    errors_module.InvalidSpecError: lambda: errors_module.InvalidSpecError(
        "page_size", 0, "must be a positive int"
    ),
    errors_module.DuplicateBackendError: lambda: errors_module.DuplicateBackendError("mine"),
    errors_module.UnsupportedModelError: lambda: errors_module.UnsupportedModelError(
        "attention dropout in training is not served"
    ),
    errors_module.RankMismatchError: lambda: errors_module.RankMismatchError(
        {"target.spec": ["native", "torch"]}, 2
    ),
    errors_module.RankFailedError: lambda: errors_module.RankFailedError(
        {1: "InvalidSpecError: page_size=0: must be a positive int"}, 2, 0
    ),
    errors_module.NoProcessGroupError: lambda: errors_module.NoProcessGroupError("merge_ranks"),
    errors_module.CaptureError: lambda: errors_module.CaptureError("plan during capture"),
    errors_module.UsageError: lambda: errors_module.UsageError(
        "attention(group=...)", "runner 'g' has no group 'global'"
    ),
    errors_module.CacheFullError: lambda: errors_module.CacheFullError("target", 9, 2, 16),
    errors_module.DispatchTableError: lambda: errors_module.DispatchTableError(
        "t.json", "version", "unknown format version 9"
    ),
    errors_module.StaleTableError: lambda: errors_module.StaleTableError(
        "t.json", {"torch": ("2.12.0", "2.13.0")}
    ),
    errors_module.InvalidKVLayoutError: lambda: errors_module.InvalidKVLayoutError(
        "page_size", 0, "must be a positive int"
    ),
    errors_module.IncompatibleKVLayoutError: lambda: errors_module.IncompatibleKVLayoutError(
        {"page_size": (16, 64)}
    ),
}


def _batch() -> Any:
    return attn_dispatch.AttnBatch.build(
        Phase.DECODE, q_lens=[1, 1], kv_lens=[5, 3], page_tables=[[2, 0], [1]], page_size=4
    )


def _shard() -> Any:
    batch = attn_dispatch.AttnBatch.build(
        Phase.DECODE, q_lens=[1], kv_lens=[6], page_tables=[[0, 1]], page_size=4
    )
    cache = torch.arange(2 * 4 * 2 * 16, dtype=torch.float32).reshape(2, 4, 2, 16)
    return distributed.shard_for_rank(batch, cache, cache, rank=1, world=2)


def _row() -> Any:
    return testing.DispatchRow("target", "decode", None, "torch", None, "mha", 3, bound=MHA)


#: Every public value type -> examples (the built-ins' capabilities among them).
VALUES: dict[type, Callable[[], list[Any]]] = {
    AttnConfig: lambda: [MHA, AttnConfig("mla", 16, 1, 576, 512, dtype="bfloat16")],
    BackendSpec: lambda: [
        BackendSpec.parse("prefill=sdpa,decode=native"),
        BackendSpec.parse("prefill=q_len<=256:native|sdpa,decode=native"),
    ],
    attn_dispatch.Buckets: lambda: [
        attn_dispatch.Buckets(phase="prefill", measure="q_len", limits=((256, "native"),))
    ],
    Phase: lambda: list(Phase),
    attn_dispatch.AttnForm: lambda: list(attn_dispatch.AttnForm),
    attn_dispatch.DispatchEvent: lambda: [
        attn_dispatch.DispatchEvent("target", Phase.VERIFY, "torch", "mla", "full", "note")
    ],
    attn_dispatch.AttnBatch: lambda: [_batch()],
    Capabilities: lambda: [
        *list_backends().values(),
        Capabilities(
            kinds={"mha"},
            checks=(_check,),
            forms={"prefill": {"mla", "mha"}},
            variants={Phase.DECODE: {"window"}},
        ),
    ],
    backend_surface.BackendEntry: lambda: [backend_surface.Registry().get("torch")],
    backend_surface.FormPolicy: lambda: [backend_surface.FormPolicy(short_prefix_max=64)],
    backend_surface.BatchSnapshot: lambda: [backend_surface.BatchSnapshot.of(_batch(), 4)],
    backend_surface.TensorChecks: lambda: [backend_surface.TensorChecks.of(MHA, backend="x")],
    distributed.RankShard: lambda: [_shard()],
    testing.DispatchRow: lambda: [_row()],
    testing.Ledger: lambda: [testing.Ledger.of("target", [_row()])],
    testing.Isolation: lambda: [testing.Isolation("target", (_row(),), (_row(),), ("draft",))],
}

#: Public classes that are not values: they hold live objects (backends, a context, locks).
NOT_VALUES = {
    "Binding": "holds the built backend objects of one process",
    "Route": "holds a built backend object and its handlers",
    "DispatchRecorder": "a live recorder installed in this process",
    "RowRecorder": "a live recorder installed in this process",
    "Registry": "a mutable table with a lock and loaded plugins",
    "BackendBase": "a base class for backends",
    "PlanBase": "a base class for plans (a plan is refused outside its backend object)",
    "PrivatePlans": "a backend's live table of the plans it issued (ids to private state)",
    "attn_scope": "a context manager (a frame of this context)",
    "record_dispatch": "a context manager",
}


def _public_classes() -> dict[str, type]:
    found: dict[str, type] = {}
    for module in SURFACES:
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj) and not getattr(obj, "_is_protocol", False):
                found[f"{module.__name__}.{name}"] = obj
    return found


def test_every_class_is_in_a_table() -> None:
    for where, cls in _public_classes().items():
        if issubclass(cls, BaseException):
            assert cls in ERRORS, f"{where}: add an example to ERRORS"
        else:
            assert cls in VALUES or cls.__name__ in NOT_VALUES, f"{where}: add it to VALUES"
    defined = {
        obj
        for obj in vars(errors_module).values()
        if inspect.isclass(obj) and issubclass(obj, AttnDispatchError)
    }
    assert defined == set(ERRORS), defined ^ set(ERRORS)


def _state(obj: Any) -> Any:
    """What two equal values share, tensors compared by content."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", obj.dtype, tuple(obj.shape), obj.tolist())
    if isinstance(obj, enum.Enum):
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj), {f.name: _state(getattr(obj, f.name)) for f in dataclasses.fields(obj)})
    if isinstance(obj, (list, tuple)):
        return type(obj)(_state(v) for v in obj)
    if isinstance(obj, dict):
        return {k: _state(v) for k, v in obj.items()}
    if hasattr(obj, "__slots__") and not isinstance(obj, (str, bytes, int, float)):
        return (type(obj), {s: _state(getattr(obj, s, None)) for s in _slots(type(obj))})
    return obj


def _slots(cls: type) -> list[str]:
    out: list[str] = []
    for klass in cls.__mro__:
        slots = vars(klass).get("__slots__", ())
        out.extend([slots] if isinstance(slots, str) else slots)
    return [s for s in out if s != "__weakref__"]


@pytest.mark.parametrize("cls", list(ERRORS), ids=lambda c: c.__name__)
def test_error_round_trips_with_type_fields_and_message(cls: type[AttnDispatchError]) -> None:
    err = ERRORS[cls]()
    assert type(err) is cls
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert str(back) == str(err)  # the same message, not wrapped twice
    assert back.args == err.args
    assert vars(back) == vars(err)  # every field (the offending values)
    if cls.__module__ == "attn_dispatch":  # public: the pickle names no private module
        assert b"attn_dispatch._" not in pickle.dumps(err)
    # A second trip changes nothing (nothing accumulates).
    again = pickle.loads(pickle.dumps(back))
    assert str(again) == str(err) and vars(again) == vars(err)


@pytest.mark.parametrize("cls", list(VALUES), ids=lambda c: c.__name__)
def test_value_round_trips_with_type_and_fields(cls: type) -> None:
    for value in VALUES[cls]():
        assert isinstance(value, cls)
        back = pickle.loads(pickle.dumps(value))
        assert type(back) is type(value)
        assert _state(back) == _state(value)
        if not any(isinstance(v, torch.Tensor) for v in vars_of(value)):
            assert back == value


def vars_of(value: Any) -> list[Any]:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [getattr(value, f.name) for f in dataclasses.fields(value)]
    return []


def test_capabilities_pickles_name_no_private_module() -> None:
    for caps in list_backends().values():
        assert b"attn_dispatch._capabilities" not in pickle.dumps(caps)


def test_builtin_capabilities_keep_their_per_phase_forms() -> None:
    # native, triton and flashinfer declare forms per phase (a read-only mapping): those were
    # the ones pickle refused.
    for name, caps in list_backends().items():
        back = pickle.loads(pickle.dumps(caps))
        for phase in Phase:
            assert back.forms_for(phase) == caps.forms_for(phase), (name, phase)
            assert back.variants_for(phase) == caps.variants_for(phase), (name, phase)


# -- a real process pool ---------------------------------------------------------------------


def _raise_in_worker(kind: str) -> None:
    if kind == "batch":
        raise attn_dispatch.InvalidBatchError("kv_lens", "must be >= q_len", request=3)
    if kind == "ranks":
        raise attn_dispatch.RankMismatchError({"target.spec": ["native", "torch"]}, 2)
    raise attn_dispatch.IncompatibleBackendError(
        "draft", {Phase.VERIFY: ("native", ["tree verify needs a custom attention mask"])}
    )


@pytest.mark.parametrize(
    ("kind", "cls", "field", "value"),
    [
        ("batch", attn_dispatch.InvalidBatchError, "request", 3),
        ("ranks", attn_dispatch.RankMismatchError, "world", 2),
        ("bind", attn_dispatch.IncompatibleBackendError, "label", "draft"),
    ],
)
def test_a_worker_error_reaches_the_parent_intact(
    kind: str, cls: type[AttnDispatchError], field: str, value: object
) -> None:
    # spawn: a fresh interpreter, as a server's workers are; the timeout turns the old hang
    # (a result the pool could not unpickle) into a failure.
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        pending = pool.map_async(_raise_in_worker, [kind])
        with pytest.raises(cls) as info:
            pending.get(timeout=120)
    assert type(info.value) is cls
    assert getattr(info.value, field) == value
    expected = str(_local(kind))
    assert str(info.value) == expected


def _local(kind: str) -> BaseException:
    try:
        _raise_in_worker(kind)
    except AttnDispatchError as exc:
        return exc
    raise AssertionError("unreachable")
