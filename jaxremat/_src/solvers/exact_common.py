"""Helpers shared by the exact solvers (`moccasin`, `checkmate`): integer data, stats, checks."""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import time
from collections.abc import Sequence
from typing import NamedTuple

from jaxremat._src.errors import NoScheduleFoundError, SolverError
from jaxremat._src.graph import RematGraph
from jaxremat._src.schedule import Schedule, schedule_from_computes
from jaxremat._src.simulate import simulate
from jaxremat._src.solvers.base import Progress, ProgressCallback
from jaxremat._src.solvers.cover import improve_computes, solve_cover, solve_cover_staged
from jaxremat._src.solvers.greedy import solve_xla_greedy

# Integer costs are scaled so that the largest is about this many units when the graph's
# costs are not integers (CP-SAT and the MIP objective work on integers).
_COST_RESOLUTION = 10**6
# The heuristic warm start of an exact solver may use this share of its time limit.
WARM_START_SHARE = 0.2
# ``stats["found_by"]`` of the empty schedule of a graph without non-input nodes.
FOUND_BY_EMPTY = "empty graph: nothing to compute"


def integer_costs(graph: RematGraph) -> tuple[list[int], float]:
  """Costs as small integers, and the factor that turns them back into graph units.

  Integral costs are divided by their gcd (exact). Others are scaled so that the largest
  is `_COST_RESOLUTION` units and rounded (exact up to that resolution).
  """
  costs = [graph.cost[v] for v in range(graph.n)]
  if all(float(c).is_integer() for c in costs):
    ints = [int(c) for c in costs]
    g = math.gcd(*ints) or 1
    return [c // g for c in ints], float(g)
  scale = max(costs) / _COST_RESOLUTION
  return [round(c / scale) for c in costs], scale


def memory_unit(graph: RematGraph) -> int:
  """The gcd of the non-input sizes: dividing demands and capacity by it is exact."""
  return math.gcd(*(graph.mem[v] for v in graph.order)) or 1


def is_staged(graph: RematGraph, computes: Sequence[int]) -> bool:
  """Whether the first compute of every node follows ``graph.order`` (the staged model of
  MOCCASIN, and Checkmate's stages)."""
  return list(dict.fromkeys(computes)) == list(graph.order)


def duration_of(graph: RematGraph, computes: Sequence[int]) -> float:
  return float(sum(graph.cost[v] for v in computes))


class Clock:
  """Wall time since the solve started, and the history of best durations."""

  def __init__(self, progress: ProgressCallback | None):
    self.start = time.perf_counter()
    self.progress = progress
    self.history: list[list[float]] = []
    self.time_to_best_s: float | None = None

  def elapsed_s(self) -> float:
    return time.perf_counter() - self.start

  def improved(self, duration: float, lower_bound: float | None = None, message: str = "") -> None:
    """Records a new best schedule within budget and reports it."""
    if self.history and duration >= self.history[-1][1]:
      return
    elapsed = self.elapsed_s()
    self.history.append([elapsed, duration])
    self.time_to_best_s = elapsed
    if self.progress is not None:
      self.progress(Progress(elapsed, duration, lower_bound, message))

  def report(self, message: str, lower_bound: float | None = None) -> None:
    if self.progress is not None:
      best = self.history[-1][1] if self.history else None
      self.progress(Progress(self.elapsed_s(), best, lower_bound, message))


def restricted_model_error(message: str, restricted_bound_bytes: int) -> NoScheduleFoundError:
  """A `NoScheduleFoundError` that carries the least peak proven for a restricted model.

  An exact solver that proves its own model infeasible (C_v copies, a staged or input
  order) proves nothing about the other schedules of the graph, so this is no
  `InfeasibleBudgetError`: ``restricted_bound_bytes`` bounds the peak of the schedules of
  that model only.
  """
  return NoScheduleFoundError(message, restricted_bound_bytes)


def checked_schedule(
  graph: RematGraph, schedule: Schedule, budget_bytes: int, solver: str
) -> Schedule:
  """Returns ``schedule`` after the simulator confirmed it is valid and within budget.

  Raises:
    SolverError: the solver's model and the simulator disagree (a bug in the model).
  """
  result = simulate(graph, schedule)
  if not result.valid:
    raise SolverError(f"solver {solver!r} built an invalid schedule: {result.error}")
  if result.peak_bytes > budget_bytes:
    raise SolverError(
      f"solver {solver!r} built a schedule peaking at {result.peak_bytes} bytes, over "
      f"budget={budget_bytes} bytes; its memory model disagrees with the simulator."
    )
  return schedule


# -- a fast warm start ---------------------------------------------------------------------

# Eviction scores of `greedy_computes`, each a function of (bytes, recompute cost, steps
# to the next use); the largest score is evicted first.
_EVICTION_SCORES = {
  "bytes-per-cost": lambda mem, cost, gap: (mem * gap / (cost + 1.0), gap),
  "bytes": lambda mem, cost, gap: (mem, gap),
  "farthest": lambda mem, cost, gap: (gap, mem),
}


def greedy_computes(
  graph: RematGraph,
  budget_bytes: int,
  score: str,
  protect_inputs: bool = True,
  deadline: float = math.inf,
) -> list[int] | None:
  """A compute sequence within budget by evict-and-recompute on the input order, or None.

  Runs ``graph.order``; before each compute that would exceed the budget it drops a live
  value that the compute does not need (the one ``score`` ranks first), and a dropped
  value is recomputed, recursively, when it is needed again. The recompute cost a score
  sees is that of the value and of every ancestor that will be gone by then. With
  ``protect_inputs`` the inputs of a dropped value are kept until it is recomputed. First
  computes stay in the input order, so the result also fits the staged model. Used as a
  warm start; gives up (None) at ``deadline`` (a `time.perf_counter` value).
  """
  order, preds, mem, cost = graph.order, graph.compute_preds, graph.mem, graph.cost
  position = {v: k for k, v in enumerate(order)}
  end = len(order)
  outputs = set(graph.outputs)
  uses = {
    u: sorted([position[w] for w in graph.succs[u]] + ([end] if u in outputs else []))
    for u in order
  }
  rank = _EVICTION_SCORES[score]
  free_bytes = budget_bytes - graph.resident_bytes
  live: set[int] = set()
  computes: list[int] = []
  stage = 0
  calls = 0

  def next_use(u: int) -> int | None:
    for k in uses[u]:
      if k >= stage:
        return k
    return None

  def gap(u: int) -> int:
    k = next_use(u)
    return 2 * end if k is None else k - stage

  def recompute_cost(u: int) -> float:
    # u and every ancestor that will not be live any more when u is next needed.
    k = next_use(u)
    if k is None:
      return 0.0
    total, seen, stack = cost[u], set(), list(preds[u])
    while stack:
      p = stack.pop()
      if p in seen or (p in live and uses[p] and uses[p][-1] >= k):
        continue
      seen.add(p)
      total += cost[p]
      stack.extend(preds[p])
    return total

  def materialize(x: int, pinned: frozenset[int], depth: int) -> bool:
    nonlocal free_bytes, calls
    calls += 1
    if depth > end or calls > 5 * end or time.perf_counter() > deadline:
      return False
    pinned = pinned | set(preds[x])
    for u in preds[x]:
      if u not in live and not materialize(u, pinned, depth + 1):
        return False
    while free_bytes < mem[x]:
      candidates = [u for u in live if u not in pinned]
      if not candidates:
        return False
      victim = max(candidates, key=lambda u: rank(mem[u], recompute_cost(u), gap(u)))
      live.discard(victim)
      free_bytes += mem[victim]
      # Its inputs must still be there when it is recomputed: no cascade back to the sources.
      k = next_use(victim)
      if protect_inputs and k is not None:
        for p in preds[victim]:
          bisect.insort(uses[p], k)
    computes.append(x)
    live.add(x)
    free_bytes -= mem[x]
    return True

  try:
    for stage, v in enumerate(order):  # noqa: B007 (next_use reads the stage)
      if not materialize(v, frozenset(), 0):
        return None
      for u in [u for u in live if not uses[u] or uses[u][-1] <= stage]:
        live.discard(u)
        free_bytes += mem[u]
    stage = end
    for v in graph.outputs:
      if (
        not graph.is_input[v] and v not in live and not materialize(v, frozenset(graph.outputs), 0)
      ):
        return None
  except RecursionError:
    return None
  return computes


class FoundComputes(NamedTuple):
  """A compute sequence within budget, and which part found it (``stats["found_by"]``)."""

  computes: list[int]
  found_by: str


def best_greedy_computes(
  graph: RematGraph, budget_bytes: int, time_limit_s: float = math.inf
) -> list[int] | None:
  """The shortest `greedy_computes` sequence within budget over its variants.

  Variants run in the order that did best on the benchmark graphs, until ``time_limit_s``.
  """
  deadline = time.perf_counter() + time_limit_s
  found = []
  for score, protect_inputs in itertools.product(_EVICTION_SCORES, (True, False)):
    computes = greedy_computes(graph, budget_bytes, score, protect_inputs, deadline)
    if computes is None:
      continue
    result = simulate(graph, schedule_from_computes(graph, computes))
    if result.valid and result.peak_bytes <= budget_bytes:
      found.append((result.duration, computes))
  return min(found, key=lambda f: f[0])[1] if found else None


def warm_start_computes(
  graph: RematGraph, budget_bytes: int, staged: bool, time_limit_s: float
) -> FoundComputes | None:
  """The shortest sequence within budget of the fast heuristics, refined, or None.

  Candidates, in this order until ``time_limit_s``: `cover` (``cover-staged`` when
  ``staged``: every compute in place), `xla-greedy` (on the input order; with
  ``staged=False`` also on `reorder`'s order) and `best_greedy_computes`. The shortest
  is refined by `improve_computes` with tabu repairs for the time left. With
  ``staged=True`` every sequence keeps the first computes in the input order, so it fits
  the staged model. ``found_by`` names the winning candidate ("warm start: cover-staged"),
  or "warm start: tabu refinement of ..." when the refinement shortened it.
  """
  deadline = time.perf_counter() + time_limit_s
  found: list[FoundComputes] = []
  # cover plans on the whole timeline and reaches MOCCASIN's optimum on moccasin_rl100 at
  # 0.8, where the eviction heuristics thrash (+54%). Each takes half of the time left.
  cover = solve_cover_staged if staged else solve_cover
  eviction = functools.partial(solve_xla_greedy, order="input" if staged else None)
  for name, solver in (("cover-staged" if staged else "cover", cover), ("xla-greedy", eviction)):
    try:
      left_s = max(deadline - time.perf_counter(), 0.0)
      computes = list(solver(graph, budget_bytes, time_limit_s=left_s / 2).computes)
    except NoScheduleFoundError:
      continue
    found.append(FoundComputes(computes, f"warm start: {name}"))
  own = best_greedy_computes(graph, budget_bytes, max(deadline - time.perf_counter(), 0.0))
  if own is not None:
    found.append(FoundComputes(own, "warm start: evict-and-recompute"))
  if not found:
    return None
  best = min(found, key=lambda start: duration_of(graph, start.computes))
  # The rest of the time refines it with tabu repairs (segnet at 0.8: 0.225% -> 0.210%).
  refined = improve_computes(graph, best.computes, budget_bytes, deadline, staged=staged, tabu=True)
  if duration_of(graph, refined) < duration_of(graph, best.computes):
    name = best.found_by.removeprefix("warm start: ")
    return FoundComputes(refined, f"warm start: tabu refinement of {name}")
  return FoundComputes(refined, best.found_by)
