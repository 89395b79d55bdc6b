"""Layer variants and FP8 caches in the core: config fields, declarations, bind reasons,
attention()'s per-call keywords and the handler call convention (no torch needed)."""

from __future__ import annotations

import math
from typing import Any
from typing import ClassVar

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attn_dispatch import AttnConfig
from attn_dispatch import IncompatibleBackendError
from attn_dispatch import InvalidBatchError
from attn_dispatch import InvalidSpecError
from attn_dispatch import Phase
from attn_dispatch import UsageError
from attn_dispatch import attention
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch.backend import BackendBase
from attn_dispatch.backend import Capabilities
from attn_dispatch.backend import list_backends
from attn_dispatch.backend import register_backend
from tests.strategies import FakeBatch
from tests.strategies import mha_config
from tests.strategies import mla_config

LAYER_VARIANTS = {"window", "logit_cap", "sinks"}
ALL = {*LAYER_VARIANTS, "non_causal", "chunked"}
FP8 = ("float8_e4m3fn", "float8_e5m2")

# -- A: config fields ---------------------------------------------------------------------------


def test_defaults_use_no_variant() -> None:
    c = mha_config()
    assert (c.window_left, c.logit_cap, c.sinks) == (None, None, False)
    assert c.variants == frozenset()
    assert not c.kv_fp8


def test_variants_named() -> None:
    c = mha_config(window_left=0, logit_cap=30, sinks=True)
    assert c.variants == LAYER_VARIANTS
    assert c.logit_cap == 30.0 and isinstance(c.logit_cap, float)
    assert mha_config(window_left=4095).variants == {"window"}


def test_zero_cap_is_off() -> None:
    c = mha_config(logit_cap=0.0)
    assert c.logit_cap is None and c.variants == frozenset()
    assert c == mha_config()


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("window_left", -1, "int >= 0"),
        ("window_left", 1.5, "int >= 0"),
        ("window_left", True, "int >= 0"),
        ("window_left", "128", "int >= 0"),
        ("logit_cap", -1.0, "finite float > 0"),
        ("logit_cap", math.inf, "finite float > 0"),
        ("logit_cap", math.nan, "finite float > 0"),
        ("logit_cap", True, "finite float > 0"),
        ("logit_cap", "30", "finite float > 0"),
        ("sinks", 1, "bool"),
        ("sinks", None, "bool"),
    ],
)
def test_bad_variant_fields(field: str, value: object, words: str) -> None:
    with pytest.raises(InvalidSpecError) as info:
        mha_config(**{field: value})
    assert info.value.field == field
    assert info.value.value is value or (value != value and info.value.value != info.value.value)
    assert words in str(info.value)


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_fp8_kv_dtype(fmt: str, dtype: str) -> None:
    c = mha_config(dtype=dtype, kv_dtype=fmt)
    assert c.kv_dtype == fmt and c.dtype == dtype and c.kv_fp8


def test_fp8_aliases() -> None:
    assert mha_config(kv_dtype="fp8_e5m2").kv_dtype == "float8_e5m2"
    assert mla_config(kv_dtype="fp8_e4m3").kv_dtype == "float8_e4m3fn"


@pytest.mark.parametrize("fmt", [*FP8, "fp8"])
def test_fp8_compute_dtype_refused(fmt: str) -> None:
    with pytest.raises(InvalidSpecError) as info:
        mha_config(dtype=fmt)
    assert info.value.field == "dtype"
    assert "KV cache format" in str(info.value)


def test_decompressed_keeps_variants_drops_fp8() -> None:
    c = mla_config(
        mha_head_dim=192,
        mha_v_head_dim=128,
        window_left=7,
        logit_cap=20.0,
        sinks=True,
        kv_dtype="float8_e4m3fn",
    )
    d = c.decompressed()
    assert (d.window_left, d.logit_cap, d.sinks) == (7, 20.0, True)
    assert d.kv_dtype == d.dtype == "bfloat16"


@given(
    window=st.none() | st.integers(0, 1 << 20),
    cap=st.none() | st.just(0.0) | st.floats(1e-30, 1e6),  # a cap float32 holds, or off
    sinks=st.booleans(),
)
def test_variant_fields_roundtrip(window: int | None, cap: float | None, sinks: bool) -> None:
    c = mha_config(window_left=window, logit_cap=cap, sinks=sinks)
    assert AttnConfig(**c.to_dict()) == c
    assert ("window" in c.variants) == (window is not None)
    assert ("logit_cap" in c.variants) == bool(cap)
    assert ("sinks" in c.variants) == sinks


# -- B: declarations and bind reasons --------------------------------------------------------------


def test_declaration_per_phase() -> None:
    caps = Capabilities(
        kinds={"mha", "mla"}, variants={"decode": {"window"}, Phase.PREFILL: ["window", "sinks"]}
    )
    assert caps.variants_for(Phase.DECODE) == {"window"}
    assert caps.variants_for(Phase.PREFILL) == {"window", "sinks"}
    assert caps.variants_for(Phase.VERIFY) == frozenset()
    assert Capabilities(kinds={"mha", "mla"}, variants=ALL).variants_for(Phase.VERIFY) == ALL
    assert Capabilities(kinds={"mha", "mla"}).variants_for(Phase.DECODE) == frozenset()


@pytest.mark.parametrize(
    ("value", "words"),
    [("window", "set of values"), ({"windows"}, "unknown variants"), ({3}, "non-empty str")],
)
def test_bad_declaration(value: object, words: str) -> None:
    with pytest.raises(InvalidSpecError) as info:
        Capabilities(kinds={"mha", "mla"}, variants=value)  # type: ignore[arg-type]
    assert words in str(info.value)


def test_reasons_name_variant_and_phase() -> None:
    caps = Capabilities(kinds={"mha", "mla"}, variants={"decode": {"window"}})
    cfg = mha_config(window_left=3, logit_cap=5.0)
    assert caps.reasons(cfg, Phase.DECODE) == [
        "layer variant 'logit_cap' (logit_cap=5.0) is not implemented in phase 'decode' "
        "(this backend serves: 'window')"
    ]
    prefill = caps.reasons(cfg, Phase.PREFILL)
    assert len(prefill) == 2 and all("no variants" in r for r in prefill)
    assert "window_left=3" in prefill[1]
    assert caps.reasons(mha_config(), Phase.PREFILL) == []


def test_fp8_reasons() -> None:
    caps = Capabilities(kinds={"mha", "mla"}, dtypes={"float32"})
    why = caps.reasons(mha_config(kv_dtype="float8_e5m2"), Phase.DECODE)
    assert why == ["kv_dtype 'float8_e5m2' is not supported (supported: 'float32')"]
    ok = Capabilities(
        kinds={"mha", "mla"}, dtypes={"float32"}, kv_dtypes={"float32", "float8_e5m2"}
    )
    assert ok.reasons(mha_config(kv_dtype="float8_e5m2"), Phase.DECODE) == []
    assert ok.missing(mha_config(kv_dtype="float8_e4m3fn"), Phase.DECODE) == ["float8_e4m3fn"]


def test_torch_declares_everything() -> None:
    torch_caps = list_backends()["torch"]
    for phase in Phase:
        assert torch_caps.variants_for(phase) == {*ALL, "lse"}  # and the attention state (issue 24)
    for cfg in (
        mha_config(window_left=0, logit_cap=1.0, sinks=True, kv_dtype="float8_e4m3fn"),
        mla_config(window_left=9, logit_cap=1.0, sinks=True, kv_dtype="float8_e5m2"),
    ):
        for phase in Phase:
            assert torch_caps.config_reasons(cfg, phase) == []


def test_native_declares_everything() -> None:
    native_caps = list_backends()["native"]
    for phase in Phase:
        assert native_caps.variants_for(phase) == {*ALL, "lse"}
    for cfg in (
        mha_config(window_left=0, logit_cap=1.0, sinks=True, kv_dtype="float8_e4m3fn"),
        mla_config(window_left=9, logit_cap=1.0, sinks=True, kv_dtype="float8_e5m2"),
        mha_config(return_lse=True, sinks=True, logit_cap=2.0, kv_dtype="float8_e5m2"),
    ):
        for phase in Phase:
            assert native_caps.config_reasons(cfg, phase) == []


def test_refusal_names_who_serves(registry_snapshot: object) -> None:
    register_backend(
        "plain", capabilities=Capabilities(kinds={"mha"}, devices={"cpu"}), factory=_Recorder
    )
    cfg = mha_config(window_left=1023, kv_dtype="float8_e4m3fn")
    with pytest.raises(IncompatibleBackendError) as info:
        bind("prefill=torch,decode=plain", cfg)
    text = str(info.value)
    assert "window_left=1023" in text
    assert "variant 'window' is served in phase 'decode' by:" in text
    assert "kv_dtype 'float8_e4m3fn' is served in phase 'decode' by:" in text
    assert "'torch'" in text.split("variant 'window' is served in phase 'decode' by:")[1]
    # prefill=torch serves both: no reason for that phase.
    assert Phase.PREFILL not in info.value.reasons


def test_served_by_none(registry_snapshot: object) -> None:
    register_backend("plain", capabilities=Capabilities(kinds={"mha", "mla"}), factory=_Recorder)
    cfg = mha_config(logit_cap=2.0)
    with pytest.raises(IncompatibleBackendError) as info:
        bind("plain", cfg)
    assert "'torch'" in str(info.value)
    assert "'plain'" not in str(info.value).split("served in phase 'decode' by:")[1].split("\n")[0]


# -- attention types (issue 27): non-causal and chunked local attention -------------------------


def test_attention_type_fields() -> None:
    assert mha_config().causal and mha_config().attention_chunk_size is None
    assert mha_config(causal=False).variants == {"non_causal"}
    assert mha_config(attention_chunk_size=8192).variants == {"chunked"}
    both = mha_config(attention_chunk_size=16, window_left=3, sinks=True)
    assert both.variants == {"chunked", "window", "sinks"}
    mla = mla_config(attention_chunk_size=64, mha_head_dim=192, mha_v_head_dim=128)
    assert mla.decompressed().attention_chunk_size == 64
    assert not mla_config(causal=False, mha_head_dim=192, mha_v_head_dim=128).decompressed().causal


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        (dict(attention_chunk_size=0), "attention_chunk_size"),
        (dict(attention_chunk_size=-4), "attention_chunk_size"),
        (dict(attention_chunk_size=2.0), "attention_chunk_size"),
        (dict(attention_chunk_size=True), "attention_chunk_size"),
        (dict(causal=0), "causal"),
        (dict(causal=False, window_left=4), "causal"),
        (dict(causal=False, attention_chunk_size=4), "causal"),
    ],
)
def test_attention_type_fields_refused(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidSpecError) as info:
        mha_config(**changes)
    assert info.value.field == field


@pytest.mark.parametrize("variant", ["non_causal", "chunked"])
def test_attention_types_refusal_names_who_serves(registry_snapshot: object, variant: str) -> None:
    register_backend(
        "plain", capabilities=Capabilities(kinds={"mha"}, devices={"cpu"}), factory=_Recorder
    )
    cfg = (
        mha_config(causal=False) if variant == "non_causal" else mha_config(attention_chunk_size=8)
    )
    with pytest.raises(IncompatibleBackendError) as info:
        bind("plain", cfg)
    text = str(info.value)
    detail = "causal=False" if variant == "non_causal" else "attention_chunk_size=8"
    assert detail in text
    served = text.split(f"variant {variant!r} is served in phase 'prefill' by:")[1].split("\n")[0]
    for name in ("'torch'", "'native'", "'triton'"):
        assert name in served
    assert "'plain'" not in served


def test_flashinfer_declares_non_causal_and_refuses_chunks_with_reason() -> None:
    caps = list_backends()["flashinfer"]
    assert "non_causal" in caps.variants_for(Phase.PREFILL)
    cfg = AttnConfig(
        "mha", 8, 2, 128, 128, dtype="bfloat16", page_size=16, device="cuda",
        sm_scale=0.1, attention_chunk_size=8192,
    )  # fmt: skip
    why = " ".join(caps.config_reasons(cfg, Phase.PREFILL))
    assert "chunk" in why and "not served" in why
    assert (
        caps.config_reasons(cfg.replace(attention_chunk_size=None, causal=False), Phase.PREFILL)
        == []
    )


# -- C/D: attention() keywords and the handler call convention ---------------------------------


class _Recorder(BackendBase):
    """Handlers record exactly how the core called them."""

    name = "rec"

    def __init__(self, config: AttnConfig, **options: Any) -> None:
        self.config = config
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def plan(self, batch: Any) -> Any:
        return ("plan", batch.phase)

    def handler(self, phase: Phase) -> Any:
        def run(*args: Any, **kw: Any) -> Any:
            self.calls.append((args, kw))
            return "out"

        return run


EVERYTHING = Capabilities(
    kinds={"mha", "mla"},
    dtypes={"float32", "bfloat16"},
    kv_dtypes={"float32", "bfloat16", *FP8},
    variants=ALL,
)


def _bound(cfg: AttnConfig) -> tuple[Any, _Recorder]:
    register_backend("rec", capabilities=EVERYTHING, factory=_Recorder, replace=True)
    binding = bind("rec", cfg)
    backend = binding.backend(Phase.DECODE)
    assert isinstance(backend, _Recorder)
    return binding, backend


def _call(binding: Any, **kw: Any) -> None:
    with attn_scope(binding, FakeBatch(Phase.DECODE)):
        assert attention("q", "k", "v", sm_scale=0.5, **kw) == "out"


def test_plain_call_is_positional(registry_snapshot: object) -> None:
    binding, rec = _bound(mha_config(window_left=4, logit_cap=3.0))
    _call(binding)
    assert rec.calls == [(("q", "k", "v", ("plan", Phase.DECODE), 0.5), {})]


def test_sinks_passed_only_for_sinks_config(registry_snapshot: object) -> None:
    binding, rec = _bound(mha_config(sinks=True))
    sinks = torch.zeros(8)  # the core checks the tensor: float32 [num_q_heads]
    _call(binding, sinks=sinks)
    assert rec.calls[-1][1] == {"sinks": sinks}
    with pytest.raises(InvalidBatchError, match=r"shape \(7,\)") as info:
        _call(binding, sinks=torch.zeros(7))
    with pytest.raises(InvalidBatchError, match="float32") as info:
        _call(binding, sinks=torch.zeros(8, dtype=torch.float64))
    with pytest.raises(InvalidBatchError, match=r"torch\.Tensor") as info:
        _call(binding, sinks="S")
    with pytest.raises(InvalidBatchError) as info:
        _call(binding)
    assert info.value.field == "sinks" and "sinks=True" in str(info.value)
    plain, rec2 = _bound(mha_config())
    with pytest.raises(InvalidBatchError) as info:
        _call(plain, sinks=sinks)
    assert info.value.field == "sinks" and "sinks=False" in str(info.value)
    assert rec2.calls == []


@pytest.mark.parametrize("fmt", FP8)
def test_fp8_scales_default_and_given(registry_snapshot: object, fmt: str) -> None:
    binding, rec = _bound(mha_config(kv_dtype=fmt))
    _call(binding)
    assert rec.calls[-1][1] == {"k_scale": 1.0, "v_scale": 1.0}
    _call(binding, k_scale=2, v_scale=0.25)
    kw = rec.calls[-1][1]
    assert kw == {"k_scale": 2.0, "v_scale": 0.25}
    assert all(type(v) is float for v in kw.values())


def test_mla_fp8_takes_k_scale_only(registry_snapshot: object) -> None:
    binding, rec = _bound(mla_config(dtype="float32", kv_dtype="float8_e4m3fn", sinks=True))
    sinks = torch.zeros(binding.config.num_q_heads)
    _call(binding, k_scale=0.5, sinks=sinks)
    assert rec.calls[-1][1] == {"sinks": sinks, "k_scale": 0.5}
    with pytest.raises(InvalidBatchError) as info:
        _call(binding, k_scale=0.5, v_scale=0.5, sinks=sinks)
    assert info.value.field == "v_scale" and "latent" in str(info.value)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan, True, "1.0", None])
@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
def test_bad_scales(registry_snapshot: object, name: str, bad: object) -> None:
    binding, rec = _bound(mha_config(kv_dtype="float8_e5m2"))
    if bad is None:
        _call(binding, **{name: bad})  # None means the default 1.0
        assert rec.calls[-1][1][name] == 1.0
        return
    with pytest.raises(InvalidBatchError) as info:
        _call(binding, **{name: bad})
    assert info.value.field == name and "finite float > 0" in str(info.value)
    assert rec.calls == []


@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
def test_scale_on_non_fp8_config(registry_snapshot: object, name: str) -> None:
    binding, rec = _bound(mha_config())
    with pytest.raises(InvalidBatchError) as info:
        _call(binding, **{name: 1.0})
    assert info.value.field == name and "not FP8" in str(info.value)
    assert rec.calls == []


def test_group_on_ungrouped_binding(registry_snapshot: object) -> None:
    binding, rec = _bound(mha_config())
    with pytest.raises(UsageError) as info:
        _call(binding, group="sliding")
    assert info.value.api == "attention(group=...)" and "without groups" in str(info.value)
    assert rec.calls == []


def test_tensor_checks_sinks() -> None:
    torch = pytest.importorskip("torch")
    from attn_dispatch._tensor_checks import TensorChecks

    checks = TensorChecks.of(mha_config(sinks=True), backend="x")
    q = torch.zeros(3, 8, 64)
    checks.check_sinks(torch.zeros(8), q)
    for bad, words in [
        ([0.0] * 8, "expected a torch.Tensor"),
        (torch.zeros(8, dtype=torch.float64), "float32"),
        (torch.zeros(4), "[num_q_heads=8]"),
        (torch.zeros(1, 8), "[num_q_heads=8]"),
    ]:
        with pytest.raises(InvalidBatchError) as info:
            checks.check_sinks(bad, q)
        assert info.value.field == "sinks" and words in str(info.value)


# -- E: groups ------------------------------------------------------------------------------------


class _Counting(_Recorder):
    """Counts plans; handlers return (config window, plan)."""

    made: ClassVar[list[_Counting]] = []

    def __init__(self, config: AttnConfig, **options: Any) -> None:
        super().__init__(config)
        self.plans = 0
        _Counting.made.append(self)

    def plan(self, batch: Any) -> Any:
        self.plans += 1
        return ("plan", self.config.window_left, self.plans)

    def handler(self, phase: Phase) -> Any:
        def run(q: Any, k: Any, v: Any, plan: Any, scale: float, **kw: Any) -> Any:
            return (self.config.window_left, plan, kw)

        return run


@pytest.fixture
def counting(registry_snapshot: object) -> type[_Counting]:
    _Counting.made = []
    register_backend("cnt", capabilities=EVERYTHING, factory=_Counting)
    register_backend("cnt2", capabilities=EVERYTHING, factory=_Counting)
    return _Counting


GEMMA = {
    "sliding": mha_config(window_left=4095, logit_cap=50.0),
    "full": mha_config(logit_cap=50.0),
}


def test_groups_plan_once_and_dispatch(counting: type[_Counting]) -> None:
    binding = bind("cnt", GEMMA, label="gemma")
    assert set(binding.groups) == {"sliding", "full"}
    assert binding.groups["sliding"].config.window_left == 4095
    assert len(counting.made) == 2  # one backend object per group
    with attn_scope(binding, FakeBatch(Phase.DECODE)):
        for _ in range(3):
            assert attention(1, 2, 3, sm_scale=1.0, group="sliding")[:2] == (
                4095,
                ("plan", 4095, 1),
            )
            assert attention(1, 2, 3, sm_scale=1.0, group="full")[:2] == (None, ("plan", None, 1))
    assert [b.plans for b in counting.made] == [1, 1]
    with attn_scope(binding, FakeBatch(Phase.PREFILL)):
        attention(1, 2, 3, sm_scale=1.0, group="full")
    assert [b.plans for b in counting.made] == [2, 2]
    assert "groups: sliding=" in repr(binding)


def test_group_spec_mapping(counting: type[_Counting]) -> None:
    binding = bind({"sliding": "cnt", "full": "prefill=cnt,decode=cnt2"}, GEMMA)
    assert binding.groups["full"].backend_name(Phase.DECODE) == "cnt2"
    assert binding.groups["sliding"].backend_name(Phase.DECODE) == "cnt"
    with pytest.raises(InvalidSpecError, match="missing: \\['full'\\]"):
        bind({"sliding": "cnt"}, GEMMA)
    with pytest.raises(InvalidSpecError, match="unknown: \\['x'\\]"):
        bind({"sliding": "cnt", "full": "cnt", "x": "cnt"}, GEMMA)
    with pytest.raises(InvalidSpecError, match="mapping group -> config"):
        bind({"sliding": "cnt"}, mha_config())
    with pytest.raises(InvalidSpecError, match="at least one group"):
        bind("cnt", {})


def test_groups_checked_before_any_factory(counting: type[_Counting]) -> None:
    register_backend("nowin", capabilities=Capabilities(kinds={"mha", "mla"}), factory=_Counting)
    with pytest.raises(IncompatibleBackendError) as info:
        bind({"full": "cnt", "sliding": "nowin"}, GEMMA)
    text = str(info.value)
    assert "group 'sliding': layer variant 'window'" in text
    assert "group 'full'" not in text  # 'cnt' serves it
    with pytest.raises(IncompatibleBackendError) as info:
        bind({"sliding": "prefill=cnt,decode=nowin", "full": "nowin"}, GEMMA)
    decode = info.value.reasons[Phase.DECODE]
    assert decode[0] == "nowin"
    assert any(r.startswith("group 'sliding': layer variant 'window'") for r in decode[1])
    assert any(r.startswith("group 'full': layer variant 'logit_cap'") for r in decode[1])
    assert counting.made == []


def test_group_errors(counting: type[_Counting]) -> None:
    binding = bind("cnt", GEMMA, label="g")
    with attn_scope(binding, FakeBatch(Phase.DECODE)):
        with pytest.raises(UsageError) as info:
            attention(1, 2, 3, sm_scale=1.0)
        assert info.value.api == "attention(group=...)" and "'sliding', 'full'" in str(info.value)
        with pytest.raises(UsageError) as info:
            attention(1, 2, 3, sm_scale=1.0, group="global")
        assert "no group 'global'" in str(info.value) and "'sliding', 'full'" in str(info.value)
        with pytest.raises(UsageError):
            attention(1, 2, 3, sm_scale=1.0, group=["sliding"])  # type: ignore[arg-type]
        from attn_dispatch import resolve

        with pytest.raises(UsageError, match="groups"):
            resolve(Phase.DECODE)
    with pytest.raises(UsageError, match="groups"):
        binding.prepare(FakeBatch(Phase.DECODE))
    with pytest.raises(UsageError, match="groups"):
        binding.handler(Phase.DECODE)
    with pytest.raises(UsageError, match=r"binding\.groups\[name\]\.backend\(phase\)"):
        binding.backend(Phase.DECODE)
    with pytest.raises(UsageError, match="groups"):
        binding.backend_name(Phase.DECODE)
    with attn_scope(binding), pytest.raises(UsageError, match="with a batch"):
        attention(1, 2, 3, sm_scale=1.0, group="full")


def test_group_extras_follow_the_group(counting: type[_Counting]) -> None:
    cfgs = {"oss": mha_config(sinks=True, window_left=127), "fp8": mha_config(kv_dtype="fp8")}
    binding = bind("cnt", cfgs)
    sinks = torch.zeros(8)
    with attn_scope(binding, FakeBatch(Phase.DECODE)):
        assert attention(1, 2, 3, sm_scale=1.0, group="oss", sinks=sinks)[2] == {"sinks": sinks}
        assert attention(1, 2, 3, sm_scale=1.0, group="fp8", k_scale=2.0)[2] == {
            "k_scale": 2.0,
            "v_scale": 1.0,
        }
        with pytest.raises(InvalidBatchError, match="sinks=False"):
            attention(1, 2, 3, sm_scale=1.0, group="fp8", sinks=sinks)
        with pytest.raises(InvalidBatchError, match="sinks=True"):
            attention(1, 2, 3, sm_scale=1.0, group="oss")


def test_record_dispatch_records_groups(counting: type[_Counting]) -> None:
    from attn_dispatch import record_dispatch

    binding = bind({"sliding": "cnt", "full": "cnt2"}, GEMMA, label="gemma")
    with record_dispatch() as rec, attn_scope(binding, FakeBatch(Phase.DECODE)):
        attention(1, 2, 3, sm_scale=1.0, group="sliding")
        attention(1, 2, 3, sm_scale=1.0, group="full")
        attention(1, 2, 3, sm_scale=1.0, group="full")
    assert rec.group_counts() == {
        ("gemma", "sliding", "decode", "cnt"): 1,
        ("gemma", "full", "decode", "cnt2"): 2,
    }
    assert [e.group for e in rec.events] == ["sliding", "full", "full"]
    assert rec.events[0].range_name() == "attn_dispatch/gemma:sliding/decode/cnt"
    assert rec.summary().splitlines()[0].split()[:2] == ["runner", "group"]


def test_grouped_torch_runner_matches_each_config() -> None:
    """A Gemma-2-style runner on the torch backend: each group's output is exactly what a
    binding of that group's config alone gives."""
    torch = pytest.importorskip("torch")
    from attn_dispatch import AttnBatch

    cfgs = {
        "sliding": mha_config(window_left=5, logit_cap=3.0, page_size=4),
        "full": mha_config(logit_cap=3.0, page_size=4),
    }
    g = torch.Generator().manual_seed(0)
    batch = AttnBatch.build(
        Phase.DECODE,
        q_lens=[1, 1],
        kv_lens=[19, 7],
        page_tables=[[0, 1, 2, 3, 4], [5, 6]],
        page_size=4,
        num_pages=8,
    )
    q = torch.randn(2, 8, 64, generator=g)
    k = torch.randn(8, 4, 2, 64, generator=g)
    v = torch.randn(8, 4, 2, 64, generator=g)
    grouped = bind("torch", cfgs)
    with attn_scope(grouped, batch):
        outs = {n: attention(q, k, v, sm_scale=0.125, group=n) for n in cfgs}
    for name, cfg in cfgs.items():
        with attn_scope(bind("torch", cfg), batch):
            alone = attention(q, k, v, sm_scale=0.125)
        assert torch.equal(outs[name], alone)
    assert not torch.allclose(outs["sliding"], outs["full"])
