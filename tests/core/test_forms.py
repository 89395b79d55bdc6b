"""MLA attention forms: per-backend policies, bind checks, numerics of the three forms."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator

import pytest
import torch

if not torch.cuda.is_available():
    # Before the triton kernels are first imported: they run on CPU under the interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attn_dispatch import AttnBatch
from attn_dispatch import AttnConfig
from attn_dispatch import AttnForm
from attn_dispatch import IncompatibleBackendError
from attn_dispatch import InvalidBatchError
from attn_dispatch import InvalidSpecError
from attn_dispatch import NoActiveScopeError
from attn_dispatch import Phase
from attn_dispatch import UsageError
from attn_dispatch import attention
from attn_dispatch import attention_form
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch import record_dispatch
from attn_dispatch._forms import FormPolicy
from attn_dispatch.backend import register_backend
from attn_dispatch.backend import unregister_backend
from attn_dispatch.backends.reference import CAPABILITIES as TORCH_CAPS
from attn_dispatch.backends.reference.backend import TorchBackend
from attn_dispatch.mla import gather_latent
from attn_dispatch.mla import latent_prefix_chunks

H, LATENT, ROPE, NOPE, VDIM = 2, 64, 16, 32, 32
PS = 4


def mla_config(**over: object) -> AttnConfig:
    args: dict[str, object] = dict(
        kind="mla",
        num_q_heads=H,
        num_kv_heads=1,
        head_dim=LATENT + ROPE,
        v_head_dim=LATENT,
        dtype="float32",
        page_size=PS,
        mha_head_dim=NOPE + ROPE,
        mha_v_head_dim=VDIM,
    )
    args.update(over)
    return AttnConfig(**args)  # type: ignore[arg-type]


def batch(phase: Phase, q_lens: list[int], prefix: list[int]) -> AttnBatch:
    kv = [p + q for p, q in zip(prefix, q_lens, strict=True)]
    tables, nxt = [], 0
    for k in kv:
        n = math.ceil(k / PS)
        tables.append(list(range(nxt, nxt + n))[::-1])  # reversed: pages out of order
        nxt += n
    return AttnBatch.build(phase, q_lens=q_lens, kv_lens=kv, page_tables=tables, page_size=PS)


@pytest.fixture
def extra_backends() -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for n in names:
        unregister_backend(n)


# -- policy choices ------------------------------------------------------------------------------

TABLE = [
    ("prefill, no prefix", Phase.PREFILL, [5, 3], [0, 0], AttnForm.MHA),
    ("prefill, short prefix", Phase.PREFILL, [5, 3], [7, 9], AttnForm.MHA),
    ("prefill, long prefix", Phase.PREFILL, [2], [40], AttnForm.MHA_CHUNKED),
    ("decode", Phase.DECODE, [1, 1], [7, 30], AttnForm.MLA),
    ("verify", Phase.VERIFY, [3], [9], AttnForm.MLA),
]


@pytest.mark.parametrize(
    ("name", "phase", "q_lens", "prefix", "form"), TABLE, ids=[t[0] for t in TABLE]
)
def test_torch_policy_table(
    name: str, phase: Phase, q_lens: list[int], prefix: list[int], form: AttnForm
) -> None:
    b = bind(
        "torch", mla_config(), options={"torch": {"form_policy": FormPolicy(short_prefix_max=16)}}
    )
    with attn_scope(b, batch(phase, q_lens, prefix)):
        assert attention_form() is form


BUILTIN_TABLE = {
    # backend: forms for (no prefix, short prefix, long prefix, decode, verify)
    "torch": (AttnForm.MHA, AttnForm.MHA, AttnForm.MHA_CHUNKED, AttnForm.MLA, AttnForm.MLA),
    "native": (AttnForm.MHA, AttnForm.MLA, AttnForm.MLA, AttnForm.MLA, AttnForm.MLA),
    "triton": (AttnForm.MHA, AttnForm.MLA, AttnForm.MLA, AttnForm.MLA, AttnForm.MLA),
    "flashinfer": (AttnForm.MHA, AttnForm.MLA, AttnForm.MLA, AttnForm.MLA, AttnForm.MLA),
}


@pytest.mark.parametrize("backend", sorted(BUILTIN_TABLE))
def test_builtin_default_policies_on_a_table_of_batches(backend: str) -> None:
    """Each built-in's default policy (its light module's DEFAULT_FORM_POLICY, which the
    registry entry declares) on the same batches, and every form it returns is declared."""
    import importlib

    from attn_dispatch.backend import list_backends

    light = importlib.import_module(
        f"attn_dispatch.backends.{'reference' if backend == 'torch' else backend}"
    )
    policy: FormPolicy = light.DEFAULT_FORM_POLICY
    from attn_dispatch._registry import DEFAULT_REGISTRY

    assert DEFAULT_REGISTRY.get(backend).form_policy is policy
    batches = [
        batch(Phase.PREFILL, [5, 3], [0, 0]),
        batch(Phase.PREFILL, [5, 3], [7, 9]),
        batch(Phase.PREFILL, [2], [5000]),
        batch(Phase.DECODE, [1, 1], [7, 30]),
        batch(Phase.VERIFY, [3], [9]),
    ]
    assert tuple(policy.choose(b) for b in batches) == BUILTIN_TABLE[backend]
    caps = list_backends()[backend]
    for phase in Phase:
        assert {f.value for f in policy.possible(phase)} <= caps.forms_for(phase)


def test_absorbed_only_config_always_mla() -> None:
    b = bind("torch", mla_config(mha_head_dim=None, mha_v_head_dim=None))
    for phase, q, p in [
        (Phase.PREFILL, [5], [0]),
        (Phase.PREFILL, [2], [90]),
        (Phase.DECODE, [1], [3]),
    ]:
        with attn_scope(b, batch(phase, q, p)):
            assert attention_form() is AttnForm.MLA


def test_attention_form_errors() -> None:
    with pytest.raises(NoActiveScopeError, match="attn_scope"):
        attention_form()
    b = bind("torch", mla_config())
    with attn_scope(b):
        with pytest.raises(UsageError, match="batch"):
            attention_form()
    mha = bind("torch", AttnConfig("mha", 2, 1, 16, 16, dtype="float32", page_size=PS))
    with attn_scope(mha, batch(Phase.DECODE, [1], [3])):
        with pytest.raises(UsageError, match="MLA"):
            attention_form()


def test_backend_registered_without_policy_runs_absorbed(extra_backends: list[str]) -> None:
    # No declared policy: the absorbed form always (never another backend's policy).
    register_backend("nopolicy", capabilities=TORCH_CAPS, factory=TorchBackend)
    extra_backends.append("nopolicy")
    b = bind("prefill=torch,decode=nopolicy,verify=nopolicy", mla_config(), label="target")
    for phase, q, p, want in [
        (Phase.PREFILL, [5], [0], AttnForm.MHA),  # torch's own policy
        (Phase.DECODE, [1], [3], AttnForm.MLA),
        (Phase.VERIFY, [3], [0], AttnForm.MLA),
    ]:
        with attn_scope(b, batch(phase, q, p)):
            assert attention_form() is want


def test_policy_is_declared_at_registration(extra_backends: list[str]) -> None:
    from attn_dispatch._registry import DEFAULT_REGISTRY

    policy = FormPolicy(short_prefix_max=3)
    register_backend("declared", capabilities=TORCH_CAPS, factory=TorchBackend, form_policy=policy)
    extra_backends.append("declared")
    assert DEFAULT_REGISTRY.get("declared").form_policy is policy
    with pytest.raises(InvalidSpecError, match="FormPolicy"):
        register_backend(
            "bad-policy",
            capabilities=TORCH_CAPS,
            factory=TorchBackend,
            form_policy="mha",  # type: ignore[arg-type]
        )
    with pytest.raises(InvalidSpecError, match="FormPolicy"):
        bind("torch", mla_config(), options={"torch": {"form_policy": "mla"}})


def test_policy_option_overrides_the_declared_one_and_is_not_passed_on(
    extra_backends: list[str],
) -> None:
    seen: list[dict[str, object]] = []

    def factory(config: AttnConfig, **options: object) -> TorchBackend:
        seen.append(options)
        return TorchBackend(config)

    register_backend(
        "opt", capabilities=TORCH_CAPS, factory=factory, form_policy=FormPolicy.absorbed_only()
    )
    extra_backends.append("opt")
    prefill = batch(Phase.PREFILL, [5], [0])
    with attn_scope(bind("opt", mla_config()), prefill):
        assert attention_form() is AttnForm.MLA  # the declared policy
    b = bind("opt", mla_config(), options={"opt": {"form_policy": FormPolicy()}})
    with attn_scope(b, prefill):
        assert attention_form() is AttnForm.MHA  # the option wins for this binding
    assert all("form_policy" not in o for o in seen)  # the core's, not the factory's


def test_policy_form_not_served_is_refused(extra_backends: list[str]) -> None:
    built: list[object] = []

    def factory(config: AttnConfig, **options: object) -> TorchBackend:
        built.append(config)
        return TorchBackend(config)

    register_backend(
        "absorbed-only",
        capabilities=TORCH_CAPS.replace(forms={"mla"}),
        factory=factory,
        form_policy=FormPolicy(),
    )
    extra_backends.append("absorbed-only")
    with pytest.raises(IncompatibleBackendError, match="may choose 'mha'") as err:
        bind("absorbed-only", mla_config())
    assert Phase.PREFILL in err.value.reasons and Phase.DECODE not in err.value.reasons
    assert built == []  # refused from the registry entry, before the factory ran
    ok = bind(
        "absorbed-only",
        mla_config(),
        options={"absorbed-only": {"form_policy": FormPolicy.absorbed_only()}},
    )
    with attn_scope(ok, batch(Phase.PREFILL, [3], [0])):
        assert attention_form() is AttnForm.MLA


def test_decompressed_dims_checked_against_capabilities(extra_backends: list[str]) -> None:
    register_backend(
        "narrow",
        capabilities=TORCH_CAPS.replace(head_dims={80}, v_head_dims={64}),
        factory=TorchBackend,
        form_policy=FormPolicy(),
    )
    extra_backends.append("narrow")
    with pytest.raises(
        IncompatibleBackendError, match=r"decompressed form .mha. .48/32.: head_dim 48"
    ):
        bind("narrow", mla_config())


# -- numerics: the three forms agree -----------------------------------------------------------


class DeepSeekLayer:
    """Random weights of one MLA attention layer, in both forms."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.w_uk = torch.randn(H, NOPE, LATENT, generator=g) / LATENT**0.5
        self.w_uv = torch.randn(H, VDIM, LATENT, generator=g) / LATENT**0.5

    def up_proj(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, kr = rows[:, :LATENT], rows[:, LATENT:]
        k_nope = torch.einsum("nl,hdl->nhd", c, self.w_uk)
        k = torch.cat([k_nope, kr[:, None, :].expand(-1, H, ROPE)], dim=-1)
        v = torch.einsum("nl,hvl->nhv", c, self.w_uv)
        return k, v

    def forward(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, b: AttnBatch
    ) -> torch.Tensor:
        scale = 1 / math.sqrt(NOPE + ROPE)
        form = attention_form()
        if form is AttnForm.MLA:
            q = torch.cat([torch.einsum("thd,hdl->thl", q_nope, self.w_uk), q_rope], dim=-1)
            latent_out = attention(q, cache, None, sm_scale=scale)
            return torch.einsum("thl,hvl->thv", latent_out, self.w_uv)
        q = torch.cat([q_nope, q_rope], dim=-1)
        if form is AttnForm.MHA:
            k, v = self.up_proj(gather_latent(cache, b))
            return attention(q, k, v, sm_scale=scale)  # type: ignore[no-any-return]
        full_k, full_v = self.up_proj(gather_latent(cache, b))
        ends = torch.cumsum(b.kv_lens_host, 0).tolist()
        new = torch.cat([torch.arange(e - ql, e) for e, ql in zip(ends, b.q_lens(), strict=True)])
        chunks = latent_prefix_chunks(cache, b, self.up_proj, chunk_tokens=5)
        return attention(q, full_k[new], full_v[new], sm_scale=scale, prefix=chunks)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("q_lens", "prefix"), [([6, 3], [0, 0]), ([4, 2], [13, 22]), ([1, 5], [30, 1])]
)
def test_three_forms_give_the_same_output(q_lens: list[int], prefix: list[int]) -> None:
    layer = DeepSeekLayer()
    b = batch(Phase.PREFILL, q_lens, prefix)
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(int(b.kv_indptr_host[-1]) + 1, PS, LATENT + ROPE, generator=g)
    q_nope = torch.randn(b.num_tokens, H, NOPE, generator=g)
    q_rope = torch.randn(b.num_tokens, H, ROPE, generator=g)
    policies = {
        AttnForm.MLA: FormPolicy.absorbed_only(),
        AttnForm.MHA: FormPolicy(short_prefix_max=10**6),
        AttnForm.MHA_CHUNKED: FormPolicy(no_prefix=AttnForm.MHA_CHUNKED, short_prefix_max=0),
    }
    outs = {}
    for form, policy in policies.items():
        binding = bind("torch", mla_config(), options={"torch": {"form_policy": policy}})
        with record_dispatch() as rec, attn_scope(binding, b):
            assert attention_form() is form
            outs[form] = layer.forward(q_nope, q_rope, cache, b)
        assert [e.form for e in rec.events] == [form.value]
    torch.testing.assert_close(outs[AttnForm.MHA], outs[AttnForm.MLA], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[AttnForm.MHA_CHUNKED], outs[AttnForm.MLA], atol=1e-5, rtol=1e-5)


def test_chunked_form_input_errors() -> None:
    binding = bind(
        "torch", mla_config(), options={"torch": {"form_policy": FormPolicy(short_prefix_max=0)}}
    )
    b = batch(Phase.PREFILL, [2], [9])
    q = torch.randn(2, H, NOPE + ROPE)
    k, v = torch.randn(2, H, NOPE + ROPE), torch.randn(2, H, VDIM)
    with attn_scope(binding, b):
        with pytest.raises(InvalidBatchError, match="needs the cached prefix as chunks"):
            attention(q, k, v, sm_scale=0.1)
        short = [(torch.randn(3, H, NOPE + ROPE), torch.randn(3, H, VDIM), [0, 3])]
        with pytest.raises(
            InvalidBatchError, match="cover 3 prefix tokens but the request has 9"
        ) as err:
            attention(q, k, v, sm_scale=0.1, prefix=short)
        assert err.value.request == 0
    other = bind("torch", mla_config())
    with attn_scope(other, batch(Phase.DECODE, [1], [4])):
        with pytest.raises(UsageError, match="only for the 'mha_chunked' form"):
            attention(q, k, v, sm_scale=0.1, prefix=short)


def test_seed_scenario_forms_follow_own_backend(extra_backends: list[str]) -> None:
    """Target MLA: prefill decompressed, decode absorbed. A draft bound afterwards to another
    backend never changes which form or backend any target call takes."""
    layer = DeepSeekLayer()
    target = bind("torch", mla_config(), label="target")
    register_backend(
        "draft-kernels", capabilities=TORCH_CAPS.replace(kinds={"mha"}), factory=TorchBackend
    )
    extra_backends.append("draft-kernels")
    draft_cfg = AttnConfig("mha", 4, 2, 16, 16, dtype="float32", page_size=PS)
    draft = bind("draft-kernels", draft_cfg, label="draft")
    with pytest.raises(IncompatibleBackendError, match="kind 'mla'"):
        bind("draft-kernels", mla_config(), label="target")
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(64, PS, LATENT + ROPE, generator=g)
    dk, dv = torch.randn(64, PS, 2, 16, generator=g), torch.randn(64, PS, 2, 16, generator=g)
    with record_dispatch() as rec:
        for phase, q_lens, prefix in [
            (Phase.PREFILL, [5], [0]),
            (Phase.DECODE, [1], [5]),
            (Phase.VERIFY, [3], [6]),
        ]:
            b = batch(phase, q_lens, prefix)
            with attn_scope(target, b):
                layer.forward(
                    torch.randn(b.num_tokens, H, NOPE), torch.randn(b.num_tokens, H, ROPE), cache, b
                )
                with attn_scope(draft, batch(Phase.DECODE, [1], [4])):
                    attention(torch.randn(1, 4, 16), dk, dv, sm_scale=0.25)
                layer.forward(
                    torch.randn(b.num_tokens, H, NOPE), torch.randn(b.num_tokens, H, ROPE), cache, b
                )
    target_events = [(e.phase, e.backend, e.form) for e in rec.events if e.label == "target"]
    assert target_events == [
        (Phase.PREFILL, "torch", "mha"),
        (Phase.PREFILL, "torch", "mha"),
        (Phase.DECODE, "torch", "mla"),
        (Phase.DECODE, "torch", "mla"),
        (Phase.VERIFY, "torch", "mla"),
        (Phase.VERIFY, "torch", "mla"),
    ]
    assert {(e.backend, e.form) for e in rec.events if e.label == "draft"} == {
        ("draft-kernels", None)
    }


@pytest.mark.parametrize("backend", ["torch", "triton", "native"])
def test_decompressed_prefill_matches_absorbed_per_backend(backend: str) -> None:
    """Each backend's MHA (decompressed) form gives the absorbed form's numbers."""
    from attn_dispatch.backend import list_backends

    caps = list_backends().get(backend)
    if caps is None or caps.availability_reasons():
        why = caps.availability_reasons() if caps is not None else ["not registered"]
        pytest.skip(f"{backend!r} cannot run here: {why}")
    if "mha" not in caps.forms_for(Phase.PREFILL):
        pytest.skip(f"{backend!r} serves no decompressed prefill")
    layer = DeepSeekLayer(seed=5)
    b = batch(Phase.PREFILL, [5, 3], [0, 0])
    g = torch.Generator().manual_seed(6)
    cache = torch.randn(int(b.kv_indptr_host[-1]) + 2, PS, LATENT + ROPE, generator=g)
    q_nope = torch.randn(b.num_tokens, H, NOPE, generator=g)
    q_rope = torch.randn(b.num_tokens, H, ROPE, generator=g)
    outs = {}
    for form, policy in ((AttnForm.MLA, FormPolicy.absorbed_only()), (AttnForm.MHA, None)):
        opts = {backend: {"form_policy": policy}} if policy is not None else None
        binding = bind(backend, mla_config(), options=opts)
        with attn_scope(binding, b):
            assert attention_form() is form
            outs[form] = layer.forward(q_nope, q_rope, cache, b)
    torch.testing.assert_close(outs[AttnForm.MHA], outs[AttnForm.MLA], atol=1e-4, rtol=1e-4)
