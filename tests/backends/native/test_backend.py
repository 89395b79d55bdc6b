"""The native C++ backend against the float64 oracle (tests/oracle.py).

Also: thread-count independence, very long page tables, every validation error path, and the
"not built" report when the library is missing.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import textwrap
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from attn_dispatch import AttnBatch  # noqa: E402
from attn_dispatch import AttnConfig  # noqa: E402
from attn_dispatch import InvalidBatchError  # noqa: E402
from attn_dispatch import Phase  # noqa: E402
from attn_dispatch._errors import AttnDispatchError  # noqa: E402
from attn_dispatch._errors import BackendUnavailableError  # noqa: E402
from attn_dispatch.backends.native import CAPABILITIES  # noqa: E402
from attn_dispatch.backends.native._lib import load  # noqa: E402
from attn_dispatch.backends.native._lib import unavailable_reason  # noqa: E402
from tests import oracle  # noqa: E402

LIB = load()
needs_lib = pytest.mark.skipif(isinstance(LIB, str), reason=f"native library: {LIB}")
ISAS = () if isinstance(LIB, str) else LIB.isa_list

if not isinstance(LIB, str):
    from attn_dispatch.backends.native.backend import NativeBackend


# -- problem builder (the reference is tests/oracle.py) ------------------------------------------


def make_case(
    kind: str,
    phase: Phase,
    *,
    q_lens: list[int],
    kv_lens: list[int],
    page_size: int,
    hq: int,
    hkv: int,
    d: int,
    dv: int,
    dtype: Any = torch.float32,
    kv_dtype: Any = torch.float32,
    tree: bool = False,
    seed: int = 0,
    window: int | None = None,
    cap: float | None = None,
    sinks: bool = False,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> dict[str, Any]:
    """Random paged cache with shuffled page tables (pages of different requests interleave)."""
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    need = [(k + page_size - 1) // page_size for k in kv_lens]
    num_pages = sum(need) + 3  # spare pages that no request uses
    perm = list(range(num_pages))
    rnd.shuffle(perm)
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    masks = None
    if tree:
        masks = []
        for q, k in zip(q_lens, kv_lens, strict=True):
            m = torch.rand(q, k, generator=gen) < 0.6
            prefix = k - q
            m[:, :prefix] |= torch.rand(q, prefix, generator=gen) < 0.3
            m[torch.arange(q), prefix + torch.arange(q)] = True  # each query sees itself
            masks.append(m)
    batch = AttnBatch.build(
        phase, q_lens=q_lens, kv_lens=kv_lens, page_tables=tables, page_size=page_size,
        num_pages=num_pages, masks=masks,
    )  # fmt: skip
    t = sum(q_lens)
    q = torch.randn(t, hq, d, generator=gen).to(dtype)
    # Larger scores than randn gives, so a logit cap changes the result.
    q = q * 3 if cap is not None else q
    if kind == "mla":
        k_cache = torch.randn(num_pages, page_size, d, generator=gen).to(kv_dtype)
        v_cache = None
    else:
        k_cache = torch.randn(num_pages, page_size, hkv, d, generator=gen).to(kv_dtype)
        v_cache = torch.randn(num_pages, page_size, hkv, dv, generator=gen).to(kv_dtype)
    sink_t = torch.randn(hq, generator=gen) * 2 if sinks else None
    config = AttnConfig(
        kind, hq, hkv, d, dv, dtype=str(dtype).removeprefix("torch."),
        kv_dtype=str(kv_dtype).removeprefix("torch."), page_size=page_size, device="cpu",
        tree_verify=tree, window_left=window, logit_cap=cap, sinks=sinks,
    )  # fmt: skip
    extras: dict[str, Any] = {}
    if sinks:
        extras["sinks"] = sink_t
    if config.kv_fp8:
        extras["k_scale"] = k_scale
        if kind != "mla":
            extras["v_scale"] = v_scale
    return dict(
        config=config, batch=batch, q=q, k_cache=k_cache, v_cache=v_cache, tables=tables,
        masks=masks, q_lens=q_lens, kv_lens=kv_lens, scale=1.0 / math.sqrt(d), extras=extras,
    )  # fmt: skip


def naive(case: dict[str, Any]) -> torch.Tensor:
    """The float64 oracle (tests/oracle.py) for a case built by ``make_case``."""
    cfg = case["config"]
    extras = case.get("extras", {})
    return oracle.reference(
        case["q"], case["k_cache"], case["v_cache"], q_lens=case["q_lens"],
        kv_lens=case["kv_lens"], page_tables=case["tables"], masks=case["masks"],
        sm_scale=case["scale"], v_head_dim=cfg.v_head_dim, window_left=cfg.window_left,
        logit_cap=cfg.logit_cap, sinks=extras.get("sinks"),
        k_scale=extras.get("k_scale", 1.0), v_scale=extras.get("v_scale", 1.0),
    )  # fmt: skip


def run_native(case: dict[str, Any], **options: Any) -> torch.Tensor:
    backend = NativeBackend(case["config"], **options)
    plan = backend.plan(case["batch"])
    handler = backend.handler(case["batch"].phase)
    return handler(
        case["q"], case["k_cache"], case["v_cache"], plan, case["scale"], **case.get("extras", {})
    )


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    # fp32 output: fp32 accumulation over <= a few thousand keys; bf16 output: one rounding
    # of the result (2^-8 relative) dominates.
    if out.dtype == torch.bfloat16:
        torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    elif out.dtype == torch.float16:
        torch.testing.assert_close(out.double(), ref, atol=3e-3, rtol=3e-3)
    else:
        torch.testing.assert_close(out.double(), ref, atol=5e-5, rtol=1e-4)


# -- correctness ---------------------------------------------------------------------------------

SHAPES = {
    # kind, hq, hkv, d, dv
    "gqa": ("mha", 8, 2, 64, 64),
    "mha-odd": ("mha", 3, 3, 40, 24),  # dims that are not multiples of the vector width
    "gqa3": ("mha", 6, 2, 64, 32),  # 3 rows per kv head: tiles padded to 4 rows
    "mla": ("mla", 16, 1, 160, 128),  # small stand-in for 576/512: latent + rope
}
PHASES = {
    "decode": (Phase.DECODE, [1, 1, 1], [37, 300, 5], False),
    "prefill": (Phase.PREFILL, [7, 1, 40], [7, 90, 70], False),
    "verify-tree": (Phase.VERIFY, [4, 6], [50, 200], True),
}


@needs_lib
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize(
    "dtypes",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.float16),
    ],
    ids=["f32", "bf16", "f32q-bf16kv", "f16", "bf16q-f16kv"],
)
def test_matches_naive_reference(shape: str, phase: str, dtypes: tuple[Any, Any]) -> None:
    kind, hq, hkv, d, dv = SHAPES[shape]
    ph, q_lens, kv_lens, tree = PHASES[phase]
    case = make_case(
        kind, ph, q_lens=q_lens, kv_lens=kv_lens, page_size=16, hq=hq, hkv=hkv, d=d, dv=dv,
        dtype=dtypes[0], kv_dtype=dtypes[1], tree=tree,
    )  # fmt: skip
    out = run_native(case, num_threads=2)
    assert out.dtype == dtypes[0] and out.shape == (sum(q_lens), hq, dv)
    assert_close(out, naive(case))


@needs_lib
def test_bf16_query_with_fp32_cache() -> None:
    case = make_case(
        "mha", Phase.PREFILL, q_lens=[3, 5], kv_lens=[20, 5], page_size=4, hq=4, hkv=2, d=32,
        dv=32, dtype=torch.bfloat16, kv_dtype=torch.float32,
    )  # fmt: skip
    assert_close(run_native(case), naive(case))


@needs_lib
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_every_instruction_set_path(isa: str, kind: str) -> None:
    """Each compiled path (the fastest is the default) gives the reference's numbers."""
    assert not isinstance(LIB, str)
    shape = ("mla", 16, 1, 96, 64) if kind == "mla" else ("mha", 4, 2, 64, 64)
    before = LIB.isa
    LIB.set_isa(isa)
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for ph, q_lens, kv_lens, tree in PHASES.values():
                case = make_case(
                    shape[0], ph, q_lens=q_lens, kv_lens=kv_lens, page_size=8, hq=shape[1],
                    hkv=shape[2], d=shape[3], dv=shape[4], dtype=dtype, kv_dtype=dtype, tree=tree,
                )  # fmt: skip
                assert_close(run_native(case, num_threads=2), naive(case))
    finally:
        LIB.set_isa(before)
    with pytest.raises(ValueError, match="not available"):
        LIB.set_isa("sse9")


# Rows per kv head -> the decode kernel's score tile on the vdpbf16ps path: 1 row x 16 keys
# (MHA), 2 x 8 (groups of 2 and 6), 4 x 4 (the rest, padded to 4 rows). MLA with few heads
# (tensor-parallel shards) takes the same tiles, FP8 MLA widening its rows in the first one.
DECODE_TILE_SHAPES = {
    "mha": ("mha", 4, 4, 64, 64),
    "gqa2": ("mha", 4, 2, 64, 64),
    "gqa6": ("mha", 12, 2, 96, 64),
    "gqa3": ("mha", 6, 2, 64, 32),
    "gqa4": ("mha", 8, 2, 128, 128),
    "mla1": ("mla", 1, 1, 160, 128),
    "mla2": ("mla", 2, 1, 160, 128),
}


@needs_lib
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", DECODE_TILE_SHAPES)
def test_decode_tiles_for_every_group_size(isa: str, shape: str) -> None:
    """Decode (and a 2-token verify, 2x the rows) for 1, 2, 3, 4 and 6 rows per kv head, with
    bf16, e4m3 and e5m2 caches and blocks cut at every length mod 16: each ISA path gives the
    oracle's numbers (a tile that mixed up its rows' or keys' lanes, or read a padded key's
    score, fails here)."""
    assert not isinstance(LIB, str)
    kind, hq, hkv, d, dv = DECODE_TILE_SHAPES[shape]
    before = LIB.isa
    LIB.set_isa(isa)
    try:
        for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
            for ph, q_lens, kv_lens in (
                (Phase.DECODE, [1] * 6, [1, 9, 16, 31, 47, 300]),
                (Phase.VERIFY, [2, 2], [18, 77]),
            ):
                case = make_case(
                    kind, ph, q_lens=q_lens, kv_lens=kv_lens, page_size=16, hq=hq, hkv=hkv,
                    d=d, dv=dv, dtype=torch.bfloat16, kv_dtype=kv_dtype, k_scale=0.8,
                    v_scale=1.3, seed=hq + d,
                )  # fmt: skip
                for threads in (1, 2):
                    assert_close(run_native(case, num_threads=threads), naive(case))
    finally:
        LIB.set_isa(before)


# The prefetch cursor's modes (csrc/tile.h, PfCursor): lean for a call whose K/V fit in
# na::kLeanPrefetchBytes (8 MiB) and whose steps issue few lines, paced for the rest (more
# than 16 lines a step: MHA at head dim 128; or K/V past the bound).
LEAN_PREFETCH_BYTES = 8 << 20
PREFETCH_MODE_CASES = {
    "lean": ("mha", 8, 2, 64, [1] * 4, [33, 70, 300, 5]),
    "paced-by-lines": ("mha", 8, 8, 128, [1] * 4, [33, 70, 300, 5]),
    "paced-by-bytes": ("mha", 16, 8, 128, [1, 1], [1100, 1000]),
    "verify-paced-by-bytes": ("mha", 16, 8, 128, [3, 3], [1100, 1000]),
}


@needs_lib
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("mode", PREFETCH_MODE_CASES)
def test_prefetch_cursor_modes_give_the_oracles_numbers(isa: str, mode: str) -> None:
    """Both prefetch cursor modes, on every ISA path, 1 and 2 threads: the oracle's numbers.
    The cursor only issues prefetches, so a wrong mode costs time, never a result; a step that
    walked its queue wrongly would show here as a crash or a call that never returns."""
    assert not isinstance(LIB, str)
    kind, hq, hkv, d, q_lens, kv_lens = PREFETCH_MODE_CASES[mode]
    kv_bytes = sum(kv_lens) * hkv * 2 * d * 2  # bf16 K and V rows
    assert (kv_bytes > LEAN_PREFETCH_BYTES) == mode.endswith("by-bytes")
    phase = Phase.VERIFY if mode.startswith("verify") else Phase.DECODE
    case = make_case(
        kind, phase, q_lens=q_lens, kv_lens=kv_lens, page_size=16, hq=hq, hkv=hkv, d=d, dv=d,
        dtype=torch.bfloat16, kv_dtype=torch.bfloat16, seed=hkv + d,
    )  # fmt: skip
    before = LIB.isa
    LIB.set_isa(isa)
    try:
        want = naive(case)
        for threads in (1, 2):
            assert_close(run_native(case, num_threads=threads), want)
    finally:
        LIB.set_isa(before)


@needs_lib
@pytest.mark.parametrize("page_size", [1, 3, 64])
def test_page_sizes(page_size: int) -> None:
    case = make_case(
        "mla", Phase.DECODE, q_lens=[1, 1], kv_lens=[130, 7], page_size=page_size, hq=4, hkv=1,
        d=48, dv=32,
    )  # fmt: skip
    assert_close(run_native(case), naive(case))


@needs_lib
def test_context_spanning_thousands_of_pages() -> None:
    """6000 one-token pages, shuffled: split-KV plus a long gather, still exact."""
    case = make_case(
        "mla", Phase.DECODE, q_lens=[1, 1], kv_lens=[6000, 2500], page_size=1, hq=4, hkv=1,
        d=32, dv=16, seed=3,
    )  # fmt: skip
    assert len(case["tables"][0]) == 6000
    assert_close(run_native(case, num_threads=2), naive(case))
    verify = make_case(
        "mha", Phase.VERIFY, q_lens=[5], kv_lens=[4100], page_size=2, hq=2, hkv=1, d=16, dv=16,
        tree=True, seed=4,
    )  # fmt: skip
    assert_close(run_native(verify, num_threads=2), naive(verify))


@needs_lib
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_results_do_not_depend_on_thread_count(kind: str) -> None:
    """Bitwise: the plan (tiles and KV splits) does not depend on 1..8 threads, and each work
    item is computed the same way whichever thread runs it; merges run in split order."""
    shape = ("mla", 16, 1, 96, 64) if kind == "mla" else ("mha", 8, 2, 64, 64)
    for ph, q_lens, kv_lens, tree in PHASES.values():
        case = make_case(
            shape[0], ph, q_lens=q_lens, kv_lens=[k * 4 for k in kv_lens], page_size=16,
            hq=shape[1], hkv=shape[2], d=shape[3], dv=shape[4], dtype=torch.bfloat16,
            kv_dtype=torch.bfloat16, tree=tree,
        )  # fmt: skip
        one = run_native(case, num_threads=1)
        two = run_native(case, num_threads=2)
        four = run_native(case, num_threads=4)
        assert torch.equal(one, two) and torch.equal(one, four)
        assert_close(one, naive(case))


@needs_lib
def test_default_threads_follow_torch() -> None:
    case = make_case("mha", Phase.DECODE, q_lens=[1], kv_lens=[9], page_size=4, hq=2, hkv=1,
                     d=16, dv=16)  # fmt: skip
    backend = NativeBackend(case["config"])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert backend.threads() == 1
        assert NativeBackend(case["config"], num_threads=3).threads() == 3
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="num_threads"):
        NativeBackend(case["config"], num_threads=0)


@needs_lib
def test_fully_masked_rows_give_zeros() -> None:
    """A tree row may see nothing in some KV split: the merge must not produce NaN."""
    case = make_case(
        "mha", Phase.VERIFY, q_lens=[2], kv_lens=[1200], page_size=16, hq=2, hkv=1, d=16, dv=16,
        tree=True,
    )  # fmt: skip
    out = run_native(case, num_threads=2)
    assert torch.isfinite(out).all()
    assert_close(out, naive(case))


@needs_lib
def test_concurrent_callers_and_torch_threads() -> None:
    """Python threads may call in at once (ctypes drops the GIL; the pool serialises them),
    interleaved with torch's own intra-op threads (our pool is not OpenMP)."""
    import concurrent.futures

    case = make_case("mla", Phase.DECODE, q_lens=[1, 1, 1], kv_lens=[700, 33, 300],
                     page_size=16, hq=8, hkv=1, d=64, dv=32, dtype=torch.bfloat16,
                     kv_dtype=torch.bfloat16)  # fmt: skip
    expect = run_native(case, num_threads=2)
    big = torch.randn(512, 512)

    def work(i: int) -> bool:
        same = torch.equal(run_native(case, num_threads=2), expect)
        (big @ big).sum()  # torch's OpenMP pool between our calls
        return same

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, range(16)))


@needs_lib
def test_forked_child_can_run() -> None:
    """The thread pool is rebuilt in a forked child (the parent's workers do not exist there)."""
    case = make_case("mha", Phase.DECODE, q_lens=[1, 1], kv_lens=[900, 40], page_size=8, hq=4,
                     hkv=1, d=32, dv=32)  # fmt: skip
    expect = run_native(case, num_threads=2)  # starts the pool's workers in the parent
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 0
        try:
            code = 0 if torch.equal(run_native(case, num_threads=2), expect) else 3
        except BaseException:
            code = 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


# -- validation: bad pointers impossible from Python -------------------------------------------


def _small(kind: str = "mha", **kw: Any) -> dict[str, Any]:
    shape = dict(hq=4, hkv=1, d=48, dv=32) if kind == "mla" else dict(hq=4, hkv=2, d=16, dv=16)
    phase = kw.pop("phase", Phase.DECODE)
    args: dict[str, Any] = dict(q_lens=[1, 1], kv_lens=[9, 20], page_size=4, **shape)
    args.update(kw)
    return make_case(kind, phase, **args)


def _expect(field: str, case: dict[str, Any], **override: Any) -> None:
    values = {k: case[k] for k in ("q", "k_cache", "v_cache")}
    plan_of = override.pop("plan", None)
    values.update(override)
    backend = NativeBackend(case["config"])
    plan = plan_of if plan_of is not None else backend.plan(case["batch"])
    with pytest.raises(InvalidBatchError) as info:
        backend.handler(case["batch"].phase)(
            values["q"], values["k_cache"], values["v_cache"], plan, case["scale"]
        )
    assert isinstance(info.value, AttnDispatchError) and isinstance(info.value, ValueError)
    assert info.value.field == field and field in str(info.value)


@needs_lib
def test_tensor_checks_name_the_field() -> None:
    case = _small()
    q, k, v = case["q"], case["k_cache"], case["v_cache"]
    _expect("q", case, q=q.to(torch.bfloat16))
    _expect("q", case, q=q[:1])
    _expect("q", case, q=q.transpose(0, 1).contiguous().transpose(0, 1))
    _expect("q", case, q=q.tolist())
    _expect("k_cache", case, k_cache=k[:, :2])
    _expect("k_cache", case, k_cache=k.transpose(0, 1).contiguous().transpose(0, 1))
    _expect("k_cache", case, k_cache=k.to(torch.bfloat16))
    _expect("v_cache", case, v_cache=v[..., :8])
    _expect("v_cache", case, v_cache=None)
    # pages beyond the cache
    _expect("kv_indices", case, k_cache=k[:2].contiguous(), v_cache=v[:2].contiguous())
    _expect("v_cache", case, v_cache=v[:2].contiguous())  # fewer V pages than K pages
    _expect("plan", case, plan=object())
    mla = _small("mla")
    _expect("v_cache", mla, v_cache=mla["k_cache"])
    _expect("k_cache", mla, k_cache=mla["k_cache"][..., :40].contiguous())
    with pytest.raises(InvalidBatchError, match="sm_scale"):
        backend = NativeBackend(case["config"])
        backend.handler(Phase.DECODE)(q, k, v, backend.plan(case["batch"]), math.nan)


def _forge(batch: AttnBatch, **fields: Any) -> AttnBatch:
    """A batch with fields changed behind AttnBatch's own checks (as a buggy caller might)."""
    forged = AttnBatch.__new__(AttnBatch)
    for name in AttnBatch.__dataclass_fields__:
        object.__setattr__(forged, name, fields.get(name, getattr(batch, name)))
    return forged


def _forge_both(batch: AttnBatch, name: str, value: torch.Tensor) -> AttnBatch:
    """The same forged tensor as the batch's index field and its host copy."""
    return _forge(batch, **{name: value, f"{name}_host": value})


@needs_lib
def test_batch_checks_name_the_field() -> None:
    case = _small()
    b = case["batch"]
    backend = NativeBackend(case["config"])
    i32 = torch.int32
    bad = {
        "kv_indices": _forge(b, kv_indices=torch.full_like(b.kv_indices, -1)),
        "kv_lens": _forge_both(b, "kv_lens", torch.tensor([0, 20], dtype=i32)),
        "kv_indptr ": _forge_both(b, "kv_lens", torch.tensor([9, 2000], dtype=i32)),
        "kv_indptr": _forge_both(b, "kv_indptr", torch.tensor([0, 3, 99], dtype=i32)),
        "qo_indptr": _forge_both(b, "qo_indptr", torch.tensor([0, 2, 1], dtype=i32)),
        "page_size": _forge(b, page_size=8),
    }
    for field, batch in bad.items():
        with pytest.raises(InvalidBatchError) as info:
            backend.plan(batch)
        assert info.value.field == field.strip(), (field, str(info.value))
    with pytest.raises(InvalidBatchError) as info:
        backend.plan(_forge_both(b, "kv_lens", torch.tensor([9.0, 20.0])))
    assert info.value.field == "kv_lens"
    tree = _small(phase=Phase.VERIFY, q_lens=[2, 3], tree=True)
    tb = tree["batch"]
    with pytest.raises(InvalidBatchError) as info:
        NativeBackend(tree["config"]).plan(_forge(tb, custom_mask=tb.custom_mask[:-1]))
    assert info.value.field == "custom_mask"
    # A plan for one phase cannot be run by another phase's handler.
    owner = NativeBackend(tree["config"])
    plan = owner.plan(tb)
    with pytest.raises(InvalidBatchError, match="phase"):
        owner.handler(Phase.PREFILL)(tree["q"], tree["k_cache"], tree["v_cache"], plan, 1.0)


@needs_lib
def test_plan_owns_its_metadata() -> None:
    """Editing the batch's index tensors in place after planning cannot reach the kernels."""
    case = _small(kv_lens=[30, 20])
    expect = run_native(case)
    backend = NativeBackend(case["config"])
    plan = backend.plan(case["batch"])
    case["batch"].kv_indices.fill_(10**6)
    case["batch"].kv_lens_host.fill_(10**6)
    out = backend.handler(Phase.DECODE)(
        case["q"], case["k_cache"], case["v_cache"], plan, case["scale"]
    )
    assert torch.equal(out, expect)


# -- capabilities and the "not built" report ---------------------------------------------------


def test_capabilities_reasons() -> None:
    mla = AttnConfig("mla", 16, 1, 576, 512, dtype="bfloat16", page_size=64, device="cpu")
    if isinstance(LIB, str):
        assert any(r.startswith("not built") for r in CAPABILITIES.reasons(mla, Phase.DECODE))
        return
    for phase in Phase:
        assert CAPABILITIES.reasons(mla, phase) == []
    fp16 = AttnConfig("mha", 8, 8, 128, 128, dtype="float16", page_size=16, device="cpu")
    assert CAPABILITIES.reasons(fp16, Phase.DECODE) == []
    for fmt in ("float8_e4m3fn", "float8_e5m2"):
        fp8 = AttnConfig(
            "mha", 8, 8, 128, 128, dtype="bfloat16", kv_dtype=fmt, page_size=16, device="cpu",
            window_left=7, logit_cap=30.0, sinks=True,
        )  # fmt: skip
        for phase in Phase:
            assert CAPABILITIES.reasons(fp8, phase) == []
    wide = AttnConfig("mha", 2, 2, 4096, 128, dtype="float32", page_size=16, device="cpu")
    assert any("head_dim 4096" in r for r in CAPABILITIES.reasons(wide, Phase.PREFILL))


def test_missing_library_reports_not_built(tmp_path: Any, monkeypatch: Any) -> None:
    missing = tmp_path / "nowhere" / "_native_attn.so"
    reason = unavailable_reason(missing)
    assert reason is not None and reason.startswith("not built") and str(missing) in reason
    junk = tmp_path / "junk.so"
    junk.write_bytes(b"not an ELF file")
    reason = unavailable_reason(junk)
    assert reason is not None and reason.startswith("not built: cannot load")
    # The capability check reads the same override from the environment.
    monkeypatch.setenv("ATTN_DISPATCH_NATIVE_LIB", str(missing))
    config = AttnConfig("mha", 2, 2, 16, 16, dtype="float32", page_size=4, device="cpu")
    reasons = CAPABILITIES.reasons(config, Phase.DECODE)
    assert any(r.startswith("not built") for r in reasons), reasons
    if not isinstance(LIB, str):
        with pytest.raises(BackendUnavailableError, match="not built"):
            NativeBackend(config, library=str(missing))


@needs_lib
@pytest.mark.parametrize(
    ("kwargs", "config_over", "field", "text"),
    [
        ({"num_threads": 0}, {}, "num_threads", "positive int"),
        ({"num_threads": "2"}, {}, "num_threads", "positive int"),
        ({}, {"head_dim": 4096, "v_head_dim": 64}, "head_dim", "must be in"),
    ],
)
def test_bad_options_raise_our_error(
    kwargs: dict[str, object], config_over: dict[str, object], field: str, text: str
) -> None:
    from attn_dispatch import AttnConfig
    from attn_dispatch import InvalidSpecError
    from attn_dispatch.backends.native.backend import NativeBackend

    base: dict[str, object] = dict(
        kind="mha", num_q_heads=2, num_kv_heads=1, head_dim=64, dtype="float32", page_size=4
    )
    base.update(config_over)
    with pytest.raises(InvalidSpecError, match=text) as err:
        NativeBackend(AttnConfig(**base), **kwargs)  # type: ignore[arg-type]
    assert err.value.field == field
    assert isinstance(err.value, ValueError)


# -- safety (issue 12): owned plans, threads, NaN, unread slots, empty batches ------------------


def _run_child(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` in a fresh interpreter: a crash (heap corruption, segfault) fails the test
    instead of killing the run."""
    full_env = {**os.environ, "PYTHONPATH": os.getcwd(), **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
        env=full_env, timeout=300,
    )  # fmt: skip


_FOREIGN_PLAN = """
    import math, torch
    from attn_dispatch import AttnBatch, AttnConfig, InvalidBatchError, Phase
    from attn_dispatch.backends.native.backend import NativeBackend

    def cfg(hq, hkv, d, ps):
        return AttnConfig("mha", hq, hkv, d, d, dtype="float32", page_size=ps, device="cpu")

    small = NativeBackend(cfg(2, 1, 16, 4))
    q = torch.randn(1, 2, 16)
    k = torch.randn(2, 4, 1, 16)
    v = torch.randn(2, 4, 1, 16)
    cases = {
        # another binding's backend: more heads, wider rows, another page size
        "big": (NativeBackend(cfg(32, 8, 256, 64)), 64),
        # only the page size differs (|out| ~ 1e31 before plans were owned)
        "page size": (NativeBackend(cfg(2, 1, 16, 16)), 16),
        # the same config, another backend object: still not this handler's plan
        "twin": (NativeBackend(cfg(2, 1, 16, 4)), 4),
    }
    for name, (other, ps) in cases.items():
        batch = AttnBatch.build(Phase.DECODE, q_lens=[1], kv_lens=[8], page_tables=[[0, 1]],
                                page_size=ps, num_pages=2)
        try:
            small.handler(Phase.DECODE)(q, k, v, other.plan(batch), 0.25)
        except InvalidBatchError as exc:
            assert exc.field == "plan", (name, exc)
            print("refused", name)
        else:
            raise SystemExit(f"{name}: a foreign plan was accepted")
"""


@needs_lib
def test_foreign_plans_are_refused() -> None:
    """A handler runs only plans its own backend object made (another config's plan used to
    corrupt the heap or return garbage)."""
    child = _run_child(_FOREIGN_PLAN)
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.split("\n")[:3] == ["refused big", "refused page size", "refused twin"]


@needs_lib
def test_plans_are_frozen() -> None:
    import dataclasses

    case = _small()
    plan = NativeBackend(case["config"]).plan(case["batch"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.max_page = 10**6  # type: ignore[misc]
    assert not hasattr(plan, "__dict__")


@needs_lib
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_threads_sharing_one_scope_and_plan_match_serial(kind: str) -> None:
    """Split-KV scratch is per call: threads carried into one scope (one plan) get exactly the
    serial results, whichever layer each runs."""
    import concurrent.futures

    from attn_dispatch import attention
    from attn_dispatch import attn_scope
    from attn_dispatch import bind
    from attn_dispatch import carry_scope

    shape = ("mla", 16, 1, 64, 32) if kind == "mla" else ("mha", 8, 2, 32, 32)
    case = make_case(
        shape[0], Phase.DECODE, q_lens=[1, 1], kv_lens=[3000, 1700], page_size=16, hq=shape[1],
        hkv=shape[2], d=shape[3], dv=shape[4], dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
    )  # fmt: skip
    binding = bind("native", case["config"], options={"native": {"num_threads": 2}})
    gen = torch.Generator().manual_seed(5)
    layers = [case["q"] + torch.randn(case["q"].shape, generator=gen).bfloat16() for _ in range(8)]
    with attn_scope(binding, case["batch"]):
        plan = binding.plan(case["batch"])
        assert plan.num_merges > 0  # split-KV really runs (its scratch is what threads shared)

        def layer(i: int) -> torch.Tensor:
            return attention(layers[i % 8], case["k_cache"], case["v_cache"], sm_scale=0.1)

        serial = [layer(i) for i in range(8)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(carry_scope(layer), range(64)))
    for i, out in enumerate(results):
        assert torch.equal(out, serial[i % 8]), i


@needs_lib
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_nan_in_q_gives_nan_in_that_row_only(kind: str, dtype: Any) -> None:
    shape = ("mla", 16, 1, 64, 32) if kind == "mla" else ("mha", 8, 2, 64, 64)
    # request 0: long (split-KV, merged); request 1: short (one item writes directly)
    case = make_case(
        shape[0], Phase.DECODE, q_lens=[1, 1], kv_lens=[2000, 40], page_size=16, hq=shape[1],
        hkv=shape[2], d=shape[3], dv=shape[4], dtype=dtype, kv_dtype=dtype,
    )  # fmt: skip
    clean = run_native(case, num_threads=2)
    q = case["q"].clone()
    q[0, 1, 3] = math.nan
    q[1, 5, 0] = math.nan
    out = run_native({**case, "q": q}, num_threads=2)
    nan_rows = torch.isnan(out).all(dim=-1)
    expect = torch.zeros_like(nan_rows)
    expect[0, 1] = expect[1, 5] = True
    assert torch.equal(nan_rows, expect)
    assert not torch.isnan(out[~expect]).any()
    assert torch.equal(out[~expect], clean[~expect])


@needs_lib
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("phase", ["decode", "prefill", "verify-tree"])
def test_unread_cache_slots_never_reach_the_output(kind: str, dtype: Any, phase: str) -> None:
    """NaN in slots past kv_len and in pages no request lists: bitwise the same output."""
    shape = ("mla", 16, 1, 64, 32) if kind == "mla" else ("mha", 8, 2, 64, 64)
    ph, q_lens, kv_lens, tree = PHASES[phase]
    case = make_case(
        shape[0], ph, q_lens=q_lens, kv_lens=kv_lens, page_size=16, hq=shape[1],
        hkv=shape[2], d=shape[3], dv=shape[4], dtype=dtype, kv_dtype=dtype, tree=tree,
    )  # fmt: skip
    clean = run_native(case, num_threads=2)
    read = torch.zeros(case["k_cache"].shape[:2], dtype=torch.bool)
    for table, n in zip(case["tables"], kv_lens, strict=True):
        for t in range(n):
            read[table[t // 16], t % 16] = True
    assert not read.all()
    poisoned = {
        name: case[name].clone() for name in ("k_cache", "v_cache") if case[name] is not None
    }
    for tensor in poisoned.values():
        tensor[~read] = math.nan
    out = run_native({**case, **poisoned}, num_threads=2)
    assert torch.equal(out, clean)


@needs_lib
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_empty_batch_gives_empty_output(kind: str) -> None:
    shape = ("mla", 16, 1, 64, 32) if kind == "mla" else ("mha", 8, 2, 64, 64)
    config = AttnConfig(
        shape[0], shape[1], shape[2], shape[3], shape[4], dtype="bfloat16", page_size=16,
        device="cpu",
    )  # fmt: skip
    backend = NativeBackend(config)
    k = torch.zeros(2, 16, shape[3]) if kind == "mla" else torch.zeros(2, 16, shape[2], shape[3])
    v = None if kind == "mla" else torch.zeros(2, 16, shape[2], shape[4])
    for phase in Phase:
        batch = AttnBatch.build(phase, q_lens=[], kv_lens=[], page_tables=[], page_size=16)
        q = torch.zeros(0, shape[1], shape[3], dtype=torch.bfloat16)
        out = backend.handler(phase)(
            q, k.bfloat16(), None if v is None else v.bfloat16(), backend.plan(batch), 0.1
        )
        assert out.shape == (0, shape[1], shape[4]) and out.dtype == torch.bfloat16


_ISA_CHECK = """
    import sys
    from attn_dispatch.backends.native._lib import load
    assert load().isa == sys.argv[1], (load().isa, sys.argv[1])
"""


@needs_lib
@pytest.mark.parametrize("isa", ISAS)
def test_contract_cases_on_every_instruction_set_path(isa: str) -> None:
    """NATIVE_ATTN_ISA forces each path this CPU has; under it, the contract suite's edge cases
    (variants and FP8 included) and this module's reference comparisons (every dtype, phase,
    shape, variant and FP8 format) pass."""
    env = {"NATIVE_ATTN_ISA": isa}
    forced = _run_child(_ISA_CHECK.replace("sys.argv[1]", repr(isa)), env)
    assert forced.returncode == 0, forced.stderr[-2000:]
    child = subprocess.run(
        [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
            "tests/contract/test_contract.py::test_edge_cases",
            "tests/contract/test_contract.py::test_variant_edge_cases",
            "tests/backends/native/test_backend.py::test_matches_naive_reference",
            "tests/backends/native/test_backend.py::test_variants_match_naive_reference",
            "-k", "native or not contract",
        ],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd(), **env},
        timeout=600,
    )  # fmt: skip
    assert child.returncode == 0, child.stdout[-3000:]
    assert " passed" in child.stdout and "failed" not in child.stdout


# -- layer variants and FP8 caches (issues 14, 15) -----------------------------------------------

VARIANTS = {
    # window_left, logit_cap, sinks, kv dtype (None: q's dtype), k_scale, v_scale
    "window": dict(window=37),
    "window0": dict(window=0),
    "cap": dict(cap=5.0),
    "sinks": dict(sinks=True),
    "all": dict(window=100, cap=8.0, sinks=True),
    "e4m3": dict(kv_dtype=torch.float8_e4m3fn, k_scale=0.7, v_scale=1.9),
    "e5m2": dict(kv_dtype=torch.float8_e5m2, k_scale=1.3, v_scale=0.4),
    "e4m3-all": dict(kv_dtype=torch.float8_e4m3fn, k_scale=0.5, window=70, cap=6.0, sinks=True),
}
VARIANT_PHASES = {
    # decode long enough to split (sinks enter in the merge) next to a short unsplit request
    "decode": (Phase.DECODE, [1, 1, 1], [2100, 40, 700], False),
    "prefill": (Phase.PREFILL, [50, 3], [300, 3], False),
    "verify-tree": (Phase.VERIFY, [4, 6], [400, 90], True),
}


def _variant_case(
    kind: str, phase: str, variant: str, dtype: Any = torch.float32, seed: int = 0
) -> dict[str, Any]:
    shape = ("mla", 16, 1, 96, 64) if kind == "mla" else ("mha", 8, 2, 64, 64)
    ph, q_lens, kv_lens, tree = VARIANT_PHASES[phase]
    opts = dict(VARIANTS[variant])
    kv_dtype = opts.pop("kv_dtype", dtype)
    return make_case(
        shape[0], ph, q_lens=q_lens, kv_lens=kv_lens, page_size=16, hq=shape[1], hkv=shape[2],
        d=shape[3], dv=shape[4], dtype=dtype, kv_dtype=kv_dtype, tree=tree, seed=seed, **opts,
    )  # fmt: skip


@needs_lib
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("phase", VARIANT_PHASES)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_variants_match_naive_reference(kind: str, phase: str, variant: str) -> None:
    case = _variant_case(kind, phase, variant)
    out = run_native(case, num_threads=2)
    assert_close(out, naive(case))


@needs_lib
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_variants_on_every_instruction_set_path(isa: str, kind: str) -> None:
    """Window, cap, sinks and both FP8 formats on each compiled path, with bf16 q (which takes
    the AVX-512-BF16 kernel where it applies), fp16 q, and dims off the vector width."""
    assert not isinstance(LIB, str)
    before = LIB.isa
    LIB.set_isa(isa)
    try:
        for phase in VARIANT_PHASES:
            for variant in ("all", "e4m3-all", "e5m2"):
                for dtype in (torch.bfloat16, torch.float16):
                    case = _variant_case(kind, phase, variant, dtype=dtype)
                    assert_close(run_native(case, num_threads=2), naive(case))
        odd = make_case(
            "mha", Phase.PREFILL, q_lens=[20], kv_lens=[90], page_size=8, hq=3, hkv=3, d=40,
            dv=24, kv_dtype=torch.float8_e5m2, window=11, cap=4.0, sinks=True, k_scale=2.0,
            v_scale=0.5,
        )  # fmt: skip
        assert_close(run_native(odd, num_threads=2), naive(odd))
    finally:
        LIB.set_isa(before)


@needs_lib
@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_conversion_is_exact(kind: str, dtype: torch.dtype) -> None:
    """Every FP8 bit pattern (subnormals, the largest finite values) is converted exactly: a
    one-key cache returns that key's V row times v_scale. bf16 q takes the vdpbf16ps kernel on
    avx512bf16 (the table lookup in the loads); every value times 3 still fits a bf16."""
    for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
        bits = torch.arange(256, dtype=torch.uint8)
        vals = bits.view(fmt).float()
        finite = bits[torch.isfinite(vals)]
        d = 64
        dv = 32 if kind == "mla" else d  # MLA: V is the latent's first dv columns
        rows = torch.cat([finite, finite[: (-len(finite)) % d]]).view(-1, d)
        for row in rows:
            case = make_case(
                kind, Phase.DECODE, q_lens=[1], kv_lens=[1], page_size=1, hq=4,
                hkv=1 if kind == "mla" else 2, d=d, dv=dv, dtype=dtype, kv_dtype=fmt, k_scale=1.0,
                v_scale=3.0,
            )  # fmt: skip
            target = "k_cache" if kind == "mla" else "v_cache"
            cache = case[target].clone()
            cache.view(torch.uint8)[case["tables"][0][0], 0] = row
            out = run_native({**case, target: cache}, num_threads=1)
            scale = 1.0 if kind == "mla" else 3.0
            expect = row.view(fmt).float()[:dv] * scale
            assert torch.equal(out[0, 0].float(), expect), fmt


@needs_lib
@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_slots_outside_the_window_are_never_read(kind: str, phase: str) -> None:
    """NaN in every slot before the first query's window (whole pages and the partial page
    before it): bitwise the same output; decode plans read at most window_left + 1 keys."""
    case = _variant_case(kind, phase, "window")
    clean = run_native(case, num_threads=2)
    w = case["config"].window_left
    poisoned = {
        name: case[name].clone() for name in ("k_cache", "v_cache") if case[name] is not None
    }
    for table, ql, kl in zip(case["tables"], case["q_lens"], case["kv_lens"], strict=True):
        for t in range(max(0, kl - ql - w)):
            for tensor in poisoned.values():
                tensor[table[t // 16], t % 16] = math.nan
    out = run_native({**case, **poisoned}, num_threads=2)
    assert torch.equal(out, clean)


@needs_lib
def test_decode_with_a_window_reads_fewer_keys() -> None:
    """The plan of a windowed decode covers window_left + 1 keys per request: fewer work items
    than the same batch without a window (the split is over the window only)."""
    full = make_case("mha", Phase.DECODE, q_lens=[1] * 2, kv_lens=[8192] * 2, page_size=64,
                     hq=8, hkv=2, d=64, dv=64)  # fmt: skip
    win = make_case("mha", Phase.DECODE, q_lens=[1] * 2, kv_lens=[8192] * 2, page_size=64,
                    hq=8, hkv=2, d=64, dv=64, window=300)  # fmt: skip
    p_full = NativeBackend(full["config"], num_threads=2).plan(full["batch"])
    p_win = NativeBackend(win["config"], num_threads=2).plan(win["batch"])
    assert p_win.num_items < p_full.num_items


@needs_lib
def test_variant_call_checks_name_the_field() -> None:
    case = _variant_case("mha", "decode", "e4m3-all")
    backend = NativeBackend(case["config"])
    plan = backend.plan(case["batch"])
    handler = backend.handler(Phase.DECODE)
    args = (case["q"], case["k_cache"], case["v_cache"], plan, 0.1)
    extras = case["extras"]
    for field, bad in (
        ("sinks", {"sinks": None}),
        ("sinks", {"sinks": torch.zeros(3)}),
        ("sinks", {"sinks": torch.zeros(8, dtype=torch.float64)}),
        ("k_scale", {"k_scale": 0.0}),
        ("k_scale", {"k_scale": math.nan}),
        ("v_scale", {"v_scale": -1.0}),
    ):
        with pytest.raises(InvalidBatchError) as err:
            handler(*args, **{**extras, **bad})
        assert err.value.field == field
    plain = _variant_case("mha", "decode", "window")
    pb = NativeBackend(plain["config"])
    with pytest.raises(InvalidBatchError) as err:
        pb.handler(Phase.DECODE)(
            plain["q"], plain["k_cache"], plain["v_cache"], pb.plan(plain["batch"]), 0.1,
            sinks=torch.zeros(8),
        )  # fmt: skip
    assert err.value.field == "sinks"


@needs_lib
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_threads_sharing_a_plan_with_variants_and_fp8(kind: str) -> None:
    """Threads carried into one scope, FP8 cache, window, cap and sinks: the serial results."""
    import concurrent.futures

    from attn_dispatch import attention
    from attn_dispatch import attn_scope
    from attn_dispatch import bind
    from attn_dispatch import carry_scope

    case = _variant_case(kind, "decode", "e4m3-all", dtype=torch.bfloat16)
    binding = bind("native", case["config"], options={"native": {"num_threads": 2}})
    gen = torch.Generator().manual_seed(7)
    layers = [case["q"] + torch.randn(case["q"].shape, generator=gen).bfloat16() for _ in range(4)]
    extras = case["extras"]
    with attn_scope(binding, case["batch"]):

        def layer(i: int) -> torch.Tensor:
            return attention(
                layers[i % 4], case["k_cache"], case["v_cache"], sm_scale=0.1, **extras
            )

        serial = [layer(i) for i in range(4)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(carry_scope(layer), range(32)))
    for i, out in enumerate(results):
        assert torch.equal(out, serial[i % 4]), i


@needs_lib
def test_out_is_checked_once_per_call_and_always(monkeypatch: pytest.MonkeyPatch) -> None:
    """A binding's call with ``out=`` reaches the handler's core-checked variant: the core
    checked the buffer, so native does not check it again; its own handler, called without
    a binding, still does. A bad buffer is refused both ways, and a good one is written."""
    from attn_dispatch import attention
    from attn_dispatch import attn_scope
    from attn_dispatch import bind
    from attn_dispatch._protocol import CORE_CHECKED
    from attn_dispatch._tensor_checks import TensorChecks

    config = AttnConfig("mha", 4, 2, 16, dtype="float32", page_size=8, sm_scale=0.25)
    binding = bind("native", config, label="target")
    batch = AttnBatch.build(
        Phase.DECODE, q_lens=[1, 1], kv_lens=[5, 9], page_tables=[[3], [0, 1]], page_size=8
    )
    q = torch.randn(2, 4, 16)
    k, v = torch.randn(4, 8, 2, 16), torch.randn(4, 8, 2, 16)
    seen: list[int] = []
    own = TensorChecks.check_out
    monkeypatch.setattr(
        TensorChecks, "check_out", lambda self, *a: (seen.append(1), own(self, *a))[1]
    )
    buf = torch.full((2, 4, 16), float("nan"))
    with attn_scope(binding, batch):
        assert attention(q, k, v, out=buf) is buf
        want = attention(q, k, v)
    assert seen == [] and torch.equal(buf, want)
    raw = binding.route(Phase.DECODE).raw
    assert callable(getattr(raw, CORE_CHECKED))  # the name the core reads
    plan = binding.plan(batch)
    assert raw(q, k, v, plan, 0.25, out=torch.empty(2, 4, 16)) is not None
    assert seen == [1]
    for bad in (torch.empty(2, 4, 16, dtype=torch.float16), torch.empty(1, 4, 16), q):
        with attn_scope(binding, batch), pytest.raises(InvalidBatchError) as err:
            attention(q, k, v, out=bad)
        assert err.value.field == "out"
        with pytest.raises(InvalidBatchError) as err:
            raw(q, k, v, plan, 0.25, out=bad)
        assert err.value.field == "out"
