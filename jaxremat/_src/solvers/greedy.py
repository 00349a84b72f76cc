"""`xla-greedy`: XLA's greedy rematerialization on a fixed order.

Walk the order; whenever the next compute would exceed the limit, evict live values
(those whose recomputation saves the most memory per unit of recompute cost) and
recompute them just before their next reader.

References:
  Kumar et al., "Efficient Rematerialization for Deep Networks", NeurIPS 2019, sec. 5
  (the XLA baseline); XLA ``HloRematerialization`` (xla/service/hlo_rematerialization.cc).
  Kirisame et al., "Dynamic Tensor Rematerialization", ICLR 2021 (staleness in the score).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from jaxremat._src.graph import RematGraph
from jaxremat._src.schedule import Schedule
from jaxremat._src.simulate import SimulationResult
from jaxremat._src.solvers.reorder import resolve_order
from jaxremat._src.solvers.replay import Replay, SequenceTooLongError, evaluate, pick_best

# Internal limits tried below the budget: eviction tracks an upper bound on memory, and
# a tighter limit sometimes yields a shorter schedule within the real budget.
_LIMIT_FRACTIONS = (1.0, 0.98, 0.95, 0.9)
# Seconds spent deleting needless recomputations from the winner (`prune_recomputes`).
_PRUNE_S = 10.0


def greedy_computes(
  graph: RematGraph, order: Sequence[int], limit_bytes: int, deadline: float | None = None
) -> list[int]:
  """The compute sequence of greedy eviction along ``order`` under ``limit_bytes``.

  Raises:
    SequenceTooLongError: past 5 computes per node (the eviction is thrashing) or past
      ``deadline`` (a `time.perf_counter()` value).
  """
  replay = Replay(
    graph, order, budget_bytes=limit_bytes, max_computes=5 * graph.n, deadline=deadline
  )
  preds = graph.compute_preds
  for t, v in enumerate(order):
    replay.now = t
    start = len(replay.computes)
    replay.ensure(v)
    fresh = replay.computes[start:]
    # Recomputations read predecessors kept alive for them: those may be dead now too.
    replay.drop_dead([*fresh, *(p for u in fresh for p in preds[u])])
  return replay.finish()


def greedy_candidates(
  graph: RematGraph,
  budget_bytes: int,
  orders: Sequence[Sequence[int]],
  solver: str,
  deadline: float | None = None,
) -> list[tuple[Schedule, SimulationResult]]:
  candidates = []
  for order in orders:
    for fraction in _LIMIT_FRACTIONS:
      limit = max(int(budget_bytes * fraction), graph.min_feasible_bytes)
      try:
        computes = greedy_computes(graph, order, limit, deadline)
      except SequenceTooLongError:
        break  # thrashing: a tighter limit would thrash more
      candidates.append(evaluate(graph, computes, solver=solver))
      if candidates[-1][1].peak_bytes <= budget_bytes:
        break
  return candidates


def solve_xla_greedy(
  graph: RematGraph,
  budget_bytes: int,
  *,
  time_limit_s: float = 60.0,
  order: str | Sequence[int] | None = None,
  **_,
) -> Schedule:
  """Greedy eviction on the input order (and on the memory-minimizing order).

  Args:
    graph: the graph.
    budget_bytes: the memory budget.
    time_limit_s: stop evicting after this long (candidates finished so far count);
      pruning recomputations of the winner then takes at most 10 s more of it.
    order: ``None`` tries the input order and `reorder`'s; ``"input"``, ``"reorder"`` or a
      node sequence fixes one.

  Raises:
    NoScheduleFoundError: eviction could not bring the peak within the budget.
  """
  graph.require_feasible(budget_bytes)
  if order is None:
    orders = list(dict.fromkeys([tuple(graph.order), resolve_order(graph, "reorder")]))
  else:
    orders = [resolve_order(graph, order)]
  deadline = time.perf_counter() + time_limit_s
  candidates = greedy_candidates(graph, budget_bytes, orders, "xla-greedy", deadline)
  prune_deadline = min(deadline, time.perf_counter() + _PRUNE_S)
  return pick_best(
    candidates, budget_bytes, "xla-greedy", "greedy eviction", graph=graph, deadline=prune_deadline
  )
