"""Import-time plumbing that keeps ``import lightning_ddpx`` cheap and every path users know working.

Two small ``sys.meta_path`` finders, both installed by ``lightning_ddpx/__init__.py``:

- :func:`register_when_imported` runs a callback once a module (``lightning.pytorch``) has finished
  importing. ``import lightning_ddpx`` has always registered our strategy names (``strategy="ddpx"``) with
  Lightning, but importing Lightning costs 2-3 s that a bare-module user should not pay. So the names are
  registered at once if Lightning is already imported, and otherwise the moment it is.
- :func:`alias_moved_modules` serves module paths from before the package was split into layers
  (``lightning_ddpx.reducer``, ``lightning_ddpx.fabric``, ...) as the very module objects that live at the new
  paths, so user code, pickles and monkeypatches that name an old path keep working.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Callable, Mapping, Optional, Sequence

__all__ = ["alias_moved_modules", "register_when_imported"]


def register_when_imported(module_name: str, callback: Callable[[], None]) -> None:
    """Call ``callback`` now if ``module_name`` is imported, else right after its import completes.

    A failing callback warns instead of raising: it must never make the user's ``import lightning`` fail.
    """
    if module_name in sys.modules:
        _call_reporting(callback, module_name)
        return
    sys.meta_path.insert(0, _AfterImportFinder(module_name, callback))


def alias_moved_modules(moved: Mapping[str, str]) -> None:
    """Make each old module path in ``moved`` import as the module at its new path."""
    sys.meta_path.append(_AliasFinder(dict(moved)))


def _call_reporting(callback: Callable[[], None], module_name: str) -> None:
    try:
        callback()
    except Exception as error:  # noqa: BLE001 - reported, and the user's import goes on
        warnings.warn(
            f"lightning_ddpx: registering the strategy names with {module_name} failed ({error!r}); "
            "strategy='ddpx' will not resolve, but DDPXStrategy(...) can still be passed directly.",
            stacklevel=3,
        )


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it wraps the real loader of one module to run a callback after it executes."""

    def __init__(self, module_name: str, callback: Callable[[], None]) -> None:
        self._module_name = module_name
        self._callback = callback

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != self._module_name:
            return None
        sys.meta_path.remove(self)  # one shot; the real finders below now locate the module
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenCall(spec.loader, self._callback, fullname)
        return spec


class _ThenCall(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, callback: Callable[[], None], module_name: str) -> None:
        self._loader = loader
        self._callback = callback
        self._module_name = module_name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader  # the module keeps its own loader, not this wrapper
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _call_reporting(self._callback, self._module_name)


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, moved: dict[str, str]) -> None:
        self._moved = moved

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname not in self._moved:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self._moved[spec.name])  # the module itself, attributes untouched

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module at the new path is already executed."""
