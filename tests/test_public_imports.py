"""experiments/ (the top layer) uses the library's public API only: every `dpsgd.*` / `topologies.*` name it imports,
or reaches as an attribute of an imported module, is public.

Public, read from the source and the API pages (no import): a name N of module M is public when
  - M is a package whose `__init__` lists N in `__all__`, and N is documented in docs/api/*.md: a `::: M.N` line,
    a line for the object where it is defined (`::: dpsgd.comm.mpi.MPICommunicator` for dpsgd.comm's re-export),
    its defining module's line, or a line for M or a package above it as a whole; or
  - M has a `::: M` line of its own (a module documented as a whole) and N is among what that page shows: its
    `members:` where the line lists them, else M's `__all__`, else the names M defines without a leading `_`.
A module itself is public when it is `dpsgd` or `topologies`, a package with `__all__`, or documented as a whole.
So `from dpsgd.comm import MPICommunicator` is public and `from dpsgd.comm.mpi import MPICommunicator` is not.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("dpsgd", "topologies")
FILES = sorted((ROOT / "experiments").rglob("*.py"))


def module_file(name: str) -> Path | None:
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def is_package(name: str) -> bool:
    path = module_file(name)
    return path is not None and path.name == "__init__.py"


@functools.cache
def tree(name: str) -> ast.Module:
    path = module_file(name)
    assert path is not None, name
    return ast.parse(path.read_text(), str(path))


@functools.cache
def exports(name: str) -> tuple[str, ...] | None:
    """Module `name`'s literal `__all__`, or None."""
    for node in tree(name).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    return None


@functools.cache
def defines(name: str) -> frozenset[str]:
    """The names module `name` defines at its top level (not those it imports), without a leading `_`."""
    found = set()
    for node in tree(name).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found |= {t.id for t in targets if isinstance(t, ast.Name)}
    return frozenset(n for n in found if not n.startswith("_"))


@functools.cache
def origin(module: str, name: str) -> str:
    """The module that defines `name`, followed through the `from .x import name` re-exports of `module`."""
    package = module if is_package(module) else module.rpartition(".")[0]
    for node in tree(module).body:
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            source = ".".join([*anchor, *([node.module] if node.module else [])])
            real = next(a.name for a in node.names if (a.asname or a.name) == name)
            if module_file(f"{source}.{real}"):
                return f"{source}.{real}"  # a submodule
            return origin(source, real) if module_file(source) else source
    return module


@functools.cache
def documented() -> dict[str, tuple[str, ...] | None]:
    """Each `::: TARGET` of docs/api/*.md with the `members:` its options list (None: no such list)."""
    found: dict[str, tuple[str, ...] | None] = {}
    for page in sorted((ROOT / "docs" / "api").glob("*.md")):
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            m = re.match(r"::: ([\w.]+)\s*$", line)
            if not m:
                continue
            members = None
            for option in lines[i + 1 :]:
                if not option.startswith(" ") or not option.strip():
                    break
                listed = re.match(r"\s+members:\s*\[(.*)\]", option)
                if listed:
                    members = tuple(x.strip() for x in listed.group(1).split(",") if x.strip())
            found[m.group(1)] = members
    return found


def shown(module: str) -> frozenset[str]:
    """What the API page of a module documented as a whole shows of it."""
    members = documented()[module]
    if members is not None:
        return frozenset(members)
    return frozenset(exports(module) or defines(module))


def ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def why_not_public(ref: str) -> str | None:
    """None if the dotted reference `ref` is public (the module's docstring), else why not."""
    parts = ref.split(".")
    k = max((i for i in range(1, len(parts) + 1) if module_file(".".join(parts[:i]))), default=0)
    if k == 0:
        return "no such module"
    module, rest = ".".join(parts[:k]), parts[k:]
    docs = documented()
    if not rest:
        if module in LIBRARY or (is_package(module) and exports(module) is not None) or module in docs:
            return None
        return f"module {module} is neither documented in docs/api as a whole nor a package with __all__"
    name = rest[0]
    if module in docs:
        return None if name in shown(module) else f"docs/api documents {module} but not its {name}"
    if is_package(module) and name in (exports(module) or ()):
        where = origin(module, name)
        owner = where.rpartition(".")[0] if where.endswith(f".{name}") else where
        lines = {f"{module}.{name}", f"{owner}.{name}", where}
        if lines & docs.keys() or any(docs.get(a, ()) is None and a in docs for a in {owner, *ancestors(module)}):
            return None
        return f"{module}.__all__ has {name}, but docs/api has no `::: {module}.{name}` (nor its module's) line"
    if is_package(module) and exports(module) is not None:
        return f"{name} is not in {module}.__all__"
    return f"{module} is not a public namespace (no package __all__, no `::: {module}` in docs/api)"


def references(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of each library name `path` imports, and of each attribute chain on an imported module."""
    found, bound = [], {}
    nodes = list(ast.walk(ast.parse(path.read_text(), str(path))))
    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in LIBRARY:
                    found.append((node.lineno, a.name))
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in LIBRARY:
            for a in node.names:
                found.append((node.lineno, f"{node.module}.{a.name}"))
                if module_file(f"{node.module}.{a.name}"):
                    bound[a.asname or a.name] = f"{node.module}.{a.name}"
    inner = {id(n.value) for n in nodes if isinstance(n, ast.Attribute)}
    for node in nodes:
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            chain, base = [], node
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                found.append((node.lineno, ".".join([bound[base.id], *reversed(chain)])))
    return found


def problems(path: Path) -> list[str]:
    rel = path.relative_to(ROOT)
    out = []
    for line, ref in sorted(set(references(path))):
        why = why_not_public(ref)
        if why:
            out.append(f"{rel}:{line}: {ref}: {why}")
    return out


def test_the_rule_on_known_names():
    assert why_not_public("dpsgd.comm.MPICommunicator") is None  # exported, documented where it is defined
    assert "not a public namespace" in why_not_public("dpsgd.comm.mpi.MPICommunicator")
    assert why_not_public("dpsgd.comm.netem.Link") is None  # a module documented as a whole
    assert why_not_public("dpsgd.build.build_peer") is None  # a module documented as a whole
    assert "neither documented" in why_not_public("dpsgd.comm.base")  # an undocumented module
    assert "not in dpsgd.comm.__all__" in why_not_public("dpsgd.comm.ring_allreduce_bytes")
    assert why_not_public("topologies.analysis.spectral_gap") is None and why_not_public("topologies") is None
    assert "docs/api has no" in why_not_public("dpsgd.sim.train_fleet")  # in __all__, not documented


def test_references_follow_imported_modules(tmp_path):
    source = tmp_path / "x.py"
    source.write_text("import dpsgd.comm\nfrom dpsgd import metrics as m\nm.gather_scalars\ndpsgd.comm.mpi.X\n")
    refs = {r for _, r in references(source)}
    assert {"dpsgd.comm", "dpsgd.metrics", "dpsgd.metrics.gather_scalars", "dpsgd.comm.mpi.X"} <= refs


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT / "experiments")) for p in FILES])
def test_experiments_import_public_names_only(path):
    found = problems(path)
    assert not found, "imports of library internals (export and document the name, or use a public one):\n" + (
        "\n".join(found)
    )
