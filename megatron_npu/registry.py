"""Declarative patch records and the registry that applies and undoes them.

A patch names its target as ``"package.module:Attr.path"``, says why it exists and
for which megatron-core versions it was verified, and builds its replacement from
the original object and the accelerator. Applying is idempotent and does not
depend on import order: targets in modules not imported yet are patched by an
import hook right after the module executes, and every module-level alias of a
replaced function (``from x import f``) in already-imported modules is replaced
too. ``undo()`` restores every original object.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from .accelerator.base import Accelerator
from .version import SUPPORTED_MEGATRON_CORE_RANGE, installed_megatron_core, release_for_patches

ORIGINAL_ATTR = "__megatron_npu_original__"
_MISSING = object()
# Modules whose globals are never rewritten when aliases are replaced: torch
# keeps its internal references; our own modules hold the originals on purpose.
_ALIAS_SCAN_SKIP = ("torch", "megatron_npu", "numpy", "builtins", "_")


@dataclass(frozen=True)
class Patch:
    """One replacement of one object."""

    name: str
    target: str
    build: Callable[[Any, Accelerator], Any]
    reason: str
    subsystem: str
    #: The megatron-core releases this patch was verified on (its target exists there and the replacement is
    #: right); outside them it does not apply. A private target that moved or changed between releases gets one
    #: patch per range, never a version test inside one patch.
    megatron_versions: str = SUPPORTED_MEGATRON_CORE_RANGE
    #: The accelerator capability that makes this patch apply (see Accelerator.capability):
    #: the patch set asks behaviour questions, never device names.
    requires: str = "patches_megatron_core"
    #: The attribute may not exist yet (the patch adds it).
    create: bool = False

    @property
    def module_name(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def attribute_path(self) -> list[str]:
        return self.target.split(":", 1)[1].split(".")

    def applies_to(self, accelerator: Accelerator) -> bool:
        return accelerator.capability(self.requires)

    def verified_for(self, megatron_core_version: str | None) -> bool:
        """True when this patch was verified for ``megatron_core_version`` (None: not installed)."""
        return megatron_core_version is not None and Version(megatron_core_version) in SpecifierSet(
            self.megatron_versions
        )


@dataclass
class _Replacement:
    owner: Any
    attribute: str
    original: Any
    patch: str
    alias: bool = False


@dataclass
class PatchRegistry:
    patches: list[Patch] = field(default_factory=list)
    _replacements: list[_Replacement] = field(default_factory=list)
    _applied: dict[str, Patch] = field(default_factory=dict)
    _pending: dict[str, list[Patch]] = field(default_factory=dict)
    _missing: dict[str, str] = field(default_factory=dict)  # patch name -> why its target was not found
    _other_release: list[Patch] = field(default_factory=list)
    _release: str | None = None
    _accelerator: Accelerator | None = None
    _hook: _PostImportHook | None = None
    _lock: threading.RLock = field(default_factory=threading.RLock)

    # ----- declaring --------------------------------------------------------
    def register(self, patch: Patch) -> Patch:
        if any(existing.name == patch.name for existing in self.patches):
            raise ValueError(f"patch {patch.name!r} is registered twice")
        if ":" not in patch.target:
            raise ValueError(f"patch {patch.name!r}: target must be 'module:attribute', got {patch.target!r}")
        self.patches.append(patch)
        return patch

    # ----- state ------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self._accelerator is not None

    def applied(self) -> list[Patch]:
        """Patches whose replacement is in place now."""
        return list(self._applied.values())

    def pending(self) -> list[Patch]:
        """Patches waiting for their module to be imported."""
        return [patch for patches in self._pending.values() for patch in patches]

    def missing(self) -> dict[str, str]:
        """Patches whose target does not exist in a release they claim: name -> the one-line error."""
        return dict(self._missing)

    def other_release(self) -> list[Patch]:
        """Patches for the accelerator whose verified releases exclude the installed megatron-core."""
        return list(self._other_release)

    @property
    def release(self) -> str | None:
        """The megatron-core release the patches were chosen for (None before apply)."""
        return self._release

    def original_attribute(self, owner: Any, attribute: str) -> Any:
        """``owner.attribute`` as it was before any patch replaced it (the current value when none did)."""
        for record in self._replacements:
            if record.owner is owner and record.attribute == attribute and not record.alias:
                return _unwrap_descriptor(record.original)
        return getattr(owner, attribute)

    def alias_count(self, patch_name: str) -> int:
        return sum(1 for r in self._replacements if r.patch == patch_name and r.alias)

    # ----- applying ---------------------------------------------------------
    def apply(self, accelerator: Accelerator) -> list[Patch]:
        """Apply every patch for ``accelerator``'s target (idempotent)."""
        with self._lock:
            if self._accelerator is not None:
                if self._accelerator.device_type != accelerator.device_type:
                    raise RuntimeError(
                        f"patches are applied for {self._accelerator.device_type!r}; "
                        f"call megatron_npu.unpatch() before patching for {accelerator.device_type!r}"
                    )
                return self.applied()
            release = release_for_patches(installed_megatron_core())
            applicable = [patch for patch in self.patches if patch.applies_to(accelerator)]
            self._other_release = [patch for patch in applicable if not patch.verified_for(release)]
            applicable = [patch for patch in applicable if patch.verified_for(release)]
            self._accelerator, self._release = accelerator, release
            swapped: dict[int, tuple[Any, Any, str]] = {}
            for patch in applicable:
                if patch.module_name in sys.modules:
                    self._apply_one(patch, sys.modules[patch.module_name], swapped)
                else:
                    self._pending.setdefault(patch.module_name, []).append(patch)
            self._replace_aliases(swapped)
            if self._pending:
                self._hook = _PostImportHook(self)
                sys.meta_path.insert(0, self._hook)
            return self.applied()

    def _apply_one(self, patch: Patch, module: ModuleType, swapped: dict[int, tuple[Any, Any, str]]) -> None:
        assert self._accelerator is not None
        owner: Any = module
        *parents, attribute = patch.attribute_path
        for part in parents:
            owner = getattr(owner, part, _MISSING)
            if owner is _MISSING:
                return self._record_missing(patch)
        original = _static_lookup(owner, attribute)
        if original is _MISSING and not patch.create:
            return self._record_missing(patch)
        plain_original = _unwrap_descriptor(original)
        replacement = patch.build(None if original is _MISSING else plain_original, self._accelerator)
        _mark(replacement, plain_original)
        if isinstance(original, staticmethod):
            replacement = staticmethod(replacement)
        elif isinstance(original, classmethod):
            replacement = classmethod(replacement)
        setattr(owner, attribute, replacement)
        self._replacements.append(_Replacement(owner, attribute, original, patch.name))
        self._applied[patch.name] = patch
        if isinstance(owner, ModuleType) and callable(plain_original):
            swapped[id(plain_original)] = (plain_original, replacement, patch.name)

    def _record_missing(self, patch: Patch, why: str = "does not exist") -> None:
        """A target missing in a release the patch claims: left unpatched, said once on stderr, and kept for
        the doctor (non-zero exit) and the tests. Raising here would fail an import inside megatron-core."""
        message = (
            f"patch {patch.name!r}: {patch.target} {why} in megatron-core {self._release}, a release it claims "
            f"({patch.megatron_versions}); left unpatched"
        )
        if patch.name not in self._missing:
            print(f"megatron-npu: error: {message}", file=sys.stderr, flush=True)
        self._missing[patch.name] = message

    def resolve(self, prefixes: tuple[str, ...]) -> None:
        """Import the modules of pending patches under ``prefixes`` so that every target is looked up now (the
        doctor's check); a module that does not exist is a missing target too."""
        for module_name in [name for name in list(self._pending) if name.startswith(prefixes)]:
            try:
                importlib.import_module(module_name)
            except ImportError as error:
                why = "(its module does not exist)" if isinstance(error, ModuleNotFoundError) else f"({error})"
                with self._lock:
                    for patch in self._pending.pop(module_name, []):
                        self._record_missing(patch, why=why)
        with self._lock:
            if not self._pending:
                self._remove_hook()

    def _replace_aliases(self, swapped: dict[int, tuple[Any, Any, str]]) -> None:
        """One pass over loaded modules: rebind every early-bound alias."""
        if not swapped:
            return
        for module_name, module in list(sys.modules.items()):
            if module is None or module_name.startswith(_ALIAS_SCAN_SKIP):
                continue
            namespace = getattr(module, "__dict__", None)
            if not isinstance(namespace, dict):
                continue
            for attribute, value in list(namespace.items()):
                hit = swapped.get(id(value))
                if hit is not None and hit[0] is value:
                    original, replacement, patch_name = hit
                    setattr(module, attribute, replacement)
                    self._replacements.append(_Replacement(module, attribute, original, patch_name, alias=True))

    def _on_module_imported(self, module: ModuleType) -> None:
        with self._lock:
            swapped: dict[int, tuple[Any, Any, str]] = {}
            for patch in self._pending.pop(module.__name__, []):
                self._apply_one(patch, module, swapped)
            self._replace_aliases(swapped)
            if not self._pending:
                self._remove_hook()

    # ----- undoing ----------------------------------------------------------
    def undo(self) -> None:
        """Restore every replaced object, aliases included."""
        with self._lock:
            for record in reversed(self._replacements):
                if record.original is _MISSING:
                    delattr(record.owner, record.attribute)
                else:
                    setattr(record.owner, record.attribute, record.original)
            self._replacements.clear()
            self._applied.clear()
            self._pending.clear()
            self._missing.clear()
            self._other_release.clear()
            self._remove_hook()
            self._accelerator, self._release = None, None

    def _remove_hook(self) -> None:
        if self._hook is not None and self._hook in sys.meta_path:
            sys.meta_path.remove(self._hook)
        self._hook = None


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Applies pending patches to a module right after it executes."""

    def __init__(self, registry: PatchRegistry) -> None:
        self.registry = registry

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.registry._pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, self.registry)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, registry: PatchRegistry) -> None:
        self.loader = loader
        self.registry = registry

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.registry._on_module_imported(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def _static_lookup(owner: Any, attribute: str) -> Any:
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if attribute in klass.__dict__:
                return klass.__dict__[attribute]
        return _MISSING
    return getattr(owner, attribute, _MISSING)


def _unwrap_descriptor(value: Any) -> Any:
    if isinstance(value, (staticmethod, classmethod)):
        return value.__func__
    return value


def _mark(replacement: Any, original: Any) -> None:
    try:
        setattr(replacement, ORIGINAL_ATTR, original)
    except (AttributeError, TypeError):
        pass  # builtins and classes without a __dict__ cannot carry the mark


def original_of(obj: Any) -> Any:
    """The object a patch replaced (``obj`` itself when it is not a replacement)."""
    return getattr(obj, ORIGINAL_ATTR, obj)


REGISTRY = PatchRegistry()


def register(
    name: str,
    target: str,
    *,
    reason: str,
    subsystem: str,
    megatron_versions: str = SUPPORTED_MEGATRON_CORE_RANGE,
    requires: str = "patches_megatron_core",
    create: bool = False,
) -> Callable[[Callable[[Any, Accelerator], Any]], Callable[[Any, Accelerator], Any]]:
    """Decorator form: the decorated function builds the replacement."""

    def decorator(build: Callable[[Any, Accelerator], Any]) -> Callable[[Any, Accelerator], Any]:
        REGISTRY.register(
            Patch(
                name=name,
                target=target,
                build=build,
                reason=reason,
                subsystem=subsystem,
                megatron_versions=megatron_versions,
                requires=requires,
                create=create,
            )
        )
        return build

    return decorator
