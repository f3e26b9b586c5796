"""What the trainer integrations refuse before any peer starts, in one line each: a setting that would otherwise
be dropped without a word (a DDP-only keyword of the Lightning strategy, topology/options beside an Algorithm) and a
misspelt algorithm option (else a TypeError once the trainer prepares). In process: nothing is launched."""

from __future__ import annotations

import pytest

from dpsgd.integrations import Algorithm, resolve

lightning = pytest.importorskip("dpsgd.integrations.lightning", reason="the lightning extra")


@pytest.mark.parametrize("keyword", [{"timeout_s": 7}, {"bogus": 1}])
def test_the_lightning_strategy_refuses_what_only_ddp_would_read(keyword):
    with pytest.raises(ValueError, match=f"got {next(iter(keyword))}, which only DDP would read") as info:
        lightning.DecentralizedStrategy("dpsgd", **keyword)
    assert "Algorithm(name, timeout_s=...)" in str(info.value) and "\n" not in str(info.value)


def test_the_lightning_strategy_keeps_ddp_strategys_own_keywords_and_the_algorithms_timeout():
    strategy = lightning.DecentralizedStrategy(Algorithm("diloco", options={"period": 3}, timeout_s=42))
    assert strategy.algorithm.timeout_s == 42 and strategy._timeout.total_seconds() == 42
    assert lightning.DecentralizedStrategy("dpsgd", process_group_backend="gloo").algorithm.name == "dpsgd"


@pytest.mark.parametrize("choice", [Algorithm("diloco"), lambda base, comm: base])
def test_topology_and_options_beside_an_algorithm_or_a_factory_are_refused(choice):
    with pytest.raises(ValueError, match="go with an algorithm given by name"):
        resolve(choice, "a test", topology="torus")
    with pytest.raises(ValueError, match="go with an algorithm given by name"):
        resolve(choice, "a test", options={"period": 3})


def test_a_misspelt_option_is_refused_by_name_with_the_algorithms_options():
    with pytest.raises(ValueError, match=r"algorithm diloco takes no option 'perod'; its options: period,"):
        resolve("diloco", "a test", options={"perod": 3})
    assert resolve("diloco", "a test", options={"period": 3}).options == {"period": 3}
