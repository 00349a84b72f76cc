"""Planning inside loops: a differentiated `lax.scan` stores what the plan chooses.

Real traces and XLA:CPU compiles: each test checks that the loop's rewrite stores less
as XLA measures it, that the backward pass really recomputes (XLA's FLOPs rise) and that
the step computes what the original does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from backend import assert_trees_allclose

import jaxremat
from jaxremat._src import capture, compat, loops
from jaxremat._src.solvers.residuals import choose_stored

LAYERS, BATCH, WIDTH = 8, 512, 128


def _layer(h, w):
  return jnp.tanh(h @ w) + 0.1 * h, None


def _loss(ws, x, layer=_layer):
  h, _ = jax.lax.scan(layer, x, ws)
  return jnp.sum(h**2)


def _args():
  ws = jax.random.normal(jax.random.key(0), (LAYERS, WIDTH, WIDTH)) / jnp.sqrt(WIDTH)
  x = jax.random.normal(jax.random.key(1), (BATCH, WIDTH))
  return ws, x


def _flat(fn, *args):
  return capture.flatten_jaxpr(jax.make_jaxpr(fn)(*args))


def _run(closed):
  return lambda *a: compat.eval_closed_jaxpr(closed, *a)


def test_a_scan_stores_only_what_the_knapsack_chooses_and_xla_recomputes_the_rest():
  grad = jax.value_and_grad(_loss)
  args = _args()
  closed = _flat(grad, *args)
  (loop,) = loops.residual_loops(closed)
  assert loop.problem.trips == LAYERS
  stacked = loop.problem.stored_bytes(loop.problem.residuals)
  # The least any choice stores: the carried activation of each iteration.
  (least,) = choose_stored([loop.problem], None)
  activation = BATCH * WIDTH * 4
  assert least.stored_bytes == LAYERS * activation < stacked
  assert least.recomputed_flops > 0
  rewritten = loops.store_less(closed, [loop], [least])

  assert_trees_allclose(_run(rewritten)(*args), list(grad(*args)))
  before, after = (jaxremat.measure(_run(c), *args) for c in (closed, rewritten))
  # XLA holds less by what the loop no longer stores, and recomputes: the forward product
  # runs again in the backward loop (XLA's cost analysis counts a loop body once).
  assert after.peak_bytes <= before.peak_bytes - (stacked - least.stored_bytes) // 2
  assert after.flops >= before.flops + 2 * BATCH * WIDTH * WIDTH * 0.9
  # Still two loops: the program stays O(1) in the number of layers.
  assert after.hlo_text.count(" while(") == before.hlo_text.count(" while(") == 2


def test_the_knapsack_stores_within_the_cap_at_the_fewest_flops():
  (loop,) = loops.residual_loops(_flat(jax.value_and_grad(_loss), *_args()))
  problem = loop.problem
  stacked = problem.stored_bytes(problem.residuals)
  (everything,) = choose_stored([problem], stacked)
  assert everything.recomputed == frozenset() and everything.stored_bytes <= stacked
  (least,) = choose_stored([problem], None)
  (half,) = choose_stored([problem], (stacked + least.stored_bytes) // 2)
  assert half.stored_bytes <= (stacked + least.stored_bytes) // 2
  assert 0 < half.recomputed_flops <= least.recomputed_flops
  assert choose_stored([problem], least.stored_bytes - 1) is None


@pytest.mark.parametrize("policy", ["dots_saveable", "nothing_saveable"])
def test_a_loop_stores_what_jax_checkpoint_with_a_policy_on_its_body_stores(policy):
  """The policy's choice, emitted as jaxremat emits the knapsack's: XLA holds no more
  than with `jax.checkpoint` on the body and counts no more FLOPs."""
  grad, args = jax.value_and_grad(_loss), _args()
  rewritten, (rewrite,) = loops.shed_residuals(_flat(grad, *args), 0, policy=policy)
  saving = getattr(jax.checkpoint_policies, policy)
  checkpointed = jax.value_and_grad(
    lambda ws, x: _loss(ws, x, jax.checkpoint(_layer, policy=saving))
  )
  assert_trees_allclose(_run(rewritten)(*args), list(checkpointed(*args)))
  ours, theirs = jaxremat.measure(_run(rewritten), *args), jaxremat.measure(checkpointed, *args)
  assert ours.peak_bytes <= theirs.peak_bytes and ours.flops <= theirs.flops
  # dots_saveable stores the product and the carried activation; nothing_saveable the
  # carried activation alone.
  activation = BATCH * WIDTH * 4
  assert rewrite.stored_bytes == LAYERS * activation * (2 if policy == "dots_saveable" else 1)
  assert f"as jax.checkpoint_policies.{policy} chose" in rewrite.line


def _fori_loss(ws, x):
  h = jax.lax.fori_loop(0, LAYERS, lambda i, h: jnp.tanh(h @ ws[i]) + 0.1 * h, x)
  return jnp.sum(h**2)


def _cond_loss(ws, x):
  def layer(h, w_i):
    w, i = w_i
    h = jax.lax.cond(i % 2 == 0, lambda h: jnp.tanh(h @ w), lambda h: jax.nn.relu(h @ w), h)
    return h + 0.1 * h, None

  return jnp.sum(jax.lax.scan(layer, x, (ws, jnp.arange(LAYERS)))[0] ** 2)


@jax.custom_vjp
def _clipped_tanh(z):
  return jnp.tanh(z)


def _clipped_tanh_fwd(z):
  y = jnp.tanh(z)
  return y, y


def _clipped_tanh_bwd(y, g):
  return (jnp.clip(g * (1 - y**2), -1e-3, 1e-3),)


_clipped_tanh.defvjp(_clipped_tanh_fwd, _clipped_tanh_bwd)


@pytest.mark.parametrize(
  "loss",
  [
    _fori_loss,  # a fori_loop with static bounds: JAX differentiates it as a scan
    _cond_loss,  # the body branches: the backward pass recomputes the whole cond
    # The user's backward rule runs as defined (its clip shows in the gradient); the
    # forward rule is recomputed to give the residual it defines.
    lambda ws, x: _loss(ws, x, lambda h, w: (_clipped_tanh(h @ w) + 0.1 * h, None)),
  ],
  ids=["fori_loop", "cond", "custom_vjp"],
)
def test_loops_whose_bodies_branch_index_or_define_their_gradient_store_their_carry(loss):
  grad, args = jax.value_and_grad(loss), _args()
  closed = _flat(grad, *args)
  (loop,) = loops.residual_loops(closed)
  (least,) = choose_stored([loop.problem], None)
  rewritten = loops.store_less(closed, [loop], [least])
  assert_trees_allclose(_run(rewritten)(*args), list(grad(*args)))
  # Each iteration stores its carried activation (and a fori_loop its counter).
  activation = BATCH * WIDTH * 4
  assert LAYERS * activation <= least.stored_bytes <= LAYERS * (activation + 64)
  stacked = loop.problem.stored_bytes(loop.problem.residuals)
  before, after = (jaxremat.measure(_run(c), *args) for c in (closed, rewritten))
  assert after.peak_bytes <= before.peak_bytes - (stacked - least.stored_bytes) // 2


def test_a_loop_with_effects_is_left_as_written():
  def loss(ws, x):
    def layer(h, w):
      jax.debug.callback(lambda v: None, h[0, 0])
      return jnp.tanh(h @ w), None

    return jnp.sum(jax.lax.scan(layer, x, ws)[0])

  closed = _flat(jax.grad(loss), *_args())
  assert any(e.primitive.name == "scan" for e in closed.jaxpr.eqns)
  assert loops.residual_loops(closed) == []
  assert loops.shed_residuals(closed, 1 << 30) == (closed, ())


def test_optimize_meets_a_budget_below_what_the_scan_stores_on_a_scanned_gpt(tmp_path):
  from examples import scanned_gpt

  step, args = scanned_gpt.make_train_step(d_model=64, n_layers=6, seq_len=64, batch=4, vocab=128)
  original = jaxremat.measure(step, *args)
  fast = jaxremat.optimize(step, budget=0.4, time_limit=60, cache_dir=str(tmp_path), progress=False)
  outputs = fast(*args)
  plan = fast.plan(*args)
  assert plan.measured_peak_bytes <= plan.budget_bytes < 0.41 * original.peak_bytes
  # Within the original's own float noise (the recomputed softmax rounds apart).
  assert plan.verification is not None and plan.verification.outputs_match
  np.testing.assert_allclose(outputs[2], jax.jit(step)(*args)[2], rtol=1e-6)
  line = plan.program.loops[0].line
  assert (
    len(plan.program.loops) == 1
    and line.startswith("scan at ")
    and "scanned_gpt.py" in line
    and "recomputes" in line
  )
  report = str(fast.report(*args))
  assert "loops that store less for the backward pass" in report and line in report


def test_a_budget_the_step_meets_keeps_its_loops_as_written(tmp_path):
  step, args = jax.value_and_grad(_loss), _args()
  fast = jaxremat.optimize(step, budget=1.0, time_limit=30, cache_dir=str(tmp_path), progress=False)
  np.testing.assert_allclose(fast(*args)[0], step(*args)[0], rtol=1e-6)
  assert fast.plan(*args).program.loops == ()


def test_a_flax_nn_scan_step_meets_a_budget_below_what_its_layers_store(tmp_path):
  import flax.linen as nn
  import optax

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      h = nn.gelu(nn.Dense(256)(nn.LayerNorm()(x)))
      return x + nn.Dense(64)(h), None

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=6)
      return nn.Dense(10)(stack()(x, None)[0])

  model, optimizer = Model(), optax.adam(1e-3)
  x = jax.random.normal(jax.random.key(2), (512, 64))
  labels = jnp.arange(512) % 10
  params = model.init(jax.random.key(0), x)

  def step(params, opt_state, x, labels):
    def loss(p):
      logits = model.apply(p, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  args = (params, optimizer.init(params), x, labels)
  original = jaxremat.measure(step, *args, runs=0)
  fast = jaxremat.optimize(step, budget=0.5, time_limit=60, cache_dir=str(tmp_path), progress=False)
  fast(*args)
  plan = fast.plan(*args)
  assert plan.measured_peak_bytes <= plan.budget_bytes <= 0.5 * original.peak_bytes + 1
  assert plan.verification.outputs_match and len(plan.program.loops) == 1
  # The loop and what it recomputes are named by this file's lines, not Flax's.
  line = plan.program.loops[0].line
  assert line.startswith(f"scan at {__file__}:") and "site-packages" not in line


@pytest.mark.parametrize(
  "policy",
  [
    # the same path at other peaks, 35-55 s each: left to `pytest -m slow`
    pytest.param("dots_saveable", marks=pytest.mark.slow),
    pytest.param("dots_with_no_batch_dims_saveable", marks=pytest.mark.slow),
    "nothing_saveable",
  ],
)
def test_a_scanned_gpt_meets_each_policys_peak_at_no_more_flops(policy, tmp_path):
  """At the peak of `jax.checkpoint` with ``policy`` on the scan body, `optimize` meets
  the budget at no more FLOPs than the policy: the loop stores the policy's own choice or
  the knapsack's, with the attention mask broadcast in each iteration (held whole, it
  took 0.5% more than the policy's step)."""
  from examples import _common, scanned_gpt

  step, args = scanned_gpt.make_train_step(d_model=64, n_layers=6, seq_len=64, batch=4, vocab=128)
  params, _, batch = args
  policy_step, _ = _common.make_train_step(
    lambda p, b: scanned_gpt.loss(p, b, checkpoint=policy), params, batch
  )
  measured = jaxremat.measure(policy_step, *args, runs=0)
  fast = jaxremat.optimize(
    step, budget=measured.peak_bytes, time_limit=60, cache_dir=str(tmp_path), progress=False
  )
  plan = fast.plan(*args)
  assert plan.measured_peak_bytes <= measured.peak_bytes
  assert plan.measurement.flops <= measured.flops
  assert plan.verification.outputs_match


def test_a_body_the_user_checkpointed_is_planned_inside_too(tmp_path):
  """The scan body is under `jax.checkpoint(dots_saveable)` already: its loop stores the
  policy's residuals, and `optimize` stores less of them for 0.8 of that step's peak."""
  from examples import _common, scanned_gpt

  _, args = scanned_gpt.make_train_step(d_model=64, n_layers=6, seq_len=64, batch=4, vocab=128)
  params, _, batch = args
  step, _ = _common.make_train_step(
    lambda p, b: scanned_gpt.loss(p, b, checkpoint="dots_saveable"), params, batch
  )
  original = jaxremat.measure(step, *args, runs=0)
  fast = jaxremat.optimize(step, budget=0.8, time_limit=60, cache_dir=str(tmp_path), progress=False)
  plan = fast.plan(*args)
  assert plan.measured_peak_bytes <= 0.8 * original.peak_bytes
  assert plan.verification.outputs_match and len(plan.program.loops) == 1


def test_below_the_least_an_iteration_stores_iterations_go_in_groups(tmp_path):
  """16 layers: storing each iteration's carry is the least one loop stores; in groups
  of 4 the forward loop stacks only each group's first carry and the backward pass runs
  each group forward again (two-level checkpointing). XLA holds less, the outputs are
  JAX's, and `optimize` plans so for a budget between the two."""
  layers = 16
  ws = jax.random.normal(jax.random.key(0), (layers, WIDTH, WIDTH)) / jnp.sqrt(WIDTH)
  args = (ws, _args()[1])
  grad = jax.value_and_grad(_loss)
  closed = _flat(grad, *args)
  (loop,) = loops.residual_loops(closed)
  (least,) = choose_stored([loop.problem], None)
  every = loops.store_less(closed, [loop], [least])
  in_groups, (rewrite,) = loops.shed_residuals(closed, 1 << 40)
  assert "in groups of 4" in rewrite.line
  assert rewrite.stored_bytes == (layers // 4 + 4) * BATCH * WIDTH * 4 < least.stored_bytes
  assert_trees_allclose(_run(in_groups)(*args), list(grad(*args)))
  one, grouped = (jaxremat.measure(_run(c), *args) for c in (every, in_groups))
  assert grouped.peak_bytes < one.peak_bytes and grouped.flops > one.flops
  # Still loops: two in the forward pass, three in the backward.
  assert grouped.hlo_text.count(" while(") == 5

  budget = (one.peak_bytes + grouped.peak_bytes) // 2
  fast = jaxremat.optimize(
    grad, budget=budget, time_limit=60, cache_dir=str(tmp_path), progress=False
  )
  plan = fast.plan(*args)
  assert plan.measured_peak_bytes <= budget and plan.verification.outputs_match
  assert "in groups of" in plan.program.loops[0].line
