"""Record SGLang's own backend choice over a grid of server args; compare ours with it.

SGLang is not a dependency of attn_dispatch. This script runs SGLang's real resolution code on
a CPU-only machine: ``ServerArgs.resolve_once()`` (with SGLang's own ``override_platform``
hook describing one Blackwell GPU, so every backend's platform gate passes), then for each
accepted combination

* target: ``attention_backends_of`` (the prefill/decode pair) and, when the pair differs,
  ``HybridAttnBackend._select_backend`` for every ``ForwardMode`` member;
* draft, EAGLE family (EAGLE, EAGLE3, NEXTN, STANDALONE): ``DraftBackendFactory``'s
  draft-extend and multi-step decode backends, whose stamped names are SGLang's answer (the
  kernel modules they import are replaced by stand-ins while the factory runs: no GPU);
* draft, DFLASH/DSPARK: ``resolve_draft_worker_attention_backend`` (one backend for every
  draft forward); NGRAM has no draft model.

Install (no shared venv is touched; ``--no-deps`` because SGLang pins CUDA packages)::

    pip install --no-deps --target /work/extra_sglang sglang==0.5.23 \
        orjson psutil pybase64 pillow starlette msgspec pyzmq ipython traitlets aiohttp \
        multidict attrs yarl propcache aiohappyeyeballs aiosignal frozenlist sentencepiece \
        dill compressed-tensors loguru gguf openai sniffio partial-json-parser

(torch, transformers, numpy, pydantic, httpx come from the project venv.) ``torchvision`` is
not installed: imports of it from SGLang's multimodal modules get an empty stand-in.

Run::

    PYTHONPATH=/work/extra_sglang python tools/sglang_grid.py --write   # tests/data/...
    PYTHONPATH=/work/extra_sglang python tools/sglang_grid.py           # compare only

The comparison prints the grid size and how many accepted combinations our
``spec_from_server_args`` answers differently, for the target and for the draft.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.abc
import importlib.machinery
import itertools
import json
import logging
import os
import sys
import tempfile
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attn_dispatch.integrations.sglang import phase_of  # noqa: E402
from attn_dispatch.integrations.sglang import spec_from_server_args  # noqa: E402

# One knob per server arg the backend choice reads. None = not given on the command line.
GRID: dict[str, list[Any]] = {
    "attention_backend": [None, "triton", "flashinfer", "fa3", "tokenspeed_mla", "torch_native"],
    "prefill_attention_backend": [None, "triton", "flashinfer"],
    "decode_attention_backend": [None, "triton", "flashinfer"],
    "speculative_attention_mode": ["prefill", "decode"],
    "speculative_draft_attention_backend": [None, "triton", "fa3"],
    "speculative_algorithm": [
        None,
        "EAGLE",
        "EAGLE3",
        "NEXTN",
        "STANDALONE",
        "DFLASH",
        "DSPARK",
        "NGRAM",
    ],
}
# One B200: every backend in the grid passes its platform gate.
PLATFORM = dict(
    is_cuda=True,
    is_hip=False,
    is_npu=False,
    is_xpu=False,
    is_musa=False,
    is_mps=False,
    is_sm90=False,
    is_sm100=True,
    is_sm100_or_sm110=True,
    is_blackwell=True,
    has_flashinfer=True,
    has_amx=False,
    device_sm=100,
    device_capability=(10, 0),
)
# A two-layer DeepSeek-V3 (MLA) config: resolution reads the architecture, never weights.
MODEL_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "rope_theta": 10000,
}
RESOLVED_KEYS = (
    "attention_backend",
    "prefill_attention_backend",
    "decode_attention_backend",
    "speculative_attention_mode",
    "speculative_draft_attention_backend",
    "speculative_algorithm",
    "speculative_num_steps",
)
# The draft runner's forwards besides the multi-step DECODE (EXTEND: its runner backend).
DRAFT_MODES = ("EXTEND", "DRAFT_EXTEND_V2")
EAGLE_FAMILY = {"EAGLE", "EAGLE3", "STANDALONE"}  # NEXTN resolves to EAGLE
# The kernel modules DraftBackendFactory imports to build a backend.
KERNEL_MODULES = [
    "sglang.srt.layers.attention." + name
    for name in (
        "flashinfer_backend",
        "flashinfer_mla_backend",
        "triton_backend",
        "intel_amx_backend",
        "xpu_backend",
        "aiter_backend",
        "flashattention_backend",
        "flashmla_backend",
        "trtllm_mha_backend",
        "trtllm_mla_backend",
        "cutedsl_mla_backend",
        "dsa_backend",
    )
]

DRAFT_COMMON_IMPORTS = [
    "sglang.srt.managers.tp_worker",
    "sglang.srt.speculative.dflash_info",
    "sglang.srt.speculative.dflash_info_v2",
]
# hybrid_attn_backend imports ModelRunner (the whole runtime) for a type annotation.
HYBRID_IMPORTS = ["sglang.srt.model_executor.model_runner"]


class _StandIn:
    """Whatever a stubbed module is asked for: constructible, callable, attribute-bearing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _StandIn:
        return _StandIn()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _StandIn()

    def __iter__(self) -> Iterator[Any]:
        return iter(())


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _StandIn


class _TorchvisionForSGLang(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """An empty ``torchvision`` for imports made by SGLang's own files only, so that
    transformers (which probes for torchvision) still sees it as absent."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.split(".")[0] != "torchvision":
            return None
        frame = sys._getframe(1)
        while frame is not None:
            name = frame.f_code.co_filename
            if "importlib" not in name and "<frozen" not in name and name != __file__:
                if "/sglang/" in name:
                    return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
                return None
            frame = frame.f_back  # type: ignore[assignment]
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


@contextlib.contextmanager
def _stub_modules(names: list[str]) -> Iterator[None]:
    saved = {name: sys.modules.get(name) for name in names}
    for name in names:
        sys.modules[name] = _StubModule(name)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _combinations() -> Iterator[dict[str, Any]]:
    keys = list(GRID)
    for values in itertools.product(*(GRID[k] for k in keys)):
        yield {k: v for k, v in zip(keys, values, strict=True) if v is not None}


def _sglang_answers(model_dir: str) -> dict[str, Any]:
    """Run SGLang over the grid; return the recorded document."""
    sys.meta_path.insert(0, _TorchvisionForSGLang())
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    import sglang
    import sglang.srt.speculative.draft_utils as draft_utils

    # draft_worker_common imports the whole scheduler for one type; its resolver needs none of it.
    with _stub_modules(DRAFT_COMMON_IMPORTS):
        import sglang.srt.speculative.draft_worker_common as draft_common
    from sglang.srt.arg_groups.model_override_base import attention_backends_of

    with _stub_modules(HYBRID_IMPORTS):
        from sglang.srt.layers.attention.hybrid_attn_backend import HybridAttnBackend
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.runtime_context import override_platform
    from sglang.srt.server_args import ServerArgs

    modes = [m.name for m in ForwardMode]

    def target_answer(resolved: dict[str, Any]) -> dict[str, str]:
        prefill, decode = attention_backends_of(types.SimpleNamespace(**resolved))
        if prefill == decode:  # _build_resolved_backend: one backend, no hybrid
            return {m: prefill for m in modes}
        hybrid = types.SimpleNamespace(
            prefill_backend=prefill,
            decode_backend=decode,
            spec_attn_is_decode=resolved["speculative_attention_mode"] == "decode",
        )
        return {m.name: HybridAttnBackend._select_backend(hybrid, m) for m in ForwardMode}

    def eagle_draft_answer(resolved: dict[str, Any]) -> dict[str, str] | str:
        pair = attention_backends_of(types.SimpleNamespace(**resolved))
        spec = types.SimpleNamespace(
            speculative_attention_mode=resolved["speculative_attention_mode"]
        )
        hf = types.SimpleNamespace()
        runner = types.SimpleNamespace(
            draft_attention_backend=resolved["speculative_draft_attention_backend"],
            use_mla_backend=True,
            model_config=types.SimpleNamespace(hf_config=hf, hf_text_config=hf),
        )
        steps = resolved["speculative_num_steps"] or 0
        factory = draft_utils.DraftBackendFactory(runner, topk=1, speculative_num_steps=steps)
        saved = (draft_utils.attention_backends, draft_utils.get_spec)
        draft_utils.attention_backends = lambda: pair
        draft_utils.get_spec = lambda: spec
        try:
            with _stub_modules(KERNEL_MODULES):
                extend = factory.create_draft_extend_backend()
                decode = factory.create_decode_backend()
        except ValueError as exc:
            return f"rejected: {exc}"
        finally:
            draft_utils.attention_backends, draft_utils.get_spec = saved
        # EAGLE v2 replaces the draft runner's attn_backend with the draft-extend backend:
        # every draft forward except the multi-step decode runs on it.
        answer = {m: extend.prefill_attention_backend_str for m in DRAFT_MODES}
        if decode is not None:
            answer["DECODE"] = decode.decode_attention_backend_str
        return answer

    def single_draft_answer(resolved: dict[str, Any]) -> dict[str, str]:
        pair = attention_backends_of(types.SimpleNamespace(**resolved))
        spec = types.SimpleNamespace(
            speculative_draft_attention_backend=resolved["speculative_draft_attention_backend"]
        )
        saved = (draft_common.attention_backends, draft_common.get_spec)
        draft_common.attention_backends = lambda: pair
        draft_common.get_spec = lambda: spec
        try:
            name = draft_common.resolve_draft_worker_attention_backend(algo_label="grid")
        finally:
            draft_common.attention_backends, draft_common.get_spec = saved
        return {m: name for m in (*DRAFT_MODES, "DECODE")}

    rows = []
    for raw in _combinations():
        kwargs = dict(raw)
        if raw.get("speculative_algorithm") not in (None, "NGRAM"):
            kwargs["speculative_draft_model_path"] = model_dir
        args = ServerArgs(model_path=model_dir, device="cuda", skip_tokenizer_init=True, **kwargs)
        row: dict[str, Any] = {"input": raw}
        try:
            with override_platform(**PLATFORM):
                args.resolve_once()
                resolved_all = args.resolved_dict()
        except BaseException as exc:  # SGLang refuses this combination at start-up
            row["rejected"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            rows.append(row)
            continue
        resolved = {k: resolved_all[k] for k in RESOLVED_KEYS}
        row["resolved"] = resolved
        # In forward_modes order, to keep the recorded file small.
        row["target"] = list(target_answer(resolved).values())
        algorithm = resolved["speculative_algorithm"]
        with override_platform(**PLATFORM):
            if algorithm in EAGLE_FAMILY:
                row["draft"] = eagle_draft_answer(resolved)
            elif algorithm in ("DFLASH", "DSPARK"):
                row["draft"] = single_draft_answer(resolved)
            else:
                row["draft"] = None
        row["_server_args"] = args
        rows.append(row)
    return {
        "sglang_version": sglang.__version__,
        "platform": "simulated B200 (SGLang override_platform), device='cuda'",
        "model": "DeepseekV3ForCausalLM, 2 layers (config only)",
        "grid": GRID,
        "forward_modes": modes,
        "rows": rows,
    }


def compare(doc: dict[str, Any], source: str) -> dict[str, int]:
    """Count accepted combinations whose target/draft spec disagrees with SGLang's answer.

    ``source``: what ``spec_from_server_args`` reads: ``"_server_args"`` (the real ServerArgs
    object), ``"resolved"`` (its resolved values as a mapping) or ``"input"`` (the raw input).
    """
    use_objects = source == "_server_args"
    stats = {"combinations": 0, "accepted": 0, "target_mismatch": 0, "draft_rows": 0}
    stats["draft_mismatch"] = 0
    for row in doc["rows"]:
        stats["combinations"] += 1
        if "rejected" in row:
            continue
        stats["accepted"] += 1
        args = row["_server_args"] if use_objects else row[source]
        modes = [m for m in doc["forward_modes"] if m != "DRAFT_EXTEND_V2"]
        target = dict(zip(doc["forward_modes"], row["target"], strict=True))
        if _differs(args, target, modes, is_draft=False):
            stats["target_mismatch"] += 1
        draft = row["draft"]
        if isinstance(draft, dict):
            stats["draft_rows"] += 1
            modes = [*DRAFT_MODES] + (["DECODE"] if "DECODE" in draft else [])
            if _differs(args, draft, modes, is_draft=True):
                stats["draft_mismatch"] += 1
    return stats


def _differs(args: Any, answer: dict[str, str], modes: list[str], *, is_draft: bool) -> bool:
    try:
        spec = spec_from_server_args(args, is_draft=is_draft)
    except Exception:
        return True
    return any(spec.backend_for(phase_of(m)) != answer[m] for m in modes)


def _packed(row: dict[str, Any]) -> dict[str, Any]:
    """A row with its mappings as lists in GRID / RESOLVED_KEYS order (see ``unpacked``)."""
    out = {k: v for k, v in row.items() if k not in ("_server_args", "input", "resolved")}
    out["input"] = [row["input"].get(k) for k in GRID]
    if "resolved" in row:
        out["resolved"] = [row["resolved"][k] for k in RESOLVED_KEYS]
    return out


def unpacked(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The recorded rows with ``input``/``resolved``/``target`` as mappings again."""
    rows = []
    for row in doc["rows"]:
        row = dict(row)
        row["input"] = {
            k: v for k, v in zip(doc["input_keys"], row["input"], strict=True) if v is not None
        }
        if "resolved" in row:
            row["resolved"] = dict(zip(doc["resolved_keys"], row["resolved"], strict=True))
            row["target"] = dict(zip(doc["forward_modes"], row["target"], strict=True))
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write tests/data/sglang_grid_*.json")
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 on any mismatch, or if the recorded grid of this version differs",
    )
    parser.add_argument(
        "--modes", action="store_true", help="print SGLang's ForwardMode names as JSON and exit"
    )
    opts = parser.parse_args()
    if opts.modes:
        sys.meta_path.insert(0, _TorchvisionForSGLang())
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        print(json.dumps([m.name for m in ForwardMode]))
        return
    with tempfile.TemporaryDirectory() as model_dir:
        Path(model_dir, "config.json").write_text(json.dumps(MODEL_CONFIG))
        doc = _sglang_answers(model_dir)
    failed = False
    for label, source in (
        ("ServerArgs objects", "_server_args"),
        ("resolved mappings", "resolved"),
        ("raw input mappings", "input"),  # no resolved defaults: informative only
    ):
        stats = compare(doc, source)
        print(f"{label}: {stats}")
        failed |= source != "input" and bool(stats["target_mismatch"] + stats["draft_mismatch"])
    out = ROOT / "tests" / "data" / f"sglang_grid_{doc['sglang_version']}.json"
    if opts.check and out.exists() and not opts.write:
        recorded = json.loads(out.read_text())
        fresh = [_packed(row) for row in doc["rows"]]
        same = recorded["rows"] == json.loads(json.dumps(fresh))
        print(f"recorded {out.relative_to(ROOT)}: {'identical' if same else 'DIFFERS'}")
        failed |= not same
    if opts.write:
        out.parent.mkdir(exist_ok=True)
        rows = [_packed(row) for row in doc.pop("rows")]
        doc["input_keys"], doc["resolved_keys"] = list(GRID), list(RESOLVED_KEYS)
        head = json.dumps(doc, sort_keys=True)[:-1]  # one row per line keeps diffs readable
        body = ",\n".join(json.dumps(row, sort_keys=True) for row in rows)
        out.write_text(f'{head}, "rows": [\n{body}\n]}}\n')
        print(f"wrote {out.relative_to(ROOT)} ({len(rows)} rows)")
    if opts.check and failed:
        sys.exit(1)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
