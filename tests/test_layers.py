"""The library's layers: imports point down (topologies <- comm <- optim <- plan <- loop <- drivers <- app)
and no module of dpsgd/ imports itself back through others."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ABOVE_OPTIM = ("dpsgd.backends", "dpsgd.training", "dpsgd.sim", "dpsgd.build", "experiments")


def test_comm_and_optim_load_nothing_above_them():
    probe = (
        "import json, sys; import dpsgd.comm, dpsgd.optim; "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('dpsgd', 'experiments')))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "dpsgd.comm.transport" in loaded and "dpsgd.optim.dpsgd" in loaded  # the probe saw the modules load
    above = [m for m in loaded if m.startswith(ABOVE_OPTIM)]
    assert not above, f"importing dpsgd.comm and dpsgd.optim loaded {above}"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of `modules` that the file at `path` imports, anywhere in it (inside functions and
    `if TYPE_CHECKING:` blocks too: an import there still ties the two files together)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the submodule pkg.mod where there is one, else a name of pkg
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a name inside a module: that module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    files = {_module_name(p): p for p in sorted((root / "dpsgd").rglob("*.py"))}
    return {name: _imports(path, set(files)) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan's algorithm): each is an import circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_reads_relative_and_package_imports():
    graph = import_graph(ROOT)
    assert "dpsgd.comm.transport" in graph["dpsgd.comm.local"]  # from .transport import ...
    assert "dpsgd.backends.launch" in graph["dpsgd.backends.mpi"]  # from . import hosts, launch
    assert "dpsgd.comm.netem" in graph["dpsgd.build"]  # from dpsgd.comm import netem


def test_no_import_circle_in_dpsgd():
    assert cycles(import_graph(ROOT)) == []
