"""dtype and device names without importing torch."""

from __future__ import annotations

from attn_dispatch._errors import InvalidSpecError

_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float8_e4m3fn": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
    "fp8_e5m2": "float8_e5m2",
}

DTYPE_NAMES = frozenset(_ALIASES.values())


def dtype_name(value: object, *, field: str = "dtype") -> str:
    """Normalise ``torch.bfloat16``, ``"bf16"`` or ``"bfloat16"`` to ``"bfloat16"``."""
    text = str(value).removeprefix("torch.").strip().lower()
    try:
        return _ALIASES[text]
    except KeyError:
        raise InvalidSpecError(
            field, value, f"unknown dtype; choose one of {', '.join(sorted(DTYPE_NAMES))}"
        ) from None


def device_type(device: object) -> str:
    """``"cuda:1"`` -> ``"cuda"``; accepts ``torch.device`` too."""
    text = str(device).strip().lower()
    return text.split(":", 1)[0]
