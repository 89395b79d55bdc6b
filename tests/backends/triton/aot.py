"""Compile the triton kernels for a CUDA target without a GPU (run in a subprocess).

    python -m tests.backends.triton.aot [arch]   # arch 90 by default; prints one line per kernel

The interpreter never runs triton's compiler, so code that interprets fine can still fail to
compile for a GPU; triton can lower and assemble (ptxas ships in its wheel) on a CPU-only
machine. Uses the launch constants the backend would use on a 132-SM CUDA device.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)  # before the kernels are defined

import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler import compile as triton_compile

from attn_dispatch import AttnConfig
from attn_dispatch.backends.triton import _decode
from attn_dispatch.backends.triton import _extend
from attn_dispatch.backends.triton import _ops
from attn_dispatch.backends.triton import _tile
from attn_dispatch.backends.triton.backend import kernel_config

_FP8 = {"float8_e4m3fn": "*fp8e4nv", "float8_e5m2": "*fp8e5"}
# The kernels' NamedTuple arguments, typed member by member (triton reads the field names).
_ROWS = _tile.RowStrides._make(["i32"] * 2)
_TUPLES: dict[str, object] = {
    "scales": _tile.Scales._make(["fp32"] * 4),
    "q_strides": _ROWS,
    "out_strides": _ROWS,
    "lse_strides": _ROWS,
    "kv_strides": _tile.CacheStrides._make(["i32"] * 6),
    "part_strides": _tile.PartStrides._make(["i32"] * 5),
}


def signature(
    fn: object, pointers: dict[str, str], constants: dict[str, object]
) -> dict[str, object]:
    names: list[str] = fn.arg_names  # type: ignore[attr-defined]
    return {
        n: "constexpr" if n in constants else pointers.get(n, _TUPLES.get(n, "i32")) for n in names
    }


def main() -> int:
    arch = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    target = GPUTarget("cuda", arch, 32)
    # (label, config, variants and FP8 cache): every constexpr branch is compiled once.
    none: dict[str, object] = {}
    every = {"window_left": 127, "logit_cap": 30.0, "sinks": True, "kv_scaled": True, "lse": True}
    cases = [
        ("mla 576/512", AttnConfig("mla", 16, 1, 576, 512, dtype="bfloat16", page_size=64), none),
        (
            "gqa 32/8x128",
            AttnConfig("mha", 32, 8, 128, 128, dtype="bfloat16", page_size=64),
            none,
        ),
        (
            "gqa 64/8x64 window+cap+sinks fp8e4m3",
            AttnConfig("mha", 64, 8, 64, 64, dtype="bfloat16", page_size=64),
            every | {"fp8": "float8_e4m3fn"},
        ),
        (
            "mla 576/512 window+cap+sinks fp8e5m2",
            AttnConfig("mla", 16, 1, 576, 512, dtype="bfloat16", page_size=64),
            every | {"fp8": "float8_e5m2"},
        ),
    ]
    # The attention types' branches (kernel-level constants; the config refuses the mix).
    cases.append(
        (
            "gqa 32/8x128 chunked+non-causal",
            AttnConfig("mha", 32, 8, 128, 128, dtype="bfloat16", page_size=64),
            {"chunk_size": 8192, "causal": False},
        )
    )
    for label, cfg, variant in cases:
        kc = kernel_config(cfg, {}, device=torch.device("cuda"), num_sms=132, interpreting=False)
        fp8 = variant.pop("fp8", None)
        # The lse branch with every variant and FP8; the plain cases compile without it.
        lse = {"STORE_LSE": bool(variant.pop("lse", False))}
        kc = dataclasses.replace(kc, **variant)  # type: ignore[arg-type]
        dt = "*bf16"
        kv = _FP8[str(fp8)] if fp8 else dt
        cache = {"Q": dt, "K": kv, "V": kv, "kv_indptr": "*i32", "kv_indices": "*i32"}
        cache |= {"kv_lens": "*i32", "qo_indptr": "*i32"}
        jobs = [
            (
                "decode split",
                _decode._decode_split_kernel,
                cache | {"Part_out": "*fp32", "Part_lse": "*fp32"},
                _ops.decode_constants(kc),
                kc.decode_warps,
            ),
            (
                "decode merge",
                _decode._decode_merge_kernel,
                {"Part_out": "*fp32", "Part_lse": "*fp32", "Out": dt, "Lse": "*fp32"}
                | {"Sinks": "*fp32"},
                _ops.merge_constants(kc) | lse,
                4,
            ),
            (
                # MLA with the tree mask, GQA causal: every constexpr branch is compiled once.
                "extend " + ("tree mask" if kc.mla else "causal"),
                _extend._extend_kernel,
                cache
                | {"Out": dt, "Lse": "*fp32", "Mask": "*u8", "mask_indptr": "*i64"}
                | {"Sinks": "*fp32"},
                _ops.extend_constants(kc, use_mask=kc.mla) | lse,
                kc.extend_warps,
            ),
        ]
        for name, fn, ptrs, consts, warps in jobs:
            t0 = time.perf_counter()
            src = ASTSource(fn, signature(fn, ptrs, consts), consts)
            opts = {"num_warps": warps, "num_stages": kc.num_stages}
            compiled = triton_compile(src, target=target, options=opts)
            assert compiled.asm.get("cubin"), f"{label} {name}: no cubin"
            print(f"sm{arch} {label} {name}: ok ({time.perf_counter() - t0:.1f}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
