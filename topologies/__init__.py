"""Gossip topologies for decentralized SGD: graphs, mixing weights, time-varying schedules, analysis.

Pure numpy/scipy (networkx and matplotlib only inside the functions that draw or convert):

    topo = topologies.make("one_peer_exponential", 16)
    W = topo.mixing_matrix(step)          # row i: the weights peer i gives to what it receives
    nb = topo.neighbors(rank, step)       # nb.recv, nb.send, nb.self_weight
    topologies.analysis.describe(topo)    # spectral gap, consensus steps, exactness, degree
"""

from . import analysis, weights
from .base import Neighbors, Topology
from .custom import from_matrix, from_networkx
from .registry import make, names, options_of

__all__ = [
    "Neighbors",
    "Topology",
    "analysis",
    "from_matrix",
    "from_networkx",
    "make",
    "names",
    "options_of",
    "weights",
]
