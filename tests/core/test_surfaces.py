"""The two public surfaces: ``attn_dispatch`` (what a framework calls) and
``attn_dispatch.backend`` (what a backend author needs). Sorted ``__all__``; every public
class and function names its public module (reprs, docs and pickles never show a private
path); the 0.1 top-level names are gone in 0.2.0 (no compatibility layer), and our own
DeprecationWarnings fail the tests."""

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
# Exported by both surfaces, the same objects; they report the framework one (model code
# compares attention_form() with AttnForm; a backend builds on AttnConfig and Phase and raises
# the errors its callers catch from attn_dispatch).
SHARED = dict.fromkeys(
    ("AttnConfig", "AttnForm", "BackendUnavailableError", "IncompatibleBackendError",
     "InvalidBatchError", "InvalidSpecError", "Phase"),
    "attn_dispatch",
)  # fmt: skip


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
    if name.isupper():  # a constant (COMPUTE_DTYPES): a value, no module of its own
        assert not callable(obj) and isinstance(obj, tuple | frozenset), (name, obj)
        return
    obj = getattr(obj, "__func__", obj)  # register_backend: a bound method
    if name in SHARED:  # the very object the framework surface exports
        assert obj is getattr(attn_dispatch, name)
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
def test_the_0_1_top_level_names_are_gone(name: str, home: str) -> None:
    # 0.2.0 keeps no compatibility layer: the name lives only in its home.
    assert name not in attn_dispatch.__all__
    with pytest.raises(AttributeError, match=name):
        getattr(attn_dispatch, name)
    with pytest.raises(ImportError):
        exec(f"from attn_dispatch import {name}", {})
    assert getattr(importlib.import_module(home), name) is not None


def test_backend_spec_has_no_sglang_constructor() -> None:
    # SGLang's rules live with its integration only (the 0.1 classmethod was patched on).
    assert not hasattr(BackendSpec, "from_server_args")


def test_our_deprecation_warnings_fail_the_tests_and_others_do_not() -> None:
    # pyproject's filterwarnings: attributed to a module of this package, or worded as ours.
    with pytest.raises(DeprecationWarning):
        warnings.warn_explicit("old", DeprecationWarning, "x.py", 1, module="attn_dispatch._spec")
    with pytest.raises(DeprecationWarning):
        warnings.warn("attn_dispatch.x moved to attn_dispatch.y", DeprecationWarning, stacklevel=1)
    with pytest.warns(DeprecationWarning):  # a third party's: still only a warning
        warnings.warn_explicit("old", DeprecationWarning, "x.py", 1, module="torch.nn")


@pytest.mark.parametrize("surface", sorted(SURFACES))
def test_unknown_names_raise_attribute_error(surface: str) -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        getattr(SURFACES[surface], "no_such_name")  # noqa: B009


def test_one_version_source() -> None:
    # pyproject reads the version from _version.py (0.1 kept two copies that disagreed with
    # the changelog); the build's metadata and attn_dispatch.__version__ are one value.
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = Path(attn_dispatch.__file__).resolve().parents[1] / "pyproject.toml"
    project = tomllib.loads(pyproject.read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    dynamic = project["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "attn_dispatch._version.__version__"}
    assert attn_dispatch.__version__ == "0.2.0"
