"""The model of plans pinned in their order (`jaxremat._src.pinned`), on XLA:CPU."""

from __future__ import annotations

import jax
import pytest
from backend import FACTS, assert_trees_allclose, counted_compiles

import examples
import jaxremat
from jaxremat._src import pinned
from jaxremat._src.planner import Attempt, PlanOptions, _Deadline, _Loop, _Tried
from jaxremat._src.simulate import baseline_schedule
from jaxremat._src.xla_memory import xla_accounted_peak_bytes

pytestmark = pytest.mark.skipif(
  FACTS.pin_first != "all", reason="plans are pinned in their order first on CPU and GPU only"
)


@pytest.fixture(scope="module")
def resnet():
  """A ResNet step with batch norms, traced in the compiler's model, and its pinned
  original (`pinned.pinned_original`)."""
  step, args = examples.load("resnet").make_train_step(
    widths=(8, 16), blocks_per_stage=1, size=32, batch=8
  )
  program = jaxremat.trace_program(step, *args)
  return (
    step,
    args,
    program,
    pinned.pinned_original(program, program.signature, jaxremat.get_target(None)),
  )


def _predicted(graph, alias_bytes):
  return xla_accounted_peak_bytes(graph, baseline_schedule(graph), alias_bytes)


def test_the_pinned_graph_counts_what_xla_holds_of_the_step_pinned_in_its_order(resnet):
  """Fenced in its own order, the step is another program: XLA computes each batch norm's
  `x - mean` inside its readers, the backward pass's too, and holds far less. Each graph,
  read from its own program, counts it within 10%; the step's graph misses the pinned one
  by far more."""
  _, _, program, pinned_original = resnet
  original, graph, measured = program.baseline, program.graph, pinned_original.measured
  assert measured.peak_bytes < 0.8 * original.peak_bytes
  view = pinned.pinned_program(program, pinned_original, jaxremat.get_target(None)).graph

  def held_subtractions(g):
    return sum(g.nodes[v].attrs["primitive"] == "sub" and g.mem[v] > 0 for v in g.order)

  assert held_subtractions(view) < held_subtractions(graph)  # computed in their readers
  assert abs(_predicted(graph, original.alias_bytes) - original.peak_bytes) <= (
    0.1 * original.peak_bytes
  )
  assert abs(_predicted(view, original.alias_bytes) - measured.peak_bytes) <= (
    0.1 * measured.peak_bytes
  )
  assert _predicted(graph, original.alias_bytes) > 1.3 * measured.peak_bytes


def test_a_plan_of_the_pinned_graph_computes_what_the_step_computes(resnet):
  """A plan made on the pinned graph is emitted from the pinned program, whose nodes group
  the equations otherwise than the step's: the step's outputs are the original's."""
  step, args, program, pinned_original = resnet
  pinned_program = pinned.pinned_program(program, pinned_original, jaxremat.get_target(None))
  view = pinned_program.graph
  peak_bytes = jaxremat.simulate(view, baseline_schedule(view)).peak_bytes
  schedule = jaxremat.solve(
    view, (peak_bytes + view.min_feasible_bytes) // 2, "auto", time_limit=5.0
  )
  assert jaxremat.simulate(view, schedule).valid
  assert len(set(schedule.computes)) < len(schedule.computes)  # it recomputes
  emitted = jaxremat.emit(pinned_program, schedule)
  assert_trees_allclose(jax.jit(emitted)(*args), jax.jit(step)(*args))


def test_plans_within_what_the_pinned_original_holds_are_made_and_counted_on_its_graph(resnet):
  """At a budget the step pinned in its order meets, the planner plans on the pinned graph,
  and counts the plan it hands out within 10% of XLA; the step's graph counted such plans
  23% over on the ResNet example (x0.401 measured). The first plan is the step's own
  order pinned: the pinned original, compiled once, for the model and as that plan."""
  step, args, _, pinned_original = resnet
  measured = pinned_original.measured
  budget = measured.peak_bytes + 1024
  # The pinned original meets the budget, so the time limit ends no search here; it only
  # needs to hold the pinned compile (`_pinned_compile_fits`), 7.6 s for this step beside a
  # second test process on 2 cores, where 30 s did not.
  with counted_compiles() as compiled:
    plan = jaxremat.optimize(step, budget=budget, time_limit=90, use_cache=False).plan(*args)
  model = plan.schedule.stats["optimize"]
  assert model["pinned_peak_bytes"] == measured.peak_bytes
  assert plan.measured_peak_bytes <= budget
  first = plan.attempts[0]
  assert (first.origin, first.pin) == ("pinned original", "all")
  assert first.measured_peak_bytes == measured.peak_bytes
  assert compiled["jit(pinned_original)"] == 1
  assert compiled["jit(emitted)"] == len(plan.attempts) - 1
  best = next(a for a in plan.attempts if a.measured_peak_bytes == plan.measured_peak_bytes)
  assert best.pin == "all"
  assert abs(best.predicted_peak_bytes - best.measured_peak_bytes) <= 0.1 * best.measured_peak_bytes
  assert plan.verification.outputs_match


def test_below_what_the_pinned_original_holds_plans_are_made_on_the_steps_graph(resnet):
  """Below the pinned original's peak the planner plans on the step's graph (no
  `pinned_peak_bytes`), and where a plan on the pinned graph missed by more than a fence
  explains (`misjudged_pinned`), it plans on the step's graph from then on."""
  step, args, program, pinned_original = resnet
  budget = int(0.9 * pinned_original.measured.peak_bytes)
  f = jaxremat.optimize(step, budget=budget, time_limit=20, use_cache=False, verify=False)
  try:
    plan = f.plan(*args)
  except jaxremat.BudgetNotMetError as e:
    plan = e.plan
  assert "pinned_peak_bytes" not in plan.schedule.stats["optimize"]
  opts = PlanOptions(budget=budget, target=jaxremat.get_target(None), progress=False)
  loop = _Loop(
    program, program.signature, budget, opts, _Deadline(30.0), program.baseline, pinned_original
  )
  assert loop.graph is not program.graph and loop.pinned_figures()
  schedule = baseline_schedule(loop.graph)

  def tried(predicted_bytes, measured_bytes):
    attempt = Attempt("auto", budget, predicted_bytes, measured_bytes, "solve", "all", None, 0)
    return _Tried(attempt, schedule, None, False, True, 0)

  predicted = budget - 1024  # a plan the model put within the budget
  assert loop.misjudged_pinned(tried(predicted, 2 * predicted))
  assert not loop.misjudged_pinned(tried(predicted, budget + 1024))
  loop.plan_on(program, program.baseline)
  assert loop.graph is program.graph and loop.pinned_figures() == {}
