"""The ying2021 and koloskova2019 reproductions: their byte formulas against the toolkit's graphs and compressors,
their verdict rules on hand-made configurations, and (slow) each command end to end at a tiny scale."""

import json
import math
from pathlib import Path

import pytest
import torch

import topologies
from dpsgd.comm import codecs
from experiments import reproduce
from experiments.report import load_runs
from experiments.reproduce import Configuration, find
from experiments.reproductions import koloskova2019, ying2021
from experiments.reproductions._verdicts import compare, overall, paired
from topologies.analysis import degree


def config(setting: dict, mean: float, ci: float | None = None, **summary) -> Configuration:
    summary = {"test_accuracy": mean, **summary}
    if ci is not None:
        summary["test_accuracy_ci95"] = ci
    return Configuration(setting, summary, [])


def test_compare_says_which_interval_lies_above():
    assert compare(config({}, 0.90, 0.01), config({}, 0.85, 0.01), "test_accuracy") == 1
    assert compare(config({}, 0.85, 0.01), config({}, 0.90, 0.01), "test_accuracy") == -1
    assert compare(config({}, 0.90, 0.03), config({}, 0.85, 0.03), "test_accuracy") == 0  # they overlap
    assert compare(config({}, 0.90), config({}, 0.90), "test_accuracy") == 0  # one seed: equal means
    assert compare(config({}, 0.90), config({}, 0.89), "test_accuracy") == 1


def test_overall_is_partly_when_some_parts_hold():
    assert overall([True, True]) is True
    assert overall([False, False]) is False
    assert overall([True, False]) is None


def test_paired_differences_match_seeds_not_order():
    def runs(values):
        return [{"summary": {"seed": seed, "test_accuracy": v}} for seed, v in values]

    a = Configuration({}, {}, runs([(2, 0.93), (0, 0.91), (1, 0.95), (5, 0.5)]))
    b = Configuration({}, {}, runs([(0, 0.90), (1, 0.92), (2, 0.94)]))
    mean, ci, higher, count = paired(a, b, "test_accuracy")  # differences 0.01, 0.03, -0.01 (seed 5 unpaired)
    assert (higher, count) == (2, 3) and math.isclose(mean, 0.01)
    assert math.isclose(ci, 4.302652729911275 * 0.02 / math.sqrt(3))  # t(0.975, 2) * sd / sqrt(3)
    with pytest.raises(LookupError, match="no seed in common"):
        paired(a, Configuration({}, {}, runs([(9, 0.9)])), "test_accuracy")


@pytest.mark.parametrize("n", [8, 32, 64])
def test_one_peer_byte_ratios_match_the_graphs_message_counts(n):
    paper, undirected = ying2021.expected_byte_ratios(n)
    one_peer = degree(topologies.make("one_peer_exponential", n))
    assert one_peer == 1
    assert math.isclose(paper, one_peer / degree(topologies.make("directed_exponential", n)))
    assert math.isclose(undirected, one_peer / degree(topologies.make("exponential", n)))


def test_ying_findings_read_the_intervals():
    configs = [
        config({"topology": "ring"}, 0.80, 0.01),
        config({"topology": "exponential"}, 0.90, 0.01),
        config({"topology": "directed_exponential"}, 0.91, 0.01),
        config({"topology": "one_peer_exponential"}, 0.905, 0.01),
    ]
    assert ying2021.findings(configs, "test_accuracy") == (True, True, True)
    configs[0] = config({"topology": "ring"}, 0.89, 0.02)
    configs[1] = config({"topology": "exponential"}, 0.95, 0.01)
    assert ying2021.findings(configs, "test_accuracy") == (True, False, False)


@pytest.mark.parametrize("numel", [50, 300, 4810, 50890, 200_000])
@pytest.mark.parametrize("name", ["top_k", "sign"])
def test_choco_byte_formula_matches_the_encoded_messages(name, numel):
    compressor = codecs.make(name, ratio=0.01 if name == "top_k" else None)
    message = compressor.encode(torch.randn(numel))
    assert math.isclose(koloskova2019.expected_byte_ratio(name, numel), message.numel() / (4 * numel))


def test_model_entries_from_exact_gossip_bytes():
    exact = Configuration({}, {"mb_sent_per_peer": 150 * 2 * 4810 * 4 / 1e6, "steps": 150}, [])
    assert koloskova2019.model_entries(exact) == 4810


def test_steps_to_reach_follows_the_mean_curve():
    def run(accuracies):
        return {
            "metrics": [
                {"step": 10 * (i + 1), "test_accuracy": a, "mb_sent_per_peer": i + 1.0}
                for i, a in enumerate(accuracies)
            ]
        }

    long = Configuration({}, {}, [run([0.5, 0.7, 0.9]), run([0.6, 0.9, 0.9])])
    assert koloskova2019.steps_to_reach(long, "test_accuracy", 0.8) == (20, 2.0)  # mean 0.55, 0.8, 0.9
    assert koloskova2019.steps_to_reach(long, "test_accuracy", 0.95) is None


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["ying2021", "koloskova2019"])
def test_reproduction_runs_end_to_end(name, tmp_path, capsys):
    out = tmp_path / name
    assert reproduce.main([name, "--seeds", "2", "--out", str(out), "epochs=1"]) == 0
    result = json.loads((out / "result.json").read_text())
    module = {"ying2021": ying2021, "koloskova2019": koloskova2019}[name]
    assert result["seeds"] == 2 and result["runs"] == 2 * sum(module.RUNS.values())
    assert result["holds"] is recomputed_holds(name, out) and result["verdict"]
    assert result["plots"] and all(Path(p).stat().st_size > 0 for p in result["plots"])
    table = (out / "result.md").read_text()
    if name == "ying2021":  # the measured byte ratio one-peer / the paper's static graph: 1/log2(n)
        assert "0.200 of the directed static graph's" in table and "0.167 of the directed static graph's" in table
    else:  # 4810 entries: top-1% packs 49 float32 values and uint16 positions, sign 4 bytes + 602 bytes of bits
        assert "0.0153 (0.0153)" in table and "0.0315 (0.0315)" in table


def recomputed_holds(name: str, out: Path) -> bool | None:
    """The claim's parts computed here from the runs read back from the sweep folders (ying2021: the byte ratio to
    the directed static graph is 1/log2 n, one-peer's accuracy matches the static graphs' and beats the ring's, for
    both metrics; koloskova2019: each compressor's best gamma reaches exact gossip's accuracy with under 0.1 of its
    bytes), and the claim holds, partly holds or does not as all, some or none of them do."""

    def read(sweep):
        return reproduce.configurations(load_runs(out / sweep))

    parts = []
    if name == "ying2021":
        for sweep in ying2021.SWEEPS:
            runs = read(sweep)
            mb = {
                t: find(runs, topology=t).mean("mb_sent_per_peer")
                for t in ("one_peer_exponential", "directed_exponential")
            }
            n = int(runs[0].summary["peers"])
            parts.append(
                math.isclose(mb["one_peer_exponential"] / mb["directed_exponential"], 1 / math.log2(n), rel_tol=0.01)
            )
            parts += [p for key, _ in ying2021.METRICS for p in ying2021.findings(runs, key)]
        return overall(parts)
    (exact,) = read("exact")
    for sweep in ("top_k", "sign"):
        configs = read(sweep)
        parts += [compare(max(configs, key=lambda c: c.mean(k)), exact, k) >= 0 for k, _ in koloskova2019.METRICS]
        parts.append(configs[0].mean("mb_sent_per_peer") / exact.mean("mb_sent_per_peer") < 0.1)
    return overall(parts)
