"""`noremat`: the input order once, each value freed after its last reader."""

from __future__ import annotations

from jaxremat._src.errors import NoScheduleFoundError
from jaxremat._src.graph import RematGraph
from jaxremat._src.schedule import Schedule
from jaxremat._src.simulate import baseline_schedule, simulate


def solve_noremat(graph: RematGraph, budget_bytes: int, **_) -> Schedule:
  """The baseline schedule, if it fits.

  Raises:
    InfeasibleBudgetError: ``budget_bytes`` is below ``graph.min_feasible_bytes``, a
      bound on every schedule (`RematGraph.require_feasible`).
    NoScheduleFoundError: the baseline peak is over budget. That is the least peak of
      this one schedule only: recomputation or another order may fit.
  """
  graph.require_feasible(budget_bytes)
  schedule = baseline_schedule(graph)
  peak = simulate(graph, schedule).peak_bytes
  if peak > budget_bytes:
    raise NoScheduleFoundError(
      f"solver 'noremat' found no schedule of graph {graph.name!r} within budget="
      f"{budget_bytes} bytes: the input order without recomputation peaks at {peak} bytes. "
      "That is one schedule, not a bound on all of them; a recomputing or reordering "
      "solver ('auto', 'reorder') may fit, or raise the budget to at least that peak."
    )
  stats = {
    "status": "optimal",
    "lower_bound": sum(graph.cost[v] for v in graph.order),
    "found_by": "noremat",
  }
  return schedule.replace(stats=stats)
