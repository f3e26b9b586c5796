"""The manual against the code: every public name documented and in the API reference; README's commands
name what exists (make targets, modules, config options), and its library example runs as written.

`make docs` (mkdocs build --strict) checks the rest: links, and that every API page names something real.
"""

from __future__ import annotations

import importlib
import inspect
import re
import shlex
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
API_PAGES = {
    "dpsgd.optim": "optim.md",
    "dpsgd.comm": "comm.md",
    "topologies": "topologies.md",
    "dpsgd.shares": "other.md",
}
CONF = ROOT / "conf"


def public_names(module_name: str) -> list[tuple[str, object]]:
    module = importlib.import_module(module_name)
    return [(name, getattr(module, name)) for name in module.__all__]


def own_doc(obj) -> str | None:
    """The object's own docstring: a class's is not inherited from its base (inspect.getdoc would)."""
    if inspect.isclass(obj):
        doc = obj.__dict__.get("__doc__")
    else:
        doc = getattr(obj, "__doc__", None)
    return doc.strip() if isinstance(doc, str) and doc.strip() else None


@pytest.mark.parametrize("module_name", sorted(API_PAGES))
def test_every_public_class_and_function_has_a_docstring(module_name):
    missing = [
        name
        for name, obj in public_names(module_name)
        if (inspect.isclass(obj) or inspect.isfunction(obj) or isinstance(obj, types.ModuleType)) and not own_doc(obj)
    ]
    assert not missing, f"{module_name}: no docstring on {missing}; write what each is, with its equation or contract"


@pytest.mark.parametrize("module_name", sorted(API_PAGES))
def test_every_public_name_is_in_the_api_reference(module_name):
    page = ROOT / "docs" / "api" / API_PAGES[module_name]
    text = page.read_text()
    missing = [name for name, _ in public_names(module_name) if not re.search(rf"\b{re.escape(name)}\b", text)]
    assert not missing, (
        f"{page.relative_to(ROOT)} does not name {missing} of {module_name}.__all__: add `::: ...` lines"
    )


def test_update_rules_state_their_equation():
    """Each algorithm's class docstring states its update (an assignment `<-` or `=` on x, or names the rule
    it inherits), so `help(DPSGD)` says what the class computes."""
    from dpsgd.optim import ALGORITHMS

    vague = [
        cls.__name__
        for cls in ALGORITHMS.values()
        if not re.search(r"x\S*\s*(<-|=)|x_i|mean_j", own_doc(cls) or "")
        and cls.__name__ not in ("SlowMo", "BMUF", "DiLoCo")
    ]
    assert not vague, f"these algorithms' docstrings state no update equation: {vague}"


# --- README's commands --------------------------------------------------------------------------------


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def commands(block: str) -> list[str]:
    """Shell lines of a block, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    lines = [re.sub(r"\s#.*$", "", line).strip() for line in joined.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), flags=re.M))


def module_exists(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def check_overrides(words: list[str], where: str) -> list[str]:
    """Hydra group choices (`algorithm=dpsgd,d2`, `experiment=...`) name files under conf/."""
    problems = []
    for word in words:
        group, _, values = word.partition("=")
        if not values or "." in group or not (CONF / group).is_dir():
            continue
        for value in values.split(","):
            if not (CONF / group / f"{value}.yaml").is_file():
                problems.append(f"{where}: {word}: no conf/{group}/{value}.yaml")
    return problems


def test_readme_commands_name_what_exists():
    text = README.read_text()
    targets, problems = make_targets(), []
    blocks = code_blocks(text, "bash")
    assert blocks, "README has no bash block"
    for block in blocks:
        for line in commands(block):
            words = shlex.split(line)
            if words[0] == "make":
                for word in words[1:]:
                    if "=" not in word and word not in targets:
                        problems.append(f"{line}: no make target {word!r}")
                args = next((w.split("=", 1)[1] for w in words if w.startswith("ARGS=")), "")
                problems += check_overrides(shlex.split(args), line)
            elif words[0].endswith("python") or words[0].endswith("python3"):
                if words[0] != ".venv/bin/python":
                    problems.append(f"{line}: call the venv's .venv/bin/python (a bare python has no Hydra)")
                if "-m" in words:
                    module = words[words.index("-m") + 1]
                    if not module_exists(module):
                        problems.append(f"{line}: no module {module}")
                problems += check_overrides(words, line)
            else:
                problems.append(
                    f"{line}: neither a make target nor the venv's python: is it runnable in a fresh clone?"
                )
    assert not problems, "\n".join(problems)


def test_guides_name_existing_modules_and_config_options():
    problems = []
    for page in sorted((ROOT / "docs" / "guide").glob("*.md")):
        for block in code_blocks(page.read_text(), "bash"):
            for line in commands(block):
                try:
                    words = shlex.split(line)
                except ValueError:
                    continue
                if "-m" in words and words[0].endswith("python"):
                    module = words[words.index("-m") + 1]
                    placeholder = any(part.isupper() for part in module.split("."))  # experiments.bench.NAME
                    ours = module.split(".")[0] in ("experiments", "topologies", "dpsgd")
                    if ours and not placeholder and not module_exists(module):
                        problems.append(f"{page.name}: {line}: no module {module}")
                problems += check_overrides(words, f"{page.name}: {line}")
    assert not problems, "\n".join(problems)


def test_manual_names_files_and_modules_that_exist():
    """Paths (`dpsgd/optim/dpsgd.py`) and dotted names (`dpsgd.comm.netem.Link`) in backticks, in README, the
    guides and the API pages, name files, modules and attributes that exist: a moved module shows up here."""
    pages = [README, ROOT / "docs" / "index.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
    pages += sorted((ROOT / "docs" / "api").glob("*.md"))
    problems = []
    for page in pages:
        text = page.read_text()
        for path in set(re.findall(r"`((?:dpsgd|topologies|experiments|tests|tools|conf)/[\w/.\-]*)`", text)):
            if "NAME" not in path and not (ROOT / path).exists():
                problems.append(f"{page.name}: no file {path}")
        for dotted in set(re.findall(r"`((?:dpsgd|topologies|experiments)(?:\.\w+)+)", text)):
            parts = dotted.split(".")
            k = max(i for i in range(1, len(parts) + 1) if module_exists(".".join(parts[:i])))
            obj = importlib.import_module(".".join(parts[:k]))
            for attr in parts[k:]:
                if not hasattr(obj, attr):
                    problems.append(f"{page.name}: {dotted}: {'.'.join(parts[:k])} has no {attr}")
                    break
                obj = getattr(obj, attr)
    assert not problems, "\n".join(problems)


def test_readme_library_example_runs_as_written(capsys):
    """The README's Python block, executed as a user would save and run it (4 peers as threads)."""
    (example,) = code_blocks(README.read_text(), "python")
    exec(compile(example, str(README), "exec"), {"__name__": "__main__"})
    distances = [float(v) for v in re.findall(r"[\d.]+(?:e-?\d+)?", capsys.readouterr().out)]
    assert len(distances) == 4 and distances[0] == 0.0, distances


# --- a documented investigation, run as written ---------------------------------------------------------


def documented(page: Path, start: str, language: str) -> str:
    """The first `language` block of `page` after the text `start`."""
    text = page.read_text()
    return code_blocks(text[text.index(start) :], language)[0]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ying2021_pooling_snippet_runs_as_documented(tmp_path):
    """docs/reproductions.md's five more seeds and its pooling snippet, as written (in a scratch folder): the
    snippet finds one configuration per graph and prints the pooled 8-seed figures the page reports. About 4 min
    on 2 loaded cores (the reproduction's 24 runs, then 10 more)."""
    import os
    import subprocess
    import sys

    page = ROOT / "docs" / "reproductions.md"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "outputs" / "reproductions"
    subprocess.run(
        [sys.executable, "-m", "experiments.reproduce", "ying2021", "--out", str(out / "ying2021")],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
    )
    more = re.search(r"\(`(python -m experiments\.train -m experiment=ying2021 [^`]*)`", page.read_text(), flags=re.S)
    assert more, "the five-more-seeds command is no longer in docs/reproductions.md"
    words = shlex.split(more.group(1).replace("\n", " "))
    words = [w.replace("outputs/reproductions", str(out)) for w in words]
    subprocess.run([sys.executable, *words[1:]], cwd=ROOT, env=env, check=True, capture_output=True)
    snippet = documented(page, "Investigation: is the ring's deficit at 64 peers noise?", "python")
    printed = subprocess.run(
        [sys.executable, "-c", snippet], cwd=tmp_path, env=env, check=True, capture_output=True, text=True
    ).stdout
    assert "peer_test_accuracy_mean 0.9427 ± 0.0051 0.9269 ± 0.0053 +0.0158 ± 0.0047, higher on 8 of 8" in printed
    assert "test_accuracy 0.9552 ± 0.0061 0.9476 ± 0.0067 +0.0076 ± 0.0043, higher on 7 of 8" in printed
