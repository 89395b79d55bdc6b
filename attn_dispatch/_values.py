"""What every kernel can represent: one check per config value and per call argument.

The kernels read integers as int32 and scores, scales and caps as float32 (C++ ``float``,
triton fp32, FlashInfer's plan arguments). A value past those ranges would be truncated or
rounded differently by each backend (a window of 2**32 became 0 on one and an error on
another; a cap of 1e-300 became "off" on one and a cap on another), so the core refuses it
once, here, and every backend trusts what passed. No torch: ``AttnConfig`` and the hot path
use these functions.

>>> positive_f32_problem(1e-300) is not None   # float32 rounds it to 0
True
"""

from __future__ import annotations

import math
import operator
import sys
from typing import Any

from attn_dispatch._errors import InvalidBatchError

#: The largest value of an int32: window sizes, page sizes, dims and batch metadata.
INT32_MAX = 2**31 - 1
#: float32's largest finite value and smallest normal value.
F32_MAX = 3.4028234663852886e38
F32_MIN_NORMAL = 1.1754943508222875e-38
_RANGE = f"{F32_MIN_NORMAL!r}, {F32_MAX!r}"


def int_problem(value: object, *, low: int, high: int = INT32_MAX) -> str | None:
    """Why ``value`` is not an int in ``[low, high]`` (bools and floats are refused), or None."""
    if isinstance(value, bool) or not isinstance(value, int):
        why = f"got {type(value).__name__}"
    elif value < low:
        why = "too small"
    elif value > high:
        why = "the kernels read it as int32"
    else:
        return None
    wanted = "a positive int" if low == 1 else f"an int >= {low}"
    return f"must be {wanted} and <= {high} ({why})"


def as_int(value: object, field: str, *, low: int = 0, request: int | None = None) -> int:
    """``value`` as an int in ``[low, INT32_MAX]`` (an ``operator.index``-able value such as
    a numpy or torch integer scalar is accepted), else ``InvalidBatchError`` naming ``field``."""
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        number = None
    if number is None or isinstance(value, bool):
        raise InvalidBatchError(
            field, f"must be an int, got {type(value).__name__} {value!r}", request=request
        )
    problem = int_problem(number, low=low)
    if problem is not None:
        raise InvalidBatchError(field, f"{problem}, got {number!r}", request=request)
    return number


def positive_f32_problem(value: object) -> str | None:
    """Why ``value`` is not a real number that float32 holds as a normal value > 0, or None.

    Refused: bools, strings and other non-numbers, NaN, infinities, zero, negatives, values
    float32 rounds to a denormal or to 0 (below ``F32_MIN_NORMAL``) and values past
    ``F32_MAX``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        why = f"got {type(value).__name__}"
    elif not F32_MIN_NORMAL <= value <= F32_MAX:  # False for NaN too
        if isinstance(value, float) and not math.isfinite(value):
            why = "not finite"
        elif value <= 0:
            why = "not > 0"
        else:
            why = "float32 cannot hold it as a normal number"
    else:
        return None
    return f"must be a finite float > 0 in float32's normal range [{_RANGE}] ({why})"


def check_scale(name: str, value: Any) -> float:
    """A per-call scale (``sm_scale``, ``k_scale``, ``v_scale``) as a float, or
    ``InvalidBatchError`` naming ``name``."""
    if type(value) is float and F32_MIN_NORMAL <= value <= F32_MAX:
        return value
    problem = positive_f32_problem(value)
    if problem is not None:
        raise InvalidBatchError(name, f"{problem}, got {value!r}")
    return float(value)


def check_sinks(sinks: Any, q: Any, num_q_heads: int, who: str) -> None:
    """``sinks`` must be a float32 ``[num_q_heads]`` tensor on ``q``'s device, contiguous
    (the kernels index it by head). Attribute reads only."""
    torch = sys.modules.get("torch")
    try:
        ok = (
            torch is not None
            and isinstance(sinks, torch.Tensor)
            and sinks.dtype == torch.float32
            and sinks.dim() == 1
            and sinks.shape[0] == num_q_heads
            # q itself is checked by the backend (TensorChecks); compare devices when it has one
            and sinks.device == getattr(q, "device", sinks.device)
            and sinks.stride(0) == 1
        )
    except AttributeError:
        ok = False
    if ok:
        return
    if torch is None or not isinstance(sinks, torch.Tensor):
        problem = f"expected a torch.Tensor, got {type(sinks).__name__}"
    elif sinks.dtype != torch.float32:
        problem = f"dtype {sinks.dtype} != torch.float32 (one sink logit per query head)"
    elif sinks.dim() != 1 or sinks.shape[0] != num_q_heads:
        problem = f"shape {tuple(sinks.shape)} != [num_q_heads={num_q_heads}]"
    elif sinks.stride(0) != 1:
        problem = "must be contiguous (call .contiguous())"
    else:
        problem = f"on {sinks.device}, q on {getattr(q, 'device', None)}"
    raise InvalidBatchError("sinks", f"{who}: {problem}")


def out_problem(
    out: Any, q: Any, k_cache: Any, v_cache: Any, num_q_heads: int, v_head_dim: int
) -> str | None:
    """Why ``out`` cannot receive one call's output, or None: it must be a contiguous tensor
    ``[q.shape[0], num_q_heads, v_head_dim]`` of q's dtype on q's device, sharing no memory
    with q or the caches (its byte span against theirs, views and slices included).
    Attribute reads only (no device work)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(out, torch.Tensor):
        return f"expected a torch.Tensor, got {type(out).__name__}"
    try:
        want = (q.shape[0], num_q_heads, v_head_dim)
        if out.shape != want:
            return (
                f"shape {tuple(out.shape)} != [tokens={want[0]}, num_q_heads={num_q_heads}, "
                f"v_head_dim={v_head_dim}] (q has {want[0]} rows)"
            )
        if out.dtype != q.dtype:
            return f"dtype {out.dtype} != q's dtype {q.dtype}"
        if out.device != q.device:
            return f"on {out.device}, q on {q.device}"
    except AttributeError:
        return None  # q itself is not a tensor: the backend's own checks name it
    if not out.is_contiguous():
        return f"must be contiguous (strides {out.stride()}); pass a contiguous buffer"
    lo = out.data_ptr()
    hi = lo + out.nbytes
    if hi > lo:
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            if isinstance(t, torch.Tensor) and _overlaps(t, lo, hi):
                return (
                    f"shares memory with {name} (the kernel reads {name} while it writes out); "
                    "pass a buffer of its own"
                )
    return None


def _overlaps(t: Any, lo: int, hi: int) -> bool:
    """Whether the bytes ``t`` may touch intersect ``[lo, hi)`` (its whole strided span)."""
    size: int = t.nbytes
    if not size:
        return False
    start: int = t.data_ptr()
    if t.is_contiguous():  # the common case: no Python loop over dims
        return start < hi and lo < start + size
    shape, stride = t.shape, t.stride()
    last = 0
    for i in range(len(stride)):
        last += (shape[i] - 1) * stride[i]
    end: int = start + (last + 1) * t.element_size()
    return start < hi and lo < end


def check_out(
    out: Any, q: Any, k_cache: Any, v_cache: Any, num_q_heads: int, v_head_dim: int, who: str
) -> None:
    """Raise ``InvalidBatchError("out", ...)`` unless ``out`` can receive the call's output
    (see ``out_problem``): the core's one rule, which a handler called without a binding
    applies itself."""
    problem = out_problem(out, q, k_cache, v_cache, num_q_heads, v_head_dim)
    if problem is not None:
        raise InvalidBatchError("out", f"{who}: {problem}")
