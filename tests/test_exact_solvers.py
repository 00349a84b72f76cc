"""The exact solvers against brute-force optima on tiny random DAGs, and their contracts."""

from __future__ import annotations

import heapq
import random
import time

import pytest
from conftest import shared_graph
from ortools.linear_solver import pywraplp

import jaxremat
from jaxremat import (
  InfeasibleBudgetError,
  NoScheduleFoundError,
  Progress,
  RematGraph,
  baseline_schedule,
  schedule_from_computes,
  simulate,
)
from jaxremat._src.solvers import checkmate
from jaxremat._src.solvers.base import get_solver
from jaxremat._src.solvers.exact_common import Clock, duration_of, warm_start_computes
from jaxremat._src.solvers.moccasin import bounded_by_duration, copy_counts

SEEDS = range(10)


def random_graph(seed: int) -> RematGraph:
  """A DAG of 4 to 7 computed nodes (and sometimes a resident input), integer costs."""
  rng = random.Random(seed)
  n_inputs = rng.choice([0, 0, 1])
  n = n_inputs + rng.randint(4, 7)
  edges = set()
  for v in range(n_inputs, n):
    for u in range(v):
      if rng.random() < 0.45:
        edges.add((u, v))
    if v > n_inputs and not any(e[1] == v and e[0] >= n_inputs for e in edges):
      edges.add((rng.randrange(n_inputs, v), v))
  mem = [rng.randint(1, 6) for _ in range(n)]
  cost = [rng.randint(1, 5) for _ in range(n)]
  return RematGraph.build(mem, cost, sorted(edges), inputs=range(n_inputs), name=f"rand{seed}")


def random_budget(graph: RematGraph, seed: int) -> int:
  """A budget between the proven lower bound and the baseline peak."""
  peak = simulate(graph, baseline_schedule(graph)).peak_bytes
  return random.Random(seed).randint(graph.min_feasible_bytes, peak)


def brute_force(graph: RematGraph, budget_bytes: int, kind: str) -> float | None:
  """The least duration of any schedule within budget (Dijkstra over program states).

  ``kind``: "free" (any order), "staged" (first computes in ``graph.order``,
  recomputations anywhere) or "checkmate" (stage k recomputes some of ``order[:k]`` in
  input order, then computes ``order[k]``; nothing after the last stage, so an early
  output can never be recomputed at the end). Frees may happen anywhere. None: infeasible.
  """
  order, preds, mem, cost = graph.order, graph.compute_preds, graph.mem, graph.cost
  n = len(order)
  pos = {v: k for k, v in enumerate(order)}
  out_mask = sum(1 << pos[v] for v in graph.outputs if not graph.is_input[v])
  free_bytes = budget_bytes - graph.resident_bytes
  pred_mask = [sum(1 << pos[u] for u in preds[v]) for v in order]

  def live_bytes(live: int) -> int:
    return sum(mem[order[i]] for i in range(n) if live >> i & 1)

  # state: (live, computed) for free/staged; (live, stage, last) for checkmate.
  start = (0, 0) if kind != "checkmate" else (0, 0, -1)
  dist = {start: 0}
  heap = [(0, start)]
  while heap:
    d, state = heapq.heappop(heap)
    if d > dist[state]:
      continue
    live = state[0]
    if kind == "checkmate":
      done = state[1] == n
    else:
      done = state[1] == (1 << n) - 1
    if done and live & out_mask == out_mask:
      return d
    moves = []
    for i in range(n):
      if live >> i & 1:
        moves.append(((live & ~(1 << i),) + state[1:], 0))
    for i in range(n):
      if live >> i & 1 or live & pred_mask[i] != pred_mask[i]:
        continue
      if live_bytes(live) + mem[order[i]] > free_bytes:
        continue
      new_live = live | 1 << i
      if kind == "free":
        moves.append(((new_live, state[1] | 1 << i), cost[order[i]]))
      elif kind == "staged":
        k = state[1].bit_count()
        if i < k or i == k:
          moves.append(((new_live, state[1] | 1 << i), cost[order[i]]))
      else:
        k, last = state[1], state[2]
        if last < i < k < n:
          moves.append(((new_live, k, i), cost[order[i]]))
        elif i == k:
          moves.append(((new_live, k + 1, -1), cost[order[i]]))
    for nxt, c in moves:
      if d + c < dist.get(nxt, float("inf")):
        dist[nxt] = d + c
        heapq.heappush(heap, (d + c, nxt))
  return None


def solve_or_none(graph, budget_bytes, solver, **options):
  """The optimal duration for the solver's model, or None where it proved the model
  infeasible (a `NoScheduleFoundError` with the model's bound, never a proof for all)."""
  try:
    schedule = jaxremat.solve(graph, budget_bytes, solver, time_limit=20, workers=2, **options)
  except NoScheduleFoundError as e:
    assert e.restricted_bound_bytes > budget_bytes, e
    return None
  check = simulate(graph, schedule)
  assert check.valid and check.peak_bytes <= budget_bytes
  assert schedule.stats["status"] == "optimal"
  return check.duration


# -- optimality against brute force -----------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_free_moccasin_reaches_the_free_optimum(seed):
  graph = random_graph(seed)
  budget = random_budget(graph, seed)
  expected = brute_force(graph, budget, "free")
  got = solve_or_none(graph, budget, "moccasin", order="free", copies=len(graph.order))
  assert got == expected


@pytest.mark.parametrize("seed", SEEDS)
def test_staged_moccasin_reaches_the_staged_optimum(seed):
  graph = random_graph(seed)
  budget = random_budget(graph, seed)
  expected = brute_force(graph, budget, "staged")
  got = solve_or_none(graph, budget, "moccasin", order="staged", copies=len(graph.order))
  assert got == expected


@pytest.mark.parametrize("backend", ["HIGHS", "SCIP"])  # SCIP starts from the warm start's hint
@pytest.mark.parametrize("seed", SEEDS)
def test_checkmate_reaches_the_checkmate_optimum(seed, backend):
  graph = random_graph(seed)
  budget = random_budget(graph, seed)
  got = solve_or_none(graph, budget, "checkmate", backend=backend)
  assert got == brute_force(graph, budget, "checkmate")


def test_staged_hint_is_a_solution_of_the_checkmate_milp():
  """The warm start rewritten into Checkmate's stages: with every R and S fixed to the
  hint, the MILP is feasible and its objective is the hint's duration."""
  checked = recomputing = 0
  for seed in range(30):
    graph = random_graph(seed)
    budget = random_budget(graph, seed)
    warm = warm_start_computes(graph, budget, staged=True, time_limit_s=5)
    start = warm.computes if warm else None
    solver = pywraplp.Solver.CreateSolver("SCIP")
    milp = checkmate._build(graph, budget, solver, True, Clock(None), 60)
    hint = checkmate._staged_hint(milp, graph, start) if start else None
    if hint is None:
      continue
    computes, values = hint
    result = simulate(graph, schedule_from_computes(graph, computes))
    if not (result.valid and result.peak_bytes <= budget):
      continue
    for x, value in values:
      x.SetBounds(value, value)
    assert solver.Solve() == pywraplp.Solver.OPTIMAL, seed
    assert solver.Objective().Value() * milp.cost_scale == pytest.approx(result.duration)
    checked += 1
    recomputing += len(computes) > len(graph.order)
    # First computes out of the input order: not a staged schedule, no hint.
    assert checkmate._staged_hint(milp, graph, start[1:] + start[:1]) is None
  assert checked >= 10 and recomputing >= 3


def test_auto_can_finish_with_checkmate_from_its_hint():
  graph = shared_graph("checkmate_vgg16_train")
  schedule = jaxremat.solve(graph, 0.9, "auto", exact="checkmate", time_limit=60, workers=2)
  portfolio = schedule.stats["portfolio"]
  assert isinstance(portfolio["checkmate"], float), portfolio["checkmate"]
  assert schedule.stats["tdi_percent"] == pytest.approx(1.968, abs=5e-4)  # the optimum


def test_a_hint_within_budget_bounds_the_model_and_keeps_the_optimum():
  bounded = 0
  for seed in SEEDS:
    graph = random_graph(seed)
    budget = random_budget(graph, seed)
    warm = warm_start_computes(graph, budget, staged=True, time_limit_s=5)
    if warm is None:
      continue
    start = warm.computes
    assert list(dict.fromkeys(start)) == list(graph.order)  # fits the staged model
    n = len(graph.order)
    hint = schedule_from_computes(graph, start)
    schedule = jaxremat.solve(
      graph, budget, "moccasin", hint=hint, copies=n, time_limit=20, workers=2
    )
    assert schedule.stats["status"] == "optimal"
    assert simulate(graph, schedule).duration == brute_force(graph, budget, "staged")
    counts, horizon = bounded_by_duration(graph, copy_counts(graph, n, True), start)
    slack = sum(graph.cost[v] for v in start) - sum(graph.cost[v] for v in graph.order)
    assert all(c == 1 for v, c in counts.items() if graph.cost[v] > slack)
    assert len(start) <= horizon <= n + sum(c - 1 for c in counts.values())
    bounded += horizon < n * n
  assert bounded >= 5  # the warm start fits on most seeds and shrinks the n * n slots


@pytest.mark.parametrize("staged", [True, False])
def test_warm_start_takes_covers_schedule_where_eviction_thrashes(staged):
  """On moccasin_rl100 at 0.8 eviction (`xla-greedy`) costs +54%; `cover` 2.30%, MOCCASIN's
  optimum 2.296%. The warm start is the shortest candidate, so it is cover's."""
  graph = shared_graph("moccasin_rl100")
  budget = jaxremat.parse_budget(0.8, simulate(graph, baseline_schedule(graph)).peak_bytes)
  start, found_by = warm_start_computes(graph, budget, staged=staged, time_limit_s=60)
  assert found_by.startswith("warm start: cover") or "refinement of cover" in found_by
  result = simulate(graph, schedule_from_computes(graph, start))
  assert result.valid and result.peak_bytes <= budget
  assert result.duration <= 1.0235 * sum(graph.cost[v] for v in graph.order)
  if staged:
    assert list(dict.fromkeys(start)) == list(graph.order)  # fits the staged model


def test_a_baseline_hint_leaves_one_copy_per_node():
  graph = random_graph(3)
  counts, horizon = bounded_by_duration(graph, copy_counts(graph, 3, True), graph.order)
  assert horizon == len(graph.order) and set(counts.values()) == {1}


def test_brute_force_orders_are_nested():
  # Sanity of the reference itself: each restriction can only cost more.
  for seed in SEEDS:
    graph = random_graph(seed)
    budget = random_budget(graph, seed)
    durations = [brute_force(graph, budget, k) for k in ("free", "staged", "checkmate")]
    finite = [d for d in durations if d is not None]
    assert finite == sorted(finite)
    assert durations[0] is not None or durations[1] is None


# -- contracts -----------------------------------------------------------------------------


def chain_with_skip() -> RematGraph:
  # 0 -> 1 -> 2 -> 3 and 0 -> 3: node 0 is held across the chain (peak 2 + 3 + 3 = 8 at
  # node 2) unless it is recomputed before node 3 (peak 6, the simple lower bound).
  return RematGraph.build([2, 3, 3, 1], [1, 1, 1, 1], [(0, 1), (1, 2), (2, 3), (0, 3)])


def early_output() -> RematGraph:
  """Input 0 (3 bytes) feeds outputs 3 and 4 (5 bytes each); 1 -> 2 -> 3 and 1 -> 4.

  In the input order (1, 2, 3, 4) output 3 is held while 4 is computed with 1 and the
  input: 3 + 5 + 3 + 5 = 16 bytes. Computing 4 before 3 (or 3 again after 4) peaks at
  14. Checkmate's stages cannot recompute after the last stage, so its model needs 15.
  """
  return RematGraph.build(
    [3, 3, 1, 5, 5], [1, 1, 1, 1, 1], [(0, 3), (0, 4), (1, 2), (1, 4), (2, 3)], inputs=[0]
  )


@pytest.mark.parametrize("solver", ["moccasin", "checkmate", "checkmate-lp"])
def test_budget_below_the_lower_bound_raises(solver):
  graph = chain_with_skip()
  with pytest.raises(InfeasibleBudgetError) as info:
    jaxremat.solve(graph, graph.min_feasible_bytes - 1, solver, time_limit=5, workers=2)
  assert info.value.min_feasible_bytes == graph.min_feasible_bytes
  assert "inputs and output of #2" in str(info.value)  # the message states its proof


@pytest.mark.parametrize("solver", ["moccasin", "checkmate", "checkmate-lp", "noremat"])
def test_solvers_check_the_proven_bound_first_when_called_directly(solver):
  graph = chain_with_skip()
  with pytest.raises(InfeasibleBudgetError):
    get_solver(solver)(graph, 5, time_limit_s=5, workers=1, progress=None)


def test_moccasin_reports_its_model_infeasible_without_claiming_a_proof():
  # A diamond whose join needs both branches live: the budget passes the simple bound
  # (3 + 3 + 1 = 7 at the join) but the root must also be live while a branch is computed.
  # CP-SAT proves its model (4 copies, free order) infeasible; that is no proof for every
  # schedule, so the answer is NoScheduleFoundError carrying the model's bound.
  graph = RematGraph.build([4, 3, 3, 1], [1, 1, 1, 1], [(0, 1), (0, 2), (1, 3), (2, 3)])
  budget = graph.min_feasible_bytes
  assert brute_force(graph, budget, "free") is None
  with pytest.raises(NoScheduleFoundError, match="bounds this model only") as info:
    jaxremat.solve(graph, budget, "moccasin", order="free", copies=4, time_limit=10, workers=2)
  assert not isinstance(info.value, InfeasibleBudgetError)
  assert info.value.restricted_bound_bytes == 10 > budget


def test_too_few_copies_is_no_schedule_found_where_more_copies_fit():
  # With C_v = 1 nothing is recomputed: the staged model peaks at 8 bytes. One
  # recomputation of node 0 fits 6, so 8 bounds the model, not the graph.
  graph, budget = chain_with_skip(), 6
  with pytest.raises(NoScheduleFoundError, match="raise the copies") as info:
    jaxremat.solve(graph, budget, "moccasin", copies=1, warm_start=False, time_limit=10)
  assert not isinstance(info.value, InfeasibleBudgetError)
  assert info.value.restricted_bound_bytes == 8
  more = jaxremat.solve(graph, budget, "moccasin", copies=2, warm_start=False, time_limit=10)
  assert more.stats["peak_bytes"] <= budget and more.stats["n_recompute"] == 1


@pytest.mark.parametrize("backend", ["SCIP", "HIGHS"])
def test_checkmate_model_infeasible_is_no_schedule_found_where_a_free_order_fits(backend):
  graph, budget = early_output(), 14
  assert brute_force(graph, budget, "checkmate") is None
  assert brute_force(graph, budget, "free") == 4
  with pytest.raises(NoScheduleFoundError, match="Checkmate model") as info:
    jaxremat.solve(graph, budget, "checkmate", backend=backend, time_limit=10, workers=1)
  assert not isinstance(info.value, InfeasibleBudgetError)
  assert info.value.restricted_bound_bytes == budget + 1
  free = jaxremat.solve(graph, budget, "moccasin", order="free", time_limit=10, workers=1)
  assert free.stats["duration"] == 4 and free.stats["peak_bytes"] <= budget
  with pytest.raises(NoScheduleFoundError, match="without recomputation peaks at 16 bytes"):
    jaxremat.solve(graph, budget, "noremat")


def test_checkmate_lp_relaxation_infeasible_is_no_schedule_found():
  # Outputs 1, 2 and 3 need 13 bytes at the end, over budget 8 = min_feasible_bytes (the
  # largest compute alone). The LP relaxation sees it; it proves the Checkmate model
  # infeasible, which the solver reports as such, with no claim about every schedule.
  graph = RematGraph.build([2, 6, 1, 6], [1, 1, 1, 1], [(0, 1), (0, 2), (0, 3)])
  budget = graph.min_feasible_bytes
  assert budget == 8
  with pytest.raises(NoScheduleFoundError, match="LP relaxation infeasible") as info:
    jaxremat.solve(graph, budget, "checkmate-lp", time_limit=10, workers=1)
  assert not isinstance(info.value, InfeasibleBudgetError)
  assert info.value.restricted_bound_bytes == budget + 1


def test_recomputation_under_a_tight_budget():
  graph = chain_with_skip()
  assert graph.min_feasible_bytes == 6
  for solver in ("moccasin", "checkmate"):
    for budget, recomputes in ((6, 1), (7, 1), (8, 0)):
      schedule = jaxremat.solve(graph, budget, solver, time_limit=10, workers=2)
      assert schedule.stats["n_recompute"] == recomputes
      assert schedule.stats["peak_bytes"] <= budget


def test_hint_is_a_warm_start_and_raises_copies():
  graph, budget = chain_with_skip(), 6
  expected = brute_force(graph, budget, "free")
  optimum = jaxremat.solve(graph, budget, "moccasin", order="free", copies=3)
  assert optimum.stats["n_recompute"] == 1 and optimum.stats["duration"] == expected == 5
  # copies=1 cannot recompute, but the hint's recomputation raises C_v where needed.
  again = jaxremat.solve(
    graph, budget, "moccasin", order="free", copies=1, hint=optimum, time_limit=10
  )
  assert again.stats["duration"] == expected
  assert again.stats["history"][0][1] == expected  # the hint itself was the first best
  assert again.stats["found_by"] == "hint"  # returned as given: nothing is shorter


# -- who found the schedule ------------------------------------------------------------


def cp_sat_beats_cover() -> tuple[RematGraph, int]:
  """A DAG where the staged warm start (cover-staged, 28) is not optimal (26) at budget 28."""
  graph = RematGraph.build(
    [4, 5, 4, 6, 5, 4, 4, 5, 4],
    [5, 1, 1, 2, 3, 3, 3, 4, 3],
    [(0, 1), (0, 2), (0, 6), (1, 2), (1, 3), (1, 4), (1, 8), (3, 5), (3, 7), (5, 6)],
  )
  return graph, 28


@pytest.mark.parametrize("solver", ["moccasin", "checkmate"])
def test_found_by_names_the_warm_start_that_the_search_cannot_improve(solver):
  graph, budget = chain_with_skip(), 6
  warm = warm_start_computes(graph, budget, staged=True, time_limit_s=5)
  assert warm.found_by == "warm start: cover-staged"
  assert duration_of(graph, warm.computes) == brute_force(graph, budget, "staged") == 5
  schedule = jaxremat.solve(graph, budget, solver, time_limit=10, workers=1)
  assert schedule.stats["found_by"] == warm.found_by
  assert list(schedule.computes) == warm.computes  # the warm start itself


@pytest.mark.parametrize("solver", ["moccasin", "checkmate"])
def test_found_by_names_the_exact_search_where_it_improves_on_the_warm_start(solver):
  graph, budget = cp_sat_beats_cover()
  warm = warm_start_computes(graph, budget, staged=True, time_limit_s=5)
  assert warm.found_by == "warm start: cover-staged" and duration_of(graph, warm.computes) == 28
  schedule = jaxremat.solve(graph, budget, solver, time_limit=20, workers=1)
  assert schedule.stats["duration"] == brute_force(graph, budget, "staged") == 26
  expected = "cp-sat search: phase 2" if solver == "moccasin" else "milp search (SCIP)"
  assert schedule.stats["found_by"] == expected
  # The same from a hint: the search, not the hint, found the answer.
  hint = schedule_from_computes(graph, warm.computes)
  again = jaxremat.solve(graph, budget, solver, hint=hint, time_limit=20, workers=1)
  assert again.stats["duration"] == 26 and again.stats["found_by"] == expected


def test_found_by_of_the_phase1_search_and_of_lp_rounding():
  graph, budget = chain_with_skip(), 6
  # No warm start: phase 1 finds a schedule within budget, phase 2 shortens it.
  cold = jaxremat.solve(graph, budget, "moccasin", warm_start=False, time_limit=10, workers=1)
  assert cold.stats["found_by"] == "cp-sat search: phase 2"
  assert [d for _, d in cold.stats["history"]][-1] == 5
  # The MILP from scratch, and the LP's rounding.
  mip = jaxremat.solve(graph, budget, "checkmate", warm_start=False, time_limit=10, workers=1)
  assert mip.stats["found_by"] == "milp search (SCIP)"
  lp = jaxremat.solve(*cp_sat_beats_cover(), "checkmate-lp", time_limit=10, workers=1)
  assert lp.stats["found_by"].startswith("lp rounding: epsilon=")


def test_invalid_hint_and_options_are_rejected():
  graph = chain_with_skip()
  bad = schedule_from_computes(graph, [1, 0, 2, 3])
  with pytest.raises(ValueError, match="hint is not a valid schedule"):
    jaxremat.solve(graph, 1.0, "moccasin", hint=bad)
  with pytest.raises(ValueError, match="copies=0"):
    jaxremat.solve(graph, 1.0, "moccasin", copies=0)
  with pytest.raises(ValueError, match="order='any'"):
    jaxremat.solve(graph, 1.0, "moccasin", order="any")
  with pytest.raises(ValueError, match="backend='NOPE'"):
    jaxremat.solve(graph, 1.0, "checkmate", backend="NOPE")


def test_copy_counts_drop_useless_copies():
  graph = chain_with_skip()
  free = copy_counts(graph, 3, staged=False)
  assert free == {3: 1, 2: 1, 1: 1, 0: 2}  # a sink output needs one copy; 0 feeds 1 and 3
  # Staged: the first copy is forced into its stage and may go unused.
  assert copy_counts(graph, {0: 3}, staged=True) == {3: 2, 2: 2, 1: 2, 0: 3}


def test_progress_reports_improving_schedules():
  graph = random_graph(5)
  budget = random_budget(graph, 5)
  reports = []
  schedule = jaxremat.solve(graph, budget, "moccasin", progress=reports.append, time_limit=10)
  assert reports and all(isinstance(r, Progress) for r in reports)
  durations = [r.best_duration for r in reports]
  assert durations == sorted(durations, reverse=True)
  assert durations[-1] == schedule.stats["duration"]
  assert schedule.stats["time_to_best_s"] <= schedule.stats["solve_time_s"]


def test_checkmate_lp_is_honest():
  for seed in SEEDS:
    graph = random_graph(seed)
    budget = random_budget(graph, seed)
    exact = brute_force(graph, budget, "checkmate")
    if exact is None:
      continue
    try:
      schedule = jaxremat.solve(graph, budget, "checkmate-lp", time_limit=20)
    except NoScheduleFoundError as e:
      assert "over budget" in str(e)
      continue
    assert schedule.stats["peak_bytes"] <= budget
    assert schedule.stats["lower_bound"] <= exact + 1e-6 <= schedule.stats["duration"] + 1e-6
    assert all("epsilon" in t for t in schedule.stats["rounding"])


def test_time_limit_is_honored():
  graph = shared_graph("moccasin_rl250")
  start = time.perf_counter()
  try:
    schedule = jaxremat.solve(graph, 0.8, "moccasin", time_limit=3, workers=2)
    assert schedule.stats["peak_bytes"] <= schedule.budget
  except NoScheduleFoundError:
    pass
  # Model building and the final check come on top of CP-SAT's own limit.
  assert time.perf_counter() - start < 3 + 10


def test_vgg16_reaches_the_reference_tdi():
  graph = shared_graph("checkmate_vgg16_train")
  schedule = jaxremat.solve(graph, 0.9, "moccasin", time_limit=5, workers=2)
  assert schedule.stats["tdi_percent"] <= 1.968 + 5e-4


@pytest.mark.slow
def test_checkmate_matches_staged_moccasin_on_vgg16():
  graph = shared_graph("checkmate_vgg16_train")
  mip = jaxremat.solve(graph, 0.9, "checkmate", time_limit=120, workers=2)
  cp = jaxremat.solve(graph, 0.9, "moccasin", time_limit=120, workers=2)
  assert mip.stats["status"] == cp.stats["status"] == "optimal"
  assert mip.stats["duration"] == cp.stats["duration"]
