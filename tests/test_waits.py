"""How a peer waits (dpsgd.comm.pending.poll_until) on a fake clock: a collective's first milliseconds are tested
without sleeping (MPICH moves a non-blocking operation only inside a test: sleeps between tests made a 1 MiB
all-reduce several times slower), later tests sleep, a long wait on the main thread yields again instead of
sleeping (each wake-up preempts a computing peer), and a deadline ends the wait with the peers named."""

from __future__ import annotations

import threading
import types

import pytest

from dpsgd.comm import PeerTimeoutError, mpi, pending


class Clock:
    """time.monotonic advancing 1 us a read, and time.sleep recording each sleep (and advancing the clock by it)."""

    def __init__(self):
        self.now, self.sleeps, self.slept_at = 0.0, [], []

    def monotonic(self) -> float:
        self.now += 1e-6
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.slept_at.append(self.now)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(pending, "time", types.SimpleNamespace(monotonic=c.monotonic, sleep=c.sleep))
    monkeypatch.setattr(pending, "_communication_threads", [])  # none left over from another test
    return c


def ready_after(polls: int):
    count = [0]

    def test() -> bool:
        count[0] += 1
        return count[0] > polls

    return test, count


def test_a_wait_spins_for_its_first_spin_s_then_sleeps_between_tests(clock):
    test, count = ready_after(100)  # about 200 us of the fake clock
    assert pending.poll_until(test, deadline=1.0, spin_s=2e-3) and count[0] == 101 and clock.sleeps == []
    test, count = ready_after(50)  # about 1 ms of sleeps: short of YIELD_FROM_S
    assert pending.poll_until(test, deadline=clock.now + 1.0, spin_s=0.0) and len(clock.sleeps) == 50
    assert all(pending._POLL_MIN_S <= s <= pending._POLL_MAX_S for s in clock.sleeps)


def test_a_long_wait_on_the_main_thread_yields_then_sleeps_again(clock):
    """From YIELD_FROM_S to YIELD_UNTIL_S the main thread tests without sleeping; past that (a straggler, a dead peer)
    it sleeps 1 ms between tests again, up to the deadline."""
    test, _ = ready_after(10**9)
    with pytest.raises(PeerTimeoutError):
        pending.poll_until(test, deadline=1.0)
    begun = list(zip(clock.slept_at, clock.sleeps))
    assert begun and all(not pending.YIELD_FROM_S < t < pending.YIELD_UNTIL_S for t, _ in begun), begun[:5]
    early = sum(s for t, s in begun if t <= pending.YIELD_FROM_S)
    assert 0 < early <= pending.YIELD_FROM_S + pending._POLL_MAX_S
    late = [s for t, s in begun if t >= pending.YIELD_UNTIL_S]
    assert late and all(s == pending._POLL_MAX_S for s in late) and sum(late) > 0.8


def sleeps_of_a_long_wait(clock) -> float:
    test, _ = ready_after(5000)
    pending.poll_until(test, deadline=clock.now + 10.0)
    return sum(clock.sleeps)


def test_a_long_wait_keeps_sleeping_beside_a_communication_thread(clock):
    """A thread that spins holds the interpreter lock: beside a registered communication thread (or off the main
    thread, as the local backend's peers wait) the whole wait sleeps between its tests."""
    release = threading.Event()
    thread = pending.communication_thread(threading.Thread(target=release.wait, daemon=True))
    thread.start()
    try:
        assert sleeps_of_a_long_wait(clock) > 100 * pending.YIELD_FROM_S
    finally:
        release.set()
        thread.join()
    clock.sleeps.clear()
    assert sleeps_of_a_long_wait(clock) <= pending.YIELD_FROM_S + pending._POLL_MAX_S  # the thread has ended

    slept = []
    worker = threading.Thread(target=lambda: slept.append(sleeps_of_a_long_wait(clock)))
    clock.sleeps.clear()
    worker.start()
    worker.join()
    assert slept[0] > 100 * pending.YIELD_FROM_S


def test_a_wait_whose_test_starts_a_communication_thread_sleeps_from_then_on(clock):
    """gloo's requests start their waiter thread in their first test(): from then on the wait must sleep."""
    release = threading.Event()
    test, count = ready_after(10**4)

    class Message(pending.Request):
        def test(self) -> bool:
            if count[0] == 0:
                pending.communication_thread(threading.Thread(target=release.wait, daemon=True)).start()
            return test()

    try:
        Message().wait(deadline=clock.now + 100.0)
    finally:
        release.set()
    assert count[0] == 10**4 + 1 and len(clock.sleeps) == 10**4


def test_one_message_waited_for_on_the_main_thread_yields_from_the_start(clock):
    """A Request (a control message, a peer's answer) is not a transfer that sleeping polls would move sooner: a
    10 ms wait for one never sleeps."""
    test, count = ready_after(10**4)

    class Message(pending.Request):
        def test(self) -> bool:
            return test()

    Message().wait(deadline=clock.now + 10.0)
    assert count[0] == 10**4 + 1 and clock.sleeps == []


def test_the_mpi_backends_collective_waits_spin(clock):
    """The MPI backend's exchanges and all-reduces wait through poll_until with SPIN_S: a collective done after 1,000
    tests (about 2 ms of this clock) never slept."""
    test, count = ready_after(1000)
    fake_mpi = types.SimpleNamespace(Request=types.SimpleNamespace(Testall=lambda requests: test()), Exception=OSError)
    mpi._Requests(fake_mpi, [object()], [-1]).wait(deadline=10.0)
    assert count[0] == 1001 and clock.sleeps == [], f"slept {len(clock.sleeps)} times (SPIN_S = {mpi.SPIN_S})"


def test_a_wait_past_its_deadline_names_the_peers_outstanding(clock):
    test, _ = ready_after(10**9)
    with pytest.raises(PeerTimeoutError, match=r"peers \[2, 3\] did not answer"):
        pending.poll_until(test, deadline=0.05, outstanding=lambda: [2, 3], spin_s=2e-3)
