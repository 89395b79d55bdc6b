"""Carrying the active scope into worker threads.

A ``threading.Thread`` starts with an empty context, so a worker sees no scope unless the
caller's context is carried into it (``contextvars.copy_context().run``).
"""

from __future__ import annotations

import contextvars
import functools
import threading
from collections.abc import Callable
from typing import Any
from typing import ParamSpec
from typing import TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def carry_scope(fn: Callable[P, R]) -> Callable[P, R]:
    """Wrap ``fn`` so it runs in a copy of the caller's context (its scopes included).

    >>> import threading
    >>> from attn_dispatch import AttnConfig, bind, current_binding
    >>> config = AttnConfig("mha", 4, 2, 16, dtype="float32", device="cpu", page_size=8)
    >>> class Runner:
    ...     attn_binding = bind("torch", config, label="target")
    >>> seen = []
    >>> def work():
    ...     seen.append(current_binding().label)
    >>> with attn_scope(Runner()):
    ...     t = threading.Thread(target=carry_scope(work)); t.start(); t.join()
    >>> seen
    ['target']
    """
    ctx = contextvars.copy_context()

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        # A Context can be entered by one thread at a time: each call gets its own copy.
        return ctx.copy().run(fn, *args, **kwargs)

    return run


def run_in_thread(fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
    """Run ``fn(*args, **kwargs)`` in a new thread with the current scope; return its result.

    >>> import torch
    >>> from attn_dispatch import AttnBatch, AttnConfig, Phase, attention, bind
    >>> config = AttnConfig("mha", 4, 2, 16, dtype="float32", device="cpu", page_size=8)
    >>> class Runner:
    ...     attn_binding = bind("torch", config, label="target")
    >>> batch = AttnBatch.build(Phase.DECODE, q_lens=[1], kv_lens=[5], page_tables=[[0]],
    ...                         page_size=8)
    >>> q, k_cache = torch.randn(1, 4, 16), torch.randn(1, 8, 2, 16)
    >>> def layer(q, k_cache, v_cache):
    ...     return attention(q, k_cache, v_cache, sm_scale=0.25)
    >>> with attn_scope(Runner(), batch):
    ...     out = run_in_thread(layer, q, k_cache, k_cache)
    >>> out.shape
    torch.Size([1, 4, 16])
    """
    result: list[Any] = []
    error: list[BaseException] = []
    wrapped = carry_scope(fn)

    def target() -> None:
        try:
            result.append(wrapped(*args, **kwargs))
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=target, name="attn_dispatch-worker")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]  # type: ignore[no-any-return]
