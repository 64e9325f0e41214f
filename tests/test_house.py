"""The house a newcomer can read, measured statically: the README's first screen, no import cycle, one name per
module, no reaching into another module's private names, no measurements or log paths in the package's code,
few tools. Each test reads the checkout's files; none needs a GPU."""

from __future__ import annotations

import ast
import collections
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "attnlab"


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every Python file of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]):
    """(imported attnlab modules, (module, name) pairs imported from another module, attribute reads
    ``alias.name`` of an imported module), counting imports inside functions."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    mods, names, aliases = set(), [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if not base.startswith("attnlab"):
                continue
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in modules:
                    mods.add(full)
                    aliases[a.asname or a.name] = full
                else:
                    mods.add(base)
                    names.append((base, a.name))
        elif isinstance(node, ast.Import):
            mods.update(a.name for a in node.names if a.name.startswith("attnlab"))
    reads = [(aliases[n.value.id], n.attr) for n in ast.walk(tree)
             if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases]
    return mods & set(modules), names, reads


def _private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__")


def test_readme_starts_with_what_and_how_on_one_screen():
    text = (ROOT / "README.md").read_text()
    assert len(text.split()) <= 1200
    assert "```python" in "\n".join(text.splitlines()[:60])


def test_no_import_cycle_inside_the_package():
    modules = _modules()
    graph = {name: _imports(name, path, modules)[0] - {name} for name, path in modules.items()}
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt):], nxt] if nxt in stack else [node, nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_one_file_name_per_module_except_sibling_backends():
    """Two modules may share a file name only as siblings under attnlab/backends/ (triton/ and cuda/)."""
    by_name = collections.defaultdict(list)
    for path in _modules().values():
        if path.name != "__init__.py":
            by_name[path.name].append(path.relative_to(PACKAGE))
    for name, paths in by_name.items():
        outside = [p for p in paths if p.parts[0] != "backends" or len(p.parts) < 3]
        assert len(paths) == 1 or not outside, f"{name}: {[str(p) for p in paths]}"


def test_no_module_reaches_into_another_modules_private_names():
    modules = _modules()
    imported, read = [], []
    for name, path in modules.items():
        _, names, reads = _imports(name, path, modules)
        imported += [(name, m, n) for m, n in names if _private(n) and m != name]
        read += [(name, m, a) for m, a in reads if _private(a) and m != name]
    assert len(imported) <= 5, imported
    assert not read, read


def test_measurements_and_logs_stay_out_of_the_code():
    """The package names the recorded GPU at most three times and points into no log folder: the numbers
    behind a rule are in docs/decisions.md and data/."""
    texts = {path: path.read_text() for path in _modules().values()}
    assert sum(t.count("H200") for t in texts.values()) <= 3
    logs = [str(p.relative_to(ROOT)) for p, t in texts.items() if re.search(r"gpu_tests/|\.txt\b.*data/", t)]
    assert not logs, logs


def test_tools_import_what_the_package_has():
    """Every ``from attnlab... import name`` in tools/ names something the package still defines (the tools run
    on the GPU only, so nothing else would notice a name that went away)."""
    import ast
    import importlib

    missing = []
    for path in sorted((ROOT / "tools").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("attnlab"):
                module = importlib.import_module(node.module)
                for a in node.names:  # a name the module defines, or a submodule of a package
                    sub = hasattr(module, "__path__") and importlib.util.find_spec(f"{node.module}.{a.name}")
                    if not hasattr(module, a.name) and not sub:
                        missing.append(f"{path.name}: {node.module}.{a.name}")
    assert not missing, missing


def test_few_tools():
    assert len([p for d in ("scripts", "tools") for p in (ROOT / d).glob("*.py")]) <= 8
