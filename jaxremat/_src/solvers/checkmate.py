"""`checkmate` and `checkmate-lp`: the MILP over R, S, U and FREE with frontier-advancing stages.

Stage t computes node ``order[t]`` for the first time and may first recompute any of
``order[:t]``, in input order. ``R[t, i]``: node i is computed in stage t; ``S[t, i]``:
i is in memory when stage t starts; ``FREE[t, i, k]``: i is freed right after k is
computed in stage t; ``U[t, k]``: memory after k is computed in stage t.

References:
  Jain, Jain, Nrusimha, Gholami, Abbeel, Keutzer, Stoica, Gonzalez. "Checkmate: Breaking
  the Memory Wall with Optimal Tensor Rematerialization", MLSys 2020.
  https://arxiv.org/abs/1910.02653
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ortools.linear_solver import pywraplp

from jaxremat._src.errors import NoScheduleFoundError, SolverError
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
  is_staged,
  memory_unit,
  restricted_model_error,
  warm_start_computes,
)

# OR-Tools names of the MIP backends tried in this order when backend="auto". SCIP first:
# from the warm start's hint it proved fcn_8_vgg_train at 0.8 optimal in 4.4 s, HiGHS
# (no hint) in 35 s.
MIP_BACKENDS = ("SCIP", "HIGHS", "SAT", "CBC")
LP_BACKENDS = ("GLOP", "HIGHS_LP", "CLP", "PDLP")
# Backends that start from a solution hint. OR-Tools 9.15 crashes (SIGSEGV) when a hint
# is given to HiGHS, so the others get none.
HINT_BACKENDS = ("SCIP", "SAT")
BOUND_SCOPE = "checkmate model: input order, frontier-advancing stages"
# What an infeasible Checkmate program proves, and what to try instead.
MSG_MODEL_INFEASIBLE = (
  "solver {solver!r} found no schedule of graph {graph!r} within budget={budget} bytes: {what} "
  "proved that no schedule of the Checkmate model (first computes in the input order, "
  "recomputations only within the frontier-advancing stages) fits. That bounds this model "
  "only, not every schedule; try solver='moccasin' with order='free' or solver='auto', "
  "or raise the budget."
)


def _create_solver(backend: str, choices: tuple[str, ...], argument: str) -> pywraplp.Solver:
  names = choices if backend == "auto" else (backend,)
  for name in names:
    solver = pywraplp.Solver.CreateSolver(name)
    if solver is not None:
      solver.backend_name = name  # SolverVersion() does not always name the backend
      return solver
  raise ValueError(
    f"{argument}={backend!r} is not available in this OR-Tools build; use 'auto' or one of "
    f"{', '.join(choices)}."
  )


# -- the model ------------------------------------------------------------------------------


@dataclasses.dataclass
class _Milp:
  solver: pywraplp.Solver
  order: tuple[int, ...]
  deps: list[list[int]]  # positions in order of each node's non-input predecessors
  users: list[list[int]]
  outputs: set[int]
  R: dict[tuple[int, int], Any]
  S: dict[tuple[int, int], Any]
  int_costs: list[int]
  cost_scale: float


def _build(
  graph: RematGraph,
  budget_bytes: int,
  solver: pywraplp.Solver,
  integer: bool,
  clock: Clock,
  time_limit_s: float,
) -> _Milp:
  """Builds the Checkmate program (section 4 of the paper) on ``solver``.

  ``integer=False`` gives the LP relaxation. The program has O(n^2) variables and is
  built in Python, so on large graphs building alone can outlast the time limit.

  Raises:
    NoScheduleFoundError: the time limit passed while building.
  """
  order = graph.order
  n = len(order)
  position = {v: k for k, v in enumerate(order)}
  deps = [[position[u] for u in graph.compute_preds[v]] for v in order]
  users = [[position[w] for w in graph.succs[v]] for v in order]
  unit = memory_unit(graph)
  mem = [graph.mem[v] // unit for v in order]
  capacity = (budget_bytes - graph.resident_bytes) // unit
  int_costs, cost_scale = integer_costs(graph)
  outputs = {position[v] for v in graph.outputs if not graph.is_input[v]}

  def boolean(name: str):
    return solver.BoolVar(name) if integer else solver.NumVar(0.0, 1.0, name)

  def check_clock(t: int) -> None:
    if clock.elapsed_s() > time_limit_s:
      raise NoScheduleFoundError(
        f"building the Checkmate program of graph {graph.name!r} ({n} nodes, O(n^2) "
        f"variables) for budget={budget_bytes} bytes outlasted time_limit_s={time_limit_s:g} "
        f"at stage {t} of {n}; raise the time limit or use solver='moccasin', whose model "
        "grows as O(n)."
      )

  # Variables and objective stage by stage, so that the clock is checked while they grow.
  R, S = {}, {}
  objective = solver.Objective()
  for t in range(n):
    check_clock(t)
    for i in range(t):
      R[t, i] = boolean(f"R{t}_{i}")
      S[t, i] = boolean(f"S{t}_{i}")
      objective.SetCoefficient(R[t, i], int_costs[order[i]])
    R[t, t] = 1  # the frontier advances: stage t computes node t
    objective.SetOffset(objective.offset() + int_costs[order[t]])
  objective.SetMinimization()

  def retained(t: int, i: int):
    """S[t, i], with S[n, i] fixed: only outputs are in memory at the end."""
    if t == n:
      return 1 if i in outputs else 0
    return S[t, i] if i < t else 0

  for t in range(n):
    check_clock(t)
    for k in range(t + 1):
      # A compute needs each input in memory or computed earlier in the stage.
      for i in deps[k]:
        solver.Add(R[t, k] <= R[t, i] + retained(t, i))
    for i in range(t + 1):
      # Only a value in memory during stage t can be kept into stage t + 1.
      keep = retained(t + 1, i)
      if not (isinstance(keep, int) and keep == 0):
        solver.Add(keep <= R[t, i] + retained(t, i))

    # Memory within stage t, and the frees after each compute.
    usage = sum(mem[i] * S[t, i] for i in range(t)) if t else 0
    for k in range(t + 1):
      usage = usage + mem[k] * R[t, k]
      solver.Add(usage <= capacity)
      freed = 0
      for i in [*deps[k], k]:
        later_users = [j for j in users[i] if k < j <= t]
        hazards = (1 - R[t, k]) + retained(t + 1, i) + sum(R[t, j] for j in later_users)
        kappa = 2 + len(later_users)
        free = boolean(f"F{t}_{i}_{k}")
        # FREE = 1 exactly when nothing still needs i (paper eq. 7, linearized).
        solver.Add(1 - free <= hazards)
        solver.Add(hazards <= kappa * (1 - free))
        freed = freed + mem[i] * free
      usage = usage - freed
  return _Milp(solver, order, deps, users, outputs, R, S, int_costs, cost_scale)


def _value(x) -> float:
  return float(x) if isinstance(x, int) else x.solution_value()


def _computes_from(milp: _Milp, R_value, S_value) -> list[int]:
  """The compute sequence of R; a node already in memory (S) is not computed again."""
  n = len(milp.order)
  computes = []
  for t in range(n):
    for i in range(t + 1):
      if R_value(t, i) and not (i < t and S_value(t, i)):
        computes.append(milp.order[i])
  return computes


def _staged_hint(
  milp: _Milp, graph: RematGraph, computes: list[int]
) -> tuple[list[int], list[tuple[Any, float]]] | None:
  """A staged compute sequence (first computes in ``milp.order``) in the model's terms.

  Returns the sequence with each stage's computes in input order, as the model runs them,
  and the value of every R and S variable; None when the first computes leave the input
  order or a stage computes a node twice, which the model cannot say.
  """
  if not is_staged(graph, computes):
    return None
  position = {v: k for k, v in enumerate(milp.order)}
  R: set[tuple[int, int]] = set()
  t = 0
  for v in computes:
    if (t, position[v]) in R:
      return None
    R.add((t, position[v]))
    t += position[v] == t
  in_order = _computes_from(milp, lambda t, i: (t, i) in R, lambda t, i: False)
  # S: what is in memory when each stage starts, each value freed at its last read.
  S: set[tuple[int, int]] = set()
  live: set[int] = set()
  t = started = 0  # the stage of the next compute, the last stage whose S is recorded
  for kind, v in schedule_from_computes(graph, in_order).events:
    if kind == "free":
      live.discard(position[v])
      continue
    if t > started:  # stage t starts: what is in memory
      S.update((t, i) for i in live)
      started = t
    live.add(position[v])
    t += position[v] == t  # the frontier ends its stage
  values = [(x, float(key in R)) for key, x in milp.R.items() if key[1] < key[0]]
  values += [(x, float(key in S)) for key, x in milp.S.items()]
  return in_order, values


# -- checkmate: the MILP --------------------------------------------------------------------


def solve_checkmate(
  graph: RematGraph,
  budget_bytes: int,
  *,
  time_limit_s: float = 60.0,
  workers: int = 1,
  progress: ProgressCallback | None = None,
  backend: str = "auto",
  hint: Schedule | None = None,
  warm_start: bool = True,
  log_search: bool = False,
) -> Schedule:
  """Checkmate's MILP solved by an OR-Tools MIP backend.

  ``stats["status"]`` "optimal" means optimal for the Checkmate model (input order,
  frontier-advancing stages); ``lower_bound`` is the backend's bound for that model;
  ``found_by`` is "hint" or "warm start: ..." when the start is returned (the backend
  found nothing shorter), else "milp search (<backend>)".

  Args:
    graph: the graph.
    budget_bytes: the peak memory allowed, in bytes.
    time_limit_s: wall seconds for the backend.
    workers: threads for backends that use them.
    progress: called once with the final result (the wrappers report no incumbents).
    backend: "auto" (first available of MIP_BACKENDS) or one of them.
    hint: a schedule to start from, in place of the warm start; used when its first
      computes follow the input order.
    warm_start: without ``hint``, start from the best staged heuristic schedule within
      budget (`warm_start_computes`, at most `WARM_START_SHARE` of the time). The start
      is rewritten into the model's stages: a hint for the backends of `HINT_BACKENDS`,
      and the answer if the backend finds nothing shorter in time.
    log_search: print the backend's log.

  Returns:
    A schedule that `simulate` accepts with peak <= ``budget_bytes``.

  Raises:
    InfeasibleBudgetError: ``budget_bytes`` is below ``graph.min_feasible_bytes``, a
      bound on every schedule (`RematGraph.require_feasible`).
    NoScheduleFoundError: the time limit passed without an integer solution, or the
      backend proved the MILP infeasible; the latter proves nothing about schedules
      outside the Checkmate model, and the error's ``restricted_bound_bytes`` is
      ``budget_bytes + 1``.

  References:
    Jain et al., "Checkmate: Breaking the Memory Wall with Optimal Tensor
    Rematerialization", MLSys 2020, section 4.
  """
  graph.require_feasible(budget_bytes)
  clock = Clock(progress)
  if not graph.order:
    stats = {"status": "optimal", "found_by": FOUND_BY_EMPTY}
    return Schedule((), graph.name, budget_bytes, "checkmate", stats)
  solver = _create_solver(backend, MIP_BACKENDS, "backend")
  heuristic = FoundComputes(list(hint.computes), "hint") if hint is not None else None
  if heuristic is None and warm_start:
    heuristic = warm_start_computes(graph, budget_bytes, True, WARM_START_SHARE * time_limit_s)
  milp = _build(graph, budget_bytes, solver, True, clock, time_limit_s)
  rewritten = _staged_hint(milp, graph, heuristic.computes) if heuristic is not None else None
  start = None  # the warm start in the model's stages, when it fits the budget there
  if rewritten is not None:
    in_order, values = rewritten
    result = simulate(graph, schedule_from_computes(graph, in_order))
    if result.valid and result.peak_bytes <= budget_bytes:
      found_by = heuristic.found_by
      if in_order != heuristic.computes:
        found_by += " (reordered into the model's stages)"
      start = FoundComputes(in_order, found_by)
      clock.improved(result.duration, message=f"checkmate: {found_by}")
      if solver.backend_name in HINT_BACKENDS:
        solver.SetHint([x for x, _ in values], [value for _, value in values])
  solver.SetTimeLimit(max(1, int(1000 * (time_limit_s - clock.elapsed_s()))))
  solver.SetNumThreads(max(1, int(workers)))
  if log_search:
    solver.EnableOutput()
  status = solver.Solve()
  if status == pywraplp.Solver.INFEASIBLE:
    raise restricted_model_error(
      MSG_MODEL_INFEASIBLE.format(
        solver="checkmate",
        graph=graph.name,
        budget=budget_bytes,
        what=f"the {solver.backend_name} backend",
      ),
      budget_bytes + 1,
    )
  solved = status in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE)
  if not solved and start is None:
    raise NoScheduleFoundError(
      f"checkmate ({solver.backend_name}) found no schedule within budget="
      f"{budget_bytes} bytes in time_limit_s={time_limit_s:g}; raise the time limit or "
      "use solver='moccasin'."
    )
  best = start
  if solved:
    found = _computes_from(
      milp, lambda t, i: _value(milp.R[t, i]) > 0.5, lambda t, i: _value(milp.S[t, i]) > 0.5
    )
    # From a hint the backend reports the hint itself: only a shorter one is its own find.
    if start is None or duration_of(graph, found) < duration_of(graph, start.computes):
      best = FoundComputes(found, f"milp search ({solver.backend_name})")
  duration = duration_of(graph, best.computes)
  bound = solver.Objective().BestBound() * milp.cost_scale if solved else None
  clock.improved(duration, bound, f"checkmate: {best.found_by}")
  stats = {
    "status": "optimal" if status == pywraplp.Solver.OPTIMAL else "feasible",
    "lower_bound": bound,
    "bound_scope": BOUND_SCOPE,
    "backend": solver.backend_name,
    "warm_start": start is not None,
    "found_by": best.found_by,
    "time_to_best_s": clock.time_to_best_s,
    "history": clock.history,
  }
  schedule = schedule_from_computes(
    graph, best.computes, solver="checkmate", budget=budget_bytes, stats=stats
  )
  return checked_schedule(graph, schedule, budget_bytes, "checkmate")


# -- checkmate-lp: LP relaxation and two-phase rounding ---------------------------------------

# Budget allowances tried by default: the LP is solved for (1 - epsilon) x budget so that
# the rounded schedule, which uses more memory than the LP, may still fit the budget.
DEFAULT_EPSILONS = (0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5)


def _round(milp: _Milp, threshold: float) -> list[int]:
  """Two-phase rounding: S by ``threshold``, then the least R that makes S valid.

  Scanning stage t from its frontier down, node i is computed when the stage needs it and
  it is not in memory: it is the frontier, it is kept into stage t + 1, or a node computed
  later in the stage reads it.
  """
  n = len(milp.order)
  S = {key: _value(s) > threshold for key, s in milp.S.items()}

  def in_memory(t: int, i: int) -> bool:
    if t == n:
      return i in milp.outputs
    return i < t and S[t, i]

  R = {}
  for t in range(n):
    for i in range(t, -1, -1):
      needed = i == t or in_memory(t + 1, i) or any(R.get((t, j), False) for j in milp.users[i])
      R[t, i] = needed and not in_memory(t, i)
  return _computes_from(milp, lambda t, i: R[t, i], lambda t, i: False)


def solve_checkmate_lp(
  graph: RematGraph,
  budget_bytes: int,
  *,
  time_limit_s: float = 60.0,
  workers: int = 1,
  progress: ProgressCallback | None = None,
  backend: str = "auto",
  epsilons: tuple[float, ...] = DEFAULT_EPSILONS,
  threshold: float = 0.5,
  log_search: bool = False,
) -> Schedule:
  """Checkmate's approximation: LP relaxation, two-phase rounding, budget allowance search.

  For each allowance epsilon the LP is solved with the budget (1 - epsilon) x
  ``budget_bytes``, S is rounded at ``threshold`` and R is the least that restores a
  valid schedule; the shortest rounded schedule within the real budget wins. The LP
  objective at epsilon = 0 is ``stats["lower_bound"]`` (for the Checkmate model);
  ``stats["rounding"]`` lists every epsilon tried with its rounded peak and duration;
  ``stats["found_by"]`` is "lp rounding: epsilon=<the allowance that won>".

  Args:
    graph: the graph.
    budget_bytes: the peak memory allowed, in bytes.
    time_limit_s: wall seconds for all the LPs together.
    workers: threads for backends that use them.
    progress: called with each better rounded schedule within budget.
    backend: "auto" (first available of GLOP, HIGHS_LP, CLP, PDLP) or one of them.
    epsilons: the budget allowances to try, each in [0, 1).
    threshold: S is rounded to 1 above it.
    log_search: print the backend's log.

  Returns:
    A schedule that `simulate` accepts with peak <= ``budget_bytes``.

  Raises:
    InfeasibleBudgetError: ``budget_bytes`` is below ``graph.min_feasible_bytes``, a
      bound on every schedule (`RematGraph.require_feasible`).
    NoScheduleFoundError: every rounded schedule exceeded the budget (the message gives
      the least violation), the time limit passed, or the LP relaxation is infeasible at
      epsilon = 0; the latter proves nothing about schedules outside the Checkmate
      model, and the error's ``restricted_bound_bytes`` is ``budget_bytes + 1``.

  References:
    Jain et al., "Checkmate: Breaking the Memory Wall with Optimal Tensor
    Rematerialization", MLSys 2020, section 5 (two-phase rounding, budget allowance).
  """
  graph.require_feasible(budget_bytes)
  clock = Clock(progress)
  if not graph.order:
    stats = {"status": "optimal", "found_by": FOUND_BY_EMPTY}
    return Schedule((), graph.name, budget_bytes, "checkmate-lp", stats)
  for eps in epsilons:
    if not 0 <= eps < 1:
      raise ValueError(f"epsilons contains {eps!r}; each allowance must be in [0, 1).")
  best: tuple[float, list[int], str] | None = None
  tried: list[dict[str, Any]] = []
  lower_bound = None
  for eps in sorted(epsilons):
    remaining_s = time_limit_s - clock.elapsed_s()
    if remaining_s <= 0:
      break
    reduced = graph.resident_bytes + int((1 - eps) * (budget_bytes - graph.resident_bytes))
    if reduced < graph.min_feasible_bytes:
      break
    solver = _create_solver(backend, LP_BACKENDS, "backend")
    try:
      milp = _build(graph, reduced, solver, False, clock, time_limit_s)
    except NoScheduleFoundError:
      if best is None:
        raise
      break
    solver.SetTimeLimit(max(1, int(1000 * (time_limit_s - clock.elapsed_s()))))
    solver.SetNumThreads(max(1, int(workers)))
    if log_search:
      solver.EnableOutput()
    status = solver.Solve()
    if status != pywraplp.Solver.OPTIMAL:
      if eps == 0 and status == pywraplp.Solver.INFEASIBLE:
        raise restricted_model_error(
          MSG_MODEL_INFEASIBLE.format(
            solver="checkmate-lp",
            graph=graph.name,
            budget=budget_bytes,
            what=f"the {solver.backend_name} backend, finding its LP relaxation infeasible,",
          ),
          budget_bytes + 1,
        )
      tried.append({"epsilon": eps, "lp_status": int(status)})
      continue
    lp_objective = solver.Objective().Value() * milp.cost_scale
    if eps == 0:
      lower_bound = lp_objective
    computes = _round(milp, threshold)
    result = simulate(graph, schedule_from_computes(graph, computes))
    if not result.valid:
      raise SolverError(f"checkmate-lp rounding built an invalid schedule: {result.error}")
    tried.append(
      {
        "epsilon": eps,
        "lp_objective": lp_objective,
        "peak_bytes": result.peak_bytes,
        "duration": result.duration,
        "within_budget": result.peak_bytes <= budget_bytes,
      }
    )
    if result.peak_bytes <= budget_bytes:
      if best is None or result.duration < best[0]:
        best = (result.duration, computes, f"lp rounding: epsilon={eps:g}")
        clock.improved(result.duration, lower_bound, f"checkmate-lp: {best[2]}")
      break  # the smallest allowance that fits: larger ones constrain the LP further
  if best is None:
    over = [t for t in tried if "peak_bytes" in t]
    least = min((t["peak_bytes"] for t in over), default=None)
    detail = (
      f"the least rounded peak was {least} bytes, {least - budget_bytes} bytes "
      f"({100 * (least - budget_bytes) / budget_bytes:.2f}%) over budget"
      if least is not None
      else "no LP was solved"
    )
    raise NoScheduleFoundError(
      f"checkmate-lp found no rounded schedule within budget={budget_bytes} bytes over "
      f"epsilons={tuple(sorted(epsilons))} ({detail}); use solver='checkmate' or 'moccasin'."
    )
  stats = {
    "status": "feasible",
    "lower_bound": lower_bound,
    "bound_scope": BOUND_SCOPE,
    "rounding": tried,
    "found_by": best[2],
    "time_to_best_s": clock.time_to_best_s,
    "history": clock.history,
  }
  schedule = schedule_from_computes(
    graph, best[1], solver="checkmate-lp", budget=budget_bytes, stats=stats
  )
  return checked_schedule(graph, schedule, budget_bytes, "checkmate-lp")
