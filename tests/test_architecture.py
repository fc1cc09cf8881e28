"""docs/dev/architecture.md stays true: the layer rules hold for every import in the package, every path and
dotted name it cites exists, and its recipes' code runs."""

from __future__ import annotations

import ast
import datetime
import importlib
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = REPO_ROOT / "lightning_ddpx"
PAGE = REPO_ROOT / "docs" / "dev" / "architecture.md"

# layer -> the layers of lightning_ddpx it may import (and whether it may import the lightning package)
ALLOWED = {
    "_compat": (set(), False),
    "engine": ({"engine", "_compat"}, False),
    "hooks": ({"engine", "hooks", "_compat"}, False),
    "lightning": ({"engine", "hooks", "lightning", "_compat"}, True),
    "bench": ({"engine", "hooks", "lightning", "bench", "_compat", ""}, True),
}


def _layer(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else ""


def _imports(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module != "lightning_ddpx":
                names.append(node.module)
            else:  # from lightning_ddpx import <layer> | <public name of the top-level package>
                names += [
                    f"lightning_ddpx.{a.name}" if a.name in ALLOWED else "lightning_ddpx" for a in node.names
                ]
    return names


def test_layers_import_only_the_layers_below() -> None:
    broken = []
    for path in sorted(PACKAGE.rglob("*.py")):
        layer = _layer(path)
        if layer not in ALLOWED:
            continue  # the top-level modules: the public surface, lazy by design (test_layers.py)
        allowed, may_import_lightning = ALLOWED[layer]
        for name in _imports(ast.parse(path.read_text())):
            parts = name.split(".")
            if parts[0] == "lightning" and not may_import_lightning:
                broken.append(f"{path.relative_to(REPO_ROOT)} imports {name}")
            if parts[0] == "lightning_ddpx":
                target = parts[1] if len(parts) > 1 else ""
                if target not in allowed:
                    broken.append(f"{path.relative_to(REPO_ROOT)} ({layer}) imports {name}")
    assert not broken, "\n".join(broken)


def _cited() -> tuple[list[str], list[str]]:
    text = PAGE.read_text()
    code = re.findall(r"`([^`\n]+)`", text)
    paths = [c for c in code if re.fullmatch(r"[\w./-]+\.(py|md|sh)", c)]
    paths += re.findall(r"(?<![`\w/])((?:tests|docs|benchmarks|scripts)/[\w./-]+\.(?:py|md|sh))", text)
    dotted = [c for c in code if re.fullmatch(r"lightning_ddpx(\.\w+)+", c)]
    return paths, dotted


def test_cited_paths_exist() -> None:
    paths, _ = _cited()
    assert len(paths) >= 15
    missing = [p for p in paths if not (REPO_ROOT / p).exists()]
    assert not missing, missing


def test_cited_names_resolve() -> None:
    _, dotted = _cited()
    assert len(dotted) >= 4
    for name in dotted:
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for attribute in parts[cut:]:
                obj = getattr(obj, attribute)
            break
        else:
            pytest.fail(f"{name} does not resolve")


def test_cited_reducer_and_module_methods_exist() -> None:
    from lightning_ddpx.engine.module import DistributedDataParallel
    from lightning_ddpx.engine.reducer import Reducer

    text = PAGE.read_text()
    for method in re.findall(r"`Reducer\.(\w+)`", text) + re.findall(r"`(_\w+)`", text):
        assert hasattr(Reducer, method) or method == "_BUILTIN", method
    for method in re.findall(r"`DistributedDataParallel\.(\w+)`", text):
        assert hasattr(DistributedDataParallel, method), method


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
    section = PAGE.read_text().split("## Recipe: add a benchmark")[1]
    names = [n for n in re.findall(r"`(\w+)`", section) if n != "run_rank"]
    assert {"build_model", "launch", "interleaved_timing", "TARGET_RATIOS"} <= set(names)
    for name in names:
        assert hasattr(common, name), name
    assert hasattr(engine_bench, "run_rank")


def test_the_lightning_layer_uses_the_module_not_its_reducer() -> None:
    """The strategies talk to DistributedDataParallel's public surface; the reducer is the engine's own."""
    offenders = [
        f"{path.relative_to(REPO_ROOT)}:{number}"
        for path in sorted((PACKAGE / "lightning").glob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\.reducer\b", line) and not line.lstrip().startswith("#")
    ]
    assert not offenders, offenders


# The engine's classes a reader should be able to hold in mind: at most this many lines, docstrings
# included. The two larger ones carry torch's whole public surface (the module) and the DDP protocol (the
# reducer); their ceilings are today's sizes, so they may shrink but not grow.
CLASS_LINES = 450
LARGER_CLASSES = {"DistributedDataParallel": 464, "Reducer": 468}
FUNCTION_LINES = 60


def _sizes(kinds: tuple[type, ...]) -> list[tuple[str, int]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, kinds):
                where = f"{path.relative_to(REPO_ROOT)}:{node.lineno} {node.name}"  # type: ignore[attr-defined]
                found.append((where, node.end_lineno - node.lineno + 1))  # type: ignore[attr-defined]
    return found


def test_functions_and_engine_classes_stay_small() -> None:
    long_functions = [
        f"{where} ({lines} lines)"
        for where, lines in _sizes((ast.FunctionDef, ast.AsyncFunctionDef))
        if lines > FUNCTION_LINES
    ]
    assert not long_functions, f"split these functions (at most {FUNCTION_LINES} lines): {long_functions}"
    large = [
        f"{where} ({lines} lines)"
        for where, lines in _sizes((ast.ClassDef,))
        if "/engine/" in where and lines > LARGER_CLASSES.get(where.rsplit(" ", 1)[1], CLASS_LINES)
    ]
    assert not large, f"split these engine classes (at most {CLASS_LINES} lines): {large}"
