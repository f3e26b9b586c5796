"""Soak: long runs leak nothing. 16 peers on `local` for 20k steps and 8 MPI processes for 2k steps:
resident memory stays flat after warm-up (under 10% growth), no thread or file descriptor is left
behind, and every message sent was received. Slow: `make soak` runs these, `make test` does not."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from dpsgd.backends import spawn
from dpsgd.comm import run_local
from tests.peers.soak_peer import open_fds, soak

PEER_SCRIPT = str(Path(__file__).resolve().parent / "peers" / "soak_peer.py")
LOCAL_PEERS, LOCAL_STEPS = 16, int(os.environ.get("SOAK_LOCAL_STEPS", 20_000))
MPI_PEERS, MPI_STEPS = 8, int(os.environ.get("SOAK_MPI_STEPS", 2_000))
MAX_GROWTH = 0.10


def check(results: list[dict]) -> None:
    for r in results:
        growth = r["rss_end_kib"] / r["rss_warm_kib"] - 1
        assert growth < MAX_GROWTH, (r["rank"], r["rss_warm_kib"], r["rss_end_kib"])
        assert r["threads_after"] == r["threads_before"], r
        assert r["unmatched_messages"] == 0, r
    total = results[0]
    assert total["bytes_sent_total"] == total["bytes_received_total"] > 0
    peers = len(results)
    assert total["messages_sent_total"] == 2 * peers * total["steps"]  # a ring: two neighbours a step


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_soak_local_16_peers(capsys):
    torch.set_num_threads(1)
    threads, fds, start = threading.active_count(), open_fds(), time.monotonic()
    results = run_local(LOCAL_PEERS, soak, LOCAL_STEPS, timeout_s=60)
    seconds = time.monotonic() - start
    r = results[0]  # the peers are threads: rank 0's measurements are the process's
    with capsys.disabled():
        print(
            f"\nsoak local: {LOCAL_PEERS} peers x {LOCAL_STEPS} steps in {seconds:.0f} s; RSS "
            f"{r['rss_warm_kib'] / 1024:.1f} MiB after warm-up ({r['warmup_steps']} steps) -> "
            f"{r['rss_end_kib'] / 1024:.1f} MiB ({100 * (r['rss_end_kib'] / r['rss_warm_kib'] - 1):+.2f}%); "
            f"threads {threads} -> {threading.active_count()}; fds {fds} -> {open_fds()}; "
            f"messages {r['messages_sent_total']}, unmatched {sum(x['unmatched_messages'] for x in results)}"
        )
    check(results)
    assert threading.active_count() == threads and open_fds() == fds


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_soak_mpi_8_processes(tmp_path, capsys):
    start = time.monotonic()
    assert spawn("mpi", MPI_PEERS, [PEER_SCRIPT, "mpi", str(tmp_path), str(MPI_STEPS)], timeout_s=1700) == 0
    seconds = time.monotonic() - start
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(MPI_PEERS)]
    growth = [100 * (r["rss_end_kib"] / r["rss_warm_kib"] - 1) for r in results]
    with capsys.disabled():
        print(
            f"\nsoak mpi: {MPI_PEERS} processes x {MPI_STEPS} steps in {seconds:.0f} s; RSS growth after warm-up "
            f"per rank {min(growth):+.2f}% .. {max(growth):+.2f}% (rank 0 {results[0]['rss_warm_kib'] / 1024:.1f} "
            f"-> {results[0]['rss_end_kib'] / 1024:.1f} MiB); threads "
            f"{results[0]['threads_before']} -> {results[0]['threads_after']}; fds per rank "
            f"{[r['fds_before'] for r in results]} -> {[r['fds_after'] for r in results]}; messages "
            f"{results[0]['messages_sent_total']}, unmatched {sum(r['unmatched_messages'] for r in results)}"
        )
    check(results)
    for r in results:
        assert r["fds_after"] == r["fds_before"], r
