"""Test-only placeholder for torchvision, never part of the library.

SGLang's multimodal modules (and transformers' image utilities, once torchvision is importable)
import torchvision names at module level; the only torchvision wheel matching SGLang's pins is a
CUDA build. Every ``torchvision.*`` module here is a placeholder whose names are inert classes:
importing works, using one for real fails. The text-only engine runs these tests make never
call them.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.29.1"


class _Meta(type):
    # Class-level names (enum members such as InterpolationMode.BILINEAR) are placeholders too.
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Meta(name, (_Placeholder,), {})


class _Placeholder(metaclass=_Meta):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("torchvision is a test placeholder here")


class _Module(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _Meta(name, (_Placeholder,), {})
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        return _Module(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []  # type: ignore[attr-defined]


sys.meta_path.insert(0, _Finder())
sys.modules[__name__].__class__ = _Module
