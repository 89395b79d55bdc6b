"""The backend registry: names -> (capabilities, form policy, factory). Thread-safe.

A ``Registry`` is an object (as pluggy's ``PluginManager`` is); the module-level
``register_backend``, ``unregister_backend`` and ``list_backends`` act on the default one,
``DEFAULT_REGISTRY``. Tests and embedders hold their own and pass it to
``bind(..., registry=mine)``.
"""

from __future__ import annotations

import contextvars
import dataclasses
import importlib
import threading
import warnings
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import TypeVar
from typing import overload

from attn_dispatch._capabilities import Capabilities
from attn_dispatch._errors import BackendUnavailableError
from attn_dispatch._errors import DuplicateBackendError
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._errors import UnknownBackendError
from attn_dispatch._forms import FormPolicy

ENTRY_POINT_GROUP = "attn_dispatch.backends"

Factory = Callable[..., Any]
F = TypeVar("F", bound=Factory)


@dataclasses.dataclass(frozen=True, slots=True)
class BackendEntry:
    """One registered backend.

    ``factory`` is a callable or a ``"module:attr"`` path. ``form_policy`` is how the backend
    picks the attention form of MLA layers per batch (``None``: always the absorbed form);
    ``bind`` reads it from here, so it is checked before any factory runs.
    """

    name: str
    capabilities: Capabilities
    factory: Factory | str
    form_policy: FormPolicy | None = None

    def load_factory(self, *, runner: str | None = None) -> Factory:
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
                self.name,
                f"cannot load factory {self.factory!r}: {type(exc).__name__}: {exc}",
                runner=runner,
            ) from exc
        if not callable(obj):
            raise BackendUnavailableError(
                self.name, f"factory {self.factory!r} is not callable", runner=runner
            )
        return obj  # type: ignore[no-any-return]


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name or any(c in name for c in ",= \t"):
        raise InvalidSpecError("name", name, "a backend name is a non-empty word without ',', '='")
    return name


class Registry:
    """Backend names -> ``BackendEntry``. ``builtins`` / ``plugins``: load the built-in
    backends / the ``attn_dispatch.backends`` entry points on first use.

    >>> from attn_dispatch import AttnConfig, bind
    >>> mine = Registry(plugins=False)
    >>> path = "attn_dispatch.backends.reference.backend:TorchBackend"  # imported at bind
    >>> mine.register("echo", capabilities=Capabilities(kinds={"mha"}), factory=path)
    'attn_dispatch.backends.reference.backend:TorchBackend'
    >>> config = AttnConfig("mha", 4, 2, 16, dtype="float32", device="cpu", page_size=8)
    >>> bind("echo", config, registry=mine)
    <Binding echo kind='mha'>
    >>> "echo" in mine.list(), "torch" in mine.list()   # builtins=True: the built-ins too
    (True, True)
    """

    def __init__(self, *, builtins: bool = True, plugins: bool = True) -> None:
        self._lock = threading.RLock()
        self._entries: dict[str, BackendEntry] = {}
        self._builtins = builtins
        self._plugins = plugins
        self._loaded = not (builtins or plugins)
        self._loading = False
        #: entry-point name -> error text, for plugins that failed to load.
        self.plugin_errors: dict[str, str] = {}

    # -- loading ---------------------------------------------------------------------------

    def _ensure_loaded(self) -> None:
        # Built-ins and entry points load on first use, not at import: `import attn_dispatch`
        # must stay cheap and must not import any plugin's module. Other threads wait on the
        # lock until loading is complete; the loading thread itself re-enters (plugins call
        # register_backend).
        if self._loaded:
            return
        with self._lock:
            if self._loaded or self._loading:
                return
            self._loading = True
            try:
                if self._builtins:
                    self._load_builtins()
                if self._plugins:
                    self._load_entry_points()
            finally:
                self._loading = False
            self._loaded = True

    def _load_builtins(self) -> None:
        for name, (module, factory) in _BUILTINS.items():
            try:
                light = importlib.import_module(module)
            except ModuleNotFoundError as exc:
                if exc.name == module:  # a partial install: that backend is not shipped
                    continue
                raise
            entry = BackendEntry(name, light.CAPABILITIES, factory, light.DEFAULT_FORM_POLICY)
            self._put(entry, replace=True)

    def _load_entry_points(self) -> None:
        from importlib.metadata import entry_points

        for ep in entry_points(group=ENTRY_POINT_GROUP):
            try:
                obj = ep.load()
                if isinstance(obj, BackendEntry):
                    self._put(obj, replace=False)
                elif callable(obj):
                    # A plugin's register function writes to the default registry (it calls
                    # attn_dispatch.backend.register_backend) or takes the registry to fill.
                    if _takes_registry(obj):
                        obj(self)
                    else:
                        # Its register_backend calls land in this registry, not the default.
                        token = _PLUGIN_TARGET.set(self)
                        try:
                            obj()
                        finally:
                            _PLUGIN_TARGET.reset(token)
                else:
                    raise TypeError(f"entry point gave {type(obj).__name__}, not a callable")
            except Exception as exc:
                # One broken plugin must not take down every runner; the error is kept and
                # shown by `list` and by UnknownBackendError, never hidden.
                msg = f"{type(exc).__name__}: {exc}"
                self.plugin_errors[ep.name] = msg
                warnings.warn(
                    f"attn_dispatch: backend plugin {ep.name!r} ({ep.value}) failed to load: {msg}",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def _put(self, entry: BackendEntry, *, replace: bool) -> None:
        with self._lock:
            if entry.name in self._entries and not replace:
                raise DuplicateBackendError(entry.name)
            self._entries[entry.name] = entry

    # -- public ----------------------------------------------------------------------------

    @overload
    def register(
        self,
        name: str,
        *,
        capabilities: Capabilities,
        factory: None = None,
        form_policy: FormPolicy | None = None,
        replace: bool = False,
    ) -> Callable[[F], F]: ...
    @overload
    def register(
        self,
        name: str,
        *,
        capabilities: Capabilities,
        factory: Factory | str,
        form_policy: FormPolicy | None = None,
        replace: bool = False,
    ) -> Factory | str: ...
    def register(
        self,
        name: str,
        *,
        capabilities: Capabilities,
        factory: Factory | str | None = None,
        form_policy: FormPolicy | None = None,
        replace: bool = False,
    ) -> Any:
        """Register a backend under ``name``; also usable as a decorator on the factory.

        >>> from attn_dispatch.backends.reference.backend import TorchBackend
        >>> registry = Registry(plugins=False)
        >>> @registry.register("mine", capabilities=Capabilities(kinds={"mha"}))
        ... def make_mine(config, **options):
        ...     return TorchBackend(config, **options)
        >>> registry.get("mine").factory is make_mine
        True

        A factory may be ``"package.module:attr"``, imported only at ``bind``.
        ``form_policy``: how the backend picks the form of MLA layers per batch (None: the
        absorbed form always); ``bind(..., options={name: {"form_policy": p}})`` overrides it
        for one binding. A taken name raises ``DuplicateBackendError`` unless
        ``replace=True``; existing bindings never change.
        """
        target = _PLUGIN_TARGET.get()
        if target is not None and target is not self and self is DEFAULT_REGISTRY:
            # A zero-argument plugin loading into another registry calls register_backend.
            return target.register(
                name,
                capabilities=capabilities,
                factory=factory,
                form_policy=form_policy,
                replace=replace,
            )
        _check_name(name)
        if not isinstance(capabilities, Capabilities):
            raise InvalidSpecError(
                "capabilities", capabilities, "pass an attn_dispatch.backend.Capabilities instance"
            )
        if form_policy is not None and not isinstance(form_policy, FormPolicy):
            raise InvalidSpecError(
                "form_policy", form_policy, "pass an attn_dispatch.backend.FormPolicy or None"
            )
        if factory is not None:
            if isinstance(factory, str):
                if ":" not in factory:
                    raise InvalidSpecError(
                        "factory", factory, "a dotted factory path is 'module:attr'"
                    )
            elif not callable(factory):
                raise InvalidSpecError(
                    "factory", factory, "must be callable or a 'module:attr' path"
                )
        self._ensure_loaded()

        def decorate(fn: F) -> F:
            self._put(BackendEntry(name, capabilities, fn, form_policy), replace=replace)
            return fn

        if factory is None:
            return decorate
        self._put(BackendEntry(name, capabilities, factory, form_policy), replace=replace)
        return factory

    def unregister(self, name: str) -> None:
        """Remove ``name`` (bindings that use it keep working)."""
        self._ensure_loaded()
        with self._lock:
            if name not in self._entries:
                raise UnknownBackendError(name, self._entries)
            del self._entries[name]

    def get(self, name: str, *, context: str = "") -> BackendEntry:
        """The entry for ``name``, or ``UnknownBackendError`` with close matches."""
        self._ensure_loaded()
        with self._lock:
            entry = self._entries.get(name)
            registered = list(self._entries)
        if entry is None:
            err = UnknownBackendError(name, registered, context=context)
            if name in self.plugin_errors:
                err.message += (
                    f" (a plugin named {name!r} failed to load: {self.plugin_errors[name]})"
                )
                err.args = (err.message,)
            raise err
        return entry

    def entries(self) -> dict[str, BackendEntry]:
        """A snapshot: registered names (sorted) and their entries."""
        self._ensure_loaded()
        with self._lock:
            return {name: self._entries[name] for name in sorted(self._entries)}

    def list(self) -> dict[str, Capabilities]:
        """Registered names (sorted) and their capabilities."""
        return {name: e.capabilities for name, e in self.entries().items()}

    def __contains__(self, name: object) -> bool:
        self._ensure_loaded()
        return name in self._entries

    def __repr__(self) -> str:
        state = f"{len(self._entries)} backends" if self._loaded else "not loaded yet"
        return f"<Registry {state}>"


# The built-in backends: name -> (light module, factory path). The package's __init__ (the one
# place that knows both the registry and the backends) installs the table; the registry never
# imports a backend package itself.
_BUILTINS: dict[str, tuple[str, str]] = {}


def install_builtins(table: Mapping[str, tuple[str, str]]) -> None:
    """Set the built-in backends every ``Registry(builtins=True)`` loads on first use
    (``attn_dispatch/__init__`` calls it once with ``attn_dispatch.backends.BUILTINS``)."""
    _BUILTINS.clear()
    _BUILTINS.update(table)


# The registry whose entry points are loading in this context (see _load_entry_points).
_PLUGIN_TARGET: contextvars.ContextVar[Registry | None] = contextvars.ContextVar(
    "attn_dispatch.plugin_target", default=None
)


def _takes_registry(fn: Callable[..., Any]) -> bool:
    import inspect

    try:
        params = [
            p
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
        ]
    except (TypeError, ValueError):
        return False
    return len(params) == 1


#: The registry the module-level functions and ``bind`` use unless given another.
DEFAULT_REGISTRY = Registry()


#: Register a backend in the default registry; also a decorator on the factory:
#:
#: >>> @register_backend("mine", capabilities=Capabilities(kinds={"mha"}))
#: ... def make_mine(config, **options):
#: ...     return MyBackend(config, **options)
#:
#: See ``Registry.register`` (the same method, bound to ``DEFAULT_REGISTRY``).
register_backend = DEFAULT_REGISTRY.register


def unregister_backend(name: str) -> None:
    """Remove ``name`` from the default registry (bindings that use it keep working)."""
    DEFAULT_REGISTRY.unregister(name)


def get_backend(name: str, *, context: str = "") -> BackendEntry:
    """The default registry's entry for ``name``, or ``UnknownBackendError``."""
    return DEFAULT_REGISTRY.get(name, context=context)


def list_backends() -> dict[str, Capabilities]:
    """The default registry's names (sorted) and their capabilities."""
    return DEFAULT_REGISTRY.list()


__all__ = [
    "DEFAULT_REGISTRY",
    "ENTRY_POINT_GROUP",
    "BackendEntry",
    "Registry",
    "get_backend",
    "install_builtins",
    "list_backends",
    "register_backend",
    "unregister_backend",
]
