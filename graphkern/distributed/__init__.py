"""Tensor-parallel models across processes: trace, wrap, compile and debug every rank.

graphkern runs on MLX's own distributed engine (``mx.distributed``: the ring backend over TCP,
MPI, NCCL) and mlx-lm's ``model.shard(group)``:

- tracing stands in every collective (``all_sum``, ``all_gather``, ``all_max``, ``all_min``,
  ``sum_scatter``, ``send``, ``recv``) and a sharded layer's ``sum_gradients``, which MLX's export
  cannot record, by a ``collective`` node carrying op, reduction, group size, rank, shapes and
  scope; compiled runs use the real collectives (:mod:`.collectives`);
- before a new signature runs, the ranks agree in one small collective: a failed node or differing
  collective sequences raise :class:`GroupError` on every rank, naming the rank, node and status
  or the first differing collective, and the group stays usable (:mod:`.agreement`);
- ``timeout=`` on ``gk.compile`` / ``gk.wrap`` arms a watchdog: a call stuck in its collectives
  becomes :class:`CollectiveTimeout` on every rank, with the last calls each rank entered
  (:mod:`.watchdog`);
- :func:`gather` and :func:`merge` make one graph of the whole job, a lane per rank, collectives
  linked across ranks (``graphkern show rank0.json rank1.json --html job.html``).

In a single process ``mx.distributed.init()`` is a group of one, where all of this runs as well:

>>> import mlx.core as mx, graphkern as gk
>>> g = gk.trace(lambda x: mx.distributed.all_sum(x) * 2, mx.ones((2,)))
>>> [(g.node(n)["op"], g.node(n)["group_size"]) for n in g.nodes("collective")]
[('all_sum', 1)]
"""

from __future__ import annotations

from .agreement import GroupError
from .launcher import RankRun, run_ranks
from .ranks import gather, merge
from .watchdog import CollectiveTimeout, JobAborted

__all__ = ["CollectiveTimeout", "GroupError", "JobAborted", "RankRun", "gather", "merge", "run_ranks"]
