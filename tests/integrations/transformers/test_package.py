"""The transformers integration's layout: one module per concept, imports that point only
down, every name of the former single module still importable from the package, and the
former ``_hf_cache`` module gone (0.2.0 keeps no compatibility layer)."""

from __future__ import annotations

import importlib
import pickle
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import attn_dispatch  # noqa: E402
import attn_dispatch.integrations.transformers as tf  # noqa: E402
from tests.imports import modules  # noqa: E402
from tests.imports import path_imports  # noqa: E402

PACKAGE = Path(tf.__file__).parent
ROOT = PACKAGE.parents[2]
PREFIX = "attn_dispatch.integrations.transformers"
# Each module may import only those listed before it (and the core, backends excluded).
ORDER = [
    "_common",
    "_config",
    "_allocator",
    "_layer",
    "_buffers",
    "_cache",
    "_view",
    "_masks",
    "_attention",
    "_use",
    "__init__",
]
# What the single module exported before the split, and the private name the CLI reads.
FORMER_NAMES = [
    "FP8_MAX",
    "GROUP_CHUNKED",
    "GROUP_FULL",
    "GROUP_SLIDING",
    "IMPLEMENTATION",
    "Bound",
    "DenseView",
    "PagedCache",
    "UnsupportedModelError",
    "attention_forward",
    "attn_config_for",
    "attn_configs_for",
    "dispatch_mask",
    "layer_groups",
    "use",
    "DEFAULT_PAGE_SIZE",
    "GroupedBatches",
]


def test_every_module_is_listed_and_short() -> None:
    modules = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert modules == sorted(ORDER)
    for path in PACKAGE.glob("*.py"):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        assert lines <= 650, (path.name, lines)


def _imports(path: Path) -> set[str]:
    """Our modules imported anywhere in ``path`` (functions included), except under
    ``if TYPE_CHECKING:`` (the suite's one scanner, tests/imports.py)."""
    known = set(modules(ROOT / "attn_dispatch", ROOT))
    return path_imports(path, f"{PREFIX}.{path.stem}", known)


def test_imports_point_down_and_never_to_the_cli_demo_or_other_integrations() -> None:
    for i, name in enumerate(ORDER):
        allowed = {f"{PREFIX}.{m}" for m in ORDER[:i]}
        for module in _imports(PACKAGE / f"{name}.py"):
            if module.startswith(PREFIX):
                assert module in allowed, f"{name} imports {module}, not below it"
            elif module.startswith("attn_dispatch"):
                assert not module.startswith(
                    ("attn_dispatch._cli", "attn_dispatch.demo", "attn_dispatch.integrations")
                ), f"{name} imports {module}"


def test_the_former_names_are_importable_from_the_package() -> None:
    for name in FORMER_NAMES:
        assert hasattr(tf, name), name
    assert not hasattr(tf, "_has_sinks")  # the pre-0.2 private alias is gone
    assert set(tf.__all__) >= set(FORMER_NAMES) | {"has_sinks"}


def test_public_classes_name_the_package() -> None:
    for cls in (tf.Bound, tf.DenseView, tf.GroupedBatches, tf.PagedCache, tf.PagedLayer):
        assert cls.__module__ == PREFIX, cls
    # The error is the core's (the vLLM integration raises it too): it names attn_dispatch.
    err = tf.UnsupportedModelError("a model this mapping would get wrong")
    assert tf.UnsupportedModelError is attn_dispatch.UnsupportedModelError
    assert repr(type(err)) == "<class 'attn_dispatch.UnsupportedModelError'>"
    data = pickle.dumps(err)
    assert b"_common" not in data and b"_errors" not in data
    assert str(pickle.loads(data)) == str(err)


def test_has_sinks_finds_learned_sink_tensors_on_any_module() -> None:
    def attention(sinks: object) -> object:
        module = torch.nn.Module()
        module.sinks = sinks  # gpt-oss: one learned logit per head, on the attention module
        return module

    with_sinks = torch.nn.Sequential(
        torch.nn.Linear(2, 2), attention(torch.nn.Parameter(torch.zeros(4)))
    )
    assert tf.has_sinks(with_sinks)
    assert not tf.has_sinks(torch.nn.Sequential(torch.nn.Linear(2, 2), attention(None)))
    assert not tf.has_sinks(torch.nn.Linear(2, 2))


def test_the_former_cache_module_is_gone() -> None:
    # 0.2.0 keeps no compatibility layer: the names live in the package only.
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("attn_dispatch.integrations._hf_cache")
