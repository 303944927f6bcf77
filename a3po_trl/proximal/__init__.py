"""The anchor of decoupled PPO: the proximal methods and their table (:mod:`.methods`), the one object the loss asks
for a micro-batch's anchor (:mod:`.anchor`), ``guarded``'s checks (:mod:`.guard`) against the previous version's
weights (:mod:`.previous_weights`), and the recomputed anchor kept with a checkpoint (:mod:`.recomputed_anchor`)."""

from .anchor import Anchor, ProximalAnchor
from .methods import PROXIMAL_METHOD_TABLE, ProximalMethod, batch_method, needs_recompute_forward

__all__ = [
    "PROXIMAL_METHOD_TABLE",
    "Anchor",
    "ProximalAnchor",
    "ProximalMethod",
    "batch_method",
    "needs_recompute_forward",
]
