"""`jaxremat.optimize` end to end on real training steps, and the plan cache."""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from backend import FACTS, assert_trees_allclose, counted_compiles

import examples
import jaxremat
from examples import _common
from jaxremat._src.demo import make_mlp_step
from jaxremat._src.plan_cache import PlanCache, fingerprint
from jaxremat._src.planner import (
  _POLICY_FLOPS_SHARE,
  _REPLAN_MARGIN,
  _SEGMENT_SOLVERS,
  _SHAPE_SHARE,
  PlanOptions,
  _cache_keys,
  _Deadline,
  _Loop,
  least_compute,
  model_flops,
  next_planning_budget,
)
from jaxremat._src.segments import segment_schedule
from jaxremat._src.signature import call_signature
from jaxremat._src.targets import get_target


def _small_step():
  return make_mlp_step(depth=8, width=128, batch=1024)


def _in_rules(step, args):
  """``step``'s call signature, its program in the rules model (the figures of the tests
  that use it were measured there) and XLA's measurement of it."""
  signature = call_signature(args, {})
  program = jaxremat.trace_program(step, *args, signature=signature, model="rules")
  return signature, program, jaxremat.measure(step, *args, runs=0)


def _small_loops(fraction: float, deadline_s: float):
  """Makes planning loops for `_small_step` at ``fraction`` of its peak, or at a budget
  in bytes and with the replans given to the loop made, in the rules model (`_in_rules`)."""
  signature, program, baseline = _in_rules(*_small_step())

  def new_loop(
    budget_bytes=int(fraction * baseline.peak_bytes), max_replans=PlanOptions.max_replans
  ):
    opts = PlanOptions(
      budget=fraction, target=get_target(None), progress=False, max_replans=max_replans
    )
    return _Loop(program, signature, budget_bytes, opts, _Deadline(deadline_s), baseline)

  return new_loop


def test_plan_cache_round_trip_and_damaged_entries(tmp_path):
  g = jaxremat.RematGraph.build(mem=[4, 2, 1], cost=[1, 1, 1], edges=[(0, 1), (1, 2)])
  other = jaxremat.RematGraph.build(mem=[4, 2], cost=[1, 1], edges=[(0, 1)])
  cache = PlanCache(tmp_path)
  key = fingerprint(graph=g.to_dict(), budget="0.5")
  assert cache.load(key, g) is None
  cache.store(key, jaxremat.baseline_schedule(g))
  assert cache.load(key, g) == jaxremat.baseline_schedule(g)
  with pytest.warns(UserWarning, match="not a valid schedule of this graph"):
    assert cache.load(key, other) is None
  cache.path(key).write_text('{"format": "jaxremat.plan/1", "key": "')
  with pytest.warns(UserWarning, match="damaged plan cache entry.*not valid JSON"):
    assert cache.load(key, g) is None
  cache.path(key).write_text(json.dumps({"format": "jaxremat.plan/1", "key": "another"}))
  with pytest.warns(UserWarning, match="belongs to another plan"):
    assert cache.load(key, g) is None


def test_interrupted_cache_write_leaves_no_partial_file(tmp_path, monkeypatch):
  g = jaxremat.RematGraph.build(mem=[4, 2], cost=[1, 1], edges=[(0, 1)])
  cache = PlanCache(tmp_path)

  def interrupted_dump(obj, f, **kwargs):
    f.write('{"format": "jaxremat.plan/1", ')  # half an entry, then Ctrl-C
    raise KeyboardInterrupt

  monkeypatch.setattr("jaxremat._src.graph.json.dump", interrupted_dump)
  with pytest.raises(KeyboardInterrupt):
    cache.store("k", jaxremat.baseline_schedule(g))
  assert list(cache.directory.iterdir()) == []


def test_optimize_meets_the_budget_as_xla_measures_it_and_matches_the_original(tmp_path):
  step, args = _small_step()
  fast = jaxremat.optimize(step, budget=0.7, solver="auto", time_limit=5, cache_dir=tmp_path)
  got = fast(*args)
  plan = fast.plan(*args)
  assert (
    plan.measured_peak_bytes <= plan.budget_bytes == int(np.ceil(0.7 * plan.baseline_peak_bytes))
  )
  assert plan.schedule.stats["n_recompute"] > 0 and not plan.from_cache
  assert_trees_allclose(got, jax.jit(step)(*args))

  # A second function (as in a second process) takes the plan from the cache.
  again = jaxremat.optimize(step, budget=0.7, solver="auto", time_limit=5, cache_dir=tmp_path)
  cached = again.plan(*args)
  assert cached.from_cache and cached.schedule.events == plan.schedule.events
  assert cached.measured_peak_bytes == plan.measured_peak_bytes

  report = fast.report(*args, runs=1)
  text = str(report)
  assert "budget" in text and "met" in text and "peak, XLA" in text and "FLOPs, model" in text
  # The model counts the FLOPs the compiled step runs (the recomputed layers twice).
  model = plan.schedule.stats["optimize"]
  predicted = model["predicted_flops"] / model["predicted_baseline_flops"]
  assert predicted > 1.1
  assert predicted == pytest.approx(report.optimized.flops / report.original.flops, rel=0.05)


def test_optimized_step_trains_like_the_original(tmp_path):
  step, (params, opt_state, x, y) = _small_step()
  fast = jaxremat.optimize(step, budget=0.8, solver="auto", time_limit=5, cache_dir=tmp_path)
  ref = jax.jit(step)
  p1, s1, p2, s2 = params, opt_state, params, opt_state
  for _ in range(5):
    p1, s1, loss1 = ref(p1, s1, x, y)
    p2, s2, loss2 = fast(p2, s2, x, y)
    np.testing.assert_allclose(loss2, loss1, rtol=1e-5)
  assert_trees_allclose(p2, p1)


def test_an_impossible_budget_names_a_proven_bound(tmp_path):
  step, args = _small_step()
  fast = jaxremat.optimize(step, budget=0.05, solver="auto", time_limit=5, cache_dir=tmp_path)
  with pytest.raises(jaxremat.InfeasibleBudgetError) as info:
    fast(*args)
  # The proof: XLA holds the step's arguments and outputs, whatever the plan.
  m = jaxremat.measure(step, *args, runs=0)
  assert info.value.min_feasible_bytes == m.argument_bytes + m.output_bytes - m.alias_bytes
  assert info.value.min_feasible_bytes > info.value.budget_bytes
  assert "holds its arguments" in str(info.value) and "no schedule goes below it" in str(info.value)


def test_a_budget_no_plan_meets_hands_out_the_best_plan_and_its_peak_is_met_on_retry(tmp_path):
  """Above the compiler's proven bound (the arguments and outputs) but below what any plan
  holds in the model: no InfeasibleBudgetError (the compiler may fuse a plan otherwise),
  but one plan of least peak compiled, verified, handed out, and a budget a retry meets."""
  step, args = _small_step()
  fast = jaxremat.optimize(step, budget=0.33, time_limit=20, cache_dir=tmp_path)
  with pytest.raises(jaxremat.BudgetNotMetError) as info:
    fast(*args)
  err = info.value
  assert err.lower_bound_bytes <= err.budget_bytes < err.measured_peak_bytes
  assert "loop" not in str(err)  # a step without loops gets no advice about them
  assert "In jaxremat's model of this step" in str(err)
  bound_bytes = err.plan.schedule.stats["optimize"]["model_bound_bytes"]
  assert f"no plan holds less than {bound_bytes}" in str(err)
  # No solve within a budget the model cannot reach: only the least-peak plan, compiled
  # with its fence and, where it missed beyond the model, the other fence.
  assert {a.origin for a in err.plan.attempts} <= {"solve", "retry"}
  assert len(err.plan.attempts) <= 2
  assert err.plan.schedule.stats["optimize"]["beyond_model"]
  assert err.plan.verification is not None and err.plan.verification.outputs_match
  assert_trees_allclose(err.plan.compiled(*args), jax.jit(step)(*args))
  again = jaxremat.optimize(step, budget=err.measured_peak_bytes, time_limit=20, cache_dir=tmp_path)
  plan = again.plan(*args)
  assert plan.measured_peak_bytes <= err.measured_peak_bytes


def test_a_budget_below_what_a_plan_holds_in_the_model_says_so():
  """Below every plan of the model (`peak_bound`), the sentence a missed budget ends with
  gives the proof; below only the least peak a search reached, that peak; above it,
  nothing. The model holds more than XLA on this step, and the planner takes that as
  credit: a budget the credit lifts over the bound is searched, not proven out of reach."""
  new_loop = _small_loops(0.33, 30.0)
  below = new_loop()
  assert below.beyond_model()
  assert f"no plan holds less than {below.model_bound_bytes} bytes" in below.least_peak_hint()
  credit_bytes = -below.baseline_gap_bytes
  assert credit_bytes > 0
  searched = new_loop(budget_bytes=below.model_bound_bytes - credit_bytes // 2)
  assert searched.least_peak_hint() == ""  # nothing searched yet
  searched.try_least_peak()
  assert not searched.beyond_model()
  assert searched.budget_bytes < searched.model_bound_bytes <= searched.least_peak_bytes
  assert f"the least peak a plan reached is {searched.least_peak_bytes} bytes" in (
    searched.least_peak_hint()
  )
  above = new_loop(budget_bytes=int(0.9 * below.reference_peak_bytes))
  above.try_least_peak()
  assert above.least_peak_bytes < above.budget_bytes and above.least_peak_hint() == ""


def test_no_plan_in_the_model_holds_less_than_its_bound():
  """`peak_bound` is below the model's peak of every schedule: the original, the plans of
  three solvers at three budgets, and the least-peak plan, which reaches it within 5% on
  this step."""
  loop = _small_loops(0.5, 60.0)()
  graph = loop.program.graph
  schedules = [jaxremat.baseline_schedule(graph)]
  for solver, fraction in (("chen-greedy", 0.8), ("cover", 0.7), ("auto", 0.6)):
    budget = loop.solver_budget(int(fraction * loop.reference_peak_bytes))
    plan = functools.partial(jaxremat.solve, budget=budget, solver=solver, time_limit=5.0)
    schedules.append(loop.solve(plan))
  least = loop.least_peak_plan(10.0)
  peaks = [loop.predicted_peak_bytes(s) for s in schedules]
  assert all(peak >= loop.model_bound_bytes for peak in peaks)
  assert loop.model_bound_bytes <= loop.least_peak_bytes <= 1.05 * loop.model_bound_bytes
  assert loop.predicted_peak_bytes(least) == loop.least_peak_bytes


def test_a_missed_budget_hands_out_the_step_itself_where_no_plan_holds_less(tmp_path):
  """Unfenced, XLA:CPU merges every recomputation with the first computation, so each plan
  measures the step's own peak and meets no budget. What a missed budget hands out is then
  the step without recomputation, verified, not a plan that costs as much or more and
  holds no less (a Flax CNN with BatchNorm at 0.5 on XLA:CPU was handed a plan 1.2% above
  its step's peak), and the error gives no budget to retry at."""
  step, args = _small_step()
  unfenced = jaxremat.optimize(
    step, budget=0.6, fence="none", max_replans=1, time_limit=20, cache_dir=tmp_path
  )
  with pytest.raises(jaxremat.BudgetNotMetError) as info:
    unfenced(*args)
  err = info.value
  original = jaxremat.measure(step, *args, runs=0)
  *plans, last = err.plan.attempts
  assert plans and all(a.measured_peak_bytes >= original.peak_bytes for a in plans)
  assert (last.origin, err.plan.schedule.solver) == ("baseline", "noremat")
  assert err.measured_peak_bytes == original.peak_bytes
  assert "none measured below the step without recomputation" in str(err)
  assert "Retry with budget" not in str(err)
  v = err.plan.verification
  assert v.outputs_match and v.n_planned_recomputes == 0
  assert_trees_allclose(err.plan.compiled(*args), jax.jit(step)(*args))


def _scanned_mlp_grad(checkpoint_body: bool):
  """The gradient of an 8-layer tanh MLP run as a `lax.scan` over stacked weights."""

  def body(h, w):
    return jnp.tanh(h @ w), None

  if checkpoint_body:
    body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)

  def loss(weights, x):
    h, _ = jax.lax.scan(body, x, weights)
    return jnp.mean(h**2)

  keys = jax.random.split(jax.random.key(5))
  weights = jax.random.normal(keys[0], (8, 256, 256)) * 0.05
  return jax.grad(loss), (weights, jax.random.normal(keys[1], (2048, 256)))


def test_a_scanned_step_meets_what_jax_checkpoint_on_its_body_reaches():
  """The budget is the peak of the step with its scan body under `jax.checkpoint`
  (nothing_saveable: x0.47 of the plain step's on jax 0.10's XLA:CPU, x0.64 on 0.11's).
  `optimize` plans inside the scan: each iteration stores its carry, as the policy
  does, and the backward pass recomputes the product and its tanh, at no more FLOPs."""
  step, args = _scanned_mlp_grad(checkpoint_body=False)
  checkpointed, _ = _scanned_mlp_grad(checkpoint_body=True)
  policy = jaxremat.measure(checkpointed, *args, runs=0)
  assert policy.peak_bytes < 0.7 * jaxremat.measure(step, *args, runs=0).peak_bytes
  plan = jaxremat.optimize(step, budget=policy.peak_bytes, time_limit=20, progress=False).plan(
    *args
  )
  assert plan.measured_peak_bytes <= policy.peak_bytes
  assert plan.measurement.flops <= policy.flops
  line = plan.program.loops[0].line
  assert (
    len(plan.program.loops) == 1
    and f"{__file__.rsplit('/', 1)[-1]}:" in line
    and "dot_general" in line
  )


def test_a_loop_whose_stored_values_the_step_returns_is_named_when_a_budget_is_missed():
  """Each iteration's output is both the step's output and what the backward pass reads,
  which no rewrite of the loop stores less of: the budget is missed, and the error names
  the loop and its source line."""

  def body(h, w):
    h = jnp.tanh(h @ w)
    return h, h

  def step(weights, x):
    def loss(weights):
      h, hs = jax.lax.scan(body, x, weights)
      return jnp.mean(h**2), hs

    return jax.value_and_grad(loss, has_aux=True)(weights)

  _, args = _scanned_mlp_grad(checkpoint_body=False)
  original = jaxremat.measure(step, *args, runs=0)
  # Just above what the arguments and outputs take (1 MiB more): no proof rules it out.
  budget = original.argument_bytes + original.output_bytes + 2**20
  # In the rules model, whose best plan here is short of the budget by less than the loop.
  fast = jaxremat.optimize(step, budget=budget, time_limit=20, progress=False, model="rules")
  with pytest.raises(jaxremat.BudgetNotMetError) as info:
    fast(*args)
  message = str(info.value)
  assert "The step's `scan` at " in message and f"{__file__.rsplit('/', 1)[-1]}:" in message
  assert "jax.checkpoint" in message


def test_bytes_xla_makes_from_constants_are_named_when_a_budget_is_missed():
  """XLA:CPU makes the index arrays of a max pool's gradient (4 int32 arrays of the
  pool's input) before the first equation; where they are what keeps a plan over the
  budget, the error says so."""
  if not FACTS.pool_gradient_buffers_at_start:
    pytest.skip("this backend makes no index arrays for a max pool's gradient")

  def loss(x):
    pooled = jax.lax.reduce_window(
      jnp.sin(x), -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"
    )
    return jnp.sum(jnp.cos(pooled))

  x = jnp.ones((8, 64, 64, 32))
  step = jax.grad(loss)
  fast = jaxremat.optimize(step, budget=0.7, time_limit=10, use_cache=False, progress=False)
  with pytest.raises(jaxremat.BudgetNotMetError) as info:
    fast(x)
  made = 4 * x.size * 4  # int32 bytes
  err = info.value
  assert err.measured_peak_bytes - err.budget_bytes < made
  assert f"XLA makes {made} bytes once" in str(err) and "max pool" in str(err)


def test_max_replans_bounds_the_plans_compiled(tmp_path):
  step, args = _small_step()
  fast = jaxremat.optimize(
    step, budget=0.36, time_limit=20, max_replans=0, cache_dir=tmp_path, use_cache=False
  )
  with pytest.raises(jaxremat.BudgetNotMetError) as info:
    fast(*args)
  # One solved plan, and the same plan once more with only its recomputations fenced.
  attempts = info.value.plan.attempts
  assert [(a.origin, a.pin) for a in attempts] == [("solve", "all"), ("retry", "recomputations")]


def test_the_fence_that_measured_lower_is_compiled_first_thereafter():
  """A plan XLA measures over the budget and further beyond the model than the original
  step (here the least-peak plan, 12% over the model) is compiled with its whole order
  fenced and with only its recomputations fenced; the step's next plans get the one XLA
  measured lower first."""
  loop = _small_loops(0.5, 60.0)()
  loop.try_schedule(loop.least_peak_plan(10.0), "solve")
  first, retry = (t.attempt for t in loop.tried)
  assert first.measured_peak_bytes > (1 + _SHAPE_SHARE) * first.predicted_peak_bytes
  assert (first.pin, retry.origin, retry.pin) == ("all", "retry", "recomputations")
  lower = min((first, retry), key=lambda a: a.measured_peak_bytes).pin
  loop.try_schedule(segment_schedule(loop.program.graph, 2), "solve")
  assert loop.tried[2].attempt.origin == "solve" and loop.tried[2].attempt.pin == lower


def test_no_least_peak_plan_is_compiled_past_the_deadline_once_a_plan_was():
  """``time_limit`` covers the whole first call, a compile in flight not cut short: past
  the deadline, the least-peak plan is compiled only where no plan was; it is solved even
  so, for what a missed budget says of the model's least peak."""
  new_loop = _small_loops(0.1, 0.0)
  loop = new_loop()
  loop.try_schedule(jaxremat.baseline_schedule(loop.program.graph), "solve")
  compiled = len(loop.tried)
  loop.try_least_peak()
  assert len(loop.tried) == compiled and not loop.met
  assert loop.least_peak_bytes < loop.tried[0].attempt.predicted_peak_bytes
  first = new_loop()
  first.try_least_peak()
  assert len(first.tried) >= 1


def test_the_first_solve_gets_its_share_of_the_time_however_long_compiles_take():
  """Where compiles take longer than the time limit leaves (a minute each for the ResNet
  example's step for TPU v5e here), the first solve still gets its share of the limit;
  replans get only what the compiles leave."""
  step, args = _small_step()
  signature = call_signature(args, {})
  program = jaxremat.trace_program(step, *args, signature=signature)
  measured = jaxremat.measure(step, *args, runs=0)
  baseline = dataclasses.replace(measured, compile_time_s=60.0)
  opts = PlanOptions(budget=0.7, time_limit=20.0, target=get_target(None), progress=False)
  budget_bytes = int(0.7 * baseline.peak_bytes)
  loop = _Loop(program, signature, budget_bytes, opts, _Deadline(opts.time_limit), baseline)
  assert loop.reserve_s > opts.time_limit
  assert loop.solve_time_s() >= 0.1 * opts.time_limit
  loop.run("auto")
  assert loop.solves >= 1 and loop.tried[0].attempt.origin == "solve"
  assert loop.solve_time_s() <= 0


def test_a_plan_compiled_already_is_not_compiled_again():
  """A solve that returns a plan the loop compiled already (a replan that lands on the
  plan before it, a least-peak plan equal to a solved one) costs a solve, not a compile."""
  loop = _small_loops(0.5, 60.0)()
  schedule = segment_schedule(loop.program.graph, 2)
  first = loop.try_schedule(schedule, "solve")
  compiled = len(loop.tried)
  assert loop.try_schedule(schedule, "solve") is first
  assert len(loop.tried) == compiled and loop.solves == 2


def test_a_plan_that_kept_its_shape_is_replanned_not_fenced_again():
  """A plan XLA measures over the budget by no more beyond the model than on the original
  step, give or take a tenth of the plan's peak, kept the shape its fence gave it: a
  replan comes next, not the same plan with the other fence (of nine first plans for H100
  1-19% over the model, none met the budget with it). With no replan left, the other
  fence is the last try."""
  new_loop = _small_loops(0.5, 60.0)
  schedule = segment_schedule(new_loop().program.graph, 2)
  measured = new_loop().try_schedule(schedule, "solve").compiled.peak_bytes
  for max_replans, origins in ((1, ["solve"]), (0, ["solve", "retry"])):
    loop = new_loop(budget_bytes=measured - 1, max_replans=max_replans)
    tried = loop.try_schedule(schedule, "solve")
    assert not tried.met and loop.kept_shape(tried.attempt)
    assert [t.attempt.origin for t in loop.tried] == origins
  # 8% beyond the model is well past a replan's margin (2% of the budget), yet kept; the
  # least-peak plan 12% beyond it is fenced again (`test_the_fence_that_measured_lower_...`).
  excess_bytes = int(0.08 * tried.attempt.predicted_peak_bytes)
  excess_bytes += max(loop.baseline_gap_bytes, 0)
  assert excess_bytes > 3 * _REPLAN_MARGIN * loop.budget_bytes
  beyond = tried.attempt.predicted_peak_bytes + excess_bytes
  assert loop.kept_shape(dataclasses.replace(tried.attempt, measured_peak_bytes=beyond))


def test_the_policys_plan_is_compiled_once_even_where_it_misses():
  """The policy's plan is a candidate beside a plan that met the budget already: one
  compile, not a second one with the other fence, even where XLA measures it over."""
  loop = _small_loops(0.1, 60.0)()
  schedule = jaxremat.solve(loop.solver_graph, 1.0, "dots-saveable")
  assert len(set(schedule.computes)) < len(schedule.computes)  # it recomputes
  tried = loop.try_schedule(schedule, "policy")
  assert not tried.met
  assert [t.attempt.origin for t in loop.tried] == ["policy"]


def test_the_optimized_step_runs_the_executable_the_planner_compiled(tmp_path):
  """XLA compiles the optimized step once per plan, and the original once: verification
  and the calls run the executables the planner measured (which donate as the step does),
  with the original's inputs perturbed by a function of their own, not compiles of their
  own."""
  step, args = _small_step()
  expected = jax.jit(step)(*args)
  jaxremat.trace_program(step, *args)  # the equations' costs, cached before counting
  with counted_compiles() as compiled:
    f = jaxremat.optimize(step, budget=0.7, time_limit=30, cache_dir=tmp_path, progress=False)
    plan = f.plan(*args)
    assert plan.verification.outputs_match
    # The original once: the compile that the compiler's model reads (each equation
    # under a scope of its own) is also the one that runs it. The model of plans pinned
    # in their order reads one more: the original's order, pinned, which is also the
    # plan of that order, compiled once (`try_pinned_order`).
    planned = [a for a in plan.attempts if a.origin != "pinned original"]
    assert compiled["jit(emitted)"] == len(planned) and compiled["jit(scoped)"] == 1
    assert compiled["jit(pinned_original)"] == 1
    emitted = {"jit(emitted)"} if planned else set()
    assert set(compiled) == {"jit(scoped)", "jit(pinned_original)", "jit(_perturbed)"} | emitted
    got = f(*args)
    assert compiled["jit(emitted)"] == len(planned)
  assert plan.compiled.executable is not None
  assert_trees_allclose(got, expected)


def test_the_memory_model_is_the_users_choice(tmp_path):
  """``model="rules"`` plans in XLA:CPU's fusion rules; the default plans in what the
  target compiler keeps of the step, read from the one compile that is also the
  baseline; a model that does not exist is refused before any call."""
  step, args = _small_step()
  f = jaxremat.optimize(
    step, budget=0.7, model="rules", time_limit=30, cache_dir=tmp_path, progress=False
  )
  plan = f.plan(*args)
  assert plan.program.graph.meta["model"] == "rules" and plan.program.baseline is None
  assert plan.measured_peak_bytes <= plan.budget_bytes and plan.verification.outputs_match
  # The default model, read from a plan that needs no recomputation.
  auto = jaxremat.optimize(step, budget=1.0, time_limit=30, cache_dir=tmp_path, progress=False)
  program = auto.plan(*args).program
  assert program.graph.meta["model"] == "compiler"
  assert program.baseline.peak_bytes == auto.plan(*args).baseline_peak_bytes
  with pytest.raises(ValueError, match="model='guess' is not a memory model"):
    jaxremat.optimize(step, budget=0.7, model="guess")


def test_the_least_peak_plan_is_compiled_only_below_every_plan_compiled():
  """Where a plan compiled already is at the least peak the model reaches (or within a
  replan's margin of it), the least-peak plan (the same plan, maybe in another order) is
  not compiled; otherwise it is."""
  new_loop = _small_loops(0.1, 10.0)

  def plans_compiled_after(first) -> int:
    loop = new_loop()
    loop.try_schedule(first(loop), "solve")
    compiled = len(loop.tried)
    loop.try_least_peak()
    return sum(t.attempt.origin == "solve" for t in loop.tried[compiled:])

  def least_in_another_order(loop):
    """The least-peak plan with two events swapped, at the same peak in the model."""
    least = loop.solve(lambda graph: jaxremat.minimize_peak(graph, "auto", time_limit=2))
    computes = least.computes
    for i in range(len(computes) - 1):
      order = [*computes[:i], computes[i + 1], computes[i], *computes[i + 2 :]]
      other = jaxremat.schedule_from_computes(loop.program.graph, order)
      if not jaxremat.simulate(loop.program.graph, other).valid:  # read before it is made
        continue
      other = loop.resequenced(other)
      same_peak = loop.predicted_peak_bytes(other) == loop.predicted_peak_bytes(least)
      if same_peak and other.computes != computes:
        return other
    raise AssertionError("every swap changes the plan's peak or order back")

  assert plans_compiled_after(least_in_another_order) == 0
  assert plans_compiled_after(lambda loop: jaxremat.baseline_schedule(loop.program.graph)) == 1


def test_time_limit_bounds_the_whole_first_call(tmp_path):
  step, args = _small_step()
  fast = jaxremat.optimize(step, budget=0.7, time_limit=4, cache_dir=tmp_path)
  plan = fast.plan(*args)
  assert plan.measured_peak_bytes <= plan.budget_bytes
  # Solves take what is left after a reserve for compiling and verifying; a compile in
  # flight is not cut short, so allow one more compile and verification.
  assert plan.plan_time_s <= 4 + 3 * plan.compile_time_s + 2.0, plan.plan_time_s


def test_cached_plans_are_verified_and_keyed_by_what_changes_the_compiled_step(tmp_path):
  step, args = _small_step()
  jaxremat.optimize(step, budget=0.8, time_limit=10, cache_dir=tmp_path)(*args)
  cached = jaxremat.optimize(step, budget=0.8, time_limit=10, cache_dir=tmp_path).plan(*args)
  assert cached.from_cache and cached.verification is not None
  assert cached.verification.outputs_match and cached.verification.recomputes_survive
  donated = jaxremat.optimize(
    step, budget=0.8, time_limit=10, cache_dir=tmp_path, donate_argnums=(0, 1)
  )
  assert not donated.plan(*args).from_cache  # donation changes the compiled step


def test_cache_keys_cover_constants_by_content():
  """Two static arrays that print alike bake different constants into one jaxpr text."""

  def scaled(x, scale):
    return jnp.sum(x * jnp.asarray(scale))

  first = np.ones(2000, np.float32)
  second = first.copy()
  second[1000] = 5.0
  options = PlanOptions(budget=1.0)
  keys = []
  for scale in (first, second):
    p = jaxremat.trace_program(scaled, jnp.ones(2000), scale, static_argnums=1, costs="shape")
    keys.append(_cache_keys(p, p.signature, 100, options))
  assert str(p.jaxpr) == str(
    jaxremat.trace_program(scaled, jnp.ones(2000), first, static_argnums=1, costs="shape").jaxpr
  )
  assert keys[0].program != keys[1].program and keys[0].plan != keys[1].plan


def test_arguments_of_a_new_shape_get_a_new_plan(tmp_path):
  step, args = _small_step()
  fast = jaxremat.optimize(step, budget=0.9, solver="auto", time_limit=5, cache_dir=tmp_path)
  fast(*args)
  params, opt_state, x, y = args
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    fast(params, opt_state, x[:512], y[:512])
  assert len(fast.plans) == 2


def test_replanning_goes_below_the_failed_plans_own_peak():
  """A plan under its planning budget that XLA measures over the budget is not returned again.

  GPT's training step at 0.5 (benchmarks/README.md): Chen's segments planned at 54.5 MB
  came back at 32.8 MB and measured 55.2 MB in XLA. Cutting the overshoot off the planning
  budget (52.8 MB) returned the same plan, again and again; cutting it off the plan's own
  peak asks for a plan that spares what XLA added.
  """
  budget, predicted, measured = 54_545_904, 32_762_920, 55_155_680
  margin = int(_REPLAN_MARGIN * budget)
  assert next_planning_budget(budget, predicted, measured, budget) == (
    predicted - (measured - budget) - margin
  )


def test_a_plan_the_model_counted_exactly_is_planned_again_at_the_budget_without_a_margin():
  """The MLP example on XLA:CPU at 0.7 in the compiler's model: the first plan, within the
  first planning budget's credit (the model counts the original 1 MiB over XLA), was
  predicted and measured 31.72 MB against a 31.01 MB budget. The margin for the model's
  error would take the next plan below 30.4 MB, under every plan the search reaches in
  seconds; no larger than the model's 892-byte error, it is made within the budget less
  twice that error, and met."""
  planning, predicted, measured, budget = 32_060_227, 31_719_828, 31_720_720, 31_012_543
  error = measured - predicted
  # What XLA added to this plan, and a margin of as much again.
  assert next_planning_budget(planning, predicted, measured, budget) == budget - 2 * error
  # Off by more than the margin, the whole margin still applies.
  off = 2 * int(_REPLAN_MARGIN * budget)
  assert next_planning_budget(planning, predicted - off, measured, budget) == (
    budget - error - off - int(_REPLAN_MARGIN * budget)
  )


def test_the_solvers_see_output_buffers_held_from_the_start_as_xla_allocates_them():
  """XLA gives a step's outputs their own buffers for the whole program; the solvers plan
  on a graph where they cost nothing when computed and their bytes are held back from the
  budget, so that a plan's peak there is XLA's accounting of it but for scratch, and for
  the operand a node's output is written into where the node frees it (``writes_into``,
  which the solvers hold beside the output). An output computed before the end (an
  optimizer's update, once its gradient is made) adds nothing beyond them."""
  from jaxremat._src.planner import as_xla_allocates
  from jaxremat._src.xla_memory import xla_accounted_peak_bytes

  step, args = _small_step()
  graph = jaxremat.trace_program(step, *args, costs="shape").graph
  outputs = sum(graph.mem[v] for v in graph.outputs if not graph.is_input[v])
  solver_graph, reserved = as_xla_allocates(graph, alias_bytes=0)
  assert reserved == outputs > 0 and all(solver_graph.mem[v] == 0 for v in graph.outputs)
  scratch = max(n.attrs.get("workspace_bytes", 0) for n in graph.nodes)
  written = max(sum(size for size, _ in n.attrs.get("writes_into", ())) for n in graph.nodes)
  assert written > 0  # the tanh's gradient into the tanh
  baseline = jaxremat.baseline_schedule(graph)
  budget = int(0.8 * jaxremat.simulate(graph, baseline).peak_bytes)
  for schedule in (baseline, jaxremat.solve(graph, budget, solver="auto", time_limit=5)):
    for alias in (0, outputs):
      planned = jaxremat.simulate(solver_graph, schedule).peak_bytes + max(0, reserved - alias)
      accounted = xla_accounted_peak_bytes(graph, schedule, alias)
      assert planned - written <= accounted <= planned + scratch
  # What XLA aliases to donated arguments is not held twice.
  assert as_xla_allocates(graph, alias_bytes=outputs)[1] == 0


def test_the_solvers_hold_constants_from_the_start_until_the_copy_their_reader_reads():
  """XLA makes a pool gradient's argmax iotas once, at the start, and holds them until the
  argmax reads the pool's input for the gradient. In the solvers' graph they are a node
  read by the node they are for and by that input, so a plan that keeps the input's
  first copy frees them early, as XLA does, and all are made before the first equation
  (read by a node of no bytes that the first equations read); a plan that makes them
  again to free them between two copies of the input sees less than XLA holds, and is
  planned again with them held throughout (`_Loop.solve`)."""
  from jaxremat._src.graph import Node
  from jaxremat._src.planner import as_xla_allocates, in_graph
  from jaxremat._src.xla_memory import xla_accounted_peak_bytes

  # x -> pool input u (1) -> exponential k (2) -> sine (3) -> sum (4); the gradient (5)
  # reads u and the sum; the iotas (8 bytes) are made for k, read with u for the gradient,
  # and 2 bytes more for the sum, read with the sine for the gradient.
  base = jaxremat.RematGraph.build(
    mem=[1, 4, 1, 8, 1, 1],
    cost=[0, 1, 1, 1, 1, 1],
    edges=[(0, 1), (1, 2), (2, 3), (3, 4), (1, 5), (4, 5)],
    inputs=[0],
  )
  nodes = list(base.nodes)
  nodes[2] = Node(
    2, "k", 1, 1.0, {"constant_bytes": 8, "constants_with": [1], "constants_for": [5]}
  )
  nodes[4] = Node(
    4, "sum", 1, 1.0, {"constant_bytes": 2, "constants_with": [3], "constants_for": [5]}
  )
  graph = dataclasses.replace(base, nodes=tuple(nodes))
  solver_graph, reserved = as_xla_allocates(graph, alias_bytes=0)
  c, d, start = range(graph.n, solver_graph.n)
  assert set(solver_graph.succs[c]) == {1, 2, start} and set(solver_graph.succs[d]) == {3, 4, start}
  assert solver_graph.succs[start] == (1,) and solver_graph.order[:3] == (c, d, start)

  def planned(g, computes):
    schedule = jaxremat.schedule_from_computes(g, computes)
    accounted = xla_accounted_peak_bytes(graph, in_graph(schedule, graph))
    return jaxremat.simulate(g, schedule).peak_bytes + reserved, accounted

  # The inputs' first copies kept: the iotas made first and freed in the forward pass,
  # as XLA counts them.
  assert planned(solver_graph, [c, d, start, 1, 2, 3, 4, 5]) == (17, 17)
  # The iotas and the input made again for the gradient: XLA holds the iotas throughout.
  cheat, accounted = planned(solver_graph, [c, d, start, 1, 2, 3, 4, c, 1, 5])
  assert cheat < accounted == 21
  held, _ = as_xla_allocates(graph, alias_bytes=0, held_constants=frozenset({2}))
  assert c in held.inputs and c not in held.order
  assert planned(held, [d, start, 1, 2, 3, 4, 1, 5]) == (accounted, accounted)

  # The planner plans again with them held, for that plan and the next.
  def plan(g):
    again = [d, start, 1, 2, 3, 4, 1, 5]
    return jaxremat.schedule_from_computes(g, again if c in g.inputs else [c, *again[:-2], c, 1, 5])

  loop = types.SimpleNamespace(
    solver_graph=solver_graph,
    program=types.SimpleNamespace(graph=graph),
    graph=graph,
    alias_bytes=0,
  )
  loop.held_constants = set()
  loop.resequenced = lambda schedule: _Loop.resequenced(loop, schedule)
  assert _Loop.solve(loop, plan).computes == [1, 2, 3, 4, 1, 5]
  assert loop.held_constants == {2} and c in loop.solver_graph.inputs


def test_the_first_plan_is_made_below_the_budget_by_what_xla_holds_beyond_the_model(tmp_path):
  """The compiler's peak of the original calibrates the model: the first plan is made at
  the budget less what XLA measured beyond the model there (here the model is the
  pessimistic one, so the first plan may hold more than the budget in the model). This
  MLP step pinned in its order holds no less than the step, so plans are made on the
  step's graph (`test_pinned` has the other case)."""
  step, args = _small_step()
  plan = jaxremat.optimize(step, budget=0.7, time_limit=20, cache_dir=tmp_path).plan(*args)
  model = plan.schedule.stats["optimize"]
  assert "pinned_peak_bytes" not in model
  gap = plan.baseline_peak_bytes - model["predicted_baseline_peak_bytes"]
  assert gap != 0
  first = plan.attempts[0]
  assert first.origin == "solve" and first.planning_budget_bytes == plan.budget_bytes - gap
  assert plan.measured_peak_bytes <= plan.budget_bytes


def test_the_solvers_plan_below_what_xla_makes_from_constants(tmp_path):
  """XLA makes a max pool gradient's zeros and indices from constants and holds them for
  their last reader, wherever a plan recomputes; the solvers' graph leaves them out, so
  their bytes are held back from the budget. The first plan is then within its planning
  budget as XLA counts it, but for the scratch of the instruction running at the peak. On
  the VGG16 example for H100 at 0.7, the zeros each ReLU's gradient selects from put the
  first plan 24% over its planning budget."""
  module = examples.load("vgg16")
  step, args = module.make_train_step(**module.SMALL)
  f = jaxremat.optimize(step, budget=0.7, time_limit=20, cache_dir=tmp_path, verify=False)
  try:
    plan = f.plan(*args)
  except jaxremat.BudgetNotMetError as e:
    plan = e.plan
  graph = plan.program.graph
  constants = sum(n.attrs.get("constant_bytes", 0) for n in graph.nodes)
  scratch = max(n.attrs.get("workspace_bytes", 0) for n in graph.nodes)
  first = plan.attempts[0]
  assert first.origin == "solve" and constants > 2 * scratch
  assert first.predicted_peak_bytes <= first.planning_budget_bytes + scratch


def test_of_the_plans_that_met_the_budget_the_least_compute_is_handed_out():
  # (peak bytes, compiler FLOPs, model duration): the fewest FLOPs, whatever the model says.
  assert least_compute([(10, 1.0, 1.0), (8, 1.0, 2.0), (9, 0.9, 3.0), (7, None, 0.0)]) == 2
  assert least_compute([(9, 1.0, 1.0), (8, 1.0, 2.0)]) == 1  # equal FLOPs: the lower peak
  assert least_compute([(9, None, 1.0), (8, None, 2.0)]) == 1  # no FLOPs: the lower peak
  assert least_compute([(8, None, 2.0), (8, None, 1.0)]) == 1  # then the model's duration


# `optimize`'s options for the ConvMixer tests: a portfolio without the policy's plan, in the
# rules model their figures were measured in.
_COVER_ONLY = dict(
  time_limit=30, progress=False, verify=False, model="rules", heuristics=("cover",), exact=None
)


def _conv_mixer():
  """A small ConvMixer's loss (depthwise and pointwise convolutions with GELU and
  residuals) and its arguments."""

  def loss(params, x):
    for dw, pw in params:
      x = x + jax.nn.gelu(_common.conv2d(dw, x, groups=x.shape[-1]))
      x = jax.nn.gelu(_common.conv2d(pw, x))
    return (x**2).mean()

  key, width = jax.random.key(0), 16
  params = [
    (
      jax.random.normal(jax.random.fold_in(key, 2 * i), (3, 3, 1, width)) / 3,
      jax.random.normal(jax.random.fold_in(key, 2 * i + 1), (1, 1, width, width)) / 4,
    )
    for i in range(4)
  ]
  return loss, (params, jax.random.normal(key, (8, 16, 16, width)))


def test_the_dots_saveable_plan_is_compiled_beside_a_plan_that_met_the_budget(tmp_path):
  """Once a plan meets the budget, `optimize` compiles the plan of the policy users try
  first, where the model puts it within the budget at about the met plan's FLOPs or
  fewer, and hands out a plan no other met plan beats in XLA's peak and FLOPs. The
  portfolio leaves the policy out here, so that its plan is not the first one. The step:
  a small ConvMixer (`_conv_mixer`). At 0.56 of its peak the model counts the policy's
  plan 0.2% dearer than the plan that met (XLA:CPU 0.03% cheaper); at 0.8, 2% dearer, and
  it is not compiled."""
  loss, args = _conv_mixer()
  options = dict(budget=0.56, cache_dir=tmp_path, **_COVER_ONLY)
  plan = jaxremat.optimize(jax.value_and_grad(loss), **options).plan(*args)
  assert [a.origin for a in plan.attempts].count("policy") == 1
  policy = next(a for a in plan.attempts if a.origin == "policy")
  assert policy.solver == "dots-saveable" and policy.flops is not None
  met = [a for a in plan.attempts if a.measured_peak_bytes <= plan.budget_bytes]
  assert plan.measured_peak_bytes <= plan.budget_bytes
  assert not any(
    a.measured_peak_bytes <= plan.measured_peak_bytes
    and a.flops <= plan.measurement.flops
    and (a.measured_peak_bytes, a.flops) != (plan.measured_peak_bytes, plan.measurement.flops)
    for a in met
  )
  # The plan chosen over the policy's comes from the cache next time, compiled once.
  cached = jaxremat.optimize(jax.value_and_grad(loss), **options).plan(*args)
  assert [a.origin for a in cached.attempts] == ["cache"]
  options.update(budget=0.8, use_cache=False)
  loose = jaxremat.optimize(jax.value_and_grad(loss), **options).plan(*args)
  assert [a.origin for a in loose.attempts] == ["solve"]
  graph = loose.program.graph
  policy = jaxremat.solve(graph, loose.baseline_peak_bytes, "dots-saveable")
  dearer = model_flops(graph, policy.computes) / model_flops(graph, loose.schedule.computes)
  assert dearer > 1 + _POLICY_FLOPS_SHARE


def test_the_policys_plan_goes_first_where_the_model_puts_it_below_the_first_plan():
  """Where the model puts the policy's plan below the first solved plan at about its
  FLOPs or fewer, the policy's is compiled first: it meets the budget with a margin the
  other lacks, in one compile. On the ConvMixer step at 0.6 the portfolio (the policy
  left out) plans x0.58 of the peak in the model, the policy x0.54 at 1.7% fewer FLOPs;
  at 0.8 the policy's plan is 2% dearer and the solved plan goes first."""
  loss, args = _conv_mixer()
  options = dict(use_cache=False, **_COVER_ONLY)
  step = jax.value_and_grad(loss)
  plan = jaxremat.optimize(step, budget=0.6, **options).plan(*args)
  assert [(a.origin, a.solver) for a in plan.attempts] == [("policy", "dots-saveable")]
  assert plan.measured_peak_bytes <= plan.budget_bytes
  loose = jaxremat.optimize(step, budget=0.8, **options).plan(*args)
  assert loose.attempts[0].origin == "solve"


def test_a_policy_plan_the_compiler_counts_dearer_than_the_model_does_not_end_the_search():
  """The policy's plan goes first for being as cheap as the first solved plan in the
  model; where the compiler counts its FLOPs more than `_FLOPS_SHARE` beyond the model's
  (as a ratio to the original's), that ranking does not stand, and the solved plan is
  compiled too. On the ConvMixer step at 0.6 XLA:CPU counts the policy's plan 3% beyond
  the hand rules; the same plan counted 10% dearer would not end the search."""
  loss, args = _conv_mixer()
  step = jax.value_and_grad(loss)
  signature, program, baseline = _in_rules(step, args)
  opts = PlanOptions(budget=0.6, time_limit=60.0, target=get_target(None), progress=False)
  budget_bytes = int(0.6 * baseline.peak_bytes)
  loop = _Loop(program, signature, budget_bytes, opts, _Deadline(60.0), baseline)
  tried = loop.try_policy(loop.policy_plan())
  assert tried.met and loop.flops_as_modelled(tried)
  dearer = dataclasses.replace(tried.attempt, flops=1.1 * tried.attempt.flops)
  assert not loop.flops_as_modelled(dataclasses.replace(tried, attempt=dearer))


def test_beside_a_met_plan_the_policys_plan_over_the_budget_in_the_model_is_not_compiled():
  """Beside a plan that met, the policy's plan is compiled for fewer FLOPs, where the model
  puts it within the budget itself: over it, only the first planning budget's credit (the
  model holding more than XLA on the original) lets it in, and the ResNet example's policy
  for H100 at 0.7 measured over the budget so. The loop is driven directly on the
  ConvMixer step at 0.56 (the policy 0.2% dearer than the met plan in the model), with the
  budget and the credit set about the policy's peak once a plan met."""
  loss, args = _conv_mixer()
  step = jax.value_and_grad(loss)
  signature, program, baseline = _in_rules(step, args)
  opts = PlanOptions(
    budget=0.56,
    time_limit=120.0,
    target=get_target(None),
    progress=False,
    solver_options={"heuristics": ("cover",), "exact": None},
  )

  def policy_compiled(over_bytes: int) -> bool:
    budget_bytes = int(0.56 * baseline.peak_bytes)
    loop = _Loop(program, signature, budget_bytes, opts, _Deadline(120), baseline)
    loop.run("auto")
    assert loop.met and not loop.policy_tried
    policy_bytes = loop.predicted_peak_bytes(loop.policy_plan())
    loop.budget_bytes = policy_bytes - over_bytes
    loop.baseline_gap_bytes = -(over_bytes + 1)  # the credit lifts the planning budget over it
    loop.try_dots_saveable()
    return loop.policy_tried

  assert policy_compiled(0)
  assert not policy_compiled(1)


def test_once_a_plan_met_the_time_kept_back_is_verifications_and_the_policys():
  """After a met plan no other solved plan is compiled, so the policy's plan needs the
  time of its own compile and the verification's, not another plan's compiles too. Here
  compiles are taken to last 10 s (the original's), and 35 s are left: three compiles fit,
  four do not."""
  loss, args = _conv_mixer()
  step = jax.value_and_grad(loss)
  signature, program, measured = _in_rules(step, args)
  baseline = dataclasses.replace(measured, compile_time_s=10.0)
  opts = PlanOptions(
    budget=0.56,
    time_limit=300.0,
    target=get_target(None),
    progress=False,
    solver_options={"heuristics": ("cover",), "exact": None},
  )
  budget_bytes = int(0.56 * baseline.peak_bytes)
  loop = _Loop(program, signature, budget_bytes, opts, _Deadline(opts.time_limit), baseline)
  loop.run("auto")
  assert loop.met and "policy" not in [t.attempt.origin for t in loop.tried]
  loop.deadline = _Deadline(35.0)
  assert loop.verify_s + loop.policy_s < loop.deadline.left_s() < loop.reserve_s
  loop.try_dots_saveable()
  assert [t.attempt.origin for t in loop.tried].count("policy") == 1


def test_a_segment_planners_least_peak_plan_within_the_planning_budget_is_compiled():
  """Where a segment planner finds nothing within the planning budget, nor within
  `_SEGMENT_SLACK` over the budget, it plans at the least peak it reached: its graph
  holds the max pools' index arrays throughout where XLA's count of a peak frees them
  after their reader, and the model puts that plan within the planning budget. The U-Net
  example's Adam step on XLA:CPU at 0.7 meets the budget so, in one compile; without it,
  only the plan of least peak was compiled, and missed (x0.82)."""
  if not FACTS.pool_gradient_buffers_at_start:
    pytest.skip("this backend makes no index arrays for a max pool's gradient")
  module = examples.load("unet")
  step, args = _common.make_train_step(module.loss, *_common.example_args(module))
  fast = jaxremat.optimize(step, budget=0.7, time_limit=10, use_cache=False, model="rules")
  plan = fast.plan(*args)
  assert plan.measured_peak_bytes <= plan.budget_bytes
  assert [a.solver in _SEGMENT_SOLVERS for a in plan.attempts] == [True]
