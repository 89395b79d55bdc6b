"""Compile the triton kernels for a CUDA target without a GPU (run in a subprocess).

    python -m tests.triton_aot [arch]   # arch 90 by default; prints one line per kernel

The interpreter never runs triton's compiler, so code that interprets fine can still fail to
compile for a GPU; triton can lower and assemble (ptxas ships in its wheel) on a CPU-only
machine. Uses the launch constants the backend would use on a 132-SM CUDA device.
"""

from __future__ import annotations

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
from attn_dispatch.backends.triton.backend import kernel_config


def signature(fn: object, pointers: dict[str, str], constants: dict[str, object]) -> dict[str, str]:
    names: list[str] = fn.arg_names  # type: ignore[attr-defined]
    return {
        n: "constexpr"
        if n in constants
        else pointers.get(n, "fp32" if n == "sm_scale_log2" else "i32")
        for n in names
    }


def main() -> int:
    arch = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    target = GPUTarget("cuda", arch, 32)
    cases = [
        ("mla 576/512", AttnConfig("mla", 16, 1, 576, 512, dtype="bfloat16", page_size=64)),
        ("gqa 32/8x128", AttnConfig("mha", 32, 8, 128, 128, dtype="bfloat16", page_size=64)),
    ]
    for label, cfg in cases:
        kc = kernel_config(cfg, {}, device=torch.device("cuda"), num_sms=132, interpreting=False)
        dt = "*bf16"
        cache = {"Q": dt, "K": dt, "V": dt, "kv_indptr": "*i32", "kv_indices": "*i32"}
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
                {"Part_out": "*fp32", "Part_lse": "*fp32", "Out": dt},
                _ops.merge_constants(kc),
                4,
            ),
            (
                # MLA with the tree mask, GQA causal: every constexpr branch is compiled once.
                "extend " + ("tree mask" if kc.mla else "causal"),
                _extend._extend_kernel,
                cache | {"Out": dt, "Mask": "*u8", "mask_indptr": "*i64"},
                _ops.extend_constants(kc, use_mask=kc.mla),
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
