"""bind(): every reason of every phase, unknown names with suggestions, one backend per name,
options routed to factories, factory failures, and immutable Bindings."""

from __future__ import annotations

from typing import Any

import pytest

from attn_dispatch import AttnConfig
from attn_dispatch import AttnDispatchError
from attn_dispatch import BackendSpec
from attn_dispatch import BackendUnavailableError
from attn_dispatch import Binding
from attn_dispatch import Capabilities
from attn_dispatch import IncompatibleBackendError
from attn_dispatch import InvalidSpecError
from attn_dispatch import Phase
from attn_dispatch import Runner
from attn_dispatch import UnknownBackendError
from attn_dispatch import bind
from attn_dispatch import register_backend
from tests.strategies import ANY_CAPS
from tests.strategies import MHA_ONLY_CAPS
from tests.strategies import EchoBackend
from tests.strategies import echo_factory
from tests.strategies import mha_config
from tests.strategies import mla_config
from tests.strategies import register_echo

pytestmark = pytest.mark.usefixtures("registry_snapshot")


def test_bind_uniform() -> None:
    register_echo("e1")
    b = bind("e1", mha_config(), label="target")
    assert isinstance(b, Binding) and isinstance(b, Runner)
    assert b.attn_binding is b
    assert b.label == "target" and b.spec == BackendSpec.uniform("e1")
    assert len(b.backends) == 1
    backend = b.backends["e1"]
    assert all(b.backend(p) is backend for p in Phase)
    assert backend.handler_calls == list(Phase)  # handlers precomputed once per phase at bind
    assert [b.handler(p).phase for p in Phase] == list(Phase)
    assert b.table() == [("prefill", "e1"), ("decode", "e1"), ("verify", "e1")]
    assert "'target'" in repr(b) and "e1" in repr(b)


def test_one_backend_object_per_distinct_name() -> None:
    made: list[str] = []

    def counting(name: str) -> Any:
        def make(config: AttnConfig, **options: Any) -> EchoBackend:
            made.append(name)
            return EchoBackend(config, name=name)

        return make

    register_backend("pa", capabilities=ANY_CAPS, factory=counting("pa"))
    register_backend("pb", capabilities=ANY_CAPS, factory=counting("pb"))
    spec = BackendSpec("pa", "pb", verify_mode="decode")
    b = bind(spec, mha_config())
    assert sorted(made) == ["pa", "pb"]
    assert b.backend(Phase.DECODE) is b.backend(Phase.VERIFY) is b.backends["pb"]
    assert b.backend(Phase.PREFILL) is b.backends["pa"]
    assert b.backend_name(Phase.VERIFY) == "pb"
    assert b.handler(Phase.VERIFY).instance == b.backends["pb"].instance
    # Two bindings of the same spec never share backend objects.
    b2 = bind(spec, mha_config())
    assert b2.backends["pa"] is not b.backends["pa"]


def test_options_routed_to_factories() -> None:
    register_echo("oa")
    register_echo("ob")
    b = bind(
        "prefill=oa,decode=ob",
        mha_config(),
        options={"oa": {"split": 4}, "ob": {"workspace": 1 << 20}},
    )
    assert b.backends["oa"].options == {"split": 4}
    assert b.backends["ob"].options == {"workspace": 1 << 20}
    with pytest.raises(InvalidSpecError) as info:
        bind("oa", mha_config(), options={"ob": {"x": 1}})
    assert info.value.field == "options" and info.value.value == ["ob"]
    assert "does not use" in str(info.value) and "['oa']" in str(info.value)


def test_collects_every_reason_of_every_phase() -> None:
    register_backend(
        "mha_dec",
        capabilities=Capabilities(kinds={"mha"}, phases={Phase.DECODE}, dtypes={"float16"}),
        factory=echo_factory("mha_dec"),
    )
    made: list[str] = []
    register_backend("ok", capabilities=ANY_CAPS, factory=lambda c, **o: made.append("ok"))
    spec = BackendSpec("mha_dec", "mha_dec", verify="ok")
    config = mla_config()
    with pytest.raises(IncompatibleBackendError) as info:
        bind(spec, config, label="target")
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, AttnDispatchError)
    assert err.label == "target" and err.config is config
    assert set(err.reasons) == {Phase.PREFILL, Phase.DECODE}  # verify -> "ok" is fine
    pre_name, pre = err.reasons[Phase.PREFILL]
    dec_name, dec = err.reasons[Phase.DECODE]
    assert pre_name == dec_name == "mha_dec"
    assert len(pre) == 4 and len(dec) == 3  # prefill also lacks the phase
    assert any("phase 'prefill' is not implemented" in r for r in pre)
    for reasons in (pre, dec):
        assert any("kind 'mla'" in r for r in reasons)
        assert any("dtype 'bfloat16'" in r for r in reasons)
        assert any("kv_dtype 'bfloat16'" in r for r in reasons)
    msg = str(err)
    assert msg.startswith("cannot bind attention backends for runner 'target':")
    assert "  - prefill -> 'mha_dec': kind 'mla' is not supported" in msg
    assert "  - decode -> 'mha_dec': kind 'mla' is not supported" in msg
    assert "verify" not in msg.split("\n", 1)[1].split("Choose")[0]
    assert "python -m attn_dispatch list" in msg
    assert made == []  # no factory runs when any phase is refused


def test_incompatible_without_label() -> None:
    register_echo("mhaonly", MHA_ONLY_CAPS)
    with pytest.raises(IncompatibleBackendError) as info:
        bind("mhaonly", mla_config())
    assert info.value.label is None
    assert "for this runner:" in str(info.value)
    assert set(info.value.reasons) == set(Phase)


def test_unknown_backend_suggests_and_lists() -> None:
    register_echo("kernelbox_mla")
    register_echo("kernelbox")
    with pytest.raises(UnknownBackendError) as info:
        bind("prefill=torch,decode=kernelbx", mha_config(), label="draft")
    err = info.value
    assert isinstance(err, KeyError) and isinstance(err, AttnDispatchError)
    assert err.name == "kernelbx"
    assert err.suggestions[0] == "kernelbox" and "kernelbox_mla" in err.suggestions
    assert {"torch", "kernelbox", "kernelbox_mla"} <= set(err.registered)
    assert list(err.registered) == sorted(err.registered)
    msg = str(err)
    assert msg.startswith("runner 'draft', phase 'decode': unknown attention backend 'kernelbx'.")
    assert "Did you mean 'kernelbox'" in msg
    assert "Registered backends: " in msg and "'torch'" in msg
    assert "register_backend" in msg


def test_unknown_backend_without_close_match() -> None:
    with pytest.raises(UnknownBackendError) as info:
        bind("zzzzzz", mha_config())
    assert info.value.suggestions == ()
    assert "Did you mean" not in str(info.value)
    assert "phase 'prefill'" in str(info.value)


def test_factory_failure_is_backend_unavailable() -> None:
    def bad(config: AttnConfig, **options: Any) -> Any:
        raise OSError("libcuda.so not found")

    register_backend("badf", capabilities=ANY_CAPS, factory=bad)
    with pytest.raises(BackendUnavailableError) as info:
        bind("badf", mha_config(), label="t")
    err = info.value
    assert isinstance(err, RuntimeError) and isinstance(err, AttnDispatchError)
    assert err.name == "badf"
    assert "its factory failed for runner 't'" in err.reason
    assert "OSError: libcuda.so not found" in err.reason
    assert isinstance(err.__cause__, OSError)
    assert str(err).startswith("attention backend 'badf' is unavailable:")


def test_factory_own_error_passes_through() -> None:
    def refuses(config: AttnConfig, **options: Any) -> Any:
        raise BackendUnavailableError("pick", "not built: run the build")

    register_backend("pick", capabilities=ANY_CAPS, factory=refuses)
    with pytest.raises(BackendUnavailableError) as info:
        bind("pick", mha_config())
    assert info.value.reason == "not built: run the build"


@pytest.mark.parametrize(
    ("spec", "config", "field"),
    [
        (42, mha_config(), "spec"),
        ("torch", {"kind": "mha"}, "config"),
        ("a,b", mha_config(), "spec"),
    ],
)
def test_bind_argument_errors(spec: Any, config: Any, field: str) -> None:
    with pytest.raises(InvalidSpecError) as info:
        bind(spec, config)
    assert info.value.field == field


def test_binding_is_immutable() -> None:
    register_echo("imm")
    b = bind("imm", mha_config())
    with pytest.raises(AttributeError, match="immutable"):
        b.label = "x"  # type: ignore[misc]
    with pytest.raises(AttributeError, match="immutable"):
        b._handlers = ()  # type: ignore[misc]
    with pytest.raises(AttributeError, match="immutable"):
        del b.spec
    with pytest.raises(TypeError):
        b.backends["other"] = None  # type: ignore[index]
    with pytest.raises(TypeError, match="bind"):
        Binding()
    assert not hasattr(b, "__dict__")
    assert b.label is None and b.spec == BackendSpec.uniform("imm")


def test_bind_torch_reference_for_mla_and_mha() -> None:
    pytest.importorskip("torch")
    for config in (mla_config(), mha_config()):
        b = bind("torch", config)
        assert b.backend(Phase.DECODE).name == "torch"
        assert callable(b.handler(Phase.VERIFY))
