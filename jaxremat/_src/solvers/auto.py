"""`auto`: a portfolio of the fast bound, the heuristics and an exact solver.

1. Bounds: below ``graph.min_feasible_bytes`` nothing fits; the sum of costs bounds the
   duration from below (every node is computed at least once).
2. No recomputation: the input order, then `reorder`'s order. Either one within budget is
   optimal (its duration is the lower bound) and ends the search.
3. Heuristics within a share of the time limit (all of it, each taking at most half of
   what is left, until one finds a schedule): `dots-saveable` (the plan of the policy
   users try first), `cover-staged` (which fits the exact solver's model) and `cover`,
   then `xla-greedy` and the structural ones.
4. The exact solver (``moccasin`` by default, looked up in the registry, skipped where it
   is not registered) warm-started from the best heuristic schedule that its model can
   represent (where that is within ``hint_max_tdi_percent`` of the bound), for the rest
   of the time limit but a margin. Without such a hint it runs on graphs of up to 500
   nodes, or when no heuristic found a schedule.

The best schedule within budget wins; `auto` always returns one if any solver found one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from jaxremat._src.errors import InfeasibleBudgetError, NoScheduleFoundError
from jaxremat._src.graph import RematGraph
from jaxremat._src.order import memory_minimizing_order
from jaxremat._src.schedule import Schedule, schedule_from_computes
from jaxremat._src.simulate import baseline_schedule, simulate
from jaxremat._src.solvers.base import Progress, ProgressCallback, available_solvers, get_solver
from jaxremat._src.solvers.exact_common import is_staged

# Heuristics in the order they run. cover-staged is the fastest to find a schedule on
# the random layered graphs (rl1000 at 0.8: 0.5 s, cover 1 s) and the warm start of the
# staged exact solver; cover is the best there and within a few hundredths of a point of
# xla-greedy on the training graphs; the structural ones are cheap insurance. dots-saveable
# (one plan, evaluated in milliseconds) goes first.
DEFAULT_HEURISTICS = (
  "dots-saveable",
  "cover-staged",
  "cover",
  "xla-greedy",
  "chen-greedy",
  "chen-greedy-ap",
  "chen-sqrtn",
  "chen-sqrtn-ap",
  "twremat",
  "griewank-ap",
  "griewank",
)
# Share of the time limit the heuristics may use before the exact solver starts, and the
# share held back at the end: CP-SAT overruns its limit while it builds and loads a large
# model on a busy machine (rl1000: 42 s for a 30 s limit at load 16).
_HEURISTIC_SHARE = 0.5
_EXACT_MARGIN = 0.1
# Without a hint it can use, the exact solver runs on graphs up to this many nodes only
# (rl1000: 44 s for a 24 s limit at load 19, and nothing found), unless nothing else fit.
_EXACT_MAX_NODES_WITHOUT_HINT = 500


def found_by_member(name: str, found_by: str | None) -> str:
  """``stats["found_by"]`` of `auto`: the member ``name``, and its own ``found_by`` where
  that says more than its name ("moccasin (warm start: cover-staged)")."""
  return name if found_by in (None, name) else f"{name} ({found_by})"


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
    needed), ``lower_bound``, ``time_to_best_s``, ``history``, ``best_solver``,
    ``found_by`` (`found_by_member`: the member whose schedule won and, where it says
    more, that member's own ``found_by``, e.g. "moccasin (cp-sat search: phase 2)") and
    ``portfolio`` (each solver's duration, or why it found nothing).

  Raises:
    InfeasibleBudgetError: the budget is below ``graph.min_feasible_bytes``, a bound on
      every schedule.
    NoScheduleFoundError: no solver found a schedule within budget in time (the
      members' own failures prove nothing about other schedules).
  """
  start = time.perf_counter()
  lower_bound = float(sum(graph.cost[v] for v in graph.order))
  graph.require_feasible(budget_bytes)
  best: dict[str, Any] = {
    "schedule": None,
    "duration": None,
    "solver": None,
    "found_by": None,
    "time_s": None,
  }
  found: list[tuple[float, Schedule]] = []  # every schedule within budget, with its duration
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
    found.append((result.duration, schedule))
    if best["duration"] is None or result.duration < best["duration"]:
      found_by = found_by_member(name, schedule.stats.get("found_by"))
      best.update(
        schedule=schedule,
        duration=result.duration,
        solver=name,
        found_by=found_by,
        time_s=elapsed(),
      )
      history.append([elapsed(), result.duration])
      if progress is not None:
        progress(Progress(elapsed(), result.duration, lower_bound, f"auto: {found_by}"))

  def finish(status: str) -> Schedule:
    stats = {
      "status": status,
      "lower_bound": lower_bound,
      "time_to_best_s": best["time_s"],
      "history": history,
      "best_solver": best["solver"],
      "found_by": best["found_by"],
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
    if best["schedule"] is None:
      # Nothing found yet: a fast answer beats none, so the heuristics may use the exact
      # solver's time too, each at most half of what is left (moccasin_rl1000 at 2 s: the
      # first heuristic used the whole share and found nothing, the next needed 0.5 s).
      left = (time_limit_s * (1 - _EXACT_MARGIN) - elapsed()) / 2
    else:
      left = heuristic_deadline - elapsed()
    if left <= 0.01 * time_limit_s:
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
  left = time_limit_s * (1 - _EXACT_MARGIN) - elapsed()
  if exact is not None and exact in registered and left > 1.0:
    options = dict(exact_options or {})
    # The staged model (MOCCASIN's default) cannot represent a schedule whose first
    # computes leave the input order: hint the best one it can.
    staged = options.get("order", "staged") == "staged"
    hints = [
      (duration, schedule)
      for duration, schedule in found
      if duration <= lower_bound * (1 + hint_max_tdi_percent / 100)
      and not (staged and not is_staged(graph, schedule.computes))
    ]
    if hints:
      options["hint"] = min(hints, key=lambda h: h[0])[1]
    if (
      "hint" not in options
      and best["schedule"] is not None
      and len(graph.order) > _EXACT_MAX_NODES_WITHOUT_HINT
    ):
      # From scratch, MOCCASIN's phase 1 found nothing better than cover on the large
      # graphs (600 s on 2 cores: rl500 4.3%, rl1000 61% against cover's 1.9% and 2.25%)
      # and overran its limit building the model: keep the heuristic schedule.
      portfolio[exact] = "skipped: no heuristic schedule within its model to start from"
    else:
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
