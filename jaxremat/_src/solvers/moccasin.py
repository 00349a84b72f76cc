"""`moccasin`: rematerialization as CP-SAT retention intervals with C_v copies per node.

Each node v gets up to C_v copies. Copy i is computed at an integer time slot ``start``
and kept in memory over the half-open retention interval ``[start, end)``; copy 0 is
always present, the others are optional. One compute per slot; the retained bytes at
every slot (inputs and output of the compute included) fit the budget; every compute of
v finds a live copy of each predecessor.

References:
  Bartan, Li, Tang, Chen, Gu, Sun, Lian, Yin, Stojanovic, Wang, Yu. "Moccasin: Efficient
  Tensor Rematerialization for Neural Networks", ICML 2023. https://arxiv.org/abs/2304.14463
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from ortools.sat.python import cp_model

from jaxremat._src.errors import NoScheduleFoundError
from jaxremat._src.graph import RematGraph
from jaxremat._src.schedule import Schedule, schedule_from_computes
from jaxremat._src.simulate import simulate
from jaxremat._src.solvers.base import ProgressCallback
from jaxremat._src.solvers.exact_common import (
  FOUND_BY_EMPTY,
  WARM_START_SHARE,
  Clock,
  FoundComputes,
  checked_schedule,
  duration_of,
  integer_costs,
  memory_unit,
  restricted_model_error,
  warm_start_computes,
)

ORDERS = ("staged", "free")
# CP-SAT parameters applied before the caller's: probing in presolve costs seconds on
# these models and rarely pays off within the short limits exact remat is run with.
# Expanding the reservoir constraints in presolve cannot be interrupted: on rl1000 it ran
# 7 s past a 2 s limit. Native propagation reached the same schedules in our benchmarks.
DEFAULT_PARAMETERS = {"cp_model_probing_level": 0, "expand_reservoir_constraints": False}
# Phase 2 starts straight from the greedy warm start when its duration increase is at most
# this fraction; a worse one only backs up phase 1.
GREEDY_START_TDI = 0.10
# ``stats["found_by"]`` of a schedule that CP-SAT's own search found, by phase.
FOUND_BY_PHASE1 = "cp-sat search: phase 1"
FOUND_BY_PHASE2 = "cp-sat search: phase 2"


# -- copy counts and time windows --------------------------------------------------------


def copy_counts(
  graph: RematGraph, copies: int | Mapping[int, int], staged: bool, default: int = 2
) -> dict[int, int]:
  """C_v for every non-input node, after dropping copies that can never help.

  In the free order every copy of v either feeds a compute of a successor or is the
  copy of an output kept to the end, so C_v <= sum of the successors' C_w (+1 for an
  output); a schedule with an unused copy is no better than the one without it. In the
  staged order the first copy is forced into its stage and may go unused, hence +1.

  Raises:
    ValueError: ``copies`` is not a positive int or a mapping of node ids to them.
  """
  if isinstance(copies, Mapping):
    requested = {v: copies.get(v, default) for v in graph.order}
  else:
    requested = dict.fromkeys(graph.order, copies)
  for v, c in requested.items():
    if isinstance(c, bool) or not isinstance(c, int) or c < 1:
      raise ValueError(
        f"copies={c!r} for node {graph.node_label(v)} must be a positive int; pass an int "
        "or a mapping from node id to an int >= 1."
      )
  outputs = set(graph.outputs)
  counts: dict[int, int] = {}
  for v in reversed(graph.order):
    useful = sum(counts[w] for w in graph.succs[v]) + (v in outputs) + staged
    counts[v] = max(1, min(requested[v], useful))
  return counts


def bounded_by_duration(
  graph: RematGraph, counts: Mapping[int, int], computes: Sequence[int]
) -> tuple[dict[int, int], int]:
  """Copy counts and a horizon that keep every schedule no longer than ``computes``.

  A schedule lasts the baseline plus the costs of its recomputations. One no longer than
  ``computes`` recomputes only nodes that cost at most the slack (its duration minus the
  baseline's), and at most as many times as the cheapest recomputations that fit in the
  slack; each takes a slot, so the horizon is n plus that number. Nothing at least as
  short as ``computes`` is cut off, so optimality for the model is kept; the start
  windows shrink from sum(C_v) slots to n + that number.
  """
  int_costs, _ = integer_costs(graph)
  slack = sum(int_costs[v] for v in computes) - sum(int_costs[v] for v in graph.order)
  bounded = {v: c if int_costs[v] <= slack else 1 for v, c in counts.items()}
  extra = sorted(int_costs[v] for v, c in bounded.items() for _ in range(c - 1))
  recomputes = 0
  for total in itertools.accumulate(extra):
    if total > slack:
      break
    recomputes += 1
  return bounded, max(len(graph.order) + recomputes, len(computes))


def _ancestor_counts(graph: RematGraph) -> tuple[dict[int, int], dict[int, int]]:
  """Number of non-input ancestors and descendants of each non-input node."""
  bit = {v: 1 << k for k, v in enumerate(graph.order)}
  anc: dict[int, int] = {}
  for v in graph.order:
    mask = 0
    for u in graph.compute_preds[v]:
      mask |= anc[u] | bit[u]
    anc[v] = mask
  desc: dict[int, int] = {}
  for v in reversed(graph.order):
    mask = 0
    for w in graph.succs[v]:
      mask |= desc[w] | bit[w]
    desc[v] = mask
  return (
    {v: m.bit_count() for v, m in anc.items()},
    {v: m.bit_count() for v, m in desc.items()},
  )


# -- the CP-SAT model ---------------------------------------------------------------------


@dataclasses.dataclass
class _Copy:
  node: int
  index: int
  present: Any  # a literal, or True for copy 0
  start: cp_model.IntVar
  end: cp_model.IntVar
  size: cp_model.IntVar
  lo: int  # the earliest slot the copy can start in


class _Model:
  """The retention-interval model of one graph, budget and set of copy counts."""

  def __init__(
    self,
    graph: RematGraph,
    counts: Mapping[int, int],
    staged: bool,
    capacity: int,
    precedence: str = "reservoir",
    horizon: int | None = None,
  ):
    self.graph = graph
    self.staged = staged
    self.mem_unit = memory_unit(graph)
    self.int_costs, self.cost_scale = integer_costs(graph)
    self.horizon = horizon = sum(counts.values()) if horizon is None else horizon
    m = self.model = cp_model.CpModel()
    n = len(graph.order)
    anc, desc = _ancestor_counts(graph)
    position = {v: k for k, v in enumerate(graph.order)}
    self.copies: dict[int, list[_Copy]] = {}
    self.counts: dict[int, int] = {}
    for v in graph.order:
      if staged:
        first_lo, first_hi = position[v], horizon - n + position[v]
      else:
        first_lo, first_hi = anc[v], horizon - 1 - desc[v]
      # Copy i starts at first_lo + i at the earliest: later than the horizon, it cannot be.
      self.counts[v] = min(counts[v], horizon - first_lo)
      copies = []
      for i in range(self.counts[v]):
        lo = first_lo + i
        hi = first_hi if i == 0 else horizon - 1
        start = m.new_int_var(lo, hi, f"s{v}_{i}")
        end = m.new_int_var(lo + 1, horizon, f"e{v}_{i}")
        size = m.new_int_var(1, horizon - lo, f"d{v}_{i}")
        present = True if i == 0 else m.new_bool_var(f"a{v}_{i}")
        copies.append(_Copy(v, i, present, start, end, size, lo))
      self.copies[v] = copies
    self.all_copies = [c for v in graph.order for c in self.copies[v]]

    # Retention intervals, and the unit "compute" intervals that take one slot each.
    retain, demands, slots = [], [], []
    for c in self.all_copies:
      if c.index == 0:
        retain.append(m.new_interval_var(c.start, c.size, c.end, f"r{c.node}_0"))
        slots.append(m.new_fixed_size_interval_var(c.start, 1, f"c{c.node}_0"))
      else:
        retain.append(
          m.new_optional_interval_var(c.start, c.size, c.end, c.present, f"r{c.node}_{c.index}")
        )
        slots.append(
          m.new_optional_fixed_size_interval_var(c.start, 1, c.present, f"c{c.node}_{c.index}")
        )
        # An absent copy sits at its earliest slot: one representative per absent copy.
        m.add(c.start == c.lo).only_enforce_if(~c.present)
        m.add(c.size == 1).only_enforce_if(~c.present)
      demands.append(graph.mem[c.node] // self.mem_unit)
    m.add_no_overlap(slots)
    total_demand = sum(demands)
    self.peak_lo, self.peak_hi = capacity, max(capacity, total_demand)
    self.peak = m.new_int_var(self.peak_lo, self.peak_hi, "peak")
    m.add_cumulative(retain, demands, self.peak)

    # Copies of a node are ordered in time and never overlap (a live node is not computed).
    for v in graph.order:
      cs = self.copies[v]
      for prev, cur in zip(cs, cs[1:], strict=False):
        if prev.index > 0:
          m.add_implication(cur.present, prev.present)
        m.add(prev.end <= cur.start).only_enforce_if(cur.present)

    # Outputs: the last present copy is live at the end of the schedule.
    for v in graph.outputs:
      if graph.is_input[v]:
        continue
      cs = self.copies[v]
      for i, c in enumerate(cs):
        enforce = [] if c.index == 0 else [c.present]
        if i + 1 < len(cs):
          enforce.append(~cs[i + 1].present)
        m.add(c.end == horizon).only_enforce_if(enforce)

    # Precedence: while a copy of v is computed at slot t, a copy of u covers t.
    for v in graph.order:
      for u in graph.compute_preds[v]:
        if precedence == "reservoir":
          self._reservoir_precedence(u, v)
        else:
          self._cover_precedence(u, v)

    if staged:
      # Section 2.3: first computes follow the input order; recomputations go anywhere.
      for u, v in zip(graph.order, graph.order[1:], strict=False):
        m.add(self.copies[u][0].start < self.copies[v][0].start)

    self.duration = sum(
      self.int_costs[c.node] * c.present for c in self.all_copies if self.int_costs[c.node]
    )

  def _reservoir_precedence(self, u: int, v: int) -> None:
    """The paper's encoding: level (# live copies of u) - (# computes of v) >= 0 at all t."""
    m = self.model
    times, changes, actives = [], [], []
    for c in self.copies[u]:
      times += [c.start, c.end]
      changes += [1, -1]
      actives += [c.present, c.present]
    for c in self.copies[v]:
      times += [c.start, c.start + 1]
      changes += [-1, 1]
      actives += [c.present, c.present]
      # Redundant but strong: u's first compute precedes every compute of v.
      enforce = [] if c.index == 0 else [c.present]
      m.add(self.copies[u][0].start < c.start).only_enforce_if(enforce)
    m.add_reservoir_constraint_with_active(times, changes, actives, 0, 1)

  def _cover_precedence(self, u: int, v: int) -> None:
    """Equivalent and tighter for the LP: a literal per (copy of u, copy of v) pair says
    which copy of u covers the compute; copies of v in time order use copies of u in time
    order, so pairs that would cross are left out."""
    m = self.model
    us = self.copies[u]
    for cv in self.copies[v]:
      choices = []
      for cu in us:
        x = m.new_bool_var(f"x{u}_{cu.index}_{v}_{cv.index}")
        m.add(cu.start < cv.start).only_enforce_if(x)
        m.add(cu.end > cv.start).only_enforce_if(x)
        if cu.index > 0:
          m.add_implication(x, cu.present)
        choices.append(x)
      enforce = [] if cv.index == 0 else [cv.present]
      m.add_bool_or(choices).only_enforce_if(enforce)
      m.add(us[0].start < cv.start).only_enforce_if(enforce)

  # -- hints and solutions ------------------------------------------------------------

  def set_hint(self, computes: Sequence[int]) -> None:
    """Hints every variable from a compute sequence (slot = position in the sequence)."""
    m, graph, horizon = self.model, self.graph, self.horizon
    m.clear_hints()
    peak_bytes = simulate(graph, schedule_from_computes(graph, computes)).peak_bytes
    used = (peak_bytes - graph.resident_bytes) // self.mem_unit
    m.add_hint(self.peak, min(self.peak_hi, max(self.peak_lo, used)))
    starts: dict[int, list[int]] = {v: [] for v in graph.order}
    ends: list[int] = []
    current: dict[int, int] = {}
    for pos, v in enumerate(computes):
      for u in graph.compute_preds[v]:
        ends[current[u]] = pos + 1
      current[v] = pos
      starts[v].append(pos)
      ends.append(pos + 1)
    for v in graph.outputs:
      if v in current:
        ends[current[v]] = horizon
    for v in graph.order:
      for c in self.copies[v]:
        if c.index < len(starts[v]):
          s = starts[v][c.index]
          e = ends[s]
          if c.index > 0:
            m.add_hint(c.present, True)
        else:
          s, e = c.lo, c.lo + 1
          m.add_hint(c.present, False)
        m.add_hint(c.start, s)
        m.add_hint(c.end, e)
        m.add_hint(c.size, e - s)

  def computes(self, value) -> list[int]:
    """The compute sequence of a solution; ``value`` reads a variable's value."""
    slots = [(value(c.start), c.node) for c in self.all_copies if c.index == 0 or value(c.present)]
    return [v for _, v in sorted(slots)]


class _OnSolution(cp_model.CpSolverSolutionCallback):
  def __init__(self, handler):
    super().__init__()
    self._handler = handler

  def on_solution_callback(self) -> None:
    self._handler(self)


def _solver(
  time_limit_s: float, workers: int, log_search: bool, parameters: Mapping[str, Any]
) -> cp_model.CpSolver:
  solver = cp_model.CpSolver()
  for name, value in {**DEFAULT_PARAMETERS, **parameters}.items():
    setattr(solver.parameters, name, value)
  solver.parameters.max_time_in_seconds = max(time_limit_s, 0.01)
  solver.parameters.num_workers = max(1, int(workers))
  solver.parameters.log_search_progress = log_search
  return solver


# -- the solver ---------------------------------------------------------------------------


def solve_moccasin(
  graph: RematGraph,
  budget_bytes: int,
  *,
  time_limit_s: float = 60.0,
  workers: int = 1,
  progress: ProgressCallback | None = None,
  copies: int | Mapping[int, int] = 2,
  order: str = "staged",
  hint: Schedule | None = None,
  precedence: str = "reservoir",
  warm_start: bool = True,
  parameters: Mapping[str, Any] | None = None,
  log_search: bool = False,
) -> Schedule:
  """MOCCASIN: the least-duration schedule within budget with at most C_v computes of v.

  Phase 1 minimizes max(peak, budget) from a hint (``hint``, or the input order) to reach
  a schedule within budget; phase 2 fixes the budget and minimizes the duration from
  phase 1's solution. A ``hint`` already within budget skips phase 1 and bounds the model
  (`bounded_by_duration`: fewer copies, n + R slots instead of sum(C_v)). ``stats`` holds
  ``status`` ("optimal" means optimal for this model: these copies and this order),
  ``lower_bound`` (CP-SAT's bound on the duration for this model, see ``bound_scope``),
  ``time_to_best_s``, ``history``, ``phase1_s``, the number of copies, ``horizon``
  (the number of time slots) and ``found_by``: "hint" (the given hint, not improved on),
  "warm start: ..." (the heuristic warm start, see `warm_start_computes`), or
  `FOUND_BY_PHASE1` / `FOUND_BY_PHASE2` (CP-SAT's search). The answer is the shortest
  schedule within budget found (hint or warm start, phase 1's, phase 2's), the first
  found among equals: CP-SAT reports its hint as a solution, which does not make it
  CP-SAT's find.

  Args:
    graph: the graph.
    budget_bytes: the peak memory allowed, in bytes.
    time_limit_s: wall seconds for both phases together.
    workers: CP-SAT worker threads.
    progress: called with a `Progress` at each better schedule within budget.
    copies: C_v, an int for every node or a mapping node id -> int (others get 2).
      Copies that can never be used are dropped (see `copy_counts`).
    order: "staged" (first computes in ``graph.order``, recomputations anywhere:
      section 2.3 of the paper) or "free" (any topological order).
    hint: a schedule to start from; nodes it computes more often than C_v get more copies.
    precedence: "reservoir" (the paper's encoding) or "cover" (a literal per pair of
      copies; equivalent, slower on the benchmark graphs tried).
    warm_start: without ``hint``, start from the best heuristic sequence within budget
      (`warm_start_computes`: `cover`, `xla-greedy` and greedy evict-and-recompute, refined
      by tabu ruin-and-recreate) when one exists; phase 1 is skipped when its duration
      increase is at most 10%.
    parameters: CP-SAT parameters (``SatParameters`` field name -> value) on top of
      `DEFAULT_PARAMETERS`.
    log_search: print CP-SAT's search log.

  Returns:
    A schedule that `simulate` accepts with peak <= ``budget_bytes``.

  Raises:
    InfeasibleBudgetError: ``budget_bytes`` is below ``graph.min_feasible_bytes``, a
      bound on every schedule (`RematGraph.require_feasible`).
    NoScheduleFoundError: the time limit passed before a schedule within budget was
      found, or CP-SAT proved that no schedule of this model (C_v copies, this order)
      fits; the latter proves nothing about other schedules, and the error's
      ``restricted_bound_bytes`` holds the least peak CP-SAT proved for the model.
    ValueError: ``order`` or ``copies`` is not one of the accepted values.

  References:
    Bartan et al., "Moccasin: Efficient Tensor Rematerialization for Neural Networks",
    ICML 2023, sections 2.2 (retention intervals) and 2.3 (staged input order).
  """
  if order not in ORDERS:
    raise ValueError(f"order={order!r} is not supported; use 'staged' or 'free'.")
  if precedence not in ("reservoir", "cover"):
    raise ValueError(f"precedence={precedence!r} is not supported; use 'reservoir' or 'cover'.")
  graph.require_feasible(budget_bytes)
  clock = Clock(progress)
  staged = order == "staged"
  if not graph.order:
    stats = {"status": "optimal", "found_by": FOUND_BY_EMPTY}
    return Schedule((), graph.name, budget_bytes, "moccasin", stats)
  counts = copy_counts(graph, copies, staged)
  if hint is not None:
    start = FoundComputes(list(hint.computes), "hint")
    result = simulate(graph, schedule_from_computes(graph, start.computes))
    if not result.valid:
      raise ValueError(f"hint is not a valid schedule of graph {graph.name!r}: {result.error}")
    start_fits = result.peak_bytes <= budget_bytes
  else:
    start, start_fits = FoundComputes(list(graph.order), "input order"), False
  # The best heuristic sequence within budget: phase 2 starts from it when it is short,
  # else it is the fallback if phase 1 runs out of time.
  greedy = None
  if warm_start and not start_fits:
    greedy = warm_start_computes(graph, budget_bytes, staged, WARM_START_SHARE * time_limit_s)
  for computes in (start.computes, greedy.computes if greedy else ()):
    for v, k in collections.Counter(computes).items():
      counts[v] = max(counts[v], k)
  baseline_duration = duration_of(graph, graph.order)
  if greedy is not None and (
    duration_of(graph, greedy.computes) <= (1 + GREEDY_START_TDI) * baseline_duration
  ):
    start, start_fits = greedy, True
  horizon = sum(counts.values())
  if start_fits:
    counts, horizon = bounded_by_duration(graph, counts, start.computes)
  capacity = (budget_bytes - graph.resident_bytes) // memory_unit(graph)
  model = _Model(graph, counts, staged, capacity, precedence, horizon)
  stats: dict[str, Any] = {
    "order": order,
    "copies": sum(model.counts.values()),
    "horizon": model.horizon,
    "bound_scope": f"moccasin model: {order} order, at most C_v computes of each node",
  }
  # Every schedule within budget found so far, in the order found: the answer is the
  # shortest, the first found among equals.
  found = [start] if start_fits else [greedy] if greedy is not None else []
  for within in found:
    clock.improved(duration_of(graph, within.computes), message=f"moccasin: {within.found_by}")
  if not start_fits:
    model.set_hint(start.computes)
    phase1_s = time_limit_s / 2 if greedy is not None else time_limit_s
    solver = _solver(phase1_s, workers, log_search, parameters or {})
    start = _phase1(model, graph, budget_bytes, capacity, solver, phase1_s, clock, greedy)
    found.append(start)
  # From here on ``start`` is within budget, and it is CP-SAT's hint.
  model.set_hint(start.computes)
  model.model.add(model.peak == capacity)
  stats["phase1_s"] = clock.elapsed_s()

  # Phase 2: minimize the duration within budget from the hint that phase 1 left.
  model.model.minimize(model.duration)
  best: dict[str, Any] = {"computes": None}

  def on_solution(cb: cp_model.CpSolverSolutionCallback) -> None:
    computes = model.computes(cb.value)
    best["computes"] = computes
    bound = cb.best_objective_bound * model.cost_scale
    clock.improved(duration_of(graph, computes), bound, f"moccasin: {FOUND_BY_PHASE2}")

  remaining_s = time_limit_s - clock.elapsed_s()
  solver = _solver(remaining_s, workers, log_search, parameters or {})
  status = solver.solve(model.model, _OnSolution(on_solution))
  stats["status"] = "feasible"
  if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) and best["computes"] is not None:
    stats["status"] = "optimal" if status == cp_model.OPTIMAL else "feasible"
    stats["lower_bound"] = solver.best_objective_bound * model.cost_scale
    # CP-SAT reports its hint as a first solution: found last, it wins only if shorter.
    found.append(FoundComputes(best["computes"], FOUND_BY_PHASE2))
  answer = min(found, key=lambda within: duration_of(graph, within.computes))
  stats.update(found_by=answer.found_by, time_to_best_s=clock.time_to_best_s, history=clock.history)
  schedule = schedule_from_computes(
    graph, answer.computes, solver="moccasin", budget=budget_bytes, stats=stats
  )
  return checked_schedule(graph, schedule, budget_bytes, "moccasin")


def _phase1(
  model: _Model,
  graph: RematGraph,
  budget_bytes: int,
  capacity: int,
  solver: cp_model.CpSolver,
  time_limit_s: float,
  clock: Clock,
  fallback: FoundComputes | None,
) -> FoundComputes:
  """Minimizes max(peak, budget); returns the first schedule within budget.

  Runs for ``time_limit_s`` at most; without a schedule within budget by then it returns
  ``fallback`` (a sequence within budget, already on the clock) or raises.

  Raises:
    NoScheduleFoundError: no schedule within budget and no fallback; when CP-SAT proved
      the model infeasible, with ``restricted_bound_bytes`` (see `restricted_model_error`).
  """
  model.model.minimize(model.peak)
  found: dict[str, Any] = {}

  def on_solution(cb: cp_model.CpSolverSolutionCallback) -> None:
    if cb.value(model.peak) <= capacity:
      computes = model.computes(cb.value)
      found["computes"] = computes
      clock.improved(duration_of(graph, computes), message=f"moccasin: {FOUND_BY_PHASE1}")
      cb.stop_search()

  solver.parameters.max_time_in_seconds = max(time_limit_s - clock.elapsed_s(), 0.01)
  status = solver.solve(model.model, _OnSolution(on_solution))
  if "computes" in found:
    return FoundComputes(found["computes"], FOUND_BY_PHASE1)
  if fallback is not None:
    return fallback
  unit = model.mem_unit
  if status == cp_model.OPTIMAL or solver.best_objective_bound > capacity:
    least = graph.resident_bytes + math.ceil(solver.best_objective_bound) * unit
    copies = sum(model.counts.values())
    order = "staged" if model.staged else "free"
    free = "" if order == "free" else "use order='free', "
    raise restricted_model_error(
      f"solver 'moccasin' found no schedule of graph {graph.name!r} within budget="
      f"{budget_bytes} bytes: CP-SAT proved that every schedule of its model ({order} "
      f"order, each node computed at most C_v times, {copies} copies in all) peaks at "
      f"{least} bytes or more. That bounds this model only, not every schedule; raise the "
      f"copies (copies=), {free}pass a hint, or try solver='auto' or 'cover'.",
      least,
    )
  reached = (
    f"phase 1 reached a peak of {graph.resident_bytes + int(solver.objective_value) * unit} bytes"
    if status == cp_model.FEASIBLE
    else "phase 1 found no solution"
  )
  raise NoScheduleFoundError(
    f"moccasin found no schedule within budget={budget_bytes} bytes in time_limit_s="
    f"{time_limit_s:g} ({reached}); raise the time limit, the budget or the copies, or pass "
    "a hint."
  )
