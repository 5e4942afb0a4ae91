"""The structure of hbkernels/, read from its source (nothing is imported): the import
graph has no cycles, no module imports another module's private names, and no
backend compares a mode against a bare number; no test module imports another
(shared fixtures are ``tests/helpers.py``, references ``hbkernels/reference.py``).

Every import counts, also those inside functions. Modules whose names start with
``_`` are internal to the package and may be imported anywhere in it; a name with a
leading underscore (not a dunder) defined in another module may not be imported.
"""
import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "hbkernels"


def module_files(root=ROOT):
    """{dotted module name: path} of every module under ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name, path, modules):
    """``[(imported module, imported name or None, line)]`` of module ``name``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names if a.name in modules]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source not in modules:
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.append((sub, None, node.lineno) if sub in modules else
                             (source, alias.name, node.lineno))
    return found


def graph(modules):
    return {name: {target for target, _, _ in imports(name, path, modules)}
            for name, path in modules.items()}


def cycles(edges):
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges[v]:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def private_imports(modules):
    """``[(importer, source, name, line)]`` of private names imported from another module."""
    bad = []
    for name, path in modules.items():
        for source, imported, line in imports(name, path, modules):
            if (imported and imported.startswith("_") and not imported.startswith("__")
                    and source != name):
                bad.append((name, source, imported, line))
    return bad


#: comparisons of a mode against a bare number, e.g. ``bounds != 2`` or ``combiner == 1``
BARE_MODE = re.compile(r"\b(bounds|combiner|mode|pooling)\s*(==|!=|<=|>=|<|>)\s*\d")


def bare_mode_numbers(root=ROOT):
    return [f"{path.relative_to(root.parent)}:{k}: {line.strip()}"
            for sub in ("cpu", "cuda") for path in sorted((root / sub).glob("*.py"))
            for k, line in enumerate(path.read_text().splitlines(), 1) if BARE_MODE.search(line)]


def cross_test_imports(tests_dir=ROOT.parent / "tests"):
    """``[(test module, line)]`` where a ``tests/test_*.py`` imports another test module."""
    found = []
    for path in sorted(tests_dir.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [(path.name, node.lineno) for n in names if n.startswith("test_")]
    return found


def test_the_import_graph_has_no_cycles():
    assert cycles(graph(module_files())) == []


def test_no_module_imports_another_modules_private_names():
    assert private_imports(module_files()) == []


def test_no_backend_compares_a_mode_against_a_bare_number():
    assert bare_mode_numbers() == []


def test_no_cross_test_imports_another():
    assert cross_test_imports() == []


@pytest.fixture
def package(tmp_path):
    """A tiny package ``pkg`` written from ``{relative path: source}``."""
    def write(files):
        for rel, text in files.items():
            path = tmp_path / "pkg" / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        return module_files(tmp_path / "pkg")
    return write


def test_the_checks_find_what_they_look_for(package, tmp_path):
    """Each check fails on a package that breaks its rule (lazy imports count)."""
    modules = package({"__init__.py": "from . import a\n",
                       "a.py": "def f():\n    from .b import _hidden\n",
                       "b.py": "from . import a\n_hidden = 1\n",
                       "c.py": "from ._d import shared\n",
                       "_d.py": "shared = 1\n"})
    assert cycles(graph(modules)) == [["pkg.a", "pkg.b"]]
    assert private_imports(modules) == [("pkg.a", "pkg.b", "_hidden", 2)]
    (tmp_path / "pkg" / "cpu").mkdir()
    (tmp_path / "pkg" / "cuda").mkdir()
    (tmp_path / "pkg" / "cpu" / "k.py").write_text("if bounds == Bounds.RAISE:\n    pass\n"
                                                   "if combiner != 0:\n    pass\n")
    assert bare_mode_numbers(tmp_path / "pkg") == ["pkg/cpu/k.py:3: if combiner != 0:"]
    (tmp_path / "test_x.py").write_text("import numpy\nfrom test_y import helper\n")
    assert cross_test_imports(tmp_path) == [("test_x.py", 2)]
