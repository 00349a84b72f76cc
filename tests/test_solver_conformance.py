"""Every registered solver x every shared graph x budgets 1.0, 0.9, 0.8, 0.7.

Each answer is a schedule that `simulate` accepts within budget and whose stats say who
found it (``found_by``), or an `InfeasibleBudgetError` (only below the proven bound
``graph.min_feasible_bytes``) / `NoScheduleFoundError`; a second run gives the same answer.
The default run covers every solver on the small graphs (exact solvers with a short
time limit); the full product is marked slow (``pytest -m slow``).
"""

from __future__ import annotations

import math

import pytest
from conftest import GRAPH_NAMES, shared_graph

import jaxremat
from jaxremat import InfeasibleBudgetError, NoScheduleFoundError, simulate

SOLVERS = jaxremat.available_solvers()
BUDGETS = (1.0, 0.9, 0.8, 0.7)
# Solvers whose answer depends on the wall clock (CP-SAT, MILP, or a portfolio that ends
# with one); the rest are deterministic functions of the graph.
TIMED = {"auto", "checkmate", "checkmate-lp", "moccasin"}
# Small graphs every solver sees in the default run; exact solvers only the first three.
FAST_GRAPHS = (
  "checkmate_vgg16_test",
  "checkmate_vgg16_train",
  "checkmate_vgg19_test",
  "checkmate_fcn_8_vgg_test",
  "checkmate_segnet_test",
  "checkmate_vgg_unet_test",
  "checkmate_vgg19_train",
  "checkmate_fcn_8_vgg_train",
  "checkmate_segnet_train",
  "moccasin_rl100",
)
FAST_TIMED_GRAPHS = FAST_GRAPHS[:3]
# Deterministic solvers whose fixed work can pass 2 s on a busy machine: a limit that
# never binds keeps the second run's answer identical.
TIME_LIMIT_S = {
  name: 60.0
  for name in (
    "cover",
    "cover-staged",
    "chen-greedy",
    "chen-greedy-ap",
    "chen-sqrtn",
    "chen-sqrtn-ap",
    "chen-search-ap",
    "segments",
  )
}


def _answer(graph, fraction, solver, time_limit):
  """(kind, detail): ("schedule", (events, duration)) or (error class name, message)."""
  try:
    s = jaxremat.solve(graph, fraction, solver, time_limit=time_limit, workers=1)
  except (InfeasibleBudgetError, NoScheduleFoundError) as e:
    return type(e).__name__, str(e), None
  return "schedule", (s.events, s.stats["duration"], s.stats["status"]), s


def _check(name, solver, fraction, time_limit):
  graph = shared_graph(name)
  budget_bytes = math.ceil(fraction * simulate(graph, jaxremat.baseline_schedule(graph)).peak_bytes)
  kind, detail, schedule = _answer(graph, fraction, solver, time_limit)
  if kind == "schedule":
    result = simulate(graph, schedule)
    assert result.valid, result.error
    assert result.peak_bytes <= budget_bytes == schedule.budget
    assert schedule.stats["status"] in ("optimal", "feasible")
    assert result.duration == schedule.stats["duration"]
    found_by = schedule.stats["found_by"]
    assert isinstance(found_by, str) and found_by
    if solver == "auto":
      assert found_by.startswith(schedule.stats["best_solver"])
    elif solver not in TIMED:
      assert found_by.split(" (")[0] == solver  # "chen-search-ap (local search)"
  elif kind == "InfeasibleBudgetError":
    # Raised only with a proof for every schedule: the bound of `require_feasible`.
    assert budget_bytes < graph.min_feasible_bytes
    assert f"smallest feasible peak of {graph.min_feasible_bytes} bytes" in detail
  else:
    assert "budget" in detail  # the message names the budget it missed
  kind2, detail2, _ = _answer(graph, fraction, solver, time_limit)
  if solver not in TIMED:
    assert (kind2, detail2) == (kind, detail)
  elif kind == kind2 == "schedule" and detail[2] == detail2[2] == "optimal":
    assert detail2[1] == pytest.approx(detail[1], rel=1e-9)


def _fast_cases():
  for solver in SOLVERS:
    names = FAST_TIMED_GRAPHS if solver in TIMED else FAST_GRAPHS
    for name in names:
      for fraction in BUDGETS:
        yield solver, name, fraction


@pytest.mark.parametrize("solver, name, fraction", list(_fast_cases()))
def test_solver_conformance(solver, name, fraction):
  _check(name, solver, fraction, time_limit=TIME_LIMIT_S.get(solver, 2.0))


@pytest.mark.slow
@pytest.mark.parametrize("fraction", BUDGETS)
@pytest.mark.parametrize("name", GRAPH_NAMES)
@pytest.mark.parametrize("solver", SOLVERS)
def test_solver_conformance_full(solver, name, fraction):
  _check(name, solver, fraction, time_limit=30.0)
