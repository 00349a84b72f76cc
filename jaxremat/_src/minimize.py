"""`minimize_peak`: the smallest peak a solver reaches, optionally under a duration cap.

This is the objective of Kumar et al. (least memory for a given length) where `solve`
has the dual one (least duration for a given memory): a bisection over the budget,
between the proven lower bound and the baseline peak, that keeps the lowest-peak
schedule found within the duration cap.
"""

from __future__ import annotations

import time
from typing import Any

from jaxremat._src.errors import InfeasibleBudgetError, NoScheduleFoundError
from jaxremat._src.graph import RematGraph
from jaxremat._src.schedule import Schedule
from jaxremat._src.simulate import baseline_schedule, simulate
from jaxremat._src.solve import solve


def minimize_peak(
  graph: RematGraph,
  solver: str = "auto",
  *,
  max_duration: float | None = None,
  time_limit: float = 60.0,
  tolerance_bytes: int | None = None,
  **options: Any,
) -> Schedule:
  """The lowest-peak schedule ``solver`` finds whose duration is at most ``max_duration``.

  Args:
    graph: the graph.
    solver: a name from `available_solvers()`; heuristics make each probe fast.
    max_duration: the longest acceptable duration (``None``: no cap). The baseline
      duration (no recomputation) is the least possible.
    time_limit: wall seconds for the whole search; each probe gets an eighth of it.
    tolerance_bytes: stop when the bracket is this narrow (default 0.1% of the baseline
      peak).
    **options: passed to the solver.

  Returns:
    The schedule with the lowest peak found; ``stats`` as `solve` fills them, plus
    ``min_peak_lower_bytes`` (the largest budget the search saw fail, plus one: the
    answer is exact for this solver when it equals ``peak_bytes``) and ``probes``.

  Raises:
    ValueError: ``max_duration`` is below the baseline duration (nothing can meet it).

  Example:
    >>> import jaxremat
    >>> g = jaxremat.RematGraph.build(mem=[4, 4, 4, 4], cost=[1, 1, 1, 1],
    ...                               edges=[(0, 1), (1, 2), (2, 3), (0, 3)])
    >>> jaxremat.minimize_peak(g, "xla-greedy", time_limit=5).stats["peak_bytes"]
    12
  """
  start = time.perf_counter()
  baseline = simulate(graph, baseline_schedule(graph))
  if max_duration is not None and max_duration < baseline.duration:
    raise ValueError(
      f"max_duration={max_duration!r} is below the baseline duration {baseline.duration!r}, "
      "the least any schedule can take; raise it or pass None."
    )
  tolerance = (
    tolerance_bytes if tolerance_bytes is not None else max(1, baseline.peak_bytes // 1000)
  )
  probe_s = max(time_limit / 8, 0.5)
  # Where effects run once, solvers plan on the graph that holds their outputs throughout
  # (`RematGraph.with_pinned_effects`), whose baseline may peak above this one's.
  planned = graph.with_pinned_effects() if graph.compute_once_nodes else graph
  start_bytes = simulate(planned, baseline_schedule(planned)).peak_bytes
  best = solve(graph, start_bytes, "noremat", time_limit=probe_s)
  lo, hi = graph.min_feasible_bytes, best.stats["peak_bytes"] - 1  # the answer: [lo, best]
  probes = 0
  while lo <= hi and hi - lo >= tolerance:
    left = time_limit - (time.perf_counter() - start)
    if left <= 0:
      break
    mid = (lo + hi) // 2
    probes += 1
    try:
      schedule = solve(graph, mid, solver, time_limit=min(probe_s, left), **options)
    except (NoScheduleFoundError, InfeasibleBudgetError):
      lo = mid + 1
      continue
    if max_duration is not None and schedule.stats["duration"] > max_duration:
      lo = mid + 1
      continue
    if schedule.stats["peak_bytes"] < best.stats["peak_bytes"]:
      best = schedule
    hi = min(mid, schedule.stats["peak_bytes"]) - 1
  stats = {**best.stats, "min_peak_lower_bytes": lo, "probes": probes}
  return best.replace(stats=stats)
