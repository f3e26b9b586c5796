"""The toolkit's inter-host byte count against what the kernel counted on a test host's link
(experiments.bench.wire_bytes): within 5% once setup, evaluation and TCP/IP headers are set aside."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import testhosts  # noqa: E402

from experiments.bench import wire_bytes  # noqa: E402

pytestmark = [
    pytest.mark.processes,
    pytest.mark.skipif(testhosts.unavailable() is not None, reason=str(testhosts.unavailable())),
]


def test_across_share_of_a_ring_and_of_hierarchical_groups():
    # 4 peers on 2 hosts: peers 2 and 3 each have one neighbour on host 1 and one beside them
    # (hierarchical: one group of 2 per host)
    assert wire_bytes.across_share("ring", 4, 2) == 0.5
    assert wire_bytes.across_share("hierarchical", 4, 2) == 0.5
    assert wire_bytes.across_share("complete", 4, 2) == pytest.approx(2 / 3)


@pytest.mark.slow  # soak: make test keeps the flat topologies' wire bytes
def test_wire_bytes_match_the_toolkit_count_on_hierarchical(tmp_path):
    with testhosts.TestHosts(2) as hosts:
        row = wire_bytes.measure("torch", "hierarchical", (1, 2), hosts, tmp_path)
    assert row["steps"] > 0 and row["packets"] > 0, row
    assert row["ratio"] == pytest.approx(1.0, abs=0.05), row
