"""The seeds every random stream of a run derives from the run's `seed` and a peer's rank, defined
once: a real peer, the fleet and the event simulator must draw the same numbers."""

from __future__ import annotations


def batch_seed(seed: int, rank: int) -> int:
    """Peer `rank`'s shuffling of its data share."""
    return seed * 1000 + rank + 1


def augment_seed(shuffle_seed: int, position: int) -> int:
    """The random crops and flips (data.augment) of minibatch number `position` of the peer whose shuffling seed is
    `shuffle_seed` (batch_seed)."""
    return shuffle_seed * 1_000_033 + position


def reshuffle_seed(seed: int, rank: int, step: int) -> int:
    """Peer `rank`'s shuffling of its new data share after an elastic world re-formed at `step`."""
    return batch_seed(seed, rank) * 1_000_003 + step


def partner_seed(seed: int, rank: int) -> int:
    """An AD-PSGD active peer's draws of averaging partners."""
    return seed * 7919 + rank


def link_jitter_seed(seed: int, rank: int) -> int:
    """The emulated network's jitter on peer `rank`'s messages (dpsgd.comm.netem)."""
    return seed * 7919 + rank


def protocol_jitter_seed(seed: int, rank: int) -> int:
    """Random delays injected into AD-PSGD's protocol (tests)."""
    return seed * 104729 + rank + 1


def message_loss_seed(seed: int, rank: int) -> int:
    """Which of peer `rank`'s messages an injected fault loses (dpsgd.faults)."""
    return seed * 100_003 + rank
