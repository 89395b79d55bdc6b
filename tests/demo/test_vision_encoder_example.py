"""examples/vision_encoder.py: a non-causal encoder runner and a causal decoder runner, each on
its own binding, match SDPA with is_causal False and True respectively."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from attn_dispatch import AttnDispatchError  # noqa: E402
from attn_dispatch import bind  # noqa: E402
from attn_dispatch.backend import list_backends  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vision_encoder.py"


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("vision_encoder_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_encoder_and_decoder_match_sdpa(backend: str, capsys: pytest.CaptureFixture[str]) -> None:
    if backend not in list_backends():
        pytest.skip(f"backend {backend!r} is not registered")
    ex = _example()
    try:
        bind(backend, ex.AttnConfig("mha", 4, 2, 32, 32, dtype="float32", causal=False))
    except AttnDispatchError as exc:  # the native library may be unbuilt on this machine
        pytest.skip(f"{backend!r} cannot serve here: {exc}")
    assert ex.main(["--spec", backend]) == 0
    out = capsys.readouterr().out
    assert "vision_encoder  prefill  " + backend in out and "matches SDPA: yes" in out


def test_the_encoder_is_really_bidirectional() -> None:
    # The same data through a causal binding is far from non-causal SDPA: the check can fail.
    ex = _example()
    lens = [49, 64]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lens), ex.HEADS, ex.DIM, generator=gen)
    k = torch.randn(sum(lens), ex.KV_HEADS, ex.DIM, generator=gen)
    v = torch.randn(sum(lens), ex.KV_HEADS, ex.DIM, generator=gen)
    diff = (ex.sdpa(q, k, v, lens, True) - ex.sdpa(q, k, v, lens, False)).abs().max()
    assert float(diff) > 1e-2
