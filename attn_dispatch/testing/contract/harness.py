"""The kit's machinery: one backend under test, the calls it runs and the checks against the
float64 oracle.

``Subject.of(name)`` reads the backend's ``Capabilities`` from the registry and derives what the
kit may ask of it: the device (CUDA when it declares ``"cuda"`` and this machine has it, else
the CPU), the shapes the strategies draw (``limits_for``), and per (kind, phase) the layer
variants and FP8 formats it declares (``served``). Everything the backend does not declare is
skipped with the reason ``Capabilities`` gives, which names the field (``kind 'mla' is not
supported (supported: 'mha')``); what it declares must match the oracle.

The test modules of this package use it through the fixture ``attn_contract_subject``
(``contract_subject_fixture``, imported by each module), built from the plugin's fixtures
``attn_backend`` and ``attn_contract_profile`` (``--attn-backend NAME``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck
from hypothesis import reject

from attn_dispatch import Phase
from attn_dispatch import _env
from attn_dispatch import attention
from attn_dispatch import attn_scope
from attn_dispatch import bind
from attn_dispatch.backend import Capabilities
from attn_dispatch.backend import list_backends
from attn_dispatch.testing.contract.cases import DEFAULT_LIMITS
from attn_dispatch.testing.contract.cases import KernelCase
from attn_dispatch.testing.contract.cases import Limits
from attn_dispatch.testing.contract.cases import Materialised
from attn_dispatch.testing.contract.cases import Served
from attn_dispatch.testing.contract.cases import assert_lse_matches
from attn_dispatch.testing.contract.cases import config_of
from attn_dispatch.testing.contract.cases import make_case
from attn_dispatch.testing.contract.cases import materialise
from attn_dispatch.testing.contract.cases import naive_state
from attn_dispatch.testing.contract.cases import tolerance

__all__ = [
    "FP8_FORMATS",
    "KIT_LIMITS",
    "SLOW",
    "THOROUGH",
    "ContractProfile",
    "Subject",
    "contract_subject_fixture",
    "limits_for",
]

FP8_FORMATS = ("float8_e4m3fn", "float8_e5m2")
#: Health checks the kit's properties switch off: cases are large and some backends slow.
SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large]
#: ``HYPOTHESIS_PROFILE=thorough``: every property draws ten times as many examples.
THOROUGH = os.environ.get(_env.HYPOTHESIS_PROFILE) == "thorough"

_VARIANTS = ("window", "logit_cap", "sinks", "non_causal", "chunked", "lse")

#: The kit's default shapes: ``DEFAULT_LIMITS`` (the repository's own runs) made smaller, so
#: a plugin's CI run stays short; every boundary (partial pages, page size 1, GQA, 576-wide
#: MLA, 16 heads) is still drawn.
KIT_LIMITS = dataclasses.replace(DEFAULT_LIMITS, max_requests=3, max_q=16, max_prefix=100)


@dataclasses.dataclass(frozen=True)
class ContractProfile:
    """How hard the kit tries on one backend: hypothesis examples per property and the shape
    limits (``None``: ``KIT_LIMITS``; either way narrowed by ``limits_for`` to what the
    backend declares). The defaults keep one backend's whole
    run to about a minute on two CPU cores; a plugin's CI may ask for more by overriding the
    ``attn_contract_profile`` fixture in its conftest."""

    limits: Limits | None = None
    examples: int = 10
    variant_examples: int = 10
    lse_examples: int = 5
    out_examples: int = 5

    def scaled(self, n: int) -> int:
        return n * 10 if THOROUGH else n


def _fit(want: Iterable[Any], allowed: Iterable[Any] | None) -> tuple[Any, ...]:
    return tuple(w for w in want if allowed is None or w in allowed)


def _dims(want: tuple[tuple[int, int], ...], caps: Capabilities) -> tuple[tuple[int, int], ...]:
    hd, vd = caps.head_dims, caps.v_head_dims
    fit = tuple((d, v) for d, v in want if (hd is None or d in hd) and (vd is None or v in vd))
    if fit or hd is None:
        return fit
    # Declared widths the defaults miss: the smallest one (v as wide, or the smallest v).
    d = min(hd)
    v = d if vd is None or d in vd else min(vd)
    return ((d, v),)


def limits_for(caps: Capabilities, base: Limits = DEFAULT_LIMITS) -> Limits:
    """``base`` narrowed to what ``caps`` declares: its compute dtypes, head widths and page
    sizes (the smallest declared one where none of ``base``'s fits), tree verify only with
    ``custom_mask``."""
    dtypes = _fit(base.dtypes, caps.dtypes) or _fit(("float16",), caps.dtypes)
    pages = _fit(base.page_sizes, caps.page_sizes)
    if not pages and caps.page_sizes:
        pages = (min(caps.page_sizes),)
    return dataclasses.replace(
        base,
        dtypes=dtypes,
        page_sizes=pages,
        mha_dims=_dims(base.mha_dims, caps),
        mla_dims=_dims(base.mla_dims, caps),
        trees=base.trees and caps.custom_mask,
        mla_trees=base.mla_trees and caps.custom_mask,
    )


@dataclasses.dataclass(frozen=True)
class Subject:
    """The backend under test: its name, capabilities, device, limits and profile."""

    name: str
    caps: Capabilities
    device: str
    limits: Limits
    profile: ContractProfile

    @classmethod
    def of(cls, name: str, profile: ContractProfile | None = None) -> Subject:
        """The backend ``name``; skips when it is not registered or cannot run here."""
        caps = list_backends().get(name)
        if caps is None:
            known = ", ".join(sorted(list_backends())) or "none"
            pytest.skip(f"backend {name!r} is not registered in this install (registered: {known})")
        why = caps.availability_reasons("cuda" if caps.devices == {"cuda"} else "cpu")
        if why:
            pytest.skip(f"backend {name!r} cannot run here: {'; '.join(why)}")
        if "cuda" in caps.devices and torch.cuda.is_available():
            device = "cuda"
        elif "cpu" in caps.devices:
            device = "cpu"
        else:
            pytest.skip(
                f"backend {name!r} declares Capabilities.devices={sorted(caps.devices)!r}; "
                "this machine has no CUDA"
            )
        profile = profile or ContractProfile()
        limits = limits_for(caps, profile.limits or KIT_LIMITS)
        if not limits.dtypes:
            pytest.skip(
                f"backend {name!r} declares no compute dtype the kit checks: "
                f"Capabilities.dtypes={sorted(caps.dtypes)!r}"
            )
        return cls(name, caps, device, limits, profile)

    # -- what it declares -------------------------------------------------------------------

    def require(
        self, *, kind: str | None = None, phase: Phase | None = None, dtype: str | None = None
    ) -> None:
        """Skip, naming the capability, unless the backend declares this kind, phase, dtype."""
        c = self.caps
        if kind is not None and kind not in c.kinds:
            pytest.skip(
                f"{self.name!r} does not declare kind {kind!r} "
                f"(Capabilities.kinds={sorted(c.kinds)!r})"
            )
        if phase is not None and phase not in c.phases:
            phases = sorted(p.name.lower() for p in c.phases)
            pytest.skip(
                f"{self.name!r} does not declare phase {phase.name.lower()!r} "
                f"(Capabilities.phases={phases!r})"
            )
        if dtype is not None and dtype not in c.dtypes:
            pytest.skip(
                f"{self.name!r} does not declare dtype {dtype!r} "
                f"(Capabilities.dtypes={sorted(c.dtypes)!r})"
            )

    def refused(self, case: KernelCase) -> list[str]:
        """What of ``case`` the backend's capabilities refuse (empty: it must serve it)."""
        return self.caps.config_reasons(config_of(case, self.device), case.phase)

    def fit(self, case: KernelCase) -> KernelCase:
        """A fixed case moved to shapes the backend declares: head widths, page size and dtype
        replaced where refused (variants, phase and kind stay: those skip)."""
        c, lim = self.caps, self.limits
        dims = lim.mla_dims if case.kind == "mla" else lim.mha_dims
        over: dict[str, Any] = {}
        if (
            dims
            and (case.head_dim, case.v_head_dim) not in dims
            and (
                (c.head_dims is not None and case.head_dim not in c.head_dims)
                or (c.v_head_dims is not None and case.v_head_dim not in c.v_head_dims)
            )
        ):
            over.update(head_dim=dims[0][0], v_head_dim=dims[0][1])
        if c.page_sizes is not None and case.page_size not in c.page_sizes and lim.page_sizes:
            over["page_size"] = lim.page_sizes[0]
        if case.dtype not in c.dtypes and lim.dtypes:
            over["dtype"] = lim.dtypes[-1]
        return dataclasses.replace(case, **over) if over else case

    def declared(self, case: KernelCase) -> KernelCase:
        """``fit(case)``, or skip naming every capability that refuses it."""
        self.require(kind=case.kind, phase=case.phase)
        case = self.fit(case)
        why = self.refused(case)
        if why:
            pytest.skip(f"outside {self.name!r}'s declared Capabilities: {'; '.join(why)}")
        return case

    def served(self, kind: str, phase: Phase) -> tuple[Served, dict[str, list[str]]]:
        """What the backend declares of the variants and FP8 formats for (kind, phase), probed
        one at a time on a small config of that kind; and, per variant or format it refuses,
        the reasons."""
        lim = self.limits
        if kind == "mla":
            hd, dv = lim.mla_dims[0] if lim.mla_dims else (80, 64)
            dims = dict(num_q_heads=lim.mla_heads[-1], num_kv_heads=1, head_dim=hd, v_head_dim=dv)
        else:
            hd, dv = lim.mha_dims[0] if lim.mha_dims else (64, 64)
            dims = dict(num_q_heads=2, num_kv_heads=1, head_dim=hd, v_head_dim=dv)
        base = make_case(
            kind=kind,
            phase=phase,
            page_size=lim.page_sizes[0] if lim.page_sizes else 16,
            dtype=lim.dtypes[-1],
            **dims,
        )
        probes: dict[str, dict[str, object]] = {
            "window": dict(window_left=4),
            "logit_cap": dict(logit_cap=5.0),
            "sinks": dict(sinks=True),
            "non_causal": dict(causal=False),
            "chunked": dict(chunk=8),
            "lse": dict(lse=True),
            **{f: dict(kv_dtype=f) for f in FP8_FORMATS},
        }
        ok: list[str] = []
        why: dict[str, list[str]] = {}
        for name, over in probes.items():
            found = self.refused(dataclasses.replace(base, **over))  # type: ignore[arg-type]
            if found:
                why[name] = found
            else:
                ok.append(name)
        return Served(
            variants=frozenset(ok) & set(_VARIANTS),
            fp8=tuple(f for f in FP8_FORMATS if f in ok),
        ), why

    def shapes_for(self, kind: str) -> None:
        """Skip unless the limits leave a head width of ``kind`` to draw."""
        dims = self.limits.mla_dims if kind == "mla" else self.limits.mha_dims
        if not dims or not self.limits.page_sizes:
            pytest.skip(
                f"{self.name!r} declares no {kind} head width or page size the kit draws "
                f"(Capabilities.head_dims={self.caps.head_dims!r}, "
                f"page_sizes={self.caps.page_sizes!r})"
            )

    # -- running it -------------------------------------------------------------------------

    def run_case(self, case: KernelCase) -> tuple[Any, Materialised]:
        """``attention`` on the case: ``out``, or ``(out, lse)`` for a case with ``lse``."""
        m = materialise(case, self.device)
        binding = bind(self.name, m.config, label=f"contract-{self.name}")
        kw = m.extras()
        if case.lse:
            kw["return_lse"] = True
        with attn_scope(binding, m.batch):
            out = attention(m.q, m.k_cache, m.v_cache, sm_scale=m.sm_scale, **kw)
        return out, m

    def check(self, case: KernelCase) -> None:
        """The backend's answer for ``case`` equals the oracle's (dtype, shape, values, lse)."""
        result, m = self.run_case(case)
        out, lse = result if case.lse else (result, None)
        where = f"backend {self.name!r} on {case!r}"
        assert out.dtype == m.q.dtype, f"{where}: out dtype {out.dtype}, q dtype {m.q.dtype}"
        want = (sum(case.q_lens), case.num_q_heads, case.v_head_dim)
        assert tuple(out.shape) == want, f"{where}: out shape {tuple(out.shape)}, want {want}"
        ref, ref_lse = naive_state(m)
        atol, rtol = tolerance(case.dtype)
        torch.testing.assert_close(
            out.cpu().double(),
            ref,
            atol=atol,
            rtol=rtol,
            msg=lambda text: f"{where}: out differs from the float64 oracle\n{text}",
        )
        if lse is not None:
            assert_lse_matches(lse, m, ref_lse)

    def check_drawn(self, case: KernelCase) -> None:
        """``check`` for a drawn case; one the capabilities refuse (a backend's own
        ``checks``, which limits cannot see) is rejected, not run."""
        if self.refused(case):
            reject()
        self.check(case)


@pytest.fixture(name="attn_contract_subject")
def contract_subject_fixture(
    attn_backend: str, attn_contract_profile: ContractProfile | None
) -> Subject:
    """The fixture ``attn_contract_subject``: the backend under test (``attn_backend``, from
    ``--attn-backend``) as a ``Subject``. A test module imports it to use it."""
    return Subject.of(attn_backend, attn_contract_profile)
