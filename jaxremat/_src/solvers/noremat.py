"""`noremat`: the input order once, each value freed after its last reader."""

from __future__ import annotations

from jaxremat._src.errors import InfeasibleBudgetError
from jaxremat._src.graph import RematGraph
from jaxremat._src.schedule import Schedule
from jaxremat._src.simulate import baseline_schedule, simulate


def solve_noremat(graph: RematGraph, budget_bytes: int, **_) -> Schedule:
  """The baseline schedule, if it fits.

  Raises:
    InfeasibleBudgetError: the baseline peak is over budget; without recomputation or
      reordering that peak is the least this solver can do.
  """
  schedule = baseline_schedule(graph)
  peak = simulate(graph, schedule).peak_bytes
  if peak > budget_bytes:
    raise InfeasibleBudgetError(budget_bytes, peak, "the no-remat peak of the input order")
  return schedule.replace(
    stats={"status": "optimal", "lower_bound": sum(graph.cost[v] for v in graph.order)}
  )
