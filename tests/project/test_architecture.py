"""The package keeps the structure docs/dev/architecture.md draws, and the page stays true.

Structure, checked on the source with ``ast`` (nothing is imported):

- layers between packages: each imports only the layers under it;
- rooms inside the engine and inside fault/: each imports only the rooms listed before it in the package's
  ``__init__.py``, counting every import (module level, under ``if TYPE_CHECKING:``, inside functions), and
  no import circle;
- the iteration's phase is asked in one place, the reducer;
- no unit reads another unit's private members, in every package (nor, outside the engine, the module's
  reducer), and private torch/Lightning attributes are touched only in the ``_compat`` modules.

The page: every path and dotted name it cites exists, every ``Class.member`` it names is one, and its recipes
run. Classes and functions have no size limit: one job each, as long as that job needs.
"""

from __future__ import annotations

import ast
import datetime
import functools
import importlib
import re
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = REPO_ROOT / "lightning_ddpx"
ENGINE = PACKAGE / "engine"
PAGE = REPO_ROOT / "docs" / "dev" / "architecture.md"
REDUCER = ENGINE / "reducer" / "reducer.py"
# Where private torch and Lightning names may be used (lightning_ddpx/_compat/__init__.py says why in two).
COMPAT = (PACKAGE / "_compat", PACKAGE / "lightning" / "_compat.py")
DEPENDENCIES = ("torch", "lightning")


# ------------------------------------------------------------------------------------------- the sources
def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.lru_cache(maxsize=None)
def _sources() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(REPO_ROOT)}:{node.lineno}"  # type: ignore[attr-defined]


def _ours(name: str) -> str | None:
    """The module of the package that a dotted import name is (or is in): ``a.b.C`` -> ``a.b``."""
    while name and name not in _sources():
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: Path) -> list[tuple[ast.stmt, str]]:
    """Every import in the file, wherever it is (a lazy import is a dependency too), as absolute names:
    ``import a.b`` -> ``a.b``; ``from a import b`` -> ``a.b`` (a module or a name in ``a``)."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: list[tuple[ast.stmt, str]] = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            found += [(node, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package, one level up per extra dot
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found += [(node, f"{base}.{alias.name}") for alias in node.names]
    return found


# ----------------------------------------------------------------------------- layers between packages
# layer -> the layers of lightning_ddpx it may import (and whether it may import the lightning package)
ALLOWED = {
    "_compat": (set(), False),
    "engine": ({"engine", "_compat"}, False),
    "hooks": ({"engine", "hooks", "_compat"}, False),
    "fault": ({"engine", "hooks", "fault", "_compat"}, False),
    "lightning": ({"engine", "hooks", "fault", "lightning", "_compat"}, True),
    "bench": ({"engine", "hooks", "fault", "lightning", "bench", "_compat", ""}, True),
}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else ""


def test_layers_import_only_the_layers_below() -> None:
    broken = []
    for module, path in _sources().items():
        layer = _layer(module)
        if not layer:
            continue  # the top-level modules: the public surface, lazy by design (test_layers.py)
        if layer not in ALLOWED:  # a new package must say where it sits, or it escapes this check
            broken.append(f"{module}: package {layer!r} is not a layer in ALLOWED (test_architecture.py)")
            continue
        allowed, may_import_lightning = ALLOWED[layer]
        for node, name in _imports(path):
            if name.split(".")[0] == "lightning" and not may_import_lightning:
                broken.append(f"{_where(path, node)} ({layer}) imports {name}")
            target = _ours(name)
            if target is not None and _layer(target) not in allowed:
                broken.append(
                    f"{_where(path, node)} ({layer}) imports {target} ({_layer(target) or 'top level'})"
                )
    assert not broken, "\n".join(broken)


# ---------------------------------------------------------------------- rooms inside a layer's package
# The packages divided into rooms; each lists its rooms, numbered in their order, in its __init__ docstring.
ROOMED = ("engine", "fault", "lightning")


def _room_order(package: str) -> dict[str, int]:
    """Room (or leaf module) -> its rank, from the numbered list of lightning_ddpx/<package>/__init__.py."""
    docstring = ast.get_docstring(_tree(PACKAGE / package / "__init__.py")) or ""
    items = re.findall(r"^(\d+)\. (.*?)(?=^\d+\. |\n\n|\Z)", docstring, re.M | re.S)
    return {name: int(rank) for rank, text in items for name in re.findall(r":mod:`\.(\w+)`", text)}


def _engine_order() -> dict[str, int]:
    return _room_order("engine")


def _room(module: str, package: str = "engine") -> str | None:
    """``lightning_ddpx.<package>.<room>[.<module>]`` -> the room (a leaf module is a room of its own rank)."""
    parts = module.split(".")
    return parts[2] if parts[:2] == ["lightning_ddpx", package] and len(parts) > 2 else None


def _room_imports(package: str) -> list[tuple[str, Path, ast.stmt, str]]:
    """(importer, its file, the import, the module imported) for every import between two modules of the
    package's rooms: module level, under ``if TYPE_CHECKING:`` and inside functions alike."""
    found = []
    for module, path in _sources().items():
        if _room(module, package) is None:
            continue
        for node, name in _imports(path):
            target = _ours(name)
            if target is not None and _room(target, package) is not None and target != module:
                found.append((module, path, node, target))
    return found


def _engine_imports() -> list[tuple[str, Path, ast.stmt, str]]:
    return _room_imports("engine")


@pytest.mark.parametrize("package", ROOMED)
def test_the_order_places_every_room(package: str) -> None:
    order = _room_order(package)
    assert len(order) >= 3, f"the numbered list of lightning_ddpx/{package}/__init__.py was not found"
    folder = PACKAGE / package
    rooms = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    rooms |= {p.name for p in folder.iterdir() if (p / "__init__.py").exists()}
    assert set(order) == rooms, (
        f"lightning_ddpx/{package}/__init__.py lists the rooms in their layer order; place these: "
        f"{sorted(rooms - set(order))}; remove these: {sorted(set(order) - rooms)}"
    )


@pytest.mark.parametrize("package", ROOMED)
def test_rooms_import_only_the_rooms_before_them(package: str) -> None:
    """A room builds on the rooms listed before it in its package's __init__.py; inside a room, modules
    import each other freely. What a lower room needs from a higher one is passed in (a callback, an object,
    a protocol it declares), never imported."""
    order = _room_order(package)
    broken = [
        f"{_where(path, node)}: {module} ({_room(module, package)}, {order[_room(module, package)]}.) "  # type: ignore[index]
        f"imports {target} ({_room(target, package)}, {order[_room(target, package)]}.)"  # type: ignore[index]
        for module, path, node, target in _room_imports(package)
        if order[_room(target, package)] > order[_room(module, package)]  # type: ignore[index]
    ]
    assert not broken, f"imports against the order of lightning_ddpx/{package}/:\n" + "\n".join(broken)


def test_the_room_order_catches_an_import_against_it() -> None:
    """Guards the check itself: fault/'s facade is above its step protocol, so the protocol importing it
    would be reported."""
    order = _room_order("fault")
    assert order["steps"] < order["manager"] and order["options"] < order["membership"]


def _circles(graph: dict[str, set[str]]) -> list[str]:
    """Import circles as ``a -> b -> a``: the shortest through each module not on a circle found before."""
    circles: list[str] = []
    covered: set[str] = set()
    for start in sorted(graph):
        if start in covered:
            continue
        paths, reached = [[start]], {start}
        while paths:
            path = paths.pop(0)  # breadth first: the shortest circle
            following = sorted(graph.get(path[-1], ()))
            if start in following:
                circles.append(" -> ".join([*path, start]))
                covered.update(path)
                break
            paths += [[*path, n] for n in following if n not in reached]
            reached.update(following)
    return circles


@pytest.mark.parametrize("package", ROOMED)
def test_no_import_circle_in_a_roomed_package_type_only_imports_included(package: str) -> None:
    """No two modules of the package import each other, directly or around a circle, counting every import:
    a strategy and the run it delegates to, the options check and the config, import each other one way."""
    graph: dict[str, set[str]] = {}
    for module, _, _, target in _room_imports(package):
        graph.setdefault(module, set()).add(target)
    circles = _circles(graph)
    assert not circles, f"lightning_ddpx/{package}/ modules importing each other in a circle:\n" + "\n".join(
        circles
    )


def test_the_circle_search_finds_circles() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a -> b -> c -> a"]
    assert _circles({"a": {"b"}, "b": {"a", "c"}, "c": {"b"}}) == ["a -> b -> a", "c -> b -> c"]
    assert _circles({"a": {"b"}, "b": set()}) == []


# -------------------------------------------------------------------------------- the iteration's phase
def _phase_checks(tree: ast.AST) -> list[tuple[ast.AST, str]]:
    found: list[tuple[ast.AST, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (
            node.attr == "phase" or (isinstance(node.value, ast.Name) and node.value.id == "Phase")
        ):
            found.append((node, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom) and any(alias.name == "Phase" for alias in node.names):
            found.append((node, "imports Phase"))
    return found


def test_the_phase_is_asked_only_in_the_reducer() -> None:
    """Whether it is between iterations is decided in one place: :class:`Reducer` owns its phase and
    answers questions about it (``between_iterations``, ``require_between_iterations``, ...); no other unit
    reads it."""
    offenders = [
        f"{_where(path, node)}: {what}"
        for path in _sources().values()
        if path != REDUCER
        for node, what in _phase_checks(_tree(path))
    ]
    assert not offenders, "ask the Reducer instead of reading its phase:\n" + "\n".join(offenders)


# ------------------------------------------------------------------------------------- private members
# namedtuple's public API is spelled with a leading underscore, to stay clear of field names
PUBLIC_BY_CONVENTION = {"_asdict", "_field_defaults", "_fields", "_make", "_replace"}


def _private(name: str) -> bool:
    dunder = name.startswith("__") and name.endswith("__")
    return name.startswith("_") and not dunder and name not in PUBLIC_BY_CONVENTION


def _defined(tree: ast.AST) -> set[str]:
    """The private names a module defines: its functions, classes, variables and imports, and the attributes
    its classes give their instances (``self._x = ...``, ``__slots__``, ``setattr(self, "_x", ...)``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_own(node.value):
            names.add(node.attr)
        elif isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == "__slots__" for t in node.targets
        ):
            names |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)}
        elif _attribute_call(node) and _is_own(node.args[0]):  # type: ignore[attr-defined]
            names.add(node.args[1].value)  # type: ignore[attr-defined]
    return {name for name in names if isinstance(name, str) and _private(name)}


def _is_own(node: ast.AST) -> bool:
    """``self``, ``cls``, ``super()``, ``type(self)``: the unit's own members."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    if not isinstance(node, ast.Call):
        return False
    called = getattr(node.func, "id", None)
    return called == "super" or (called == "type" and len(node.args) == 1 and _is_own(node.args[0]))


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of names, else ``None``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def _attribute_call(node: ast.AST) -> bool:
    """``getattr(x, "_name", ...)`` and its siblings: an attribute access spelled as a call."""
    return (
        isinstance(node, ast.Call)
        and getattr(node.func, "id", None) in ("getattr", "setattr", "hasattr", "delattr")
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    )


def _bound_modules(tree: ast.AST) -> dict[str, str]:
    """Local names bound to a module (``import a.b as c``, ``from a import b`` where ``a.b`` is a module of
    ours): name -> dotted module name; dependencies' modules map to their top-level package's name."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                bound[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in _sources() or node.module.split(".")[0] in DEPENDENCIES:
                    bound[alias.asname or alias.name] = full
    return bound


@functools.lru_cache(maxsize=None)
def _defined_in_package() -> frozenset[str]:
    return frozenset(name for path in _sources().values() for name in _defined(_tree(path)))


class PrivateRead(NamedTuple):
    node: ast.AST
    name: str  # the private name, as the failure message shows it
    owner: str  # "ours": another unit of this package; "dependency": torch's or Lightning's


def _private_reads(tree: ast.AST) -> list[PrivateRead]:
    """Private members this module reads (or sets) on something other than itself.

    ``x._name`` (or ``getattr(x, "_name")``) where ``x`` is not ``self``/``cls``/``super()``: on one of our
    modules (``module._helper``, ``from module import _helper``) or on an object whose class defines
    ``_name`` in another module of ours, it is another unit's private state; on torch, Lightning or an
    object whose ``_name`` no module of ours defines, it is a dependency's. A name this module defines itself
    is its own (its classes' instances reading each other's members, a module-level ``_helper``).
    """
    own, bound, reads = _defined(tree), _bound_modules(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_ddpx"):
            for alias in node.names:
                if _private(alias.name) and f"{node.module}.{alias.name}" not in _sources():
                    reads.append(PrivateRead(node, f"{node.module}.{alias.name}", "ours"))
            continue
        if isinstance(node, ast.Attribute) and _private(node.attr):
            target, name = node.value, node.attr
        elif _attribute_call(node) and _private(node.args[1].value):  # type: ignore[attr-defined]
            target, name = node.args[0], node.args[1].value  # type: ignore[attr-defined]
        else:
            continue
        if _is_own(target):
            continue
        head, _, rest = (_dotted(target) or "").partition(".")
        module = bound.get(head)  # the chain starts at a module: torch, dist, one of ours
        full = None if module is None else ".".join([module, rest] if rest else [module])
        if full is not None and full.split(".")[0] in DEPENDENCIES:
            reads.append(PrivateRead(node, ast.unparse(node), "dependency"))
        elif full is not None and full in _sources():
            if f"{full}.{name}" not in _sources():  # a private submodule is a file, not a member
                reads.append(PrivateRead(node, f"{full}.{name}", "ours"))
        elif name not in own:
            owner = "ours" if name in _defined_in_package() else "dependency"
            reads.append(PrivateRead(node, ast.unparse(node), owner))
    return reads


def _in_compat(path: Path) -> bool:
    return any(path == place or place in path.parents for place in COMPAT)


def test_no_unit_reads_another_units_private_members() -> None:
    """A unit that needs another's state asks through a small public method (docs/STYLE: "One decision, one
    place"): reading ``other._x`` couples the two to an implementation the owner may change at any time."""
    offenders = [
        f"{_where(path, read.node)}: {read.name}"
        for path in _sources().values()
        for read in _private_reads(_tree(path))
        if read.owner == "ours"
    ]
    assert not offenders, "private members of another unit, read: add a public method there\n" + "\n".join(
        offenders
    )


def test_private_torch_and_lightning_attributes_only_in_compat() -> None:
    """torch's and Lightning's private attributes (``torch._C``, ``optimizer._optimizer_step_pre_hooks``,
    ``precision._wrap_closure``, ...) are used behind named functions of lightning_ddpx/_compat/torch.py and
    lightning_ddpx/lightning/_compat.py, so an upgrade that breaks one breaks it in one place
    (tests/lightning/test_compat.py exercises them). Other modules import those functions; nothing else touches the
    attributes."""
    offenders = [
        f"{_where(path, read.node)}: {read.name}"
        for path in _sources().values()
        if not _in_compat(path)
        for read in _private_reads(_tree(path))
        if read.owner == "dependency"
    ]
    assert not offenders, (
        "private torch/Lightning attributes outside _compat: wrap each in a function of "
        "lightning_ddpx/_compat/torch.py (or lightning_ddpx/lightning/_compat.py), saying which versions it "
        "was checked on\n" + "\n".join(offenders)
    )


def test_the_private_read_scan_sees_each_form() -> None:
    """Guards the scan itself: each form it looks for is found, and each allowed form is not."""
    code = """
import torch
import torch.distributed as dist
from lightning_ddpx.engine.reducer import reducer as reducer_module
from lightning_ddpx.lightning.settings.config import _resolve_comm_hook

class Mine:
    __slots__ = ("_slot",)

    def __init__(self, other):
        self._mine = 1
        other._mine = 2
        self._slot = super().__init__()

def f(x, optimizer, reducer):
    torch._C._foo(dist._rank_not_in_group(x))
    x._forward_module, getattr(optimizer, "_optimizer", None)
    reducer._pending, reducer_module._nothing, x.__dict__, x._replace(a=1)
"""
    found = sorted((read.name, read.owner) for read in _private_reads(ast.parse(code)))
    assert found == [
        ("dist._rank_not_in_group", "dependency"),
        ("getattr(optimizer, '_optimizer', None)", "dependency"),
        ("lightning_ddpx.engine.reducer.reducer._nothing", "ours"),
        ("lightning_ddpx.lightning.settings.config._resolve_comm_hook", "ours"),
        ("reducer._pending", "ours"),
        ("torch._C", "dependency"),
        ("torch._C._foo", "dependency"),
        ("x._forward_module", "dependency"),
    ]


# ------------------------------------------------------------------------ the layers above the engine
def _reducer_reads(tree: ast.AST) -> list[ast.AST]:
    """``x.reducer`` and ``getattr(x, "reducer")``; a module path (``lightning_ddpx.engine.reducer``) is not."""
    found: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "reducer":
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if not (isinstance(root, ast.Name) and root.id == "lightning_ddpx"):
                found.append(node)
        elif _attribute_call(node) and node.args[1].value == "reducer":  # type: ignore[attr-defined]
            found.append(node)
    return found


def test_the_layers_above_the_engine_use_the_module_not_its_reducer() -> None:
    """The strategies, the hooks, the fault tolerance and the tooling talk to DistributedDataParallel's
    public surface (``model.comm_hook``, ``model.updates_parameters_in_backward``, ...); the reducer is the
    engine's own. Every package but the engine, sub-packages included."""
    offenders = [
        f"{_where(path, node)}: {ast.unparse(node)}"
        for module, path in _sources().items()
        if _layer(module) not in ("engine", "")
        for node in _reducer_reads(_tree(path))
    ]
    assert not offenders, offenders


def test_the_reducer_scan_sees_each_form() -> None:
    code = """
import lightning_ddpx.engine.reducer.comm_stats
def f(model):
    model.reducer.overlap, getattr(model, "reducer"), model.module.reducer, model._reducer
"""
    found = [ast.unparse(node) for node in _reducer_reads(ast.parse(code))]
    assert sorted(found) == ["getattr(model, 'reducer')", "model.module.reducer", "model.reducer"]
    # and a private member of another unit (the module's) is the private-member scan's
    assert [read.name for read in _private_reads(ast.parse(code))] == ["model._reducer"]


# ------------------------------------------------------------------------------------------ the page
def _cited() -> tuple[list[str], list[str]]:
    text = PAGE.read_text()
    code = re.findall(r"`([^`\n]+)`", text)
    paths = [c for c in code if re.fullmatch(r"[\w./-]+\.(py|md|sh)", c)]
    paths += re.findall(
        r"(?<![`\w/.])((?:tests|docs|benchmarks|scripts|examples|lightning_ddpx)/[\w./-]*\w\.(?:py|md|sh))",
        text,
    )
    dotted = [c for c in code if re.fullmatch(r"lightning_ddpx(\.\w+)+", c)]
    return paths, dotted


def _resolve(name: str) -> object:
    """The object a dotted name names: the longest importable module prefix, then attributes."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            obj = getattr(obj, attribute)
        return obj
    raise ImportError(name)


ROOMS_TABLES = {
    "engine": "## The engine's rooms",
    "fault": "## The rooms of fault/",
    "lightning": "## The Lightning layer's rooms",
}


@pytest.mark.parametrize("package", ROOMED)
def test_the_rooms_table_lists_every_module_in_its_room(package: str) -> None:
    """The page's table of a package's rooms (`` # room module what``, under its heading) names each of its
    modules once, in its room, with the room's number from lightning_ddpx/<package>/__init__.py."""
    section = PAGE.read_text().split(ROOMS_TABLES[package] + "\n")[1]
    table = section.split("```text\n #  room")[1].split("```")[0]
    order = _room_order(package)
    listed, rank, folder = set(), 0, ""
    for line in table.splitlines()[1:]:
        match = re.match(r"^ ?(\d)? +(?:(\w+)/ +)?(\w+\.py)  ", line)
        assert match, f"not a row of the rooms table: {line!r}"
        if match.group(1):
            rank, folder = int(match.group(1)), match.group(2) or ""
        module = ".".join(filter(None, ["lightning_ddpx", package, folder, match.group(3)[: -len(".py")]]))
        room = _room(module, package)
        assert room in order and order[room] == rank, (
            f"{module} is listed as room {rank}; lightning_ddpx/{package}/__init__.py gives {order.get(room)}"  # type: ignore[arg-type]
        )
        listed.add(module)
    modules = {
        m for m, path in _sources().items() if _room(m, package) is not None and path.name != "__init__.py"
    }
    assert listed == modules, (
        f"add to the table: {sorted(modules - listed)}; remove: {sorted(listed - modules)}"
    )


def test_cited_paths_exist() -> None:
    paths, _ = _cited()
    assert len(paths) >= 30
    missing = sorted({p for p in paths if not (REPO_ROOT / p).exists()})
    assert not missing, missing


def test_cited_names_resolve() -> None:
    _, dotted = _cited()
    assert len(dotted) >= 10
    unresolved = []
    for name in dotted:
        try:
            _resolve(name)
        except (ImportError, AttributeError):
            unresolved.append(name)
    assert not unresolved, unresolved


@functools.lru_cache(maxsize=None)
def _classes() -> dict[str, list[str]]:
    """Class name -> the modules of the package that define a class of that name at top level."""
    found: dict[str, list[str]] = {}
    for module, path in _sources().items():
        for node in _tree(path).body:
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(module)
    return found


def _instance_attributes(cls: type) -> set[str]:
    """What ``self.<name> = ...`` sets in ``cls`` or its bases (defined in this package)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        path = _sources().get(klass.__module__)
        if path is None:
            continue
        for node in _tree(path).body:
            if isinstance(node, ast.ClassDef) and node.name == klass.__name__:
                names |= {
                    n.attr
                    for n in ast.walk(node)
                    if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and _is_own(n.value)
                }
    return names


def test_cited_class_members_exist() -> None:
    """Every ``Class.member`` the page cites (a class of this package) is a member of that class."""
    missing = []
    for cls_name, member in re.findall(r"`(\w+)\.(\w+)(?:\([^`]*\))?`", PAGE.read_text()):
        modules = _classes().get(cls_name, [])
        if not modules:
            continue  # not one of ours (torch's Join, a module name: test_cited_names_resolve)
        classes = [getattr(importlib.import_module(m), cls_name) for m in modules]
        if not any(hasattr(c, member) or member in _instance_attributes(c) for c in classes):
            missing.append(f"{cls_name}.{member}")
    assert not missing, missing


def _recipe(name: str) -> str:
    blocks = re.findall(r"```python\n# recipe: (\w+)\n(.*?)```", PAGE.read_text(), re.S)
    return dict(blocks)[name]


def test_the_hook_recipe_runs(tmp_path: Path) -> None:
    from lightning_ddpx import DistributedDataParallel

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        namespace: dict = {}
        exec(compile(_recipe("hook"), "architecture.md recipe", "exec"), namespace)  # noqa: S102
        torch.manual_seed(0)
        reference = torch.nn.Linear(4, 3)
        model = DistributedDataParallel(torch.nn.Linear(4, 3))
        model.module.load_state_dict(reference.state_dict())
        model.register_comm_hook(namespace["state"], namespace["hook"])
        x = torch.randn(5, 4)
        model(x).sum().backward()
        reference(x).sum().backward()
        for ours, theirs in zip(model.module.parameters(), reference.parameters()):
            torch.testing.assert_close(ours.grad, 2.0 * theirs.grad)  # factor 2 on one rank
    finally:
        dist.destroy_process_group()


def test_the_benchmark_recipe_names_exist() -> None:
    import sys

    sys.path.insert(0, str(REPO_ROOT))
    try:
        common = importlib.import_module("benchmarks.common")
        engine_bench = importlib.import_module("benchmarks.bench_engine")
    finally:
        sys.path.remove(str(REPO_ROOT))
    section = PAGE.read_text().split("## Recipe: add a benchmark")[1].split("\n## ")[0]
    names = [n for n in re.findall(r"`(\w+)`", section) if n != "run_rank"]
    assert {"build_model", "launch", "interleaved_timing", "TARGET_RATIOS"} <= set(names)
    for name in names:
        assert hasattr(common, name), name
    assert hasattr(engine_bench, "run_rank")


# ------------------------------------------------------------------------ the strategies' run modes
def test_no_strategy_method_asks_whether_fault_tolerance_is_on() -> None:
    """Each strategy picks its run once (lightning/runs/trainer_run.py, lightning/runs/fabric_run.py) and its methods
    delegate: no ``if`` (or conditional expression) inside the strategy classes tests anything named after
    fault tolerance (``fault_tolerance``, ``self._run.fault``, ``fault_manager``)."""
    offenders = []
    for name in ("trainer.py", "fabric.py"):
        path = PACKAGE / "lightning" / "strategies" / name
        for node in ast.walk(_tree(path)):
            if not isinstance(node, ast.ClassDef) or node.name != "DDPXStrategy":
                continue
            for test in (n.test for n in ast.walk(node) if isinstance(n, (ast.If, ast.IfExp, ast.While))):
                words = {n.attr for n in ast.walk(test) if isinstance(n, ast.Attribute)}
                words |= {n.id for n in ast.walk(test) if isinstance(n, ast.Name)}
                if any("fault" in word for word in words):
                    offenders.append(
                        f"lightning_ddpx/lightning/strategies/{name}:{test.lineno}: {ast.unparse(test)}"
                    )
    assert not offenders, (
        "branch on fault tolerance in a strategy method (move it to the run):\n" + "\n".join(offenders)
    )
