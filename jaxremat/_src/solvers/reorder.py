"""`reorder`: a memory-minimizing topological order (`order.memory_minimizing_order`),
without recomputation. The solver returns that order's schedule, and every other heuristic
accepts it as its input order (``order="reorder"``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxremat._src.errors import NoScheduleFoundError
from jaxremat._src.graph import RematGraph
from jaxremat._src.order import memory_minimizing_order
from jaxremat._src.schedule import Schedule, schedule_from_computes
from jaxremat._src.simulate import simulate


def resolve_order(graph: RematGraph, order: str | Sequence[int] | None) -> tuple[int, ...]:
  """The input order a heuristic runs on: ``None``/``"input"``, ``"reorder"`` or a sequence.

  Raises:
    ValueError: ``order`` is an unknown name or not a topological order of the graph.
  """
  if order is None or order == "input":
    return tuple(graph.order)
  if order == "reorder":
    return memory_minimizing_order(graph)
  if isinstance(order, str):
    raise ValueError(f"order={order!r} is not 'input', 'reorder' or a sequence of node ids.")
  try:
    return dataclasses.replace(graph, order=tuple(int(v) for v in order)).order
  except ValueError as e:
    raise ValueError(f"order= is not a topological order of graph {graph.name!r}: {e}") from None


def solve_reorder(graph: RematGraph, budget_bytes: int, **_) -> Schedule:
  """The memory-minimizing order run once, if its peak fits.

  Without recomputation the duration is the sum of costs: any schedule it returns is
  optimal.

  Raises:
    NoScheduleFoundError: the best order found still peaks over the budget (a better
      order may exist: the search is heuristic).
  """
  graph.require_feasible(budget_bytes)
  order = memory_minimizing_order(graph)
  schedule = schedule_from_computes(graph, order, solver="reorder", budget=budget_bytes)
  peak_bytes = simulate(graph, schedule).peak_bytes
  if peak_bytes > budget_bytes:
    raise NoScheduleFoundError(
      f"solver 'reorder' found no order of graph {graph.name!r} within budget={budget_bytes} "
      f"bytes without recomputation (best peak {peak_bytes} bytes); use a recomputing "
      "solver such as 'auto'."
    )
  duration = sum(graph.cost[v] for v in order)
  return schedule.replace(
    stats={"status": "optimal", "lower_bound": duration, "found_by": "reorder"}
  )
