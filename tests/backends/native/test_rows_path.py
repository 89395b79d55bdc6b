"""The many-row tile path (csrc/rows_path.h, issue 42) against the float64 oracle.

Items with at least ``rows_min`` rows per kv head (q heads of one kv head x query tokens: GQA
verify chains and trees, prefill with a prefix, a cascade's shared part) take the GEMM-shaped
kernel; decode-shaped items keep the older kernels. Each case runs on every compiled ISA path,
in this process with the default threshold and in child processes with the path forced on
every item (``NATIVE_ATTN_ROWS_MIN=1``: tiles of 1..32 rows, straddling the vector width) and
off everywhere (a huge threshold), so both kernels are checked on the same cases.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from attn_dispatch import AttnBatch  # noqa: E402
from attn_dispatch import Phase  # noqa: E402
from attn_dispatch._env import NATIVE_NO_VBMI  # noqa: E402
from attn_dispatch._env import NATIVE_ROWS_MIN  # noqa: E402
from attn_dispatch.backends.native._lib import load  # noqa: E402
from tests import oracle  # noqa: E402
from tests.backends.native.test_backend import assert_close  # noqa: E402
from tests.backends.native.test_backend import make_case  # noqa: E402
from tests.backends.native.test_backend import run_native  # noqa: E402

LIB = load()
needs_lib = pytest.mark.skipif(isinstance(LIB, str), reason=f"native library: {LIB}")
ISAS = () if isinstance(LIB, str) else LIB.isa_list

# name: (phase, q_lens, kv_lens, tree, hq, hkv, d, extra make_case options, chunk)
# Rows per kv head = (hq / hkv) x q_len: 15, 16, 20, 24, 32 (and more, cut into tiles of 32)
# around the 8- and 16-lane vectors; kv lengths off the 32-key block (ragged last blocks).
CASES: dict[str, tuple[Any, ...]] = {
    "chain-verify": (Phase.VERIFY, [4, 5, 3], [301, 90, 37], False, 8, 2, 64, {}, None),
    "tree-8": (Phase.VERIFY, [8, 6], [200, 45], True, 8, 2, 64, {}, None),
    "tree-16-group8": (Phase.VERIFY, [16, 3], [130, 70], True, 16, 2, 64, {}, None),
    "prefill-prefix": (Phase.PREFILL, [40, 7, 1], [300, 7, 50], False, 8, 2, 64, {}, None),
    "prefill-group3": (Phase.PREFILL, [5, 11], [69, 11], False, 6, 2, 32, {}, None),
    "window-cap-sinks": (
        Phase.PREFILL, [33, 4], [250, 80], False, 8, 2, 64,
        dict(window=37, cap=6.0, sinks=True), None,
    ),
    "tree-window-sinks": (
        Phase.VERIFY, [8, 5], [160, 64], True, 8, 2, 64, dict(window=50, sinks=True), None
    ),
    "chunk": (Phase.PREFILL, [30, 9], [140, 40], False, 8, 2, 64, {}, 48),
    "e4m3": (
        Phase.VERIFY, [4, 8], [220, 61], False, 8, 2, 64,
        dict(kv_dtype=torch.float8_e4m3fn, k_scale=0.7, v_scale=1.9), None,
    ),
    "e5m2-tree-cap": (
        Phase.VERIFY, [8, 4], [99, 300], True, 8, 2, 64,
        dict(kv_dtype=torch.float8_e5m2, k_scale=1.3, v_scale=0.4, cap=5.0), None,
    ),
    "mha-prefill": (Phase.PREFILL, [20, 33], [20, 100], False, 2, 2, 96, {}, None),
    # Head dim 128 with at most 16 rows per kv head: the bf16 kernel's packed-K q.K^T.
    "verify-d128": (Phase.VERIFY, [4, 3], [301, 45], False, 8, 2, 128, {}, None),
    "tree-d128-cap": (Phase.VERIFY, [4, 2], [150, 33], True, 8, 2, 128, dict(cap=5.0), None),
    # Head dim 128 with 20-32 rows per kv head (32-row tiles: the packed-K 8 x 2 q.K^T and the
    # V pairs interleaved once per block), FP8 through the same kernels on its widened rows.
    "tree8-d128": (Phase.VERIFY, [8, 5], [203, 40], True, 8, 2, 128, {}, None),
    "prefill-d128": (Phase.PREFILL, [40, 9], [301, 9], False, 8, 2, 128, {}, None),
    "e4m3-tree-d128": (
        Phase.VERIFY, [8, 4], [150, 77], True, 8, 2, 128,
        dict(kv_dtype=torch.float8_e4m3fn, k_scale=0.6, v_scale=1.7), None,
    ),
    # 16 rows per kv head over 8 kv heads: one 128-row tile per request (whole token rows) on
    # the vdpbf16ps kernel, tiles of 2 kv heads elsewhere; long enough to be split (partial
    # rows at slot + row), and a 3-token request beside it (12 rows: the decode kernels).
    "verify-8-kv-heads": (Phase.VERIFY, [4, 4, 3], [700, 90, 520], False, 32, 8, 64, {}, None),
    "verify-8-kv-heads-d128": (Phase.VERIFY, [4, 4], [600, 77], False, 32, 8, 128, {}, None),
    "verify-8-kv-heads-e5m2": (
        Phase.VERIFY, [4, 4], [530, 40], False, 32, 8, 64,
        dict(kv_dtype=torch.float8_e5m2, k_scale=1.1, v_scale=0.6), None,
    ),
    # 32 rows per kv head in a request of at most 16 tokens (a tree of 8 or 16 over groups of
    # 4, a 4- or 6-token chain over groups of 8): tiles of 4 kv heads (128 rows) on the
    # many-row kernels, one kv head elsewhere; split keys (partial rows at slot + a x 32), a
    # 20-row request beside (one kv head per tile).
    "tree-8-kv-heads": (Phase.VERIFY, [8, 8, 5], [700, 90, 520], True, 32, 8, 64, {}, None),
    "tree16-8-kv-heads-d128": (Phase.VERIFY, [16, 8], [600, 77], True, 32, 8, 128, {}, None),
    "verify-group8-8-kv-heads": (Phase.VERIFY, [4, 6], [650, 61], False, 64, 8, 64, {}, None),
    "tree-8-kv-heads-e4m3": (
        Phase.VERIFY, [8, 8], [530, 40], True, 32, 8, 64,
        dict(kv_dtype=torch.float8_e4m3fn, k_scale=0.8, v_scale=1.4), None,
    ),
    # MLA (one latent row per token, its first dv elements the value): 16 heads of one token
    # are already 16 rows, so decode takes the many-row path too; a stand-in 160/128 and the
    # real 576/512, FP8 latent rows widened once per block for both q.K^T and p.V.
    "mla-decode": (
        Phase.DECODE, [1, 1, 1], [300, 37, 129], False, 16, 1, 160, dict(kind="mla", dv=128),
        None,
    ),
    "mla-verify-576": (
        Phase.VERIFY, [4, 2], [301, 50], False, 16, 1, 576, dict(kind="mla", dv=512), None
    ),
    "mla-tree-e4m3": (
        Phase.VERIFY, [8, 5], [150, 77], True, 16, 1, 160,
        dict(kind="mla", dv=128, kv_dtype=torch.float8_e4m3fn, k_scale=0.6), None,
    ),
    "mla-prefill-e5m2-cap": (
        Phase.PREFILL, [20, 3], [100, 3], False, 16, 1, 160,
        dict(kind="mla", dv=128, kv_dtype=torch.float8_e5m2, k_scale=1.3, cap=5.0), None,
    ),
    "mla-8-heads-window": (
        Phase.VERIFY, [4, 3], [200, 64], False, 8, 1, 96, dict(kind="mla", dv=64, window=40),
        None,
    ),
}  # fmt: skip
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def build(name: str, dtype: Any) -> dict[str, Any]:
    ph, q_lens, kv_lens, tree, hq, hkv, d, extra, chunk = CASES[name]
    opts = dict(extra)
    kv_dtype = opts.pop("kv_dtype", dtype)
    kind = opts.pop("kind", "mha")
    dv = opts.pop("dv", d)
    case = make_case(
        kind, ph, q_lens=q_lens, kv_lens=kv_lens, page_size=16, hq=hq, hkv=hkv, d=d, dv=dv,
        dtype=dtype, kv_dtype=kv_dtype, tree=tree, seed=len(name), **opts,
    )  # fmt: skip
    if chunk is not None:
        case["config"] = dataclasses.replace(case["config"], attention_chunk_size=chunk)
    case["chunk"] = chunk
    return case


def reference(case: dict[str, Any]) -> torch.Tensor:
    cfg = case["config"]
    extras = case.get("extras", {})
    return oracle.reference(
        case["q"], case["k_cache"], case["v_cache"], q_lens=case["q_lens"],
        kv_lens=case["kv_lens"], page_tables=case["tables"], masks=case["masks"],
        sm_scale=case["scale"], v_head_dim=cfg.v_head_dim, window_left=cfg.window_left,
        logit_cap=cfg.logit_cap, sinks=extras.get("sinks"), chunk=case["chunk"],
        k_scale=extras.get("k_scale", 1.0), v_scale=extras.get("v_scale", 1.0),
    )  # fmt: skip


def check_all(isas: tuple[str, ...]) -> int:
    """Every case x q dtype x ISA against the oracle; returns how many ran (raises on a miss)."""
    assert not isinstance(LIB, str)
    before = LIB.isa
    ran = 0
    try:
        for isa in isas:
            LIB.set_isa(isa)
            for name in CASES:
                for dname, dtype in DTYPES.items():
                    case = build(name, dtype)
                    out = run_native(case, num_threads=2)
                    try:
                        assert_close(out, reference(case))
                    except AssertionError as exc:
                        raise AssertionError(f"{isa} {name} {dname}: {exc}") from None
                    ran += 1
    finally:
        LIB.set_isa(before)
    return ran


@needs_lib
@pytest.mark.parametrize("isa", ISAS)
def test_many_row_cases_on_every_isa(isa: str) -> None:
    assert check_all((isa,)) == len(CASES) * len(DTYPES)


def _child(rows_min: str) -> subprocess.CompletedProcess[str]:
    code = (
        "from tests.backends.native.test_rows_path import ISAS, check_all\n"
        "print('ran', check_all(tuple(ISAS)))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd(), NATIVE_ROWS_MIN: rows_min}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )


@needs_lib
@pytest.mark.parametrize("rows_min", ["1", "1000000"], ids=["forced-on", "forced-off"])
def test_many_row_path_forced_on_and_off(rows_min: str) -> None:
    """Forced on, every item (decode too, tiles of 1-32 rows, several kv heads per tile) takes
    the many-row kernel; forced off, none does: both match the oracle on every ISA."""
    done = _child(rows_min)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert f"ran {len(CASES) * len(DTYPES) * len(ISAS)}" in done.stdout


@needs_lib
def test_decode_and_cascade_forced_through_the_many_row_path() -> None:
    """Decode (4 rows per kv head, 4 kv heads per tile) and a cascade of shared pages forced
    onto the many-row kernel: the results match the oracle."""
    code = """
import torch
from attn_dispatch import Phase
from tests.backends.native.test_backend import assert_close, make_case, naive, run_native
from tests.backends.native.test_rows_path import ISAS, LIB
n = 0
for isa in ISAS:
    LIB.set_isa(isa)
    for dtype in (torch.float32, torch.bfloat16):
        for kv in (dtype, torch.float8_e4m3fn):
            extra = dict(k_scale=0.5, v_scale=2.0) if kv != dtype else {}
            case = make_case("mha", Phase.DECODE, q_lens=[1, 1, 1], kv_lens=[700, 40, 300],
                             page_size=16, hq=16, hkv=4, d=64, dv=64, dtype=dtype,
                             kv_dtype=kv, **extra)
            assert_close(run_native(case, num_threads=2), naive(case))
            # every request shares the first request's pages: a cascade
            shared = dict(case)
            t0 = case["tables"][0]
            tables = [t0[:30] + t0[30 + 4 * i: 34 + 4 * i] for i in range(3)]
            from attn_dispatch import AttnBatch
            b = AttnBatch.build(Phase.DECODE, q_lens=[1, 1, 1], kv_lens=[544, 544, 544],
                                page_tables=tables, page_size=16,
                                num_pages=case["k_cache"].shape[0])
            shared.update(batch=b, tables=tables, kv_lens=[544, 544, 544])
            assert_close(run_native(shared, num_threads=2, cascade=True), naive(shared))
            n += 1
print("ran", n)
"""
    env = {**os.environ, "PYTHONPATH": os.getcwd(), NATIVE_ROWS_MIN: "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert f"ran {4 * len(ISAS)}" in done.stdout


def holey_masks(case: dict[str, Any], holes: dict[int, list[tuple[int, int]]]) -> None:
    """Replaces a tree case's masks: the prefix all visible but for ``holes`` (request ->
    (query row, key)), the draft part the case's own tree; rebuilds the batch."""
    from attn_dispatch import AttnBatch

    masks = []
    for i, (q, k) in enumerate(zip(case["q_lens"], case["kv_lens"], strict=True)):
        m = case["masks"][i].clone()
        m[:, : k - q] = True
        for row, key in holes.get(i, []):
            m[row, key] = False
        masks.append(m)
    b = case["batch"]
    case["masks"] = masks
    case["batch"] = AttnBatch.build(
        b.phase, q_lens=case["q_lens"], kv_lens=case["kv_lens"], page_tables=case["tables"],
        page_size=case["config"].page_size, num_pages=case["k_cache"].shape[0], masks=masks,
    )  # fmt: skip


@needs_lib
@pytest.mark.parametrize("isa", ISAS)
def test_sparse_mask_holes_between_whole_blocks(isa: str) -> None:
    """Custom masks whose prefix is visible but for single keys (one row, mid-block, at a
    block's first and last key, in the first block): the blocks before the first hole are
    taken as seen whole without a look (a per-item summary, Round 5), the others are looked
    at. A hole the summary missed would let its row see that key: the oracle disagrees."""
    assert not isinstance(LIB, str)
    before = LIB.isa
    try:
        LIB.set_isa(isa)
        for d, dtype in ((128, torch.bfloat16), (64, torch.float32), (128, torch.float8_e4m3fn)):
            kv = dtype
            q_dtype = torch.bfloat16 if dtype == torch.float8_e4m3fn else dtype
            case = make_case(
                "mha", Phase.VERIFY, q_lens=[8, 8, 8], kv_lens=[300, 260, 97], page_size=16,
                hq=8, hkv=2, d=d, dv=d, dtype=q_dtype, kv_dtype=kv, tree=True, seed=d,
            )  # fmt: skip
            holes = {0: [(3, 100), (5, 64), (5, 127)], 1: [(0, 0), (7, 31), (2, 250)], 2: []}
            holey_masks(case, holes)
            for threads in (1, 2):
                out = run_native(case, num_threads=threads)
                assert_close(out, reference(dict(case, chunk=None)))
            # the hole matters: the same case without it gives another result
            open_case = dict(case)
            holey_masks(open_case, {})
            assert not torch.equal(run_native(open_case, num_threads=1), out)
    finally:
        LIB.set_isa(before)


@needs_lib
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("page_size", [5, 48, 64])
def test_page_sizes_across_blocks(isa: str, page_size: int) -> None:
    """Page sizes that divide neither way with the 32-key block (5, 48) and one that holds
    two blocks (64), with a window (key ranges that start inside a page) and several query
    tiles of one kv head in a row (prefill: the next tile's keys were just read): the rows of
    each block are found per page run (Round 5), so a wrong run length or offset reads
    another key's row and the oracle disagrees."""
    assert not isinstance(LIB, str)
    before = LIB.isa
    try:
        LIB.set_isa(isa)
        for dtype in (torch.bfloat16, torch.float32):
            for ph, q_lens, kv_lens, tree, window in (
                (Phase.PREFILL, [70, 9], [301, 9], False, None),
                (Phase.PREFILL, [40, 12], [230, 100], False, 45),
                (Phase.VERIFY, [8, 5], [203, 131], True, None),
            ):
                case = make_case(
                    "mha", ph, q_lens=q_lens, kv_lens=kv_lens, page_size=page_size, hq=8,
                    hkv=2, d=128, dv=128, dtype=dtype, kv_dtype=dtype, tree=tree, seed=page_size,
                    window=window,
                )  # fmt: skip
                for threads in (1, 2):
                    assert_close(
                        run_native(case, num_threads=threads), reference(dict(case, chunk=None))
                    )
    finally:
        LIB.set_isa(before)


@pytest.mark.parametrize("isa", ISAS)
def test_block_with_swapped_middle_pages_is_not_read_as_one_run(isa: str) -> None:
    """16-row verify at head dim 128 reads a block's K rows in place when its 32 keys are
    consecutive cache slots (Round 6). Pages of 4 keys laid out b, b+1, b+3, b+2, b+4 .. b+7:
    the block's first and last keys are 31 slots apart, as in one run, but keys 8-15 are not
    where a run would put them, so a block judged by its ends alone reads other keys' rows
    and the oracle disagrees."""
    assert not isinstance(LIB, str)
    ps, kv_lens, q_lens = 4, [96, 70], [4, 4]
    case = make_case(
        "mha", Phase.VERIFY, q_lens=q_lens, kv_lens=kv_lens, page_size=ps, hq=8, hkv=2, d=128,
        dv=128, dtype=torch.bfloat16, kv_dtype=torch.bfloat16, seed=11,
    )  # fmt: skip
    tables, at = [], 0
    for kv in kv_lens:
        pages = list(range(at, at + -(-kv // ps)))
        for b in range(0, len(pages) - 3, 8):  # swap the 3rd and 4th page of each block
            pages[b + 2], pages[b + 3] = pages[b + 3], pages[b + 2]
        tables.append(pages)
        at += len(pages)
    num_pages = case["k_cache"].shape[0]
    assert at <= num_pages
    case["tables"] = tables
    case["batch"] = AttnBatch.build(
        Phase.VERIFY, q_lens=q_lens, kv_lens=kv_lens, page_tables=tables, page_size=ps,
        num_pages=num_pages,
    )  # fmt: skip
    before = LIB.isa
    try:
        LIB.set_isa(isa)
        for threads in (1, 2):
            assert_close(run_native(case, num_threads=threads), reference(dict(case, chunk=None)))
    finally:
        LIB.set_isa(before)


_EVERY_CODE = """
import torch
from tests.backends.native.test_rows_path import LIB, every_fp8_code_through_the_value_rows
ran = 0
for isa in LIB.isa_list:
    LIB.set_isa(isa)
    ran += every_fp8_code_through_the_value_rows()
print("ran", ran)
"""


def every_fp8_code_through_the_value_rows() -> int:
    """One key (weight exactly 1) whose value row holds every finite FP8 code (subnormals,
    both zeros, the largest): each output row must be the codes' values exactly, for both
    formats. (A value row with NaN or inf makes its output rows NaN as a whole: tested with the
    guards.) 16 heads of one kv head: a decode item on the many-row path, whose value rows are
    widened to bf16 (fp8_row_to_bf16) before p.V; dv 288 = 4 x 64 codes + a 32-wide tail."""
    ran = 0
    for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
        codes = torch.arange(256, dtype=torch.uint8)
        codes = codes[torch.isfinite(codes.view(fmt).float())]  # 254 (e4m3fn), 248 (e5m2)
        row = codes.repeat(2)[:288].view(fmt)
        case = make_case(
            "mha", Phase.DECODE, q_lens=[1], kv_lens=[1], page_size=16, hq=16, hkv=1, d=32,
            dv=288, dtype=torch.bfloat16, kv_dtype=fmt, k_scale=1.0, v_scale=1.0,
        )  # fmt: skip
        case["k_cache"].zero_()
        page = case["tables"][0][0]
        case["v_cache"][page, 0, 0] = row
        out = run_native(case, num_threads=1)
        want = row.float().expand(16, -1)
        got = out.reshape(16, 288).float()
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        ran += 1
    return ran


@needs_lib
@pytest.mark.parametrize("vbmi", ["on", "off"])
def test_fp8_value_rows_widen_every_code_exactly(vbmi: str) -> None:
    """Every e4m3fn and e5m2 code, widened by the many-row kernel's row conversion, on every
    ISA path; with AVX-512 VBMI's byte lookups (where the CPU has them) and without
    (NATIVE_ATTN_NO_VBMI), in a child process each (the switch is read once)."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    env.pop(NATIVE_NO_VBMI, None)
    if vbmi == "off":
        env[NATIVE_NO_VBMI] = "1"
    done = subprocess.run(
        [sys.executable, "-c", _EVERY_CODE], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert f"ran {2 * len(ISAS)}" in done.stdout


_THRESHOLD_CHILD = """
import sys, torch
from attn_dispatch import Phase
from tests.backends.native.test_backend import make_case, run_native
from tests.backends.native.test_rows_path import ISAS, LIB
outs = {}
for isa in ISAS:
    LIB.set_isa(isa)
    for kv in (torch.bfloat16, torch.float8_e4m3fn):
        extra = dict(k_scale=0.5, v_scale=2.0) if kv != torch.bfloat16 else {}
        # GQA 8/2, a 4-token verify chain: 16 rows per kv head (one kv head per tile at d 64).
        # fp32 q (the fp32 kernels on every path; an fp32 output keeps their rounding apart).
        case = make_case("mha", Phase.VERIFY, q_lens=[4, 4], kv_lens=[300, 517], page_size=16,
                         hq=8, hkv=2, d=64, dv=64, dtype=torch.float32, kv_dtype=kv, **extra)
        outs[f"{isa}/{kv}"] = run_native(case, num_threads=1)
torch.save(outs, sys.argv[1])
"""


@needs_lib
def test_default_threshold_is_16_rows_except_on_generic(tmp_path: Any) -> None:
    """A GQA 4-token verify chain (16 rows per kv head, fp32 q over a bf16 or e4m3 cache)
    takes the many-row kernel by default on every vector path (avx2, avx512, avx512bf16, amx)
    and the decode kernel on generic (32 rows there): its default output is bit for bit the
    forced-on or forced-off one. The two kernels round differently, so the case tells them
    apart (asserted too)."""
    outs = {}
    for name, rows_min in (("default", None), ("on", "1"), ("off", "1000000")):
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        env.pop(NATIVE_ROWS_MIN, None)
        if rows_min is not None:
            env[NATIVE_ROWS_MIN] = rows_min
        path = tmp_path / f"{name}.pt"
        done = subprocess.run(
            [sys.executable, "-c", _THRESHOLD_CHILD, str(path)], capture_output=True, text=True,
            env=env, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        outs[name] = torch.load(path)
    assert set(outs["default"]) == {f"{isa}/{kv}" for isa in ISAS
                                    for kv in (torch.bfloat16, torch.float8_e4m3fn)}  # fmt: skip
    for key, out in outs["default"].items():
        on, off = outs["on"][key], outs["off"][key]
        assert not torch.equal(on, off), f"{key}: the two kernels agree bit for bit here"
        want = off if key.startswith("generic/") else on
        assert torch.equal(out, want), f"{key}: the default took the other kernel"


def _planned_items(case: dict[str, Any], phase: Phase) -> int:
    """How many work items native's planner makes for the case's batch (1 thread), after
    checking that plan's output against the oracle."""
    from attn_dispatch.backends.native.backend import NativeBackend

    backend = NativeBackend(case["config"], num_threads=1)
    plan = backend.plan(case["batch"])
    out = backend.handler(phase)(case["q"], case["k_cache"], case["v_cache"], plan, case["scale"])
    assert_close(out, reference({**case, "chunk": None}))
    return int(plan.num_items)


@needs_lib
def test_short_requests_of_32_rows_per_kv_head_take_four_kv_heads_per_tile() -> None:
    """The planner's item counts (split keys kept off: 200 keys, under the split floor): a
    request of at most 16 tokens with 32 rows per kv head makes tiles of 4 kv heads (2 for
    GQA 32/8), a prompt (or a tree of 16 over groups of 8: 64 rows, two head blocks' worth)
    and a 5-token chain of 20 rows one kv head per tile; the outputs match the oracle."""

    def items(q_len: int, hq: int, phase: Phase = Phase.VERIFY) -> int:
        case = make_case(
            "mha", phase, q_lens=[q_len], kv_lens=[200], page_size=16, hq=hq, hkv=8, d=64,
            dv=64, dtype=torch.bfloat16, kv_dtype=torch.bfloat16, tree=phase is Phase.VERIFY,
        )  # fmt: skip
        return _planned_items(case, phase)

    assert items(8, 32) == 2  # a tree of 8, groups of 4: 32 rows, 4 kv heads per tile
    assert items(16, 32) == 4  # a tree of 16: two 8-token blocks of 32 rows
    assert items(4, 64) == 2  # a 4-token chain, groups of 8
    assert items(5, 32) == 8  # 20 rows: one kv head per tile
    assert items(17, 32) == 24  # 17 tokens: 3 blocks x 8 kv heads, as before
    assert items(32, 32, Phase.PREFILL) == 32  # a prompt keeps one kv head per tile


@needs_lib
def test_wide_verify_tiles_count_as_their_32_row_tiles_in_the_split_decision() -> None:
    """The planner's item counts for GQA 32/8 verify-4 chains (16 rows per kv head: one tile of
    all 8 kv heads per request) at 2048 keys: the split decision counts each such tile as the 4
    tiles of 32 rows it stands for, so 8 requests keep their keys whole (counted as one tile
    each, they made 32 items of 512 keys), 3 requests split theirs in 3, and one request in 8
    (the 256-key floor); every output matches the oracle."""

    def items(batch: int) -> int:
        case = make_case(
            "mha", Phase.VERIFY, q_lens=[4] * batch, kv_lens=[2048] * batch, page_size=16,
            hq=32, hkv=8, d=64, dv=64, dtype=torch.bfloat16, kv_dtype=torch.bfloat16, seed=batch,
        )  # fmt: skip
        return _planned_items(case, Phase.VERIFY)

    assert items(8) == 8  # 8 requests x 4 counted tiles: 32, the split target; keys whole
    assert items(3) == 9  # 12 counted tiles: 3 splits of 704 keys (22 blocks of 32)
    assert items(1) == 8  # 4 counted tiles: 8 splits, held at the 256-key floor
