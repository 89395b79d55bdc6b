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
from attn_dispatch import IncompatibleBackendError
from attn_dispatch import InvalidBatchError
from attn_dispatch import InvalidSpecError
from attn_dispatch import Phase
from attn_dispatch import Runner
from attn_dispatch import UnknownBackendError
from attn_dispatch import bind
from attn_dispatch.backend import BackendBase
from attn_dispatch.backend import Capabilities
from attn_dispatch.backend import FormPolicy
from attn_dispatch.backend import Registry
from attn_dispatch.backend import register_backend
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
    assert err.runner == "t"
    assert "its factory failed" in err.reason
    assert "OSError: libcuda.so not found" in err.reason
    assert isinstance(err.__cause__, OSError)
    assert str(err).startswith("attention backend 'badf' is unavailable for runner 't':")


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


# -- what a factory may build: each failure is ours, naming the backend and the runner ---------


class NoHandler:
    name = "nohandler"

    def plan(self, batch: Any) -> Any:
        return None


class HandlerRaises(BackendBase):
    name = "raises"

    def plan(self, batch: Any) -> Any:
        return None

    def handler(self, phase: Phase) -> Any:
        raise RuntimeError(f"no kernel for {phase.name}")


class HandlerNotCallable(BackendBase):
    name = "notcallable"

    def plan(self, batch: Any) -> Any:
        return None

    def handler(self, phase: Phase) -> Any:
        return 42


@pytest.mark.parametrize(
    ("factory", "words"),
    [
        (lambda config, **o: None, "returned NoneType, which is not an AttentionBackend"),
        (lambda config, **o: NoHandler(), "returned NoHandler, which is not an AttentionBackend"),
        (lambda config, **o: HandlerRaises(), "handler(PREFILL) failed: RuntimeError: no kernel"),
        (lambda config, **o: HandlerNotCallable(), "handler(PREFILL) returned int"),
    ],
    ids=["none", "no-handler", "handler-raises", "handler-not-callable"],
)
def test_bad_backend_objects_are_backend_unavailable(factory: Any, words: str) -> None:
    register_backend("odd", capabilities=ANY_CAPS, factory=factory)
    with pytest.raises(BackendUnavailableError) as info:
        bind("odd", mha_config(), label="target")
    err = info.value
    assert err.name == "odd" and err.runner == "target"
    assert words in str(err), str(err)
    assert "runner 'target'" in str(err)


def test_a_backend_base_subclass_without_plan_is_refused_at_bind() -> None:
    from attn_dispatch.backend import BackendBase

    class NoPlan(BackendBase):
        name = "noplan"

        def handler(self, phase: Any) -> Any:
            return lambda *a: None

    register_backend("noplan", capabilities=ANY_CAPS, factory=lambda config, **o: NoPlan())
    with pytest.raises(BackendUnavailableError) as info:
        bind("noplan", mha_config(), label="target")
    assert info.value.runner == "target"
    assert "returned NoPlan, which subclasses BackendBase but defines no plan(batch)" in str(
        info.value
    )


def test_missing_members_are_named() -> None:
    register_backend("odd2", capabilities=ANY_CAPS, factory=lambda config, **o: NoHandler())
    with pytest.raises(BackendUnavailableError) as info:
        bind("odd2", mha_config())
    assert "missing: handler, chunked_handler, update_plan, plans_in_place" in str(info.value)
    assert "BackendBase" in str(info.value)


def test_decompressed_factory_errors_are_wrapped() -> None:
    # The MLA binding builds a second object for the decompressed form: its failure is ours.
    calls: list[str] = []

    def factory(config: AttnConfig, **options: Any) -> Any:
        calls.append(config.kind)
        if config.kind == "mha":
            raise MemoryError("no room for the decompressed workspace")
        return EchoBackend(config, name="dec")

    caps = Capabilities(kinds={"mha", "mla"}, forms={"mla", "mha"})
    register_backend(
        "dec",
        capabilities=caps,
        factory=factory,
        form_policy=FormPolicy.decompressed_without_prefix(),
    )
    cfg = mla_config().replace(mha_head_dim=6, mha_v_head_dim=4)
    with pytest.raises(BackendUnavailableError) as info:
        bind("dec", cfg, label="target")
    assert calls == ["mla", "mha"]
    assert info.value.runner == "target"
    assert "its factory for the decompressed form failed: MemoryError" in str(info.value)


def test_one_registry_lookup_per_name() -> None:
    # A re-registration racing with bind must not mix two versions in one Binding: the
    # decompressed form is built by the same entry's factory as the absorbed one.
    made: list[str] = []

    def v1(config: AttnConfig, **options: Any) -> Any:
        made.append(f"v1:{config.kind}")
        # Re-register while bind is running (as another thread could).
        register_backend("race", capabilities=caps, factory=v2, replace=True)
        return EchoBackend(config, name="v1")

    def v2(config: AttnConfig, **options: Any) -> Any:
        made.append(f"v2:{config.kind}")
        return EchoBackend(config, name="v2")

    caps = Capabilities(kinds={"mha", "mla"}, forms={"mla", "mha"})
    register_backend(
        "race", capabilities=caps, factory=v1, form_policy=FormPolicy.decompressed_without_prefix()
    )
    reg = Registry(builtins=False, plugins=False)
    lookups: list[str] = []
    original_get = Registry.get

    def counting_get(self: Registry, name: str, *, context: str = "") -> Any:
        lookups.append(name)
        return original_get(self, name, context=context)

    reg.get = counting_get.__get__(reg)  # type: ignore[method-assign]
    reg.register(
        "race", capabilities=caps, factory=v1, form_policy=FormPolicy.decompressed_without_prefix()
    )
    cfg = mla_config().replace(mha_head_dim=6, mha_v_head_dim=4)
    b = bind(BackendSpec(prefill="race", decode="race", verify="race"), cfg, registry=reg)
    assert lookups == ["race"]
    assert made == ["v1:mla", "v1:mha"]  # both objects from the one entry bind looked up
    assert {be.name for be in b.backends.values()} == {"v1"}


def test_every_check_runs_before_any_factory() -> None:
    built: list[str] = []

    def factory(config: AttnConfig, **options: Any) -> Any:
        built.append("x")
        return EchoBackend(config)

    # The policy may choose the decompressed form, which the capabilities do not serve:
    # refused from the registry entry alone, before the (costly) factory runs.
    register_backend(
        "eager",
        capabilities=ANY_CAPS,
        factory=factory,
        form_policy=FormPolicy.decompressed_without_prefix(),
    )
    cfg = mla_config().replace(mha_head_dim=6, mha_v_head_dim=4)
    with pytest.raises(IncompatibleBackendError, match="which it does not serve"):
        bind("eager", cfg)
    assert built == []


def test_own_registry() -> None:
    reg = Registry(builtins=False, plugins=False)
    reg.register("mine", capabilities=ANY_CAPS, factory=echo_factory("mine"))
    assert list(reg.list()) == ["mine"] and "mine" in reg
    b = bind("mine", mha_config(), registry=reg)
    assert b.backend(Phase.DECODE).name == "mine"
    with pytest.raises(UnknownBackendError):
        bind("mine", mha_config())  # not in the default registry
    with pytest.raises(UnknownBackendError) as info:
        bind("torch", mha_config(), registry=reg)  # nor the built-ins in this one
    assert info.value.registered == ("mine",)
    with pytest.raises(InvalidSpecError, match="Registry"):
        bind("mine", mha_config(), registry={"mine": None})  # type: ignore[arg-type]


def test_plans_scale_needs_a_config_scale() -> None:
    caps = Capabilities(kinds={"mha"}, plans_scale=True)
    register_backend("fixed", capabilities=caps, factory=echo_factory("fixed"))
    with pytest.raises(IncompatibleBackendError) as info:
        bind("fixed", mha_config(), label="t")
    assert "fixes the softmax scale when it plans" in str(info.value)
    assert "AttnConfig(sm_scale=...)" in str(info.value)
    b = bind("fixed", mha_config().replace(sm_scale=0.125))
    assert b.config.sm_scale == 0.125


def test_flashinfer_declares_plans_scale() -> None:
    from attn_dispatch.backends.flashinfer import CAPABILITIES

    assert CAPABILITIES.plans_scale is True
    cfg = AttnConfig("mha", 4, 4, 128, dtype="bfloat16", device="cuda")
    assert any("fixes the softmax scale" in r for r in CAPABILITIES.reasons(cfg, Phase.DECODE))
    fixed = cfg.replace(sm_scale=128**-0.5)
    assert not any("softmax scale" in r for r in CAPABILITIES.reasons(fixed, Phase.DECODE))


# -- issue 24: the attention state (return_lse) is a variant, checked at bind -----------------


class _LseRecorder(BackendBase):
    """Handlers record the keywords the core passed; with ``return_lse`` they return a pair."""

    name = "lserec"

    def __init__(self, config: AttnConfig, *, keyword: bool = True, **options: Any) -> None:
        self.config = config
        self.calls: list[dict[str, Any]] = []
        self.keyword = keyword

    def plan(self, batch: Any) -> Any:
        return ("plan", batch.phase)

    def handler(self, phase: Phase) -> Any:
        calls = self.calls

        def run(
            q: Any, k: Any, v: Any, plan: Any, sm_scale: float, *, return_lse: bool = False
        ) -> Any:
            calls.append({"return_lse": return_lse} if return_lse else {})
            return ("out", "lse") if return_lse else "out"

        def no_keyword(q: Any, k: Any, v: Any, plan: Any, sm_scale: float) -> Any:
            return "out"

        return run if self.keyword else no_keyword


LSE_CAPS = Capabilities(kinds={"mha", "mla"}, dtypes={"float32"}, variants={"lse"})


def _lse_registry() -> Registry:
    reg = Registry(builtins=False, plugins=False)
    reg.register("lserec", capabilities=LSE_CAPS, factory=_LseRecorder)
    reg.register(
        "nolse", capabilities=Capabilities(kinds={"mha"}, dtypes={"float32"}), factory=_LseRecorder
    )
    return reg


def test_return_lse_is_the_variant_lse() -> None:
    assert mha_config().variants == frozenset()
    assert mha_config(return_lse=True).variants == {"lse"}
    assert mha_config(return_lse=True).replace(sinks=True).variants == {"lse", "sinks"}
    with pytest.raises(InvalidSpecError) as info:
        mha_config(return_lse=1)
    assert info.value.field == "return_lse"
    mla = mla_config(mha_head_dim=192, mha_v_head_dim=128, return_lse=True)
    assert mla.decompressed().return_lse  # the decompressed form computes the same state


def test_bind_refuses_a_backend_without_lse_naming_who_serves_it() -> None:
    reg = _lse_registry()
    with pytest.raises(IncompatibleBackendError) as info:
        bind("nolse", mha_config(return_lse=True), registry=reg)
    text = str(info.value)
    assert "'lse' (return_lse=True) is not implemented" in text
    assert "variant 'lse' is served in phase 'decode' by: 'lserec'" in text
    bind("nolse", mha_config(), registry=reg)  # without the state it binds


def test_handler_without_return_lse_keyword_refused_at_bind() -> None:
    reg = Registry(builtins=False, plugins=False)
    reg.register(
        "lsebad",
        capabilities=LSE_CAPS,
        factory=lambda config, **o: _LseRecorder(config, keyword=False),
    )
    with pytest.raises(BackendUnavailableError, match="return_lse=") as info:
        bind("lsebad", mha_config(return_lse=True), registry=reg, label="target")
    text = str(info.value)
    assert "'lsebad'" in text and "target" in text and "handler(PREFILL)" in text
    # The core never passes return_lse to a config without it: that binding is fine.
    bind("lsebad", mha_config(), registry=reg)


class _Batch:
    phase = Phase.DECODE


def test_return_lse_passed_only_when_asked_on_every_path() -> None:
    from attn_dispatch import attention
    from attn_dispatch import attn_scope
    from attn_dispatch import resolve

    reg = _lse_registry()
    binding = bind("lserec", mha_config(return_lse=True), registry=reg)
    backend = binding.backend(Phase.DECODE)
    assert isinstance(backend, _LseRecorder)
    with attn_scope(binding, _Batch()):
        assert attention("q", "k", "v", sm_scale=0.5) == "out"  # the fast path: no keyword
        assert attention("q", "k", "v", sm_scale=0.5, return_lse=False) == "out"
        assert attention("q", "k", "v", sm_scale=0.5, return_lse=True) == ("out", "lse")
        # The direct path a Binding hands out follows the same rules.
        run = resolve(Phase.DECODE)
        plan = binding.plan(_Batch())
        assert run("q", "k", "v", plan, 0.5) == "out"
        assert run("q", "k", "v", plan, 0.5, return_lse=True) == ("out", "lse")
        for bad in (1, "yes"):
            with pytest.raises(InvalidBatchError) as info:
                attention("q", "k", "v", sm_scale=0.5, return_lse=bad)
            assert info.value.field == "return_lse"
    assert backend.calls == [{}, {}, {"return_lse": True}, {}, {"return_lse": True}]


def test_return_lse_refused_without_the_config_flag() -> None:
    from attn_dispatch import attention
    from attn_dispatch import attn_scope

    reg = _lse_registry()
    binding = bind("lserec", mha_config(), registry=reg, label="target")
    backend = binding.backend(Phase.DECODE)
    assert isinstance(backend, _LseRecorder)
    with attn_scope(binding, _Batch()):
        with pytest.raises(InvalidBatchError) as info:
            attention("q", "k", "v", sm_scale=0.5, return_lse=True)
        assert info.value.field == "return_lse"
        assert "AttnConfig(return_lse=True)" in str(info.value) and "'target'" in str(info.value)
        with pytest.raises(InvalidBatchError):
            binding.handler(Phase.DECODE)(
                "q", "k", "v", binding.plan(_Batch()), 0.5, return_lse=True
            )
    assert backend.calls == []  # refused before any backend code ran


def test_return_lse_per_group_and_under_record_dispatch() -> None:
    from attn_dispatch import attention
    from attn_dispatch import attn_scope
    from attn_dispatch import record_dispatch

    reg = _lse_registry()
    binding = bind(
        "lserec",
        {"sliding": mha_config(), "full": mha_config(return_lse=True)},
        registry=reg,
        label="gemma",
    )
    with attn_scope(binding, _Batch()), record_dispatch() as rec:
        assert attention("q", "k", "v", sm_scale=0.5, group="full", return_lse=True) == (
            "out",
            "lse",
        )
        assert attention("q", "k", "v", sm_scale=0.5, group="sliding") == "out"
        with pytest.raises(InvalidBatchError) as info:
            attention("q", "k", "v", sm_scale=0.5, group="sliding", return_lse=True)
        assert info.value.field == "return_lse" and "group 'sliding'" in str(info.value)
    assert [e.group for e in rec.events] == ["full", "sliding"]
