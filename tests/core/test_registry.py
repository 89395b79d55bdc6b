"""The registry: decorator form, dotted factories imported at bind, duplicates, thread safety,
lazy entry-point plugins, and bindings that never see later registry changes."""

from __future__ import annotations

import importlib.metadata
import sys
import textwrap
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest

import attn_dispatch
from attn_dispatch import AttnConfig
from attn_dispatch import AttnDispatchError
from attn_dispatch import BackendSpec
from attn_dispatch import BackendUnavailableError
from attn_dispatch import DuplicateBackendError
from attn_dispatch import InvalidSpecError
from attn_dispatch import Phase
from attn_dispatch import UnknownBackendError
from attn_dispatch import _env
from attn_dispatch import _registry
from attn_dispatch import bind
from attn_dispatch.backend import Capabilities
from attn_dispatch.backend import list_backends
from attn_dispatch.backend import register_backend
from attn_dispatch.backend import unregister_backend
from tests.strategies import ANY_CAPS
from tests.strategies import MHA_ONLY_CAPS
from tests.strategies import EchoBackend
from tests.strategies import EchoHandler
from tests.strategies import echo_factory
from tests.strategies import mha_config
from tests.strategies import register_echo

pytestmark = pytest.mark.usefixtures("registry_snapshot")

WAIT = 30.0  # seconds: a thread test fails instead of hanging


def join_all(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(WAIT)
    assert not any(t.is_alive() for t in threads), "a thread did not finish (hung?)"


def test_builtin_reference_is_registered() -> None:
    backends = list_backends()
    assert "torch" in backends
    assert list(backends) == sorted(backends)
    assert backends["torch"].kinds == frozenset({"mha", "mla"})


def test_decorator_form_returns_the_factory() -> None:
    @register_backend("deco", capabilities=ANY_CAPS)
    def make(config: AttnConfig, **options: Any) -> EchoBackend:
        return EchoBackend(config, name="deco")

    assert callable(make) and make.__name__ == "make"  # the function itself, undecorated
    assert list_backends()["deco"] is ANY_CAPS
    b = bind("deco", mha_config())
    assert isinstance(b.backend(Phase.DECODE), EchoBackend)


def test_plain_form_returns_the_factory() -> None:
    f = echo_factory("plain")
    assert register_backend("plain", capabilities=ANY_CAPS, factory=f) is f
    assert "plain" in list_backends()


def test_duplicate_raises_unless_replace() -> None:
    register_echo("dup")
    with pytest.raises(DuplicateBackendError) as info:
        register_echo("dup", MHA_ONLY_CAPS)
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, AttnDispatchError)
    assert err.name == "dup"
    assert "'dup' is already registered" in str(err) and "replace=True" in str(err)
    assert list_backends()["dup"] is ANY_CAPS  # unchanged by the refused registration
    register_echo("dup", MHA_ONLY_CAPS, replace=True)
    assert list_backends()["dup"] is MHA_ONLY_CAPS
    with pytest.raises(DuplicateBackendError):  # built-ins are protected too
        register_echo("torch")


@pytest.mark.parametrize(
    ("kwargs", "field", "words"),
    [
        (dict(name="", capabilities=ANY_CAPS, factory=echo_factory("x")), "name", "non-empty"),
        (dict(name="a,b", capabilities=ANY_CAPS, factory=echo_factory("x")), "name", "','"),
        (dict(name="a b", capabilities=ANY_CAPS, factory=echo_factory("x")), "name", "word"),
        (
            dict(name="x", capabilities={"kinds": {"mha"}}, factory=echo_factory("x")),
            "capabilities",
            "Capabilities instance",
        ),
        (
            dict(name="x", capabilities=ANY_CAPS, factory="pkg.module.attr"),
            "factory",
            "module:attr",
        ),
        (dict(name="x", capabilities=ANY_CAPS, factory=42), "factory", "callable"),
    ],
)
def test_register_rejects(kwargs: dict[str, Any], field: str, words: str) -> None:
    before = set(list_backends())
    with pytest.raises(InvalidSpecError) as info:
        register_backend(**kwargs)
    assert info.value.field == field
    assert words in str(info.value)
    assert set(list_backends()) == before


def test_unregister() -> None:
    register_echo("gone")
    binding = bind("gone", mha_config())
    unregister_backend("gone")
    assert "gone" not in list_backends()
    assert binding.handler(Phase.DECODE)(None, None, None, None, 1.0)[0] == "gone"
    with pytest.raises(UnknownBackendError) as info:
        unregister_backend("gone")
    assert info.value.name == "gone" and isinstance(info.value, KeyError)


# -- dotted factories ---------------------------------------------------------------------------


def _write_module(tmp_path: Path, name: str, log: Path, body: str = "") -> None:
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            f"""
            from pathlib import Path
            Path({str(log)!r}).open("a").write(__name__ + "\\n")  # records each import

            from tests.strategies import EchoBackend

            def make(config, **options):
                return EchoBackend(config, name="lazy", **options)
            """
        )
        + textwrap.dedent(body)
    )


def test_dotted_factory_imported_only_at_bind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "imports.log"
    mod = "attn_dispatch_test_lazy_factory"
    _write_module(tmp_path, mod, log)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, mod, raising=False)

    register_backend("lazy", capabilities=ANY_CAPS, factory=f"{mod}:make")
    list_backends()
    assert not log.exists() and mod not in sys.modules  # registering imports nothing

    binding = bind("lazy", mha_config(), options={"lazy": {"flavour": "x"}})
    assert log.read_text() == f"{mod}\n"
    assert binding.backend(Phase.PREFILL).options == {"flavour": "x"}
    bind("lazy", mha_config())
    assert log.read_text() == f"{mod}\n"  # imported once, then cached by Python
    monkeypatch.delitem(sys.modules, mod)


def test_dotted_factory_nested_attribute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = "attn_dispatch_test_nested_factory"
    _write_module(tmp_path, mod, tmp_path / "log", "class Holder:\n    make = staticmethod(make)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    register_backend("nested", capabilities=ANY_CAPS, factory=f"{mod}:Holder.make")
    assert isinstance(bind("nested", mha_config()).backend(Phase.DECODE), EchoBackend)
    monkeypatch.delitem(sys.modules, mod)


@pytest.mark.parametrize(
    ("factory", "words"),
    [
        ("attn_dispatch_no_such_module:make", "ModuleNotFoundError"),
        ("attn_dispatch._spec:no_such_attr", "AttributeError"),
        ("attn_dispatch._spec:VerifyMode.__name__", "is not callable"),
    ],
)
def test_dotted_factory_that_cannot_load(factory: str, words: str) -> None:
    register_backend("broken", capabilities=ANY_CAPS, factory=factory)
    with pytest.raises(BackendUnavailableError) as info:
        bind("broken", mha_config())
    err = info.value
    assert isinstance(err, RuntimeError) and isinstance(err, AttnDispatchError)
    assert err.name == "broken"
    assert words in err.reason and repr(factory) in str(err)


# -- bindings are snapshots --------------------------------------------------------------------


def test_registry_change_never_alters_a_binding() -> None:
    register_echo("snap")
    config = mha_config()
    binding = bind(BackendSpec.parse("prefill=snap,decode=torch"), config, label="t")
    handlers = [binding.handler(p) for p in Phase]
    backends = dict(binding.backends)
    caps = binding.capabilities("snap")

    register_backend(
        "snap", capabilities=MHA_ONLY_CAPS, factory=echo_factory("other"), replace=True
    )
    unregister_backend("torch")
    register_echo("torch", replace=False)  # a different "torch" now

    assert [binding.handler(p) for p in Phase] == handlers
    assert all(binding.handler(p) is h for p, h in zip(Phase, handlers, strict=True))
    assert dict(binding.backends) == backends
    assert binding.capabilities("snap") is caps is ANY_CAPS
    out = binding.handler(Phase.PREFILL)(None, None, None, None, 1.0)
    assert out[0] == "snap"
    # A new bind sees the new registry.
    fresh = bind(BackendSpec.parse("prefill=snap,decode=torch"), config)
    # The binding hands out the backend's handler behind the core's call checks.
    assert isinstance(fresh.handler(Phase.PREFILL).__wrapped__, EchoHandler)
    assert fresh.handler(Phase.PREFILL).backend == "other"
    assert fresh.handler(Phase.DECODE).backend == "torch"


# -- threads -------------------------------------------------------------------------------------


def test_thread_safe_registration() -> None:
    n_threads, per_thread = 16, 25
    start = threading.Barrier(n_threads)
    errors: list[BaseException] = []
    dup_errors: list[DuplicateBackendError] = []

    def work(t: int) -> None:
        try:
            start.wait(timeout=WAIT)
            for i in range(per_thread):
                register_echo(f"thr{t}_{i}")
                try:
                    register_echo("contended")  # exactly one thread wins
                except DuplicateBackendError as exc:
                    dup_errors.append(exc)
                list_backends()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    join_all(threads)
    assert errors == []
    names = set(list_backends())
    assert {f"thr{t}_{i}" for t in range(n_threads) for i in range(per_thread)} <= names
    assert "contended" in names
    assert len(dup_errors) == n_threads * per_thread - 1


# -- entry points -------------------------------------------------------------------------------

GOOD_PLUGIN = """
from tests.strategies import ANY_CAPS, echo_factory

def register(registry):  # a register function may take the registry being loaded
    registry.register("plugged", capabilities=ANY_CAPS, factory=echo_factory("plugged"))
"""


def fake_distribution(
    tmp_path: Path, name: str, version: str, entry_points: str
) -> importlib.metadata.EntryPoints:
    """The entry points of a distribution installed nowhere but in ``tmp_path`` (a
    ``.dist-info`` with METADATA and entry_points.txt), so that each knows its distribution."""
    info = tmp_path / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[{_registry.ENTRY_POINT_GROUP}]\n{entry_points}")
    return importlib.metadata.PathDistribution(info).entry_points


def use_entry_points(
    monkeypatch: pytest.MonkeyPatch, *groups: importlib.metadata.EntryPoints
) -> list[str]:
    """Make these the only installed entry points; returns the log of the groups asked for."""
    eps = importlib.metadata.EntryPoints([ep for group in groups for ep in group])
    calls: list[str] = []

    def entry_points(**kw: Any) -> importlib.metadata.EntryPoints:
        calls.append(kw.get("group", ""))
        return eps.select(**kw)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    return calls


@pytest.fixture
def fake_plugins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[str], _registry.Registry]:
    """Two entry points (a register function of distribution adt-good 1.2.3, and a broken
    one), and a fresh Registry of our own that has not loaded anything yet (the process-wide
    one is left alone)."""
    (tmp_path / "adt_good_plugin.py").write_text(GOOD_PLUGIN)
    (tmp_path / "adt_broken_plugin.py").write_text("raise ImportError('needs libfoo.so')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(_env.PLUGINS, raising=False)
    good = fake_distribution(tmp_path, "adt-good", "1.2.3", "plugged = adt_good_plugin:register\n")
    group = _registry.ENTRY_POINT_GROUP
    broken = importlib.metadata.EntryPoint("fancy", "adt_broken_plugin:register", group)
    calls = use_entry_points(monkeypatch, good, importlib.metadata.EntryPoints([broken]))
    for m in ("adt_good_plugin", "adt_broken_plugin"):
        monkeypatch.delitem(sys.modules, m, raising=False)
    return calls, _registry.Registry()


def test_entry_points_load_lazily_once(fake_plugins: tuple[list[str], _registry.Registry]) -> None:
    calls, reg = fake_plugins
    assert calls == []  # nothing loaded until the registry is used
    assert "adt_good_plugin" not in sys.modules
    with pytest.warns(RuntimeWarning) as rec:
        names = set(reg.list())
    assert calls == [_registry.ENTRY_POINT_GROUP]
    assert {"torch", "plugged"} <= names
    assert "fancy" not in names
    assert "plugged" not in list_backends()  # our registry only, not the process-wide one
    (w,) = [w for w in rec if "fancy" in str(w.message)]
    assert "'fancy'" in str(w.message) and "ImportError: needs libfoo.so" in str(w.message)
    assert "adt_broken_plugin:register" in str(w.message)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second use neither reloads nor warns again
        reg.list()
        bind("plugged", mha_config(), registry=reg)
        reg.register("after_plugins", capabilities=ANY_CAPS, factory=echo_factory("a"))
    assert calls == [_registry.ENTRY_POINT_GROUP]


def test_broken_plugin_error_in_unknown_backend(
    fake_plugins: tuple[list[str], _registry.Registry],
) -> None:
    _, reg = fake_plugins
    with pytest.warns(RuntimeWarning):
        reg.list()
    with pytest.raises(UnknownBackendError) as info:
        bind("fancy", mha_config(), registry=reg)
    msg = str(info.value)
    assert "unknown attention backend 'fancy'" in msg
    assert "a plugin named 'fancy' failed to load: ImportError: needs libfoo.so" in msg
    assert reg.plugin_errors == {"fancy": "ImportError: needs libfoo.so"}


def test_plugin_loading_is_thread_safe(fake_plugins: tuple[list[str], _registry.Registry]) -> None:
    # Many threads race to the first use: the plugins load once, all see them.
    calls, reg = fake_plugins
    seen: list[set[str]] = []
    start = threading.Barrier(8)

    def first_use() -> None:
        start.wait(timeout=WAIT)
        seen.append(set(reg.list()))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        threads = [threading.Thread(target=first_use) for _ in range(8)]
        for t in threads:
            t.start()
        join_all(threads)
    assert calls == [_registry.ENTRY_POINT_GROUP]
    assert len(seen) == 8 and all({"plugged", "torch"} <= s for s in seen)


def test_registries_are_independent() -> None:
    a = _registry.Registry(builtins=False, plugins=False)
    b = _registry.Registry(builtins=False, plugins=False)
    a.register("only-a", capabilities=ANY_CAPS, factory=echo_factory("only-a"))
    assert "only-a" in a and "only-a" not in b and "only-a" not in list_backends()
    assert list(b.list()) == []
    with pytest.raises(DuplicateBackendError):
        a.register("only-a", capabilities=ANY_CAPS, factory=echo_factory("x"))
    a.unregister("only-a")
    assert list(a.list()) == []
    assert "not loaded yet" in repr(_registry.Registry())


def test_module_functions_use_the_default_registry() -> None:
    register_echo("via-module")
    assert "via-module" in _registry.DEFAULT_REGISTRY
    assert _registry.get_backend("via-module").name == "via-module"
    unregister_backend("via-module")
    assert "via-module" not in _registry.DEFAULT_REGISTRY


def test_capabilities_object_is_kept() -> None:
    caps = Capabilities(kinds={"mha"}, description="mine")
    register_backend("keep", capabilities=caps, factory=echo_factory("keep"))
    assert list_backends()["keep"] is caps


def test_cli_list_shows_failed_plugins(
    fake_plugins: tuple[list[str], _registry.Registry], capsys: pytest.CaptureFixture[str]
) -> None:
    from attn_dispatch.cli import main

    with pytest.warns(RuntimeWarning):
        assert main(["list"], registry=fake_plugins[1]) == 0
    lines = capsys.readouterr().out.splitlines()
    (row,) = [line for line in lines if line.startswith("fancy ")]
    assert "no: plugin failed to load: ImportError: needs libfoo.so" in row
    assert any(line.startswith("plugged ") and line.endswith("yes") for line in lines)


# -- one plugin shape, host control, distributions (issue 46) -----------------------------------


def test_each_name_records_its_distribution(
    fake_plugins: tuple[list[str], _registry.Registry],
) -> None:
    _, reg = fake_plugins
    with pytest.warns(RuntimeWarning):
        assert reg.origin("plugged") == _registry.Origin("adt-good", "1.2.3", "plugged")
    assert reg.origin("torch") == _registry.Origin("attn_dispatch", attn_dispatch.__version__)
    assert reg.plugin_origins["fancy"] == _registry.Origin(None, None, "fancy")  # no metadata
    reg.register("at_run_time", capabilities=ANY_CAPS, factory=echo_factory("r"))
    assert reg.origin("at_run_time") is None
    reg.register("plugged", capabilities=ANY_CAPS, factory=echo_factory("p"), replace=True)
    assert reg.origin("plugged") is None  # replaced by code: no longer the plugin's
    with pytest.raises(UnknownBackendError):
        reg.origin("never_registered")


REFUSED_SHAPES = """
from attn_dispatch.backend import BackendEntry, register_backend
from tests.strategies import ANY_CAPS, echo_factory

CALLED = []
ENTRY = BackendEntry("entry_plugged", ANY_CAPS, echo_factory("entry_plugged"))

def zero():
    CALLED.append("zero")
    register_backend("zero_plugged", capabilities=ANY_CAPS, factory=echo_factory("zero"))

def two(registry, extra):
    CALLED.append("two")

NOT_CALLABLE = {"name": "dict_plugged"}
"""


@pytest.mark.parametrize(
    ("attr", "words"),
    [
        ("ENTRY", "gave a BackendEntry ('entry_plugged'), which is not accepted"),
        ("zero", "taking no positional arguments, not one"),
        ("two", "taking 2 positional arguments, not one"),
        ("NOT_CALLABLE", "gave a dict, not a function"),
    ],
)
def test_other_plugin_shapes_are_refused_with_the_one_shape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, attr: str, words: str
) -> None:
    # Before: a BackendEntry and a zero-argument function were loaded; now only
    # register(registry) is, and the refusal says so without calling the plugin.
    (tmp_path / "adt_shapes_plugin.py").write_text(REFUSED_SHAPES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "adt_shapes_plugin", raising=False)
    monkeypatch.delenv(_env.PLUGINS, raising=False)
    eps = fake_distribution(tmp_path, "adt-shapes", "0.3", f"odd = adt_shapes_plugin:{attr}\n")
    use_entry_points(monkeypatch, eps)
    before = set(list_backends())
    reg = _registry.Registry(builtins=False)
    with pytest.warns(RuntimeWarning, match="'odd'"):
        assert reg.list() == {}
    error = reg.plugin_errors["odd"]
    assert error.startswith("TypeError: ") and words in error, error
    assert error.endswith(_registry.PLUGIN_SHAPE)
    assert "register(registry)" in _registry.PLUGIN_SHAPE
    assert sys.modules["adt_shapes_plugin"].CALLED == []
    assert set(list_backends()) == before  # nothing leaked into the default registry
    assert reg.plugin_origins["odd"] == _registry.Origin("adt-shapes", "0.3", "odd")


def _loaded(reg: _registry.Registry) -> set[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fancy's failure, where it is allowed to load
        return set(reg.list())


def test_registry_allow_and_block_choose_the_entry_points(
    fake_plugins: tuple[list[str], _registry.Registry],
) -> None:
    allowed = _registry.Registry(builtins=False, allow={"plugged"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # fancy is never imported, so never fails
        assert set(allowed.list()) == {"plugged"}
    assert "adt_broken_plugin" not in sys.modules
    assert allowed.plugins_blocked == {"fancy": "not in Registry(allow=['plugged'])"}
    assert allowed.plugin_errors == {}

    blocked = _registry.Registry(builtins=False, block={"plugged"})
    assert _loaded(blocked) == set()
    assert blocked.plugins_blocked == {"plugged": "blocked by Registry(block=['plugged'])"}
    assert set(blocked.plugin_errors) == {"fancy"}
    with pytest.raises(UnknownBackendError) as info:
        blocked.get("plugged")
    assert "a plugin named 'plugged' was not loaded: blocked by Registry(block=" in str(info.value)

    none = _registry.Registry(builtins=False, allow=set())
    assert _loaded(none) == set() and set(none.plugins_blocked) == {"plugged", "fancy"}


@pytest.mark.parametrize(
    ("value", "loads", "left_out"),
    [
        ("plugged", {"plugged"}, {"fancy"}),
        (" plugged , fancy ", {"plugged"}, set()),  # fancy loads, and fails
        ("", set(), {"plugged", "fancy"}),
        ("none", set(), {"plugged", "fancy"}),
        (",", set(), {"plugged", "fancy"}),
    ],
)
def test_env_var_allows_entry_points_by_name(
    fake_plugins: tuple[list[str], _registry.Registry],
    monkeypatch: pytest.MonkeyPatch,
    value: str,
    loads: set[str],
    left_out: set[str],
) -> None:
    monkeypatch.setenv(_env.PLUGINS, value)
    reg = _registry.Registry(builtins=False)
    assert _loaded(reg) == loads
    assert set(reg.plugins_blocked) == left_out
    for reason in reg.plugins_blocked.values():
        assert reason == f"not allowed by ATTN_DISPATCH_PLUGINS={value!r}"
    assert ("adt_good_plugin" in sys.modules) == ("plugged" in loads)


def test_env_var_and_options_must_both_allow(
    fake_plugins: tuple[list[str], _registry.Registry], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(_env.PLUGINS, "plugged,fancy")
    reg = _registry.Registry(builtins=False, block={"fancy"})
    assert _loaded(reg) == {"plugged"} and reg.plugin_errors == {}
    monkeypatch.setenv(_env.PLUGINS, "fancy")
    reg = _registry.Registry(builtins=False, allow={"plugged"})
    assert _loaded(reg) == set()
    assert reg.plugins_blocked == {
        "plugged": "not allowed by ATTN_DISPATCH_PLUGINS='fancy'",
        "fancy": "not in Registry(allow=['plugged'])",
    }


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"allow": "plugged"}, "allow"), ({"block": "x"}, "block"), ({"block": [""]}, "block")],
)
def test_allow_and_block_take_sets_of_names(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidSpecError) as info:
        _registry.Registry(**kwargs)
    assert info.value.field == field and "entry-point names" in str(info.value)


def test_cli_list_shows_distributions_and_left_out_plugins(
    fake_plugins: tuple[list[str], _registry.Registry],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from attn_dispatch.cli import main

    monkeypatch.setenv(_env.PLUGINS, "plugged")
    reg = _registry.Registry()
    reg.register("at_run_time", capabilities=ANY_CAPS, factory=echo_factory("r"))
    assert main(["list"], registry=reg) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows["plugged"][5:8] == ["adt-good", "1.2.3", "yes"]
    assert rows["torch"][5:8] == ["attn_dispatch", attn_dispatch.__version__, "yes"]
    assert rows["at_run_time"][5:8] == ["-", "-", "yes"]
    assert " ".join(rows["fancy"][5:]) == (
        "- - no: plugin not loaded: not allowed by ATTN_DISPATCH_PLUGINS='plugged'"
    )
