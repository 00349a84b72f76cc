"""`emit` and `verify` on real XLA:CPU compilations: same values, recomputation kept."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from backend import assert_trees_allclose
from jax import lax

import jaxremat
from jaxremat._src.emit import (
  _input_dependent,
  always_true,
  apply_fence,
  default_fence,
  emit,
  plan_runs,
)
from jaxremat._src.segments import segment_schedule
from jaxremat._src.trace import trace_program
from jaxremat._src.verify import count_hlo_ops, planned_recomputes, verify
from jaxremat._src.xla_memory import xla_accounted_peak_bytes

LAYERS, BATCH, WIDTH = 6, 512, 64


def mlp_loss(params, x):
  h = x
  for w in params:
    h = jnp.tanh(h @ w)
  return jnp.sum(h * h)


@pytest.fixture(scope="module")
def mlp():
  key = jax.random.key(0)
  params = [
    jax.random.normal(jax.random.fold_in(key, i), (WIDTH, WIDTH)) / np.sqrt(WIDTH)
    for i in range(LAYERS)
  ]
  x = jax.random.normal(key, (BATCH, WIDTH))
  step = jax.value_and_grad(mlp_loss)
  program = trace_program(step, params, x, costs="shape")
  return step, program, (params, x)


def dots(fn, *args, **jit_kwargs) -> int:
  text = jax.jit(fn, **jit_kwargs).lower(*args).compile().as_text()
  return count_hlo_ops(text).get("dot", 0)


def test_segment_schedule_recomputes_forward_dots(mlp):
  _, program, _ = mlp
  schedule = segment_schedule(program.graph, 3)
  result = jaxremat.simulate(program.graph, schedule)
  assert result.valid, result.error
  base = jaxremat.simulate(program.graph, jaxremat.baseline_schedule(program.graph))
  assert result.peak_bytes < base.peak_bytes
  assert planned_recomputes(program, schedule)["dot"] >= 2
  recomputed = {v for v in schedule.computes if schedule.computes.count(v) > 1}
  assert not any(program.graph.nodes[v].attrs["backward"] for v in recomputed)


@pytest.mark.parametrize("fence", ["cond", "cond-branch", "select", "barrier", "none"])
def test_emitted_step_equals_original(mlp, fence):
  step, program, args = mlp
  emitted = emit(program, segment_schedule(program.graph, 3), fence=fence)
  assert_trees_allclose(jax.jit(emitted)(*args), jax.jit(step)(*args))
  assert_trees_allclose(emitted(*args), step(*args))


def test_emit_traces_a_function_and_keeps_its_name(mlp):
  _, _, args = mlp
  graph = trace_program(mlp_loss, *args, costs="shape").graph
  emitted = emit(mlp_loss, segment_schedule(graph, 2), *args)
  assert emitted.__name__ == "mlp_loss"
  np.testing.assert_allclose(emitted(*args), mlp_loss(*args), rtol=1e-6)


def test_grad_of_emitted_forward_equals_grad_of_original(mlp):
  _, _, args = mlp
  program = trace_program(mlp_loss, *args, costs="shape", model="rules")
  # Recompute the first two nodes (the first layer's dot and what follows) right away.
  order = list(program.graph.order)
  computes = order[:2] + order[:2] + order[2:]
  schedule = jaxremat.schedule_from_computes(program.graph, computes)
  assert jaxremat.simulate(program.graph, schedule).n_recompute == 2
  emitted = emit(program, schedule, fence="cond")
  assert_trees_allclose(jax.jit(jax.grad(emitted))(*args), jax.jit(jax.grad(mlp_loss))(*args))
  assert_trees_allclose(
    jax.jit(jax.grad(emitted, argnums=1))(*args), jax.jit(jax.grad(mlp_loss, argnums=1))(*args)
  )


def test_emitted_step_under_jit_with_donated_params(mlp):
  step, program, args = mlp
  emitted = emit(program, segment_schedule(program.graph, 3), fence="cond")
  expected = jax.jit(step)(*args)
  params = [jnp.array(w, copy=True) for w in args[0]]
  got = jax.jit(emitted, donate_argnums=0)(params, args[1])
  assert_trees_allclose(got, expected)
  assert all(w.is_deleted() for w in params)


@pytest.mark.parametrize("fence", ["cond", "cond-branch", "select"])
def test_data_dependent_fences_keep_recomputation_and_none_loses_it(mlp, fence):
  step, program, args = mlp
  schedule = segment_schedule(program.graph, 3)
  planned = planned_recomputes(program, schedule)["dot"]
  assert planned >= 2
  original = dots(step, *args)
  assert dots(emit(program, schedule, fence=fence), *args) == original + planned
  # Without a fence XLA's CSE merges every recomputation away (ARCHITECTURE.md fact 1).
  assert dots(emit(program, schedule, fence="none"), *args) == original


def test_verify_reports_plan_kept_and_memory_lowered(mlp):
  step, program, args = mlp
  schedule = segment_schedule(program.graph, 3)
  kept = verify(step, emit(program, schedule, fence="cond"), schedule, *args)
  assert kept.outputs_match and kept.max_abs_error < 1e-4
  assert kept.recomputes_survive
  assert kept.planned_recomputes["dot"] == kept.surviving_recomputes["dot"] >= 2
  assert kept.emitted.temp_bytes < kept.original.temp_bytes
  assert kept.measured_flops_increase == pytest.approx(kept.planned_flops_increase, rel=0.05)
  assert kept.predicted_peak_bytes < kept.predicted_baseline_peak_bytes
  summary = kept.summary()
  assert summary["recomputes_survive"]
  assert summary["n_surviving_recomputes"] == kept.planned_recomputes["dot"]
  assert summary["measured_peak_bytes"] == kept.emitted.peak_bytes
  assert summary["emitted_temp_bytes"] < summary["original_temp_bytes"]
  json.dumps(summary)
  merged = verify(step, emit(program, schedule, fence="none"), None, *args)
  assert merged.outputs_match
  assert not merged.recomputes_survive and not merged.ok()
  assert merged.surviving_recomputes["dot"] == 0


def test_verify_flags_wrong_outputs(mlp):
  step, program, args = mlp
  emitted = emit(program, jaxremat.baseline_schedule(program.graph))

  def off_by_a_bit(*a):
    value, grads = emitted(*a)
    return value * (1 + 1e-3), grads

  off_by_a_bit.schedule, off_by_a_bit.program = emitted.schedule, emitted.program
  report = verify(step, off_by_a_bit, None, *args)
  assert not report.outputs_match and not report.ok(peak_rtol=10.0)
  assert report.max_abs_error > 0


def test_unused_recomputation_is_dropped_not_planned(mlp):
  step, program, args = mlp
  graph = program.graph
  order = list(graph.order)
  # The first copy of the first node is freed unread, then computed again: only one counts.
  schedule = jaxremat.schedule_from_computes(graph, order[:1] + order)
  assert jaxremat.simulate(graph, schedule).n_recompute == 1
  emitted = emit(program, schedule, pin="recomputations")
  assert emitted.n_fences == 0
  report = verify(step, emitted, schedule, *args)
  assert report.planned_recomputes == {} and report.recomputes_survive
  assert report.planned_flops_increase == 0.0
  assert report.outputs_match


def test_verify_needs_the_plan(mlp):
  step, program, args = mlp
  with pytest.raises(ValueError, match="needs the schedule and the traced program"):
    verify(step, step, None, *args)
  with pytest.raises(ValueError, match="needs the schedule and the traced program"):
    verify(step, step, program, *args)


def test_recomputing_an_effectful_node_is_refused():
  def noisy(x):
    y = jnp.sin(x)
    jax.debug.print("y = {}", y)
    return jnp.sum(y * 2.0)

  program = trace_program(noisy, jnp.ones(4), costs="shape")
  graph = program.graph
  effectful = [v for v in graph.order if graph.nodes[v].attrs.get("effectful")]
  assert len(effectful) == 1
  schedule = jaxremat.schedule_from_computes(graph, [*graph.order, effectful[0]])
  assert jaxremat.simulate(graph, schedule).valid
  with pytest.raises(jaxremat.UnsupportedError, match="side effects"):
    emit(program, schedule)


def test_schedule_of_another_graph_is_rejected_clearly(mlp):
  _, program, args = mlp
  other = trace_program(lambda x: jnp.sum(jnp.sin(x)), jnp.ones(3), costs="shape", name="other")
  schedule = jaxremat.baseline_schedule(other.graph)
  with pytest.raises(ValueError, match=r"not a valid program for the traced graph.*'other'"):
    emit(program, schedule)
  with pytest.raises(ValueError, match="fence='wall'"):
    emit(program, jaxremat.baseline_schedule(program.graph), fence="wall")


def test_called_with_another_structure_is_rejected(mlp):
  _, program, args = mlp
  emitted = emit(program, jaxremat.baseline_schedule(program.graph))
  with pytest.raises(ValueError, match="structure"):
    emitted(args[0][:2], args[1])


@pytest.mark.parametrize(
  "value",
  [
    0.0,
    -0.0,
    np.nan,
    -np.inf,
    1.5,
    np.float16(0.0),
    np.int32(0),
    np.int8(-128),
    False,
    np.uint64(0),
    np.complex64(0),
  ],
)
def test_always_true_is_true_for_every_value(value):
  x = jnp.full((3,), value)
  assert bool(always_true(x))
  assert bool(jax.jit(always_true)(x))


def test_fences_return_their_values_unchanged():
  trigger = jnp.full((2, 2), jnp.nan)
  values = [jnp.arange(6.0).reshape(2, 3), jnp.array([True, False]), jnp.int32(7)]
  for fence in ("cond", "select", "barrier", "none"):
    t, out = jax.jit(lambda t, v, f=fence: apply_fence(f, t, v))(trigger, values)
    assert_trees_allclose(out, values, exact=True)
    np.testing.assert_array_equal(t, trigger)


def test_default_fence_per_backend():
  assert default_fence("cpu") == "select"
  assert default_fence("gpu") == "barrier"
  assert default_fence("tpu") == "barrier"


def test_fence_waits_for_a_value_xla_cannot_fold():
  # Two nodes (the iota product and its sum) are constants, and one is computed just
  # before the recomputed dot. XLA may fold a predicate read from a constant: on ResNet
  # it folded `jnp.var`'s `N - ddof > 0` and merged the recomputed convolutions (the slow
  # test below). The fence must wait for a value that depends on an input.
  def f(x, w):
    h = x @ w
    s = jnp.sum(jnp.sin(h))
    r = jnp.arange(32.0) * jnp.arange(32.0)
    return s * jnp.sum(r) + jnp.sum(jnp.cos(h) * r)

  x = jax.random.normal(jax.random.key(0), (64, 32))
  w = jax.random.normal(jax.random.key(1), (32, 32))
  program = trace_program(f, x, w, costs="shape", model="rules")
  graph, eqns = program.graph, program.jaxpr.jaxpr.eqns
  varying = _input_dependent(program)

  def constant(v):
    return not any(x in varying for i in program.node_eqns[v] for x in eqns[i].outvars)

  constants = [v for v in graph.order if constant(v)]
  (dot,) = [v for v in graph.order if graph.nodes[v].attrs.get("primitive") == "dot_general"]
  readers = [v for v in graph.order if v != dot and v not in constants]
  assert len(constants) == 2 and len(readers) == 2
  # The dot, its first reader, the last constant, then the dot again for the other reader.
  computes = [constants[0], dot, readers[0], constants[1], dot, readers[1]]
  schedule = jaxremat.schedule_from_computes(graph, computes)
  (run,) = [r for r in plan_runs(program, schedule) if r.recompute]
  assert run.trigger in varying
  report = verify(f, emit(program, schedule, pin="recomputations"), schedule, x, w)
  assert report.planned_recomputes == {"dot": 1} and report.recomputes_survive
  assert report.outputs_match


def test_a_value_without_a_buffer_is_read_from_the_recomputed_copy_of_its_operand():
  # `d` keeps no buffer (XLA:CPU duplicates it into both readers), so the graph has its
  # readers read `h` instead. A plan that frees `h` after the first reader and computes it
  # again for the last must have that reader evaluate `d` from the new copy: read from
  # the first computation, `d` kept the first `h` live through the chain (on the ResNet
  # step for TPU v5e, 24 MiB of convolution outputs the plan had recomputed).
  def f(x, w):
    h = x @ w
    d = jnp.tanh(h) * 2.0
    a = jnp.sin(d)
    m = a
    for _ in range(4):
      m = jnp.tanh(m @ w)
    return a, d * m

  x = jax.random.normal(jax.random.key(0), (64, 64))
  w = jax.random.normal(jax.random.key(1), (64, 64)) / 8.0
  program = trace_program(f, x, w, costs="shape", model="rules")
  graph = program.graph
  (d,) = [v for v in graph.order if graph.nodes[v].attrs.get("duplicated")]
  h, first_reader, *chain, last_reader = [v for v in graph.order if v != d]
  computes = [h, d, first_reader, *chain, h, last_reader]
  schedule = jaxremat.schedule_from_computes(graph, computes)
  emitted = emit(program, schedule, pin="recomputations")
  jaxpr = jax.make_jaxpr(emitted)(x, w).jaxpr
  sin_operand = next(e.invars[0] for e in jaxpr.eqns if e.primitive.name == "sin")
  last_mul = [e for e in jaxpr.eqns if e.primitive.name == "mul"][-1]
  assert sin_operand not in last_mul.invars
  report = verify(f, emitted, schedule, x, w)
  assert report.outputs_match and report.planned_recomputes == {"dot": 1}
  assert report.recomputes_survive


def test_a_dot_fused_with_its_readers_runs_once_when_every_reader_is_pinned():
  # XLA:CPU fuses the dot with both its readers. Each pinned reader waits behind a fence
  # of its own; evaluated in each, the dot would run once per reader.
  def f(x, w):
    h = x @ w
    return jnp.sum(jnp.sin(h)) + jnp.sum(jnp.cos(h) * jnp.arange(32.0))

  x = jax.random.normal(jax.random.key(0), (64, 32))
  w = jax.random.normal(jax.random.key(1), (32, 32))
  program = trace_program(f, x, w, costs="shape")
  emitted = emit(program, jaxremat.baseline_schedule(program.graph), pin="all")
  hlo = jax.jit(emitted).lower(x, w).compile().as_text()
  assert count_hlo_ops(hlo)["dot"] == 1


def test_a_kept_product_that_xla_fuses_into_its_reader_is_counted_with_its_bytes():
  # A fused QKV projection: XLA:CPU fuses each layer's product into the reshape that
  # reads it, so the step never holds it. `dots_saveable`'s plan keeps the products and
  # makes the slices again in the backward pass, and the emitted program holds each whole
  # product until then: counted without them, the plan read x0.69 of what XLA measured.
  b, t, d, heads = 16, 64, 128, 2

  def loss(ws, x):
    for w, o in ws:
      qkv = jnp.split((x @ w).reshape(b, t, 3, heads, d // heads), 3, axis=2)
      q, k, v = (y[:, :, 0] for y in qkv)
      a = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", q, k), -1)
      x = x + jnp.einsum("bhts,bshd->bthd", a, v).reshape(b, t, d) @ o
    return (x**2).sum()

  keys = jax.random.split(jax.random.key(0), 9)
  ws = [
    (jax.random.normal(keys[2 * i], (d, 3 * d)) * 0.05, jax.random.normal(keys[2 * i + 1], (d, d)))
    for i in range(4)
  ]
  x = jax.random.normal(keys[8], (b, t, d))
  program = trace_program(jax.grad(loss), ws, x, model="rules")
  schedule = jaxremat.solve(program.graph, budget=10**9, solver="dots-saveable")
  predicted = xla_accounted_peak_bytes(program.graph, schedule)
  measured = jaxremat.measure(emit(program, schedule), ws, x, runs=0).peak_bytes
  assert abs(predicted - measured) <= 0.1 * measured, (predicted, measured)


def test_a_recomputed_random_draw_is_drawn_again():
  # The draw reads only its key. Fenced through the key's data, the recomputation waits
  # for its trigger; unfenced, XLA merged it with the first draw and held the bits from
  # the forward pass to the backward one. The loss is an output, so that the forward
  # pass reads the draw (of a gradient alone, XLA drops the forward sum).
  def loss(x, key):
    keep = jax.random.bernoulli(key, 0.5, x.shape)
    return jnp.sum(jnp.where(keep, jnp.sin(x), 0.0) ** 2)

  x = jax.random.normal(jax.random.key(0), (256, 256))
  key = jax.random.key(1)
  f = jax.value_and_grad(loss)
  program = trace_program(f, x, key)
  graph = program.graph
  draw = next(v for v in graph.order if graph.nodes[v].attrs["primitive"] == "random_bits")
  last = max(graph.order.index(w) for w in graph.succs[draw])
  schedule = jaxremat.schedule_from_computes(
    graph, [*graph.order[:last], draw, *graph.order[last:]]
  )
  emitted = jax.jit(emit(program, schedule, pin="all"))
  # Threefry's key schedule constant appears once per draw.
  draws = emitted.lower(x, key).compile().as_text().count("constant(466688986)")
  assert draws == 2 * jax.jit(f).lower(x, key).compile().as_text().count("constant(466688986)")
  assert_trees_allclose(emitted(x, key), f(x, key))


def test_smallest_operand_is_routed(mlp):
  _, program, _ = mlp
  runs = plan_runs(program, segment_schedule(program.graph, 3))
  recomputed = [r for r in runs if r.recompute]
  assert recomputed
  # A recomputed layer's dot reads its activations (BATCH x WIDTH) and weights (WIDTH x
  # WIDTH): only the weights go through the fence.
  shapes = {tuple(x.aval.shape) for r in recomputed for x in r.routed}
  assert (WIDTH, WIDTH) in shapes and (BATCH, WIDTH) not in shapes


def _products_and_their_stack(w, xs):
  ps = [x @ w for x in xs]
  return sum(jnp.sum(jnp.sin(p)) for p in ps), jnp.stack(ps)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the select fence is XLA:CPU's")
def test_a_select_fence_copies_each_operand_right_before_its_reader():
  """Twelve products recomputed in one run, each reading an activation larger than the
  weight they share: the select fence copies each activation (XLA cannot fuse a select
  into a product). Selected all at the run's start, the twelve copies were held at once:
  +33% over the plan, above the step's own peak (an unrolled GRU's backward products,
  +18.7%); each selected before its product, +1.5%."""
  keys = jax.random.split(jax.random.key(0), 2)
  w = jax.random.normal(keys[0], (768, 256)) * 0.03
  xs = list(jax.random.normal(keys[1], (12, 128, 768)))
  program = trace_program(_products_and_their_stack, w, xs, model="compiler")
  graph, eqns = program.graph, program.jaxpr.jaxpr.eqns
  order = list(graph.order)

  def makes(v, *primitives):
    return any(eqns[k].primitive.name in primitives for k in program.node_eqns[v])

  products = [v for v in order if makes(v, "dot_general")]
  stack = next(v for v in order if makes(v, "stack", "concatenate"))
  at = order.index(stack)
  schedule = jaxremat.schedule_from_computes(graph, order[:at] + products + order[at:])
  emitted = emit(program, schedule, fence="select", pin="all")
  measured = jaxremat.measure(emitted, w, xs, runs=1, warmup=0).peak_bytes
  predicted = xla_accounted_peak_bytes(graph, schedule)
  assert measured <= 1.05 * predicted < program.baseline.peak_bytes
  assert_trees_allclose(jax.jit(emitted)(w, xs), _products_and_their_stack(w, xs))


def test_pinning_fences_every_compute_and_keeps_values(mlp):
  step, program, args = mlp
  schedule = segment_schedule(program.graph, 3)
  pinned = emit(program, schedule, pin="all")
  loose = emit(program, schedule, pin="recomputations")
  handed_on = emit(program, schedule, pin="checkpoint")
  n_runs = len(plan_runs(program, schedule, pin="all"))
  # Every run but the first (nothing computed before it to wait for) has a fence.
  assert pinned.n_fences == n_runs - 1 > loose.n_fences == handed_on.n_fences > 0

  # As after jax.checkpoint's barrier, later readers read the fenced copy of a weight.
  def input_reads(fn) -> int:
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return sum(x in jaxpr.invars for e in jaxpr.eqns for x in e.invars)

  assert input_reads(handed_on) < input_reads(loose)
  assert_trees_allclose(jax.jit(pinned)(*args), jax.jit(step)(*args))
  assert_trees_allclose(jax.jit(handed_on)(*args), jax.jit(step)(*args))
  report = verify(step, pinned, schedule, *args)
  assert report.recomputes_survive and report.outputs_match
  with pytest.raises(ValueError, match="pin='order'"):
    emit(program, schedule, pin="order")


def test_convolutions_lowered_to_dots_still_count():
  # XLA:CPU runs 1x1 convolutions as dots; a recomputed one survives as a dot.
  def loss(kernels, x):
    h = x
    for k in kernels:
      conv = lax.conv_general_dilated(
        h, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
      )
      h = jnp.tanh(conv)
    return jnp.sum(h * h)

  key = jax.random.key(0)
  # Six layers in two segments: the first segment's first two are recomputed.
  kernels = [jax.random.normal(jax.random.fold_in(key, i), (1, 1, 8, 8)) / 3 for i in range(6)]
  x = jax.random.normal(key, (4, 8, 8, 8))
  step = jax.grad(loss)
  program = trace_program(step, kernels, x, costs="shape")
  schedule = segment_schedule(program.graph, 2)
  report = verify(step, emit(program, schedule), schedule, kernels, x)
  assert report.planned_recomputes == {"convolution": 2}
  assert report.surviving_recomputes["dot"] == 2
  assert report.recomputes_survive and report.n_surviving_recomputes == 2
  assert report.outputs_match


@pytest.mark.slow
@pytest.mark.parametrize("solver", ["chen-greedy", "griewank"])
def test_resnet_solver_schedules_keep_every_recomputation(solver):
  import examples

  fn, args = examples.load("resnet").make_grad_fn()
  program = trace_program(fn, *args, costs="xla")
  schedule = jaxremat.solve(program.graph, 0.9, solver=solver, time_limit=10, workers=1)
  report = verify(fn, emit(program, schedule), schedule, *args)
  assert report.n_planned_recomputes > 0 and report.recomputes_survive
  assert report.outputs_match
