"""The package's import graph, read from the source (imports inside functions count too, and nothing is
imported): no cycles anywhere, since a cycle means two modules that cannot be understood (or tested) one
without the other; and engine/ (the model and its runtime on one device) imports neither Ray nor NIXL,
which belong to the workers (workers/, the roles) and the KV transfer (transfer/)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Distribution and transport libraries the engine must not depend on (by top-level import name).
NOT_IN_ENGINE = {"ray", "nixl", "nixl_cu13"}


def package_dirs() -> dict[str, Path]:
    dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {pkg: REPO / folder for pkg, folder in dirs.items()}


def modules() -> dict[str, Path]:
    """Every module of the installed package, by dotted name: each file under the package-dir folder
    that maps it most specifically (kvrelay.v1 is protoc's output inside protos/)."""
    dirs = package_dirs()
    out: dict[str, Path] = {}
    for folder in sorted(set(dirs.values())):
        for path in folder.rglob("*.py"):
            pkg, base = max(((p, f) for p, f in dirs.items() if path.is_relative_to(f)),
                            key=lambda pf: len(pf[1].parts))
            rel = path.relative_to(base).with_suffix("")
            out[".".join([pkg, *(p for p in rel.parts if p != "__init__")])] = path
    return out


def _imports(path: Path, package: str = "") -> list[tuple[str, tuple[str, ...]]]:
    """(module, names imported from it) for every import statement in the file, at the top or inside a
    function; a relative one (`from .x import y`, `from . import y`) resolved against `package`, the
    dotted package the file belongs to."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names = tuple(a.name for a in node.names)
            if node.level == 0:
                found.append((node.module, names))
                continue
            parts = package.split(".")
            base = ".".join(parts[:len(parts) - (node.level - 1)])
            found.append((f"{base}.{node.module}" if node.module else base, names))
        elif isinstance(node, ast.Import):
            found += [(a.name, ()) for a in node.names]
    return found


def _package_of(mod: str, path: Path) -> str:
    return mod if path.name == "__init__.py" else mod.rpartition(".")[0]


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        deps = set()
        for target, names in _imports(path, _package_of(mod, path)):
            if not target.startswith("kvrelay."):
                continue
            deps.add(target)
            # `from kvrelay.engine import kv_geometry` depends on the submodule, not only the package.
            deps |= {f"{target}.{n}" for n in names if f"{target}.{n}" in mods}
        graph[mod] = deps - {mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walk_sees_every_module_of_every_package():
    graph = import_graph()
    assert "kvrelay.decode_worker.worker" in graph["kvrelay.decode_worker.colocated"]
    assert "kvrelay.engine.layers.attention" in graph and "kvrelay.v1" in graph
    # Every importable folder at the top of the repository is a package of the wheel, so none is unwalked.
    mapped = set(package_dirs().values())
    folders = {p.parent for p in REPO.glob("*/__init__.py")} - {REPO / "tests"}
    assert folders <= mapped, f"folders missing from pyproject's package-dir: {sorted(map(str, folders - mapped))}"
    for folder in mapped:
        for path in folder.rglob("*.py"):
            assert path in modules().values(), path


def test_a_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_engine_imports_no_ray_and_no_nixl():
    bad = [f"{mod} imports {target}" for mod, path in modules().items() if mod.startswith("kvrelay.engine")
           for target, _ in _imports(path, _package_of(mod, path)) if target.split(".")[0] in NOT_IN_ENGINE]
    assert bad == []


def test_relative_imports_resolve_to_the_module_they_name(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from .a import b\nfrom . import c\ndef f():\n    from ..d import e\n")
    assert _imports(path, "kvrelay.kernels") == [
        ("kvrelay.kernels.a", ("b",)), ("kvrelay.kernels", ("c",)), ("kvrelay.d", ("e",))]
    graph = import_graph()
    # kernels/ imports itself only relatively: the walk sees those edges, top-level and inside functions.
    assert "kvrelay.kernels.pdl" in graph["kvrelay.kernels.fp8_gemm"]
    assert "kvrelay.kernels.fp8_quant" in graph["kvrelay.kernels.fused"]


def test_a_forbidden_import_is_seen_inside_a_function(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from ray.util import x\n    import nixl_cu13\n")
    assert {t.split(".")[0] for t, _ in _imports(path)} == {"ray", "nixl_cu13"}


# Which packages each package may import (docs/map.md draws the same layers): the roles share workers/
# and never import each other; the router knows only the engine's types and the wire contract; nothing
# imports the benchmarks or the CLI's cluster/.
LAYERS = {
    "kernels": set(),
    "engine": {"kernels"},
    "transfer": {"engine"},
    "workers": {"engine", "transfer"},
    "prefill_worker": {"engine", "transfer", "workers"},
    "decode_worker": {"engine", "transfer", "workers"},
    "router": {"engine", "v1", "protos"},
    "protos": {"v1"},
    "v1": set(),
    "configs": set(),
}


def test_packages_import_only_the_layers_below_them():
    bad = []
    for mod, deps in import_graph().items():
        pkg = mod.split(".")[1]
        for dep in deps:
            target = dep.split(".")[1]
            if target == pkg:
                continue
            if target in ("bench", "cluster") and pkg not in ("bench", "cluster"):
                bad.append(f"{mod} imports {dep}")
            elif pkg in LAYERS and target not in LAYERS[pkg]:
                bad.append(f"{mod} imports {dep}")
    assert bad == []


def test_every_module_says_what_it_is_for():
    """A newcomer reads the docstring first (docs/map.md points there); protoc's output has none."""
    generated = ("kvrelay.v1", "kvrelay.protos.kvrelay")
    missing = [mod for mod, path in modules().items()
               if not mod.startswith(generated) and not ast.get_docstring(ast.parse(path.read_text()))]
    assert missing == []


def test_test_files_have_unique_basenames():
    """`make test` collects tests/cpu and tests/e2e in one pytest run, which imports test files by basename
    (rootdir-relative, no packages): two files of one name stop the whole run at collection, as a helper's
    tests/e2e/test_bench_multiturn.py beside tests/cpu/'s did on a clean clone. The helper modules the
    tests import (tests/e2e/greedy_judge.py, tests/cpu/scripted_router.py, ...) are imported by basename
    too: one name may not stand for two files (conftest.py aside: pytest loads each by its path)."""
    seen: dict[str, Path] = {}
    for path in sorted((REPO / "tests").rglob("*.py")):
        if path.name == "conftest.py" or "__pycache__" in path.parts:
            continue
        assert path.name not in seen, f"{path} has the name of {seen[path.name]}"
        seen[path.name] = path
