"""`solve`: the one entry point to every solver, and the checks around it."""

from __future__ import annotations

import math
import os
import time
from typing import Any

from jaxremat._src.budget import BudgetLike, parse_budget
from jaxremat._src.errors import InfeasibleBudgetError, NoScheduleFoundError, SolverError
from jaxremat._src.graph import RematGraph
from jaxremat._src.schedule import Schedule, keep_first_copies
from jaxremat._src.simulate import baseline_schedule, simulate
from jaxremat._src.solvers.base import ProgressCallback, check_options, get_solver


def tdi_percent(duration: float, baseline_duration: float) -> float:
  """Total duration increase over the baseline, in percent."""
  if baseline_duration <= 0:
    return 0.0
  return 100.0 * (duration - baseline_duration) / baseline_duration


def solve(
  graph: RematGraph,
  budget: BudgetLike,
  solver: str = "auto",
  *,
  time_limit: float = 60.0,
  workers: int | None = None,
  progress: ProgressCallback | None = None,
  **options: Any,
) -> Schedule:
  """Plans a schedule of ``graph`` whose peak memory is at most ``budget``.

  Args:
    graph: the graph to plan.
    budget: bytes, a fraction of the baseline peak, "80%", "12GiB" (see `parse_budget`).
    solver: a name from `available_solvers()`.
    time_limit: wall seconds the solver may use.
    workers: CPU threads for solvers that parallelize (default: every core).
    progress: called with `Progress` reports during long solves.
    **options: solver-specific options.

  Returns:
    A `Schedule` that `simulate` accepts with peak <= budget. ``stats`` holds
    ``status``, ``duration``, ``peak_bytes``, ``tdi_percent``, ``n_recompute``,
    ``baseline_duration``, ``baseline_peak_bytes``, ``solve_time_s`` and the solver's own
    figures (``found_by``, ``lower_bound``, ``time_to_best_s``, ``history``) where it has
    them.

  Raises:
    InfeasibleBudgetError: the budget is below ``graph.min_feasible_bytes``, a lower bound
      on the peak of every schedule; the message states its proof.
    NoScheduleFoundError: the solver found nothing within the time limit, or proved only
      that no schedule of its own kind fits (a fixed order, C_v copies, no
      recomputation): another solver or option may still succeed.
    BudgetError: the budget cannot be parsed.

  Example:
    >>> import jaxremat
    >>> g = jaxremat.RematGraph.build(mem=[4, 2, 1], cost=[1, 1, 1], edges=[(0, 1), (1, 2)])
    >>> jaxremat.solve(g, 1.0, solver="noremat").stats["peak_bytes"]
    6
  """
  if not isinstance(graph, RematGraph):
    raise TypeError(
      f"graph must be a jaxremat.RematGraph, got {type(graph).__name__}; load a file with "
      "RematGraph.load(path) or trace a function with jaxremat.trace."
    )
  baseline = simulate(graph, baseline_schedule(graph))
  budget_bytes = parse_budget(budget, baseline.peak_bytes)
  graph.require_feasible(budget_bytes)
  if not (isinstance(time_limit, (int, float)) and 0 < time_limit < math.inf):
    raise ValueError(f"time_limit={time_limit!r} must be a positive, finite number of seconds.")
  if workers is not None and not (isinstance(workers, int) and workers >= 1):
    raise ValueError(f"workers={workers!r} must be a positive count of threads, or None for all.")
  workers = workers or os.cpu_count() or 1
  check_options(solver, options)
  once = graph.compute_once_nodes
  start = time.perf_counter()
  try:
    schedule = get_solver(solver)(
      graph.with_pinned_effects() if once else graph,
      budget_bytes,
      time_limit_s=float(time_limit),
      workers=workers,
      progress=progress,
      **options,
    )
  except InfeasibleBudgetError as e:
    if not once:
      raise
    # The pinned graph overstates memory, so its bound proves nothing about `graph`.
    raise NoScheduleFoundError(
      f"solver {solver!r} found no schedule within budget={budget_bytes} bytes that runs "
      f"the {len(once)} effectful node(s) (e.g. {graph.node_label(once[0])}) once each, "
      f"with their outputs kept for the whole step ({e.reason or e}); raise the budget."
    ) from None
  schedule = keep_first_copies(graph, schedule, once)
  solve_time_s = time.perf_counter() - start
  check = simulate(graph, schedule)
  if not check.valid:
    raise SolverError(f"solver {solver!r} returned an invalid schedule: {check.error}")
  if check.peak_bytes > budget_bytes:
    raise SolverError(
      f"solver {solver!r} returned a schedule peaking at {check.peak_bytes} bytes, over "
      f"budget={budget_bytes} bytes."
    )
  stats = {
    "status": "feasible",
    **schedule.stats,
    "duration": check.duration,
    "peak_bytes": check.peak_bytes,
    "n_recompute": check.n_recompute,
    "tdi_percent": tdi_percent(check.duration, baseline.duration),
    "baseline_duration": baseline.duration,
    "baseline_peak_bytes": baseline.peak_bytes,
    "solve_time_s": solve_time_s,
    "workers": workers,
  }
  return schedule.replace(graph=graph.name, budget=budget_bytes, solver=solver, stats=stats)
