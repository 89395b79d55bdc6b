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

SMALL = TuneSizes(
    prefill_batch=1, prefill_len=16, decode_batch=2, context=32, draft_tokens=2, repeats=2
)
MHA = AttnConfig(
    kind="mha", num_q_heads=4, num_kv_heads=2, head_dim=16, dtype="float32", page_size=8
)
MLA = AttnConfig(
    kind="mla",
    num_q_heads=2,
    num_kv_heads=1,
    head_dim=24,
    v_head_dim=16,
    dtype="float32",
    page_size=8,
    tree_verify=True,
)


def test_recommends_the_fastest_measured_backend_per_phase():
    report = tune({"full": MHA, "latent": MLA}, sizes=SMALL, backends=["torch", "native"])
    for group in ("full", "latent"):
        best = {}
        for phase in ("prefill", "decode", "verify"):
            cells = [
                t
                for t in report.timings
                if t.group == group and t.phase == phase and t.call_s is not None
            ]
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
    # flashinfer needs CUDA: on a CPU machine the reason says so; nothing is substituted.
    import torch

    if not torch.cuda.is_available():
        assert "CUDA" in report.unavailable["flashinfer"]
        assert "not timed: flashinfer:" in report.table()
        assert all(t.backend != "flashinfer" for t in report.timings)


def test_a_backend_that_cannot_serve_is_refused_with_bind_reason():
    capped = AttnConfig(
        kind="mha",
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        dtype="float32",
        page_size=8,
        logit_cap=30.0,
    )
    # sdpa (built in, CPU) declares no logit_cap: no fused kernel applies a soft-cap.
    report = tune({"": capped}, sizes=SMALL, backends=["torch", "sdpa"])
    cells = [t for t in report.timings if t.backend == "sdpa"]
    assert len(cells) == 3 and all(t.refused and "logit_cap" in t.refused for t in cells)
    assert all(t.call_s is not None for t in report.timings if t.backend == "torch")


def test_bad_input_is_refused():
    with pytest.raises(InvalidSpecError, match="decode_batch"):
        TuneSizes(decode_batch=0)
    with pytest.raises(InvalidSpecError, match="backends"):
        tune({"": MHA}, sizes=SMALL, backends=["no-such-backend"])


def test_cli_tune_prints_the_table_and_json(capsys):
    from attn_dispatch.cli import main

    args = [
        "tune",
        "--kind",
        "mha",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--head-dim",
        "16",
        "--dtype",
        "float32",
        "--page-size",
        "8",
        "--prefill-len",
        "16",
        "--decode-batch",
        "2",
        "--context",
        "32",
        "--draft-tokens",
        "2",
        "--repeats",
        "1",
        "--backends",
        "torch,native",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "recommended:" in out and "native ISA" in out
    assert main([*args, "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["recommended"]) == {""}
    assert {t["backend"] for t in data["timings"]} == {"torch", "native"}


def test_cli_tune_refuses_demo_with_shape_flags(capsys):
    from attn_dispatch.cli import main

    with pytest.raises(SystemExit) as e:
        main(["tune", "--demo", "tiny", "--heads", "4"])
    assert e.value.code == 2
    assert "--demo names the layer shapes" in capsys.readouterr().err


def test_cli_tune_demo_tiny_recommends_for_both_runners(capsys):
    from attn_dispatch.cli import main

    assert (
        main(
            [
                "tune",
                "--demo",
                "tiny",
                "--prefill-len",
                "16",
                "--decode-batch",
                "2",
                "--context",
                "32",
                "--repeats",
                "1",
                "--backends",
                "torch,native",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "recommended [target]:" in out and "recommended [draft]:" in out
