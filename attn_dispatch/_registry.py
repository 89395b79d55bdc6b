"""The backend registry: names -> (capabilities, form policy, factory). Thread-safe.

A ``Registry`` is an object (as pluggy's ``PluginManager`` is); the module-level
``register_backend``, ``unregister_backend`` and ``list_backends`` act on the default one,
``DEFAULT_REGISTRY``. Tests and embedders hold their own and pass it to
``bind(..., registry=mine)``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import threading
import warnings
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any
from typing import TypeVar
from typing import overload

from attn_dispatch import _env
from attn_dispatch._capabilities import Capabilities
from attn_dispatch._errors import BackendUnavailableError
from attn_dispatch._errors import DuplicateBackendError
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._errors import UnknownBackendError
from attn_dispatch._forms import FormPolicy
from attn_dispatch._version import __version__

ENTRY_POINT_GROUP = "attn_dispatch.backends"

#: The one shape an ``attn_dispatch.backends`` entry point may have, quoted in every refusal.
PLUGIN_SHAPE = (
    "an attn_dispatch.backends entry point names a function register(registry) that calls "
    "registry.register(...)"
)

#: The value of ``ATTN_DISPATCH_PLUGINS`` (besides the empty string) that loads no plugin.
_NO_PLUGINS = "none"

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


@dataclasses.dataclass(frozen=True, slots=True)
class Origin:
    """Where a backend name or an entry point came from: the distribution (as installed:
    its name and version; ``None`` when the entry point has no distribution metadata) and
    the entry point (``None`` for the built-ins)."""

    distribution: str | None
    version: str | None
    entry_point: str | None = None


#: The origin of every built-in backend.
BUILTIN_ORIGIN = Origin("attn_dispatch", __version__)


def _ep_origin(ep: Any) -> Origin:
    dist = getattr(ep, "dist", None)
    if dist is None:  # an EntryPoint made by hand, not read from a distribution's metadata
        return Origin(None, None, ep.name)
    try:
        name = dist.metadata["Name"]
        version = dist.version
    except Exception:  # broken metadata must not stop the plugin from being recorded
        name, version = None, None
    return Origin(name, version, ep.name)


def _name_set(field: str, value: object) -> frozenset[str] | None:
    if value is None:
        return None
    # A bare string would be taken letter by letter: the classic allow="mine" mistake.
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise InvalidSpecError(
            field, value, "pass a set of entry-point names, e.g. {'mine'}, or None"
        )
    names = frozenset(value)
    bad = sorted(repr(n) for n in names if not isinstance(n, str) or not n)
    if bad:
        raise InvalidSpecError(
            field, value, f"entry-point names are non-empty strings, got {', '.join(bad)}"
        )
    return names


def _env_allow() -> tuple[str, frozenset[str] | None]:
    """``ATTN_DISPATCH_PLUGINS`` (its text, and its allow-list), as vLLM reads
    ``VLLM_PLUGINS``: unset, every entry point (``None``); otherwise a comma-separated
    allow-list, where empty or ``none`` allows none."""
    raw = os.environ.get(_env.PLUGINS)
    if raw is None:
        return "", None
    names = frozenset(n.strip() for n in raw.split(",") if n.strip())
    return raw, frozenset() if names == {_NO_PLUGINS} else names


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name or any(c in name for c in ",= \t"):
        raise InvalidSpecError("name", name, "a backend name is a non-empty word without ',', '='")
    return name


class Registry:
    """Backend names -> ``BackendEntry``. ``builtins`` / ``plugins``: load the built-in
    backends / the ``attn_dispatch.backends`` entry points on first use.

    ``allow`` (a set of entry-point names, ``None``: all) and ``block`` choose which entry
    points load; the ``ATTN_DISPATCH_PLUGINS`` variable is a second allow-list read at the
    first use, and an entry point loads only if both allow it. A blocked one is never
    imported; it is listed in ``plugins_blocked`` with the reason.

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

    def __init__(
        self,
        *,
        builtins: bool = True,
        plugins: bool = True,
        allow: Iterable[str] | None = None,
        block: Iterable[str] = (),
    ) -> None:
        self._allow = _name_set("allow", allow)
        self._block = _name_set("block", block) or frozenset()
        self._lock = threading.RLock()
        self._entries: dict[str, BackendEntry] = {}
        # Backend name -> where it came from (built-in, or which entry point of which
        # distribution); a name registered by code at run time has none.
        self._origins: dict[str, Origin] = {}
        self._builtins = builtins
        self._plugins = plugins
        self._loaded = not (builtins or plugins)
        self._loading = False
        self._origin_now: Origin | None = None  # the entry point being loaded, if any
        #: entry-point name -> error text, for plugins that failed to load.
        self.plugin_errors: dict[str, str] = {}
        #: entry-point name -> why it was not loaded (``allow``, ``block``, the variable).
        self.plugins_blocked: dict[str, str] = {}
        #: entry-point name -> its distribution, for every entry point seen (loaded or not).
        self.plugin_origins: dict[str, Origin] = {}

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
            self._origins[name] = BUILTIN_ORIGIN

    def _blocked_because(self, name: str, env: tuple[str, frozenset[str] | None]) -> str | None:
        if name in self._block:
            return f"blocked by Registry(block={sorted(self._block)!r})"
        if self._allow is not None and name not in self._allow:
            return f"not in Registry(allow={sorted(self._allow)!r})"
        raw, env_allow = env
        if env_allow is not None and name not in env_allow:
            return f"not allowed by {_env.PLUGINS}={raw!r}"
        return None

    def _load_entry_points(self) -> None:
        from importlib.metadata import entry_points

        env = _env_allow()  # read once per load: every entry point sees the same value
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            origin = _ep_origin(ep)
            self.plugin_origins[ep.name] = origin
            why_not = self._blocked_because(ep.name, env)
            if why_not is not None:
                self.plugins_blocked[ep.name] = why_not  # never imported
                continue
            try:
                obj = ep.load()
                _check_plugin_shape(obj)
                self._origin_now = origin
                try:
                    obj(self)
                finally:
                    self._origin_now = None
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
            # Only a plugin's register(registry) call, during loading, records a distribution.
            if self._origin_now is not None:
                self._origins[entry.name] = self._origin_now
            else:
                self._origins.pop(entry.name, None)

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
            self._origins.pop(name, None)

    def origin(self, name: str) -> Origin | None:
        """Where ``name`` came from: ``BUILTIN_ORIGIN``, the entry point and distribution of
        the plugin that registered it, or ``None`` (registered by code at run time)."""
        self._ensure_loaded()
        with self._lock:
            if name not in self._entries:
                raise UnknownBackendError(name, self._entries)
            return self._origins.get(name)

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
            elif name in self.plugins_blocked:
                err.message += (
                    f" (a plugin named {name!r} was not loaded: {self.plugins_blocked[name]})"
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


def _check_plugin_shape(obj: object) -> None:
    """Refuse, before calling it, anything but a ``register(registry)`` function: one shape,
    so that a plugin always fills the registry that loads it (never the default one) and may
    register as many names as it likes through the checked ``register`` method."""
    if isinstance(obj, BackendEntry):
        raise TypeError(
            f"entry point gave a BackendEntry ({obj.name!r}), which is not accepted: {PLUGIN_SHAPE}"
        )
    if not callable(obj):
        raise TypeError(f"entry point gave a {type(obj).__name__}, not a function: {PLUGIN_SHAPE}")
    try:
        params = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):
        return  # no signature to read (a builtin): the call itself will tell
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in params)
    if len(required) > 1 or not (positional or varargs):
        raise TypeError(
            f"entry point gave {getattr(obj, '__qualname__', obj)!r} taking "
            f"{len(required) if required else 'no'} positional argument"
            f"{'' if len(required) == 1 else 's'}, not one: {PLUGIN_SHAPE}"
        )


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
    "BUILTIN_ORIGIN",
    "DEFAULT_REGISTRY",
    "ENTRY_POINT_GROUP",
    "PLUGIN_SHAPE",
    "BackendEntry",
    "Origin",
    "Registry",
    "get_backend",
    "install_builtins",
    "list_backends",
    "register_backend",
    "unregister_backend",
]
