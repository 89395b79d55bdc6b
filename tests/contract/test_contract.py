"""The kernel contract over every built-in backend: the kit's suite
(``attn_dispatch.testing.contract.test_contract``, parametrised by conftest.py), and what only
this repository checks (the torch reference's own bounds)."""

from __future__ import annotations

import torch

from attn_dispatch import AttnBatch
from attn_dispatch import Phase
from attn_dispatch import bind
from attn_dispatch.testing.contract.cases import config_of
from attn_dispatch.testing.contract.cases import make_case
from attn_dispatch.testing.contract.cases import materialise
from attn_dispatch.testing.contract.harness import Subject
from attn_dispatch.testing.contract.test_contract import *  # noqa: F403  (the kit's tests)


def test_config_of_marks_tree_verify() -> None:
    case = make_case(phase=Phase.VERIFY, trees=((-1, 0, 1),))
    assert config_of(case).tree_verify
    assert isinstance(materialise(case).batch, AttnBatch)


def test_reference_long_context_is_chunked() -> None:
    """A 32k-token decode: the reference never holds more than one chunk of scores."""
    from attn_dispatch.backends.reference import backend as ref

    case = make_case(
        kind="mla",
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=80,
        v_head_dim=64,
        phase=Phase.DECODE,
        q_lens=(1,),
        prefix_lens=(32767,),
        page_size=64,
    )
    m = materialise(case)
    binding = bind("torch", m.config)
    plan = binding.plan(m.batch)
    assert plan.chunk_pages * case.page_size == ref.CHUNK_TOKENS < 32768
    seen: list[int] = []
    real_update = ref._OnlineSoftmax.update

    def spy(
        self: object, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, s: float
    ) -> None:
        seen.append(k.shape[-2])
        real_update(self, k, v, allowed, s)  # type: ignore[arg-type]

    ref._OnlineSoftmax.update = spy  # type: ignore[method-assign]
    try:
        Subject.of("torch").check(case)
    finally:
        ref._OnlineSoftmax.update = real_update  # type: ignore[method-assign]
    assert len(seen) == 16 and max(seen) == ref.CHUNK_TOKENS
