"""The paged path hands each layer's attention a buffer (``attention(..., out=buf)``) when the
backend declares ``Capabilities.out_buffer``: the same tokens as without, the buffer really
passed and reused across layers and steps, never overwritten while transformers (a hook,
autograd) still holds a layer's output, and a backend without ``out_buffer`` served as before
(no ``out=``, no copy). The spies wrap the torch reference, so both runs compute the same
numbers."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from attn_dispatch import AttnConfig  # noqa: E402
from attn_dispatch import Phase  # noqa: E402
from attn_dispatch.backend import BackendBase  # noqa: E402
from attn_dispatch.backend import register_backend  # noqa: E402
from attn_dispatch.backend import unregister_backend  # noqa: E402
from attn_dispatch.backends.reference import CAPABILITIES  # noqa: E402
from attn_dispatch.integrations.transformers import PagedCache  # noqa: E402
from attn_dispatch.integrations.transformers import use  # noqa: E402
from tests.integrations.transformers.test_transformers import left_padded  # noqa: E402
from tests.integrations.transformers.tiny import gemma2  # noqa: E402
from tests.integrations.transformers.tiny import llama  # noqa: E402

# Every handler call of the spies: (backend name, q, out or None), in order.
CALLS: list[tuple[str, Any, Any]] = []


class _Spy(BackendBase):
    """The torch reference, recording each call's ``out=`` (None when not given)."""

    def __init__(self, config: AttnConfig, **options: Any) -> None:
        from attn_dispatch.backends.reference.backend import TorchBackend

        self.inner = TorchBackend(config)

    def plan(self, batch: Any) -> Any:
        return self.inner.plan(batch)

    def handler(self, phase: Phase) -> Any:
        name, run = self.name, self.inner.run

        def spy(q: Any, k: Any, v: Any, plan: Any, sm_scale: float, **kw: Any) -> Any:
            out = kw.get("out")
            CALLS.append((name, q, out))
            result = run(q, k, v, plan, sm_scale, **kw)
            assert out is None or result is out
            return result

        return spy


def _factory(name: str) -> Any:
    def make(config: AttnConfig, **options: Any) -> _Spy:
        spy = _Spy(config, **options)
        spy.name = name
        return spy

    return make


@pytest.fixture
def spies() -> Iterator[None]:
    """``spy_out`` declares ``out_buffer``; ``spy_plain`` does not."""
    for name, takes in (("spy_out", True), ("spy_plain", False)):
        register_backend(
            name,
            capabilities=dataclasses.replace(CAPABILITIES, out_buffer=takes),
            factory=_factory(name),
            replace=True,
        )
    CALLS.clear()
    yield
    CALLS.clear()
    for name in ("spy_out", "spy_plain"):
        unregister_backend(name)


def _generate(model: Any, spec: Any, new: int = 6) -> tuple[Any, Any, PagedCache]:
    """Greedy tokens and scores of a left-padded batch (the prefill has padding rows)."""
    bound = use(model, spec, page_size=4)
    ids, mask, _ = left_padded([9, 5])
    try:
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                do_sample=False,
                return_dict_in_generate=True,
                output_scores=True,
            )
    finally:
        bound.remove()
    return out.sequences, torch.stack(out.scores), out.past_key_values


def _storage(t: Any) -> int:
    return int(t.untyped_storage().data_ptr())


@pytest.mark.usefixtures("spies")
def test_out_is_passed_reused_and_gives_the_same_tokens() -> None:
    tokens, scores, cache = _generate(llama(), "spy_out")
    outs = [out for _, _, out in CALLS]
    assert len(outs) == 2 * 6 and all(out is not None for out in outs)  # 6 forwards x 2 layers
    assert all(out.is_contiguous() for out in outs)
    assert all(_storage(out) != _storage(q) for _, q, out in CALLS)
    # Prefill (padding rows): the kernel writes the 14 real rows compactly, one buffer for
    # both layers; then every decode step of every layer writes into one [2, 4, 16] buffer.
    assert [tuple(o.shape) for o in outs[:2]] == [(14, 4, 16)] * 2 and outs[0] is outs[1]
    decode = outs[2:]
    assert all(o is decode[0] for o in decode) and tuple(decode[0].shape) == (2, 4, 16)
    # The prefill's buffers were dropped when the decode's shapes began.
    assert len(cache.out_buffers) == 1
    CALLS.clear()
    plain_tokens, plain_scores, _ = _generate(llama(), "spy_plain")
    assert CALLS and all(out is None for _, _, out in CALLS)  # no out=, so no copy into one
    assert torch.equal(tokens, plain_tokens)
    assert torch.equal(scores, plain_scores)


@pytest.mark.usefixtures("spies")
def test_each_group_follows_its_own_backend() -> None:
    """Gemma 2 (sliding and full layers, a soft-cap): the sliding group's backend takes out=,
    the full group's does not; the tokens are those of the reference without out=."""
    tokens, scores, _ = _generate(gemma2(), {"sliding": "spy_out", "full": "spy_plain"})
    by_name = {n: [out for name, _, out in CALLS if name == n] for n in ("spy_out", "spy_plain")}
    assert by_name["spy_out"] and all(o is not None for o in by_name["spy_out"])
    assert by_name["spy_plain"] and all(o is None for o in by_name["spy_plain"])
    plain_tokens, plain_scores, _ = _generate(gemma2(), "spy_plain")
    assert torch.equal(tokens, plain_tokens)
    assert torch.equal(scores, plain_scores)


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_an_output_still_held_is_never_overwritten(backend: str) -> None:
    """A hook keeps every layer's attention output (o_proj's input): each later layer gets a
    buffer of its own, and every kept output still holds what it held when o_proj read it."""
    model = llama(layers=3)
    kept: list[tuple[Any, Any]] = []

    def keep(module: Any, args: tuple[Any, ...]) -> None:
        kept.append((args[0], args[0].clone()))

    hooks = [layer.self_attn.o_proj.register_forward_pre_hook(keep) for layer in model.model.layers]
    try:
        tokens, scores, _ = _generate(model, backend)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(kept) == 3 * 6
    for held, snapshot in kept:
        assert torch.equal(held, snapshot)
    assert len({_storage(held) for held, _ in kept}) == len(kept)
    free_tokens, free_scores, _ = _generate(model, backend)
    assert torch.equal(tokens, free_tokens)
    assert torch.allclose(scores, free_scores, rtol=0, atol=1e-6)


@pytest.mark.usefixtures("spies")
def test_a_forward_with_grad_enabled_is_served_without_out() -> None:
    """Autograd keeps o_proj's input and refuses out= on tensors that need grad: a forward
    with grad enabled gives the attention no buffer and the same logits as one without."""
    model = llama()
    ids, mask, _ = left_padded([6, 6])
    bound = use(model, "spy_out", page_size=4)
    try:
        with torch.no_grad():
            want = model(input_ids=ids, attention_mask=mask).logits
        CALLS.clear()
        got = model(input_ids=ids, attention_mask=mask).logits
    finally:
        bound.remove()
    assert got.requires_grad
    assert CALLS and all(out is None for _, _, out in CALLS)
    assert torch.equal(got.detach(), want)


@pytest.mark.usefixtures("spies")
def test_a_bucketed_spec_follows_the_bucket_that_serves_the_forward() -> None:
    """Decode bucketed by context: the steps up to 12 keys run on ``spy_out`` (given out=),
    the later ones on ``spy_plain`` (not); every call gets out= exactly when its backend
    declares out_buffer."""
    tokens, scores, _ = _generate(llama(), "prefill=spy_plain,decode=context<=12:spy_out|spy_plain")
    assert {name for name, _, _ in CALLS[2:]} == {"spy_out", "spy_plain"}
    assert all((out is not None) == (name == "spy_out") for name, _, out in CALLS)
    plain_tokens, plain_scores, _ = _generate(llama(), "spy_plain")
    assert torch.equal(tokens, plain_tokens)
    assert torch.equal(scores, plain_scores)
