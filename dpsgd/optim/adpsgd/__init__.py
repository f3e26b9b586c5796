"""AD-PSGD (Lian, Zhang, Zhang, Liu, ICML 2018): asynchronous decentralized SGD, no global step. Each
peer steps at its own pace on a snapshot of its parameters (`optimizer`) while a communication thread
averages them atomically with one neighbour at a time (`averaging`), until the run's budget of steps,
samples or seconds is spent (`budget`)."""

from .averaging import HEADER, choose_partner, partner_rng, roles
from .budget import BUDGETS, check_budget
from .optimizer import ADPSGD

__all__ = ["ADPSGD", "BUDGETS", "HEADER", "check_budget", "choose_partner", "partner_rng", "roles"]
