"""The house plan holds: docs/architecture.md lists exactly kdexp's rooms (its top-level packages and modules, conf
and launchers included), and every import in the source goes down its stack: no room imports a room of a higher
layer, and no two rooms import each other (directly or round a longer cycle), function-local imports included.

The import graph is built from the source with ``ast`` (every ``import`` / ``from ... import`` anywhere in a file,
relative imports resolved, and ``importlib.import_module`` / ``__import__`` of a literal name), never by importing
the code. A failure names each offending edge with file:line."""
from __future__ import annotations

import ast
import re
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = "kdexp"


def package_dirs(root: Path) -> dict[str, Path]:
    """Room -> its directory for the subpackages that live outside kdexp/ (pyproject's package-dir: conf, launchers)."""
    dirs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {name.split(".", 1)[1]: root / path for name, path in dirs.items() if name.startswith(PACKAGE + ".")}


def rooms_on_disk(root: Path) -> set[str]:
    """Every top-level package (a directory with __init__.py) and module of kdexp, and the package-dir ones."""
    pkg = root / PACKAGE
    found = {p.stem for p in pkg.glob("*.py") if p.name != "__init__.py"}
    found |= {p.name for p in pkg.iterdir() if (p / "__init__.py").is_file()}
    return found | set(package_dirs(root))


def source_files(root: Path) -> list[tuple[Path, list[str]]]:
    """(file, its dotted package as a list) for every .py of kdexp, conf and launchers."""
    out = []
    bases = [(root / PACKAGE, [PACKAGE])] + [(d, [PACKAGE, room]) for room, d in package_dirs(root).items()]
    for base, prefix in bases:
        for f in sorted(base.rglob("*.py")):
            out.append((f, prefix + list(f.relative_to(base).parts[:-1])))
    return out


def _literal_prefix(node: ast.AST) -> str | None:
    """The text of a str constant, or the leading literal text of an f-string."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return str(node.values[0].value)
    return None


def imported_modules(tree: ast.AST, package: list[str]) -> list[tuple[str, int]]:
    """(absolute dotted name, line) of every import in a module's tree; ``from X import a, b`` yields X.a and X.b, so
    that ``from kdexp import config`` reads as an import of kdexp.config."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out += [(f"{module}.{a.name}", node.lineno) for a in node.names if a.name != "*"] or [(module, node.lineno)]
        elif isinstance(node, ast.Call) and node.args:
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            text = _literal_prefix(node.args[0])
            if name in ("import_module", "__import__") and text:
                out.append((text, node.lineno))
    return out


def room_of(module: str, rooms: set[str]) -> str | None:
    """The room a dotted module name lies in; None for a name outside kdexp or the package root itself."""
    parts = module.split(".")
    if parts[0] != PACKAGE or len(parts) < 2 or parts[1] not in rooms:
        return None
    return parts[1]


def import_edges(root: Path) -> dict[tuple[str, str], list[str]]:
    """(importing room, imported room) -> ["file:line", ...]. The package root counts as importing room "kdexp"."""
    rooms = rooms_on_disk(root)
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for f, package in source_files(root):
        src = package[1] if len(package) > 1 else (f.stem if f.name != "__init__.py" else PACKAGE)
        for module, line in imported_modules(ast.parse(f.read_text(), str(f)), package):
            dst = room_of(module, rooms)
            if dst is not None and dst != src:
                edges[(src, dst)].append(f"{f.relative_to(root)}:{line}")
    return dict(edges)


def cycles(edges) -> list[list[str]]:
    """The strongly connected components of more than one room (Tarjan), each sorted."""
    graph = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
        graph.setdefault(b, set())
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def upward(edges, layers: dict[str, int]) -> dict[tuple[str, str], list[str]]:
    """The edges from a room to a room of a higher layer."""
    return {(a, b): where for (a, b), where in edges.items() if a in layers and b in layers and layers[b] > layers[a]}


def doc_layers(text: str) -> dict[str, int]:
    """Room -> layer from the table of docs/architecture.md (rows ``| <layer> | `<room>` | <what> |``)."""
    rows = re.findall(r"^\|\s*(\d+)\s*\|\s*`([\w]+)`\s*\|", text, flags=re.M)
    layers: dict[str, int] = {}
    for layer, room in rows:
        assert room not in layers, f"docs/architecture.md lists the room {room!r} twice"
        layers[room] = int(layer)
    return layers


def _lines(edges) -> str:
    return "\n".join(f"  {a} -> {b}: {', '.join(where)}" for (a, b), where in sorted(edges.items()))


# ------------------------------------------------------------------------------------------------------------------
# the repository


@pytest.fixture(scope="module")
def edges():
    return import_edges(ROOT)


@pytest.fixture(scope="module")
def layers():
    return doc_layers(DOC.read_text())


def test_the_architecture_page_lists_exactly_the_rooms(layers):
    on_disk = rooms_on_disk(ROOT)
    assert set(layers) == on_disk, (f"rooms in kdexp but not in docs/architecture.md: {sorted(on_disk - set(layers))}; "
                                    f"listed there but not in kdexp: {sorted(set(layers) - on_disk)}")


def test_no_two_rooms_import_each_other(edges):
    found = cycles(edges)
    detail = [_lines({e: w for e, w in edges.items() if e[0] in c and e[1] in c}) for c in found]
    assert not found, "import cycles between rooms:\n" + "\n".join(
        f"{' <-> '.join(c)}:\n{d}" for c, d in zip(found, detail))


def test_every_import_goes_down_the_stack(edges, layers):
    bad = upward(edges, layers)
    assert not bad, "imports of a higher room (docs/architecture.md's stack):\n" + _lines(bad)


def test_the_package_root_imports_no_room(edges):
    assert not {e: w for e, w in edges.items() if e[0] == PACKAGE}, "kdexp/__init__.py must stay below every room"


# ------------------------------------------------------------------------------------------------------------------
# the checker itself, on a made-up package: what it must catch


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools.package-dir]\n"kdexp.conf" = "conf"\n')
    for name, text in {"kdexp/__init__.py": "", "conf/__init__.py": "", **files}.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_checker_finds_every_kind_of_import(tmp_path):
    root = _tree(tmp_path, {
        "kdexp/rules.py": "import os\n",
        "kdexp/low/__init__.py": "from . import core\n",  # within the room: no edge
        "kdexp/low/core.py": "def f():\n    from ..high import thing\n    return thing\n",  # relative, in a function
        "kdexp/high/__init__.py": "from kdexp import low, cache_dir\nimport kdexp.rules\n",
        "kdexp/high/lazy.py": "import importlib\nm = importlib.import_module(f'kdexp.conf.{1}')\n",
        "kdexp/mid/__init__.py": "from kdexp.low.core import f\n",
        "conf/x.py": "from kdexp.mid import f\n",
    })
    assert rooms_on_disk(root) == {"rules", "low", "high", "mid", "conf"}
    assert import_edges(root) == {
        ("low", "high"): ["kdexp/low/core.py:2"],
        ("high", "low"): ["kdexp/high/__init__.py:1"],
        ("high", "rules"): ["kdexp/high/__init__.py:2"],
        ("high", "conf"): ["kdexp/high/lazy.py:2"],
        ("mid", "low"): ["kdexp/mid/__init__.py:1"],
        ("conf", "mid"): ["conf/x.py:1"],
    }


def test_the_checker_names_cycles_and_upward_edges(tmp_path):
    edges = {("a", "b"): ["x.py:1"], ("b", "c"): ["y.py:2"], ("c", "a"): ["z.py:3"], ("c", "d"): ["w.py:4"],
             ("d", "e"): ["v.py:5"]}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles({("a", "b"): [], ("b", "a"): []}) == [["a", "b"]]
    assert cycles({("a", "b"): [], ("b", "c"): []}) == []
    layers = {"a": 1, "b": 1, "c": 2, "d": 3, "e": 3}
    # beside (a -> b, d -> e) and down (c -> a) pass; up (b -> c, c -> d) does not
    assert upward(edges, layers) == {("b", "c"): ["y.py:2"], ("c", "d"): ["w.py:4"]}
    assert doc_layers("| layer | room | what |\n| --- | --- | --- |\n| 1 | `a` | x |\n| 2 | `b` | y |\n") == \
        {"a": 1, "b": 2}
