"""The two public surfaces: ``attn_dispatch`` (what a framework calls) and
``attn_dispatch.backend`` (what a backend author needs). Sorted ``__all__``; every public
class and function names its public module (reprs, docs and pickles never show a private
path); the old top-level names still work for one release, with a DeprecationWarning that
names the new place."""

from __future__ import annotations

import importlib
import pickle
import warnings

import pytest

import attn_dispatch
import attn_dispatch.backend as backend_surface
from attn_dispatch import AttnConfig
from attn_dispatch import BackendSpec
from attn_dispatch import Phase

SURFACES = {"attn_dispatch": attn_dispatch, "attn_dispatch.backend": backend_surface}
# Exported by both surfaces; reports the framework one (model code compares
# attention_form() with it).
SHARED = {"AttnForm": "attn_dispatch"}


@pytest.mark.parametrize("name", sorted(SURFACES))
def test_all_is_sorted_and_unique(name: str) -> None:
    names = SURFACES[name].__all__
    assert names == sorted(names) and len(set(names)) == len(names)


@pytest.mark.parametrize(
    ("surface", "name"),
    [(s, n) for s, mod in sorted(SURFACES.items()) for n in mod.__all__],
)
def test_every_public_name_reports_its_public_module(surface: str, name: str) -> None:
    obj = getattr(SURFACES[surface], name)  # lazy ones (torch) load here
    obj = getattr(obj, "__func__", obj)  # register_backend: a bound method
    assert obj.__module__ == SHARED.get(name, surface), (surface, name, obj.__module__)


def test_the_framework_surface_holds_what_a_framework_calls() -> None:
    # The design's list (DESIGN.md, "Vocabulary"); the backend author's names live apart.
    core = {"Phase", "BackendSpec", "AttnConfig", "AttnBatch", "bind", "Binding", "Route",
            "attn_scope", "attention", "resolve", "current_binding", "record_dispatch",
            "merge_state", "merge_states", "AttnDispatchError"}  # fmt: skip
    assert core <= set(attn_dispatch.__all__)
    authors = {"Capabilities", "PlanBase", "issue_plan", "check_plan", "Registry",
               "register_backend", "unregister_backend", "list_backends", "FormPolicy",
               "BackendBase", "Handler", "AttentionBackend"}  # fmt: skip
    assert authors <= set(backend_surface.__all__)
    assert not authors & set(attn_dispatch.__all__)


def test_a_pickled_spec_names_the_public_module_only() -> None:
    spec = BackendSpec.parse("prefill=torch,decode=native")
    data = pickle.dumps(spec)
    assert b"attn_dispatch" in data and b"_spec" not in data
    assert pickle.loads(data) == spec
    cfg = AttnConfig("mha", 4, 2, 64, dtype="float32")
    for value in (cfg, Phase.VERIFY):
        data = pickle.dumps(value)
        assert b"attn_dispatch._" not in data, data
        assert pickle.loads(data) == value
    assert repr(BackendSpec).startswith("<class 'attn_dispatch.BackendSpec'")


MOVED = [
    ("Capabilities", "attn_dispatch.backend"),
    ("BackendBase", "attn_dispatch.backend"),
    ("PlanBase", "attn_dispatch.backend"),
    ("issue_plan", "attn_dispatch.backend"),
    ("check_plan", "attn_dispatch.backend"),
    ("Registry", "attn_dispatch.backend"),
    ("register_backend", "attn_dispatch.backend"),
    ("unregister_backend", "attn_dispatch.backend"),
    ("list_backends", "attn_dispatch.backend"),
    ("FormPolicy", "attn_dispatch.backend"),
    ("Handler", "attn_dispatch.backend"),
    ("ChunkedHandler", "attn_dispatch.backend"),
    ("AttentionBackend", "attn_dispatch.backend"),
    ("phase_of", "attn_dispatch.integrations.sglang"),
]


@pytest.mark.parametrize(("name", "home"), MOVED)
def test_old_top_level_names_warn_and_still_work(name: str, home: str) -> None:
    assert name not in attn_dispatch.__all__
    with pytest.warns(DeprecationWarning, match=rf"attn_dispatch\.{name} moved to {home}\.{name}"):
        old = getattr(attn_dispatch, name)
    assert old is getattr(importlib.import_module(home), name)


def test_from_import_of_an_old_name_warns_at_the_importing_line() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from attn_dispatch import Capabilities  # noqa: F401
    (w,) = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert w.filename == __file__  # stacklevel points at the user's import


def test_backend_spec_from_server_args_warns_and_gives_the_integrations_spec() -> None:
    from attn_dispatch.integrations.sglang import spec_from_server_args

    args = {"attention_backend": "triton", "decode_attention_backend": "flashinfer"}
    with pytest.warns(DeprecationWarning, match="integrations.sglang.spec_from_server_args"):
        old = BackendSpec.from_server_args(args, is_draft=True, speculative_algorithm="EAGLE")  # type: ignore[attr-defined]
    assert old == spec_from_server_args(args, is_draft=True, speculative_algorithm="EAGLE")


@pytest.mark.parametrize("surface", sorted(SURFACES))
def test_unknown_names_raise_attribute_error(surface: str) -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        getattr(SURFACES[surface], "no_such_name")  # noqa: B009
