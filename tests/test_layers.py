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


def name_comparisons(root: Path, names: set[str], own: dict[str, set[str]]) -> list[str]:
    """`x == "mpi"`, `algorithm in ("adpsgd", ...)` and the like in dpsgd/: comparisons of a backend's or an
    algorithm's name (the other side's code says backend, algorithm or name) outside that one's own modules."""
    found = []
    for path in sorted((root / "dpsgd").rglob("*.py")):
        rel = str(path.relative_to(root))
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            consts = {c.value for s in sides for c in ast.walk(s) if isinstance(c, ast.Constant)} & names
            code = " ".join(ast.get_source_segment(text, s) or "" for s in sides)
            if any(w in code for w in ("backend", "algorithm", "name")):
                found += [f"{rel}:{node.lineno} {code}" for c in consts if rel not in own.get(c, set())]
    return found


def test_name_comparisons_finds_one_and_passes_other_words(tmp_path):
    (tmp_path / "dpsgd").mkdir()
    (tmp_path / "dpsgd" / "x.py").write_text(
        "def f(cfg, comm, words):\n"
        '    return cfg["backend"]["name"] != "torch" or words[0] == "local" or comm.backend in ("mpi",)\n'
    )
    found = name_comparisons(tmp_path, {"torch", "local", "mpi"}, {"mpi": {"dpsgd/x.py"}})
    assert found == ['dpsgd/x.py:2 cfg["backend"]["name"] "torch"']  # words[0] is no name; x.py is mpi's own


def test_no_code_outside_its_own_module_names_a_backend_or_an_algorithm():
    from dpsgd import backends
    from dpsgd.optim import ALGORITHMS

    own = {  # a backend's transport and driver; an algorithm's own file is where its class is
        "local": {"dpsgd/comm/local.py", "dpsgd/backends/local.py"},
        "mpi": {"dpsgd/comm/mpi.py", "dpsgd/backends/mpi.py"},
        "torch": {"dpsgd/comm/torch_dist.py", "dpsgd/backends/torch_dist.py"},
        "fleet": {"dpsgd/sim/fleet.py", "dpsgd/backends/fleet.py"},
    }
    for name, cls in ALGORITHMS.items():
        own.setdefault(name, set()).add(str(Path(sys.modules[cls.__module__].__file__).relative_to(ROOT)))
    assert name_comparisons(ROOT, set(backends.names()) | set(ALGORITHMS), own) == []
