"""Model reading for ``explain --model``: a model config -> the AttnConfig of each layer group.

Only the config is read, never a model built: the time does not grow with the model's sizes
(a config naming a billion layers is refused, not unrolled). Its numbers are checked before
transformers sees them, the same way whatever the flags: an attention field that is not a
whole number in range (``num_attention_heads: 0``, ``num_key_value_heads: 0``, a negative or
absurd size) is bad input (exit 2), as ``--heads 0`` is.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path
from typing import Any

from attn_dispatch._config import AttnConfig
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch.cli._files import read_regular

__all__ = ["UnsupportedModel", "model_configs"]


class UnsupportedModel(Exception):
    """The integration refuses this model (a layer type it cannot serve): a refusal, exit 1."""


#: Model types whose attention modules hold learned sink logits (no config field says so):
#: gpt-oss keeps one per head (``sinks``, passed as ``s_aux``). Others: say ``--sinks``.
SINK_MODEL_TYPES = frozenset({"gpt_oss"})

# Bounds of the attention fields of a config (inclusive). Larger values name no real model
# and would only make the mapping slow (a list per layer) or overflow the int32 metadata.
_COUNT_MAX = 1 << 20  # heads, head dims, layers, latent ranks
_POSITION_MAX = (1 << 31) - 1  # windows and chunks: token positions
_FIELDS: dict[str, tuple[int, int]] = {
    "num_hidden_layers": (1, _COUNT_MAX),
    "num_attention_heads": (1, _COUNT_MAX),
    "num_key_value_heads": (1, _COUNT_MAX),
    "head_dim": (1, _COUNT_MAX),
    "hidden_size": (1, _COUNT_MAX),
    "qk_nope_head_dim": (0, _COUNT_MAX),
    "qk_rope_head_dim": (0, _COUNT_MAX),
    "v_head_dim": (1, _COUNT_MAX),
    "kv_lora_rank": (1, _COUNT_MAX),
    "sliding_window": (0, _POSITION_MAX),
    "attention_chunk_size": (1, _POSITION_MAX),
}
_CONFIG_BYTES_MAX = 16 << 20  # a model config is kilobytes; a larger file is not one
# Nesting depth of a config.json (text_config.rope_scaling: 3); far deeper is not a config.
_DEPTH_MAX = 32


def _config_file(path: Path) -> Path:
    return path / "config.json" if path.is_dir() else path


def check_config_values(data: object, where: str) -> None:
    """Refuse (``InvalidSpecError``, exit 2) an attention field of a config.json's object (or
    of its ``text_config``) that is not a whole number within its bounds. Fields left out or
    null are transformers' to default."""
    if not isinstance(data, dict):
        return  # not a JSON object: transformers says why it cannot read it
    parts = [("", data)]
    text = data.get("text_config")
    if isinstance(text, dict):
        parts.append(("text_config.", text))
    for prefix, part in parts:
        for field, (low, high) in _FIELDS.items():
            value = part.get(field)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise InvalidSpecError(
                    "--model",
                    where,
                    f"{prefix}{field}={value!r} in its config.json; expected a whole number "
                    f"in [{low}, {high}]",
                )
        types = part.get("layer_types")
        if isinstance(types, list) and len(types) > _COUNT_MAX:
            raise InvalidSpecError(
                "--model", where, f"{prefix}layer_types lists {len(types)} layers"
            )


def _read_raw(path: Path) -> object:
    """The config.json's JSON value, or None where transformers should report the problem
    (no such file, not JSON). Only a regular file is read (a FIFO would block, a link to a
    device never end), bounded in size and in nesting depth."""
    file = _config_file(path)
    try:
        data = read_regular(
            file, "--model", _CONFIG_BYTES_MAX, what="a model config", shown=str(path)
        )
    except FileNotFoundError:
        return None  # transformers names the missing file
    try:
        value = json.loads(data)
    except RecursionError:
        value = _TOO_DEEP
    except ValueError:
        return None  # transformers names the problem (and its message is the documented one)
    if value is _TOO_DEEP or _depth(value) > _DEPTH_MAX:
        raise InvalidSpecError(
            "--model",
            str(path),
            f"{file.name} nests its values deeper than {_DEPTH_MAX} levels; a model config "
            "nests a few",
        )
    return value


_TOO_DEEP = object()


def _depth(value: object) -> int:
    """How deep a parsed JSON value nests (a scalar: 0), without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        children = (
            item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        )
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            if level > _DEPTH_MAX:
                break
            todo.extend((c, level + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def _transformers_integration() -> Any:
    """``attn_dispatch.integrations.transformers`` (imports torch and transformers)."""
    try:
        return importlib.import_module("attn_dispatch.integrations.transformers")
    except ImportError as exc:
        raise InvalidSpecError(
            "--model",
            None,
            f"reading a model config needs torch and transformers ({exc}); "
            "pip install 'attn_dispatch[transformers]'",
        ) from None


def model_configs(args: argparse.Namespace) -> tuple[dict[str, AttnConfig], list[str]]:
    """Group -> AttnConfig of the model config at ``args.model``, mapped by the code ``use()``
    runs (``layer_groups``, ``attn_configs_for``), and lines that describe it.

    The config is read from the local file system only (``local_files_only``): a path that
    does not exist is an error, never a Hub download. Sinks are a property of the attention
    modules, not of the config: ``--sinks``/``--no-sinks`` says, else the model type does
    (``SINK_MODEL_TYPES``); no model is built to look.
    """
    path = Path(args.model).expanduser()
    if not path.exists():
        raise InvalidSpecError(
            "--model",
            str(path),
            "no such file or directory; pass a model directory holding config.json, or the "
            "config.json itself (read locally, never downloaded)",
        )
    check_config_values(_read_raw(path), str(path))
    tf = _transformers_integration()
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise InvalidSpecError(
            "--model", str(path), f"transformers cannot read this config: {exc}"
        ) from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text, "model_type", None) or getattr(config, "model_type", "?")
    dtype = args.dtype or str(getattr(text, "dtype", None) or "float32").removeprefix("torch.")
    if args.sinks is not None:
        sinks, why = bool(args.sinks), "as given"
    else:
        sinks = getattr(config, "model_type", None) in SINK_MODEL_TYPES or (
            model_type in SINK_MODEL_TYPES
        )
        why = f"model type {model_type!r}; --sinks/--no-sinks to say otherwise"
    try:
        layers = tf.layer_groups(config)  # what use() refuses by layer type, refused here too
        configs: dict[str, AttnConfig] = tf.attn_configs_for(
            config,
            dtype=dtype,
            device=args.device,
            page_size=args.page_size,
            tree_verify=args.tree_verify,
            sinks=sinks,
            kv_dtype=args.kv_dtype,
        )
    except tf.UnsupportedModelError as exc:
        raise UnsupportedModel(str(exc)) from None
    if args.sm_scale is not None:
        configs = {g: c.replace(sm_scale=args.sm_scale) for g, c in configs.items()}
    counts = ", ".join(f"{layers.count(g)} {g}" for g in configs)
    header = [
        f"model:  {path} (model_type {getattr(text, 'model_type', '?')!r}, "
        f"{len(layers)} layers: {counts}; dtype {dtype}"
        f"{'' if args.dtype else ' from the config'}, sinks {'yes' if sinks else 'no'} "
        f"({why}))"
    ]
    return configs, header
