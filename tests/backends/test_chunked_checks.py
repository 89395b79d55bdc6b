"""The chunked-prefix MLA form (``AttnForm.MHA_CHUNKED``) is checked once, by the public checker
(``attn_dispatch.backend.TensorChecks.check_chunked`` / ``prefix_chunks``), on every backend that
serves it: each mistake below is refused with our error, naming the argument, on each of them
(issue 46: the per-backend copies had drifted; the reference took ``sinks=`` on a sink-free
layer and ``k_new``/``v_new`` of any dtype, sdpa took ``return_lse=1``).

The handlers are called directly, as a framework calling a backend without a binding would: a
binding's calls pass the core's same rules first.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from attn_dispatch import AttnBatch
from attn_dispatch import AttnConfig
from attn_dispatch import InvalidBatchError
from attn_dispatch import Phase
from attn_dispatch._registry import get_backend
from attn_dispatch.backend import list_backends

ROOT = Path(__file__).resolve().parents[2]

#: Every registered backend that declares the chunked form in prefill.
CHUNKED = sorted(
    name for name, caps in list_backends().items() if "mha_chunked" in caps.forms_for(Phase.PREFILL)
)

H, D, DV = 4, 16, 8  # heads, q/k head dim, v head dim (differ, so a swapped width is caught)
Q_LENS, KV_LENS = [2, 1], [5, 3]  # prefixes of 3 and 2 tokens


def test_the_chunked_backends_are_the_expected_ones() -> None:
    # So the parametrisation below cannot go empty: the built-ins that serve the form.
    assert {"sdpa", "torch"} <= set(CHUNKED), CHUNKED


def _config(sinks: bool = False) -> AttnConfig:
    return AttnConfig("mha", H, H, D, DV, dtype="float32", page_size=1, device="cpu",
                      sinks=sinks)  # fmt: skip


def _batch(masks: list[torch.Tensor] | None = None) -> AttnBatch:
    tables = [[0, 1, 2, 3, 4], [5, 6, 7]]
    return AttnBatch.build(Phase.PREFILL, q_lens=Q_LENS, kv_lens=KV_LENS, page_tables=tables,
                           page_size=1, num_pages=8, masks=masks)  # fmt: skip


def _handler(name: str, config: AttnConfig) -> Callable[..., Any]:
    entry = get_backend(name)
    reasons = entry.capabilities.availability_reasons("cpu")
    if reasons:
        pytest.skip(f"{name}: {'; '.join(reasons)}")
    backend = entry.load_factory()(config)
    run: Callable[..., Any] = backend.chunked_handler(Phase.PREFILL)
    return run


def _args(dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    t = sum(Q_LENS)
    prefix = [k - q for k, q in zip(KV_LENS, Q_LENS, strict=True)]
    rows = sum(prefix)
    k_c = torch.randn(rows, H, D, generator=g).to(dtype)
    v_c = torch.randn(rows, H, DV, generator=g).to(dtype)
    return {
        "q": torch.randn(t, H, D, generator=g).to(dtype),
        "k_new": torch.randn(t, H, D, generator=g).to(dtype),
        "v_new": torch.randn(t, H, DV, generator=g).to(dtype),
        "batch": _batch(),
        "sm_scale": 0.25,
        "prefix": [(k_c, v_c, [0, prefix[0], rows])],
    }


def _call(run: Callable[..., Any], args: dict[str, Any], **keywords: Any) -> Any:
    a = dict(args)
    return run(a.pop("q"), a.pop("k_new"), a.pop("v_new"), a.pop("batch"), a.pop("sm_scale"),
               a.pop("prefix"), **keywords)  # fmt: skip


def _chunks(k_rows: int, indptr: list[int], **change: Any) -> list[tuple[Any, ...]]:
    k_c, v_c = torch.randn(k_rows, H, D), torch.randn(k_rows, H, DV)
    k_c, v_c = change.get("k", k_c), change.get("v", v_c)
    return [(k_c, v_c, indptr)]


#: (what is wrong, the changed arguments, the keywords, the field named, words of the message)
MISTAKES: list[tuple[str, dict[str, Any], dict[str, Any], str, str]] = [
    ("return_lse an int", {}, {"return_lse": 1}, "return_lse", "True or False"),
    ("return_lse a string", {}, {"return_lse": "yes"}, "return_lse", "True or False"),
    ("sinks on a sink-free layer", {}, {"sinks": torch.zeros(H)}, "sinks", "sinks=False"),
    ("k_new float64", {"k_new": torch.zeros(3, H, D, dtype=torch.float64)}, {}, "k_new",
     "torch.float64"),
    ("v_new bfloat16", {"v_new": torch.zeros(3, H, DV, dtype=torch.bfloat16)}, {}, "v_new",
     "torch.bfloat16"),
    ("k_new on another device", {"k_new": torch.zeros(3, H, D, device="meta")}, {}, "k_new",
     "meta"),
    ("v_new on another device", {"v_new": torch.zeros(3, H, DV, device="meta")}, {}, "v_new",
     "meta"),
    ("k_new of another width", {"k_new": torch.zeros(3, H, DV)}, {}, "k_new", f"[3, {H}, {D}]"),
    ("v_new of q's width", {"v_new": torch.zeros(3, H, D)}, {}, "v_new", f"[3, {H}, {DV}]"),
    ("k_new not a tensor", {"k_new": [[0.0]]}, {}, "k_new", "new tokens"),
    ("sm_scale zero", {"sm_scale": 0.0}, {}, "sm_scale", "> 0"),
    ("sm_scale NaN", {"sm_scale": float("nan")}, {}, "sm_scale", "not finite"),
    ("no prefix", {"prefix": None}, {}, "prefix", "needs the cached prefix"),
    ("prefix not iterable", {"prefix": 3}, {}, "prefix", "iterable"),
    ("a chunk not a triple", {"prefix": [(torch.zeros(5, H, D),)]}, {}, "prefix",
     "(k_chunk, v_chunk, indptr)"),
    ("a chunk in float64", {"prefix": _chunks(5, [0, 3, 5], k=torch.zeros(5, H, D).double())},
     {}, "prefix", "torch.float64"),
    ("a chunk on another device",
     {"prefix": _chunks(5, [0, 3, 5], v=torch.zeros(5, H, DV, device="meta"))}, {}, "prefix",
     "meta"),
    ("a chunk of other heads", {"prefix": _chunks(5, [0, 3, 5], k=torch.zeros(5, 2, D))}, {},
     "prefix", f"[rows, {H}, {D}]"),
    ("v_chunk of q's width", {"prefix": _chunks(5, [0, 3, 5], v=torch.zeros(5, H, D))}, {},
     "prefix", f"[rows, {H}, {DV}]"),
    ("an indptr past the rows", {"prefix": _chunks(4, [0, 3, 5])}, {}, "prefix",
     "within the chunk's 4 rows"),
    ("an indptr decreasing", {"prefix": _chunks(5, [0, 4, 3])}, {}, "prefix", "non-decreasing"),
    ("an indptr of other requests", {"prefix": _chunks(5, [0, 5])}, {}, "prefix", "want 3"),
    ("chunks past a prefix", {"prefix": _chunks(6, [0, 4, 6])}, {}, "prefix", "more than the 3"),
    ("chunks short of a prefix", {"prefix": _chunks(4, [0, 3, 4])}, {}, "prefix",
     "cover 1 prefix tokens but the request has 2"),
]  # fmt: skip


@pytest.mark.parametrize("name", CHUNKED)
@pytest.mark.parametrize(
    ("change", "keywords", "field", "words"),
    [pytest.param(*m[1:], id=m[0]) for m in MISTAKES],
)
def test_each_mistake_is_refused_with_our_error(
    name: str, change: dict[str, Any], keywords: dict[str, Any], field: str, words: str
) -> None:
    run = _handler(name, _config())
    args = _args()
    _call(run, args)  # the call without the mistake runs
    with pytest.raises(InvalidBatchError) as err:
        _call(run, {**args, **change}, **keywords)
    assert err.value.field == field, err.value
    assert words in str(err.value), err.value


@pytest.mark.parametrize("name", CHUNKED)
def test_the_request_at_fault_is_named(name: str) -> None:
    run = _handler(name, _config())
    with pytest.raises(InvalidBatchError) as err:  # request 1 has a prefix of 2, given 3
        _call(run, {**_args(), "prefix": _chunks(6, [0, 3, 6])})
    assert err.value.field == "prefix" and err.value.request == 1, err.value
    with pytest.raises(InvalidBatchError) as err:  # request 0 has 3, given 2
        _call(run, {**_args(), "prefix": _chunks(4, [0, 2, 4])})
    assert err.value.field == "prefix" and err.value.request == 0, err.value


@pytest.mark.parametrize("name", CHUNKED)
def test_a_sinks_layer_needs_its_sinks(name: str) -> None:
    run = _handler(name, _config(sinks=True))
    args = _args()
    _call(run, args, sinks=torch.zeros(H))
    for bad, words in [(None, "sinks=True"), (torch.zeros(H + 1), "shape"),
                       (torch.zeros(H, dtype=torch.float64), "float32")]:  # fmt: skip
        with pytest.raises(InvalidBatchError, match=words) as err:
            _call(run, args, sinks=bad)
        assert err.value.field == "sinks"


@pytest.mark.parametrize("name", CHUNKED)
def test_a_tree_batch_is_refused(name: str) -> None:
    run = _handler(name, _config())
    masks = [
        torch.ones(q, k, dtype=torch.bool).tril(k - q) for q, k in zip(Q_LENS, KV_LENS, strict=True)
    ]
    with pytest.raises(InvalidBatchError, match="causal only") as err:
        _call(run, {**_args(), "batch": _batch(masks)})
    assert err.value.field == "custom_mask"


@pytest.mark.parametrize("name", CHUNKED)
def test_the_backends_agree_on_a_valid_call(name: str) -> None:
    args = _args()
    got = _call(_handler(name, _config()), args, return_lse=True)
    want = _call(_handler("torch", _config()), args, return_lse=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_checks_live_in_the_public_checker_only() -> None:
    # One copy: no backend module words a chunked-form check of its own.
    needles = ("needs the cached prefix", "chunk indptr", "chunks cover")
    found = [
        f"{path.relative_to(ROOT)}: {needle!r}"
        for path in sorted((ROOT / "attn_dispatch" / "backends").rglob("*.py"))
        for needle in needles
        if needle in path.read_text(encoding="utf-8")
    ]
    assert found == []
    checker = (ROOT / "attn_dispatch" / "_tensor_checks.py").read_text(encoding="utf-8")
    assert all(needle in checker for needle in needles)


@pytest.mark.parametrize("name", ["torch", "sdpa", "native"])
def test_the_paged_handler_refuses_sinks_on_a_sink_free_layer(name: str) -> None:
    # The same keyword rule on the paged route (TensorChecks.check_keywords): the reference
    # applied sinks given to a sink-free layer when called without a binding.
    config = AttnConfig("mha", H, 2, D, dtype="float32", device="cpu", page_size=4)
    entry = get_backend(name)
    if entry.capabilities.availability_reasons("cpu"):
        pytest.skip(f"{name}: {entry.capabilities.availability_reasons('cpu')}")
    backend = entry.load_factory()(config)
    batch = AttnBatch.build(Phase.DECODE, q_lens=[1], kv_lens=[5], page_tables=[[1, 0]],
                            page_size=4)  # fmt: skip
    q, k = torch.randn(1, H, D), torch.randn(2, 4, 2, D)
    run: Any = backend.handler(Phase.DECODE)
    plan = backend.plan(batch)
    run(q, k, k, plan, 0.25)
    with pytest.raises(InvalidBatchError, match="sinks=False") as err:
        run(q, k, k, plan, 0.25, sinks=torch.zeros(H))
    assert err.value.field == "sinks"
