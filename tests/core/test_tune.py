"""tune: times each backend per group x phase and recommends the fastest; refusals listed."""

from __future__ import annotations

import json

import pytest

from attn_dispatch import AttnConfig
from attn_dispatch import BackendSpec
from attn_dispatch import Phase
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch.tune import TuneSizes
from attn_dispatch.tune import tune

SMALL = TuneSizes(prefill_batch=1, prefill_len=16, decode_batch=2, context=32, draft_tokens=2,
                  repeats=2)
MHA = AttnConfig(kind="mha", num_q_heads=4, num_kv_heads=2, head_dim=16, dtype="float32",
                 page_size=8)
MLA = AttnConfig(kind="mla", num_q_heads=2, num_kv_heads=1, head_dim=24, v_head_dim=16,
                 dtype="float32", page_size=8, tree_verify=True)


def test_recommends_the_fastest_measured_backend_per_phase():
    report = tune({"full": MHA, "latent": MLA}, sizes=SMALL, backends=["torch", "native"])
    for group in ("full", "latent"):
        best = {}
        for phase in ("prefill", "decode", "verify"):
            cells = [t for t in report.timings if t.group == group and t.phase == phase
                     and t.call_s is not None]
            assert {c.backend for c in cells} == {"torch", "native"}
            best[phase] = min(cells, key=lambda c: c.forward_s(1)).backend
        spec = BackendSpec.parse(report.recommended[group])
        for phase, name in best.items():
            assert spec.backend_for(Phase[phase.upper()]) == name, (report.recommended, best)
    table = report.table()
    assert "machine:" in table and "threads:" in table and "recommended [full]:" in table
    data = json.loads(report.to_json())
    assert data["recommended"] == dict(report.recommended)


def test_unavailable_backends_are_listed_with_their_reason():
    report = tune({"": MHA}, sizes=SMALL)
    refused = {t.backend: t.refused for t in report.timings if t.call_s is None}
    # flashinfer and triton need CUDA here; the reason says so, nothing is substituted.
    import torch

    if not torch.cuda.is_available():
        assert "flashinfer" in refused and refused["flashinfer"].startswith("unavailable")


def test_a_backend_that_cannot_serve_is_refused_with_bind_reason():
    capped = AttnConfig(kind="mha", num_q_heads=4, num_kv_heads=2, head_dim=16, dtype="float32",
                        page_size=8, logit_cap=30.0)
    from attn_dispatch import list_backends

    refusing = [n for n, c in list_backends().items()
                if not c.availability_reasons() and "logit_cap" not in c.variants]
    if not refusing:
        pytest.skip("every available backend here serves logit_cap")
    report = tune({"": capped}, sizes=SMALL, backends=["torch", refusing[0]])
    cells = [t for t in report.timings if t.backend == refusing[0]]
    assert cells and all(t.refused for t in cells)


def test_bad_input_is_refused():
    with pytest.raises(InvalidSpecError, match="decode_batch"):
        TuneSizes(decode_batch=0)
    with pytest.raises(InvalidSpecError, match="backends"):
        tune({"": MHA}, sizes=SMALL, backends=["no-such-backend"])
