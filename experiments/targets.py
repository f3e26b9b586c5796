"""Targets and closed forms that a benchmark and a reproduction both judge a claim by, in one place: both import
them from here (experiments.bench.stragglers and experiments.reproductions.lian2018: a slow peer slows AD-PSGD
only a little, all-reduce to its pace)."""

from __future__ import annotations

ADPSGD_TARGET = 0.75  # AD-PSGD's throughput with one slow peer, of its throughput without, at least
ALLREDUCE_PACE_RANGE = (0.7, 1.05)  # all-reduce's throughput with the slow peer, of the slow peer's pace


def slow_peer_pace(peers: int, batch: int, scale: float, compute_time: float) -> float:
    """All-reduce's ceiling in samples/s (all peers together) with one peer `scale` x slower: every step waits for
    it, and its step takes at least scale x compute_time."""
    return peers * batch / (scale * compute_time)


# Liu et al. 2024 (experiments.reproductions.liu2024 and tests/test_async_local_sgd.py): asynchronous Local-SGD with
# delayed Nesterov and dynamic local updates ends within this many test-accuracy points of synchronous DiLoCo
LIU2024_TOLERANCE = 0.03
