"""Model reading for ``explain --model``: a model config -> the AttnConfig of each layer group."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Any

from attn_dispatch._config import AttnConfig
from attn_dispatch._errors import InvalidSpecError


class UnsupportedModel(Exception):
    """The integration refuses this model (a layer type it cannot serve): a refusal, exit 1."""


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
    modules, not of the config: like ``use()``, this looks at the modules of the model built
    on the meta device (no memory, no weights), unless ``--sinks``/``--no-sinks`` says.
    """
    path = Path(args.model).expanduser()
    if not path.exists():
        raise InvalidSpecError(
            "--model",
            str(path),
            "no such file or directory; pass a model directory holding config.json, or the "
            "config.json itself (read locally, never downloaded)",
        )
    tf = _transformers_integration()
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:
        raise InvalidSpecError(
            "--model", str(path), f"transformers cannot read this config: {exc}"
        ) from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    dtype = args.dtype or str(getattr(text, "dtype", None) or "float32").removeprefix("torch.")
    try:
        layers = tf.layer_groups(config)  # what use() refuses by layer type, refused here too
        sinks = _model_has_sinks(config, tf) if args.sinks is None else args.sinks
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
        f"{'' if args.dtype else ' from the config'}, sinks {'yes' if sinks else 'no'})"
    ]
    return configs, header


def _model_has_sinks(config: Any, tf: Any) -> bool:
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    except Exception as exc:
        raise InvalidSpecError(
            "--model",
            type(config).__name__,
            f"cannot build the model on the meta device to look for attention sinks "
            f"({type(exc).__name__}: {exc}); say it with --sinks or --no-sinks",
        ) from None
    # The integration's public helper (the private name until it exports one).
    has_sinks = getattr(tf, "has_sinks", None) or tf._has_sinks
    return bool(has_sinks(model))
