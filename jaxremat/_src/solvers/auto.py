"""`auto`: a portfolio of the fast bound, the heuristics and an exact solver.

1. Bounds: below ``graph.min_feasible_bytes`` nothing fits; the sum of costs bounds the
   duration from below (every node is computed at least once).
2. No recomputation: the input order, then `reorder`'s order. Either one within budget is
   optimal (its duration is the lower bound) and ends the search.
3. Heuristics, fastest and best first, each within a share of the time limit.
4. The exact solver (``moccasin`` by default, looked up in the registry, skipped where it
   is not registered) warm-started from the best heuristic schedule (where that is
   within ``hint_max_tdi_percent`` of the bound), for the rest of the time limit.

The best schedule within budget wins; `auto` always returns one if any solver found one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from jaxremat._src.errors import InfeasibleBudgetError, NoScheduleFoundError
from jaxremat._src.graph import RematGraph
from jaxremat._src.schedule import Schedule, schedule_from_computes
from jaxremat._src.simulate import baseline_schedule, simulate
from jaxremat._src.solvers.base import Progress, ProgressCallback, available_solvers, get_solver
from jaxremat._src.solvers.reorder import memory_minimizing_order

# Heuristics in the order they run. xla-greedy is usually the best on training graphs;
# the structural ones are cheap insurance for graphs where eviction thrashes.
DEFAULT_HEURISTICS = (
  "xla-greedy",
  "chen-greedy",
  "chen-greedy-ap",
  "chen-sqrtn",
  "chen-sqrtn-ap",
  "twremat",
  "griewank-ap",
  "griewank",
)
# Share of the time limit the heuristics may use before the exact solver starts.
_HEURISTIC_SHARE = 0.25


def solve_auto(
  graph: RematGraph,
  budget_bytes: int,
  *,
  time_limit_s: float = 60.0,
  workers: int = 1,
  progress: ProgressCallback | None = None,
  exact: str | None = "moccasin",
  heuristics: Sequence[str] = DEFAULT_HEURISTICS,
  exact_options: dict[str, Any] | None = None,
  hint_max_tdi_percent: float = 20.0,
  **_,
) -> Schedule:
  """The best schedule within budget that the portfolio finds within ``time_limit_s``.

  Args:
    graph: the graph.
    budget_bytes: the memory budget.
    time_limit_s: wall seconds for the whole portfolio.
    workers: threads for the exact solver.
    progress: called with a `Progress` at each better schedule.
    exact: registered name of the exact solver to finish with (``None``: none).
    heuristics: registered names of the heuristics to try.
    exact_options: extra keyword arguments for the exact solver.
    hint_max_tdi_percent: warm-start the exact solver only from a heuristic schedule
      within this TDI of the lower bound. A poor hint recomputes many nodes, which
      enlarges MOCCASIN's model (one interval per copy): on moccasin_rl100 at 0.8 a
      +83% greedy hint led CP-SAT to 79% in 45 s, the input order to 4.3%.

  Returns:
    A schedule with ``stats``: ``status`` ("optimal" only when no recomputation was
    needed), ``lower_bound``, ``time_to_best_s``, ``history``, ``best_solver`` and
    ``portfolio`` (each solver's duration, or why it found nothing).

  Raises:
    InfeasibleBudgetError: the budget is below ``graph.min_feasible_bytes``.
    NoScheduleFoundError: no solver found a schedule within budget in time.
  """
  start = time.perf_counter()
  lower_bound = float(sum(graph.cost[v] for v in graph.order))
  graph.require_feasible(budget_bytes)
  best: dict[str, Any] = {"schedule": None, "duration": None, "solver": None, "time_s": None}
  portfolio: dict[str, Any] = {}
  history: list[list[float]] = []

  def elapsed() -> float:
    return time.perf_counter() - start

  def offer(name: str, schedule: Schedule) -> None:
    result = simulate(graph, schedule)
    if not (result.valid and result.peak_bytes <= budget_bytes):
      portfolio[name] = f"rejected: {result.error or f'peak {result.peak_bytes} bytes'}"
      return
    portfolio[name] = result.duration
    if best["duration"] is None or result.duration < best["duration"]:
      best.update(schedule=schedule, duration=result.duration, solver=name, time_s=elapsed())
      history.append([elapsed(), result.duration])
      if progress is not None:
        progress(Progress(elapsed(), result.duration, lower_bound, f"auto: {name}"))

  def finish(status: str) -> Schedule:
    stats = {
      "status": status,
      "lower_bound": lower_bound,
      "time_to_best_s": best["time_s"],
      "history": history,
      "best_solver": best["solver"],
      "portfolio": portfolio,
    }
    return best["schedule"].replace(budget=budget_bytes, solver="auto", stats=stats)

  # Without recomputation the duration is the lower bound: done if the memory fits.
  for name, schedule in (
    ("noremat", baseline_schedule(graph)),
    ("reorder", schedule_from_computes(graph, memory_minimizing_order(graph))),
  ):
    offer(name, schedule)
    if best["schedule"] is not None:
      return finish("optimal")

  registered = set(available_solvers())
  heuristic_deadline = time_limit_s * _HEURISTIC_SHARE
  for name in heuristics:
    if name not in registered:
      portfolio[name] = "not registered"
      continue
    left = heuristic_deadline - elapsed()
    if left <= 0:
      portfolio[name] = "skipped: heuristic time share used"
      continue
    try:
      schedule = get_solver(name)(
        graph, budget_bytes, time_limit_s=left, workers=workers, progress=None
      )
    except (NoScheduleFoundError, InfeasibleBudgetError) as e:
      portfolio[name] = f"none: {e}"
      continue
    offer(name, schedule)

  exact_error: Exception | None = None
  left = time_limit_s - elapsed()
  if exact is not None and exact in registered and left > 1.0:
    options = dict(exact_options or {})
    if best["schedule"] is not None and best["duration"] <= lower_bound * (
      1 + hint_max_tdi_percent / 100
    ):
      options["hint"] = best["schedule"]
    try:
      schedule = get_solver(exact)(
        graph, budget_bytes, time_limit_s=left, workers=workers, progress=progress, **options
      )
    except (NoScheduleFoundError, InfeasibleBudgetError) as e:
      exact_error = e
      portfolio[exact] = f"none: {e}"
    else:
      offer(exact, schedule)
  elif exact is not None:
    portfolio[exact] = "not registered" if exact not in registered else "skipped: no time left"

  if best["schedule"] is None:
    detail = f" The exact solver said: {exact_error}" if exact_error else ""
    raise NoScheduleFoundError(
      f"solver 'auto' found no schedule of graph {graph.name!r} within budget={budget_bytes} "
      f"bytes in time_limit_s={time_limit_s:g} (the proven lower bound is "
      f"{graph.min_feasible_bytes} bytes).{detail} Raise the budget or the time limit."
    )
  return finish("optimal" if best["duration"] <= lower_bound else "feasible")
