"""The backend registry: names -> (capabilities, factory). Thread-safe; plugins load lazily."""

from __future__ import annotations

import dataclasses
import importlib
import threading
import warnings
from collections.abc import Callable
from typing import Any
from typing import TypeVar
from typing import overload

from attn_dispatch._capabilities import Capabilities
from attn_dispatch._errors import AttnDispatchError
from attn_dispatch._errors import BackendUnavailableError
from attn_dispatch._errors import DuplicateBackendError
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._errors import UnknownBackendError

ENTRY_POINT_GROUP = "attn_dispatch.backends"

Factory = Callable[..., Any]
F = TypeVar("F", bound=Factory)


@dataclasses.dataclass(frozen=True, slots=True)
class BackendEntry:
    """One registered backend. ``factory`` is a callable or a ``"module:attr"`` path."""

    name: str
    capabilities: Capabilities
    factory: Factory | str

    def load_factory(self) -> Factory:
        """The factory callable, importing a dotted path now (only ever at bind time)."""
        if not isinstance(self.factory, str):
            return self.factory
        module, _, attr = self.factory.partition(":")
        try:
            obj: Any = importlib.import_module(module)
            for part in attr.split(".") if attr else ():
                obj = getattr(obj, part)
        except Exception as exc:
            raise BackendUnavailableError(
                self.name, f"cannot load factory {self.factory!r}: {type(exc).__name__}: {exc}"
            ) from exc
        if not callable(obj):
            raise BackendUnavailableError(self.name, f"factory {self.factory!r} is not callable")
        return obj  # type: ignore[no-any-return]


_lock = threading.RLock()
_entries: dict[str, BackendEntry] = {}
_loaded = False
_loading = False
plugin_errors: dict[str, str] = {}


def _ensure_loaded() -> None:
    # Built-ins and entry points load on first use, not at import: `import attn_dispatch` must
    # stay cheap and must not import any plugin's module. Other threads wait on the lock until
    # loading is complete; the loading thread itself re-enters (plugins call register_backend).
    global _loaded, _loading
    if _loaded:
        return
    with _lock:
        if _loaded or _loading:
            return
        _loading = True
        try:
            from attn_dispatch.backends import register_builtins

            register_builtins()
            _load_entry_points()
        finally:
            _loading = False
        _loaded = True


def _load_entry_points() -> None:
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
            if isinstance(obj, BackendEntry):
                _register(obj, replace=False)
            elif callable(obj):
                obj()
            else:
                raise TypeError(f"entry point gave {type(obj).__name__}, not a callable")
        except Exception as exc:
            # One broken plugin must not take down every runner; the error is kept and shown
            # by `list` and by UnknownBackendError, never hidden.
            msg = f"{type(exc).__name__}: {exc}"
            plugin_errors[ep.name] = msg
            warnings.warn(
                f"attn_dispatch: backend plugin {ep.name!r} ({ep.value}) failed to load: {msg}",
                RuntimeWarning,
                stacklevel=2,
            )


def _register(entry: BackendEntry, *, replace: bool) -> None:
    with _lock:
        if entry.name in _entries and not replace:
            raise DuplicateBackendError(entry.name)
        _entries[entry.name] = entry


@overload
def register_backend(
    name: str, *, capabilities: Capabilities, factory: None = None, replace: bool = False
) -> Callable[[F], F]: ...
@overload
def register_backend(
    name: str, *, capabilities: Capabilities, factory: Factory | str, replace: bool = False
) -> Factory | str: ...
def register_backend(
    name: str,
    *,
    capabilities: Capabilities,
    factory: Factory | str | None = None,
    replace: bool = False,
) -> Any:
    """Register a backend under ``name``; also usable as a decorator on the factory.

    >>> @register_backend("mine", capabilities=Capabilities(kinds={"mha"}))
    ... def make_mine(config, **options):
    ...     return MyBackend(config, **options)

    A factory may be ``"package.module:attr"``, imported only at ``bind``. A taken name raises
    ``DuplicateBackendError`` unless ``replace=True``; existing bindings never change.
    """
    if not isinstance(name, str) or not name or any(c in name for c in ",= \t"):
        raise InvalidSpecError("name", name, "a backend name is a non-empty word without ',', '='")
    if not isinstance(capabilities, Capabilities):
        raise InvalidSpecError(
            "capabilities", capabilities, "pass an attn_dispatch.Capabilities instance"
        )
    _ensure_loaded()

    def decorate(fn: F) -> F:
        _register(BackendEntry(name, capabilities, fn), replace=replace)
        return fn

    if factory is None:
        return decorate
    if isinstance(factory, str):
        if ":" not in factory:
            raise InvalidSpecError("factory", factory, "a dotted factory path is 'module:attr'")
    elif not callable(factory):
        raise InvalidSpecError("factory", factory, "must be callable or a 'module:attr' path")
    _register(BackendEntry(name, capabilities, factory), replace=replace)
    return factory


def unregister_backend(name: str) -> None:
    """Remove ``name`` (bindings that use it keep working)."""
    _ensure_loaded()
    with _lock:
        if name not in _entries:
            raise UnknownBackendError(name, _entries)
        del _entries[name]


def get_backend(name: str, *, context: str = "") -> BackendEntry:
    """The entry for ``name``, or ``UnknownBackendError`` with close matches."""
    _ensure_loaded()
    entry = _entries.get(name)
    if entry is None:
        err = UnknownBackendError(name, list(_entries), context=context)
        if name in plugin_errors:
            err.message += f" (a plugin named {name!r} failed to load: {plugin_errors[name]})"
            err.args = (err.message,)
        raise err
    return entry


def list_backends() -> dict[str, Capabilities]:
    """Registered names (sorted) and their capabilities."""
    _ensure_loaded()
    with _lock:
        return {name: _entries[name].capabilities for name in sorted(_entries)}


def _reset_for_tests() -> None:
    """Forget everything; the next use loads built-ins and plugins again."""
    global _loaded
    with _lock:
        _entries.clear()
        plugin_errors.clear()
        _loaded = False


__all__ = [
    "ENTRY_POINT_GROUP",
    "AttnDispatchError",
    "BackendEntry",
    "get_backend",
    "list_backends",
    "register_backend",
    "unregister_backend",
]
