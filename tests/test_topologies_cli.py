"""`python -m topologies`: show, compare, plot and errors, run as a user would (subprocess)."""

import subprocess
import sys
import time

import pytest

from topologies.cli import main


def run(*args):
    cmd = [sys.executable, "-m", "topologies", *args]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60)


def test_compare_table_is_fast_and_matches_closed_forms():
    start = time.perf_counter()
    out = run("compare", "ring", "torus", "exponential", "one_peer_exponential", "base_k", "--n", "16", "32", "64")
    elapsed = time.perf_counter() - start
    assert out.returncode == 0, out.stderr
    assert elapsed < 5
    rows = {(r.split()[0], int(r.split()[1])): r.split() for r in out.stdout.splitlines()[2:] if r.strip()}
    assert len(rows) == 15
    assert float(rows["ring", 16][4]) == pytest.approx(0.05075, abs=1e-5)  # (2/3)(1 - cos(2 pi / 16))
    assert float(rows["torus", 16][4]) == pytest.approx(0.4)  # (2/5)(1 - cos(2 pi / 4))
    assert float(rows["torus", 64][4]) == pytest.approx(0.1172, abs=1e-4)
    assert rows["one_peer_exponential", 64][2:] == ["1", "6", "1", "6", "6"]
    assert rows["base_k", 32][6] == "5"


def test_show_with_options_and_plot(tmp_path):
    png = tmp_path / "torus.png"
    out = run("show", "torus", "--n", "12", "--rows", "3", "--plot", str(png))
    assert out.returncode == 0, out.stderr
    assert "rows=3, cols=4" in out.stdout and "spectral gap" in out.stdout and "consensus steps" in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_show_and_list_in_process(capsys, tmp_path):
    assert main(["show", "base_k", "--n", "10", "--k=2"]) == 0
    text = capsys.readouterr().out
    assert "k=2" in text and "exact averaging  after" in text
    assert main(["show", "random_matching", "--n", "6", "--plot", str(tmp_path / "m.png")]) == 0
    assert "random schedule" in capsys.readouterr().out
    assert main(["list"]) == 0
    assert "one_peer_exponential" in capsys.readouterr().out


def test_errors_exit_2_with_one_line(capsys):
    assert main(["show", "hypercube", "--n", "6"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: hypercube needs n a power of 2")
    assert main(["show", "ring", "--n", "6", "--colour", "red"]) == 2
    assert "unknown option(s) colour" in capsys.readouterr().err
    assert main(["compare", "ring", "hypercube", "--n", "6"]) == 0
    assert "hypercube n=6: hypercube needs n a power of 2" in capsys.readouterr().out


def test_import_is_pure_numpy():
    code = (
        "import sys, topologies; topologies.make('ring', 4); "
        "heavy = {'torch', 'mpi4py', 'networkx', 'matplotlib'} & set(sys.modules); assert not heavy, heavy"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
