"""docs/dev/contracts.md states the engine's contracts; this test holds it to the code.

Every signature the page cites -- ``Class.method(parameters)`` or ``function(parameters)`` in backticks, or a
line of a signature block (a ``Class(...)`` line, then its ``.method(...)`` and ``.attribute`` lines) -- is
looked up and compared with ``inspect.signature`` of the real object: the parameters' names in their order
(``...`` stands for parameters the page leaves out) and the defaults it shows. Every path on the page exists,
every dotted name resolves and every import it shows runs.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
from pathlib import Path
from typing import Any, NamedTuple

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = REPO_ROOT / "lightning_ddpx"
PAGE = REPO_ROOT / "docs" / "dev" / "contracts.md"

# Names the page writes as signatures that are contracts, not objects: checked by the engine at run time.
PROTOCOLS = {"hook": "a communication hook: any callable hook(state, bucket), torch's contract"}
NOT_GIVEN = object()


class Citation(NamedTuple):
    name: str  # as written: "Reducer.write_back", "join.shadow_reduction", "DistributedDataParallel"
    parameters: list[tuple[str, Any]] | None  # (name, default text or NOT_GIVEN); None: an attribute


# --------------------------------------------------------------------------------------- reading the page
def _split_top_level(text: str) -> list[str]:
    """``a, b=(1, 2), c`` -> ``["a", "b=(1, 2)", "c"]``: commas outside brackets and quotes."""
    parts, depth, quote, current = [], 0, "", ""
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(current)
            current = ""
            continue
        current += char
    return [p.strip() for p in [*parts, current] if p.strip()]


def _parameters(text: str) -> list[tuple[str, Any]]:
    """The cited parameter list: names (``*args``, ``**kwargs`` kept; ``*`` and ``/`` markers dropped),
    ``...`` as itself, each with its default's text."""
    found: list[tuple[str, Any]] = []
    for part in _split_top_level(text):
        if part in ("*", "/"):
            continue
        if part == "...":
            found.append(("...", NOT_GIVEN))
            continue
        match = re.match(r"(\*{0,2}\w+)\s*(?::[^=]+)?(?:=(?!=)\s*(.+))?$", part)
        assert match, f"cannot read the parameter {part!r} on docs/dev/contracts.md"
        found.append((match.group(1), match.group(2) if match.group(2) is not None else NOT_GIVEN))
    return found


def _call_at(text: str, start: int) -> tuple[str, int] | None:
    """The text inside the parentheses opening at ``text[start]``, and the index after them."""
    if start >= len(text) or text[start] != "(":
        return None
    depth = 0
    for index in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[index], 0)
        if depth == 0:
            return text[start + 1 : index], index + 1
    raise AssertionError(f"unbalanced parentheses on docs/dev/contracts.md: {text[start : start + 60]!r}")


def _block_citations(block: str) -> list[Citation]:
    """A signature block: ``Class(...)`` (or a bare ``Class``) starts a class; indented ``.member(...)`` /
    ``.attribute`` entries (several per line, joined by ``,`` or ``/``) belong to it; text after two spaces
    is description. A signature may run over several lines."""
    citations, owner, position = [], None, 0
    lines = block.splitlines(keepends=True)
    offsets = [sum(len(line) for line in lines[:i]) for i in range(len(lines))]
    for line, offset in zip(lines, offsets):
        if offset < position:
            continue  # the continuation of a signature already read
        stripped = line.lstrip()
        at = offset + len(line) - len(stripped)
        if stripped.startswith("from "):
            continue  # imports: test_the_imports_shown_run
        head = re.match(r"(?:[\w, ]+=\s*)?([A-Za-z_][\w.]*)(?=\(|\s*$)", stripped)
        if head and not stripped.startswith("."):
            start = at + head.end(1)
            call = _call_at(block, start)
            citations.append(Citation(head.group(1), None if call is None else _parameters(call[0])))
            owner = head.group(1) if head.group(1)[0].isupper() else None
            position = start if call is None else call[1]
            continue
        cursor = at
        while owner and cursor < len(block) and block[cursor] == ".":
            member = re.match(r"\.(\w+)", block[cursor:])
            assert member, block[cursor : cursor + 40]
            cursor += member.end()
            call = _call_at(block, cursor)
            parameters = None if call is None else _parameters(call[0])
            citations.append(Citation(f"{owner}.{member.group(1)}", parameters))
            if call is not None:
                cursor = call[1]
            separator = re.match(r" ?[,/] ?(?=\.)", block[cursor:])
            if separator is None:
                break
            cursor += separator.end()
        position = cursor
    return citations


def _citations() -> list[Citation]:
    text = PAGE.read_text()
    blocks = re.findall(r"^```\w*\n(.*?)^```", text, re.M | re.S)
    citations = [c for block in blocks for c in _block_citations(block)]
    prose = re.sub(r"^```\w*\n.*?^```", "", text, flags=re.M | re.S)
    for code in re.findall(r"`([^`\n]+)`", prose):
        match = re.fullmatch(r"([A-Za-z_][\w.]*)\((.*)\)", code)
        if match:
            citations.append(Citation(match.group(1), _parameters(match.group(2))))
    return citations


# ------------------------------------------------------------------------------------- finding the object
@functools.lru_cache(maxsize=None)
def _modules() -> dict[str, str]:
    return {
        ".".join(p.relative_to(REPO_ROOT).with_suffix("").parts).removesuffix(".__init__"): str(p)
        for p in PACKAGE.rglob("*.py")
    }


@functools.lru_cache(maxsize=None)
def _top_level_names() -> dict[str, list[str]]:
    """Name -> the modules of the package that define it at top level (class, function, assignment)."""
    found: dict[str, list[str]] = {}
    for module, path in _modules().items():
        for node in ast.parse(Path(path).read_text()).body:
            names = [getattr(node, "name", None)]
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
            for name in filter(None, names):
                found.setdefault(name, []).append(module)
    return found


def _candidates(name: str) -> list[Any]:
    """The objects ``name`` can mean: a dotted import path; else its first part as a class or function of
    the package (several modules may define one: each is a candidate), or as the last part of one of the
    package's module names (``join.shadow_reduction``)."""
    head, *rest = name.split(".")
    roots: list[Any] = []
    if head in ("lightning_ddpx", "torch"):
        for cut in range(len(rest), -1, -1):
            try:
                roots = [importlib.import_module(".".join([head, *rest[:cut]]))]
            except ImportError:
                continue
            rest = rest[cut:]
            break
    else:
        roots = [getattr(importlib.import_module(m), head) for m in _top_level_names().get(head, [])]
        roots += [importlib.import_module(m) for m in _modules() if m.rsplit(".", 1)[-1] == head]
    found = []
    for obj in roots:
        for attribute in rest:
            obj = getattr(obj, attribute, NOT_GIVEN)
            if obj is NOT_GIVEN:
                break
        else:
            found.append(obj)
    return found


def _assigned_on_self(cls: type, name: str) -> bool:
    """Whether ``cls`` or one of its bases of this package sets ``self.<name>`` (an instance attribute)."""
    for klass in cls.__mro__:
        if klass.__module__.startswith("lightning_ddpx"):
            if re.search(rf"\bself\.{name}\s*(?::[^=\n]+)?=[^=]", inspect.getsource(klass)):
                return True
    return False


def _attribute_exists(name: str) -> bool:
    if _candidates(name):
        return True
    owner, _, member = name.rpartition(".")
    return any(isinstance(cls, type) and _assigned_on_self(cls, member) for cls in _candidates(owner))


def _mismatch(obj: Any, cited: list[tuple[str, Any]]) -> str | None:
    """Why ``cited`` is not ``obj``'s parameter list, or ``None`` if it is."""
    function = obj.fget if isinstance(obj, property) else obj
    signature = inspect.signature(function)
    real = {}
    for index, parameter in enumerate(signature.parameters.values()):
        if index == 0 and parameter.name in ("self", "cls") and not isinstance(obj, type):
            continue
        prefix = {parameter.VAR_POSITIONAL: "*", parameter.VAR_KEYWORD: "**"}.get(parameter.kind, "")
        real[prefix + parameter.name] = parameter.default
    names = [name for name, _ in cited if name != "..."]
    if any(name == "..." for name, _ in cited):
        remaining = iter(real)
        if not all(name in remaining for name in names):  # in the real order, others left out
            return f"({', '.join(names)}, ...) is not in the order of {signature}"
    elif names != list(real):
        return f"({', '.join(names)}) differs from {signature}"
    for name, default in cited:
        if default is NOT_GIVEN or name == "...":
            continue
        try:
            value = ast.literal_eval(default)
        except (ValueError, SyntaxError):
            continue  # a description of the accepted values ("None | PowerSGDOptions | dict")
        if real[name] is inspect.Parameter.empty or real[name] != value:
            return f"{name}={default} but the default is {real[name]!r}: {signature}"
    return None


# ------------------------------------------------------------------------------------------------ tests
def test_the_page_cites_signatures() -> None:
    """Guards the reading of the page: it finds the blocks' and the prose's signatures."""
    cited = {c.name for c in _citations()}
    assert {"DistributedDataParallel", "DistributedDataParallel.join", "Reducer.write_back"} <= cited
    assert {"join.shadow_reduction", "build_comm_hook", "GradBucket.set_buffer"} <= cited
    assert sum(c.parameters is not None for c in _citations()) >= 40


def test_the_reader_reads_each_form() -> None:
    block = (
        "Thing(a, b=1, *,\n      c=None, ...)\n  .go(x) / .stop()   what\n  .size, .name  more (an aside\n"
    )
    assert _block_citations(block) == [
        Citation("Thing", [("a", NOT_GIVEN), ("b", "1"), ("c", "None"), ("...", NOT_GIVEN)]),
        Citation("Thing.go", [("x", NOT_GIVEN)]),
        Citation("Thing.stop", []),
        Citation("Thing.size", None),
        Citation("Thing.name", None),
    ]

    def real(a: int, b: int = 1, *, c: Any = None, d: int = 0) -> None: ...

    assert _mismatch(real, _parameters("a, b=1, *, c=None, d=0")) is None
    assert _mismatch(real, _parameters("a, c=None, ...")) is None
    assert _mismatch(real, _parameters("c, a, ...")) is not None  # order
    assert _mismatch(real, _parameters("a, b=2, ...")) is not None  # default
    assert _mismatch(real, _parameters("a, b")) is not None  # missing without "..."


def test_cited_signatures_match_the_code() -> None:
    wrong = []
    for citation in _citations():
        if citation.name in PROTOCOLS:
            continue
        if citation.parameters is None:
            if not _attribute_exists(citation.name):
                wrong.append(f"{citation.name}: no such attribute")
            continue
        candidates = [c for c in _candidates(citation.name) if callable(c) or isinstance(c, property)]
        if not candidates:
            wrong.append(f"{citation.name}: not found (qualify it: Class.method, module.function)")
            continue
        reasons = [_mismatch(c, citation.parameters) for c in candidates]
        if all(reasons):
            wrong.append(f"{citation.name}: {reasons[0]}")
    assert not wrong, "docs/dev/contracts.md differs from the code:\n" + "\n".join(wrong)


def test_cited_paths_exist() -> None:
    text = PAGE.read_text()
    paths = set(re.findall(r"(?<![\w/.])((?:lightning_ddpx|tests|docs|benchmarks)/[\w./-]*)", text))
    assert len(paths) >= 15, f"the page's paths were not found: {sorted(paths)}"
    missing = sorted(p for p in paths if not (REPO_ROOT / p.rstrip(".")).exists())
    assert not missing, missing


def test_cited_dotted_names_resolve() -> None:
    dotted = re.findall(r"`(lightning_ddpx(?:\.\w+)+)`", PAGE.read_text())
    assert dotted
    unresolved = [name for name in dotted if not _candidates(name)]
    assert not unresolved, unresolved


def test_the_imports_shown_run() -> None:
    shown = r"^(from lightning_ddpx\S* import \([^)]*\)|from lightning_ddpx\S* import [^(].*)$"
    imports = re.findall(shown, PAGE.read_text(), re.M)
    assert imports
    for statement in imports:
        try:
            exec(statement, {})  # noqa: S102
        except ImportError as error:
            pytest.fail(f"docs/dev/contracts.md shows {statement!r}: {error}")
