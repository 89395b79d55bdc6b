"""dtype and device names without importing torch."""

from __future__ import annotations

from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._vocab import DTYPE_ALIASES as _ALIASES
from attn_dispatch._vocab import DTYPE_NAMES


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
