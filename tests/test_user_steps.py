"""Training steps as new users write them, through `jaxremat.optimize` (issue 16).

A Flax linen CNN with BatchNorm (a mutable collection), Dropout (an rng per step) and AdamW
with a float learning rate (examples/flax_cnn.py), and an Equinox transformer with a
function-valued leaf, trained with Adam (examples/equinox_transformer.py): with a static
keyword argument, donation and a traced keyword argument, given to `optimize` or to the
wrapped `jax.jit` / ``eqx.filter_jit``. Each runs, plans once per signature, stays within
its budget as XLA measures it, and computes what the original computes under `jax.jit`;
a budget jaxremat does not meet is met on a retry at the peak it states, and a budget is
only called infeasible below what the step's arguments and outputs take.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from backend import assert_trees_allclose

import jaxremat
from examples import equinox_transformer, flax_cnn

TIME_LIMIT = 30.0
FLAX_OPTIONS = {
  "static_argnames": flax_cnn.STATIC_ARGNAMES,
  "donate_argnums": flax_cnn.DONATE_ARGNUMS,
}
EQX_OPTIONS = {"donate_argnums": equinox_transformer.DONATE_ARGNUMS}


def _copy(tree: Any) -> Any:
  """Fresh buffers for every array leaf: a donating call deletes the ones it is given."""
  return jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, tree)


def _deleted(tree: Any) -> bool:
  return any(x.is_deleted() for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))


def _plan_within(
  make_fast: Callable[[Any], jaxremat.OptimizedFunction], budget: Any, args: tuple, kwargs: dict
) -> tuple[jaxremat.OptimizedFunction, jaxremat.Plan]:
  """The optimized step and its plan at ``budget``, or, where jaxremat says no plan it
  found meets it, at the peak it states; either way XLA measures the plan within it."""
  fast = make_fast(budget)
  try:
    plan = fast.plan(*args, **kwargs)
  except jaxremat.BudgetNotMetError as e:
    assert e.lower_bound_bytes <= e.measured_peak_bytes <= e.plan.baseline_peak_bytes
    fast = make_fast(e.measured_peak_bytes)
    plan = fast.plan(*args, **kwargs)
    assert plan.budget_bytes == e.measured_peak_bytes
  assert plan.measured_peak_bytes <= plan.budget_bytes, (plan.measured_peak_bytes, plan.attempts)
  assert not _deleted(args), "planning consumed the caller's donated arguments"
  return fast, plan


def _min_feasible_bytes(fn: Callable, args: tuple, donate_argnums: tuple[int, ...]) -> int:
  """What the step's arguments and outputs take in XLA, less the donated buffers it reuses."""
  m = jaxremat.measure(fn, *args, runs=0, donate_argnums=donate_argnums)
  return m.argument_bytes + m.output_bytes - m.alias_bytes


def _tighter_budget(make_fast, budget, args, kwargs, min_feasible: Callable[[], int]) -> None:
  """At ``budget``: met; or not met and met on a retry at the stated peak; or proven
  infeasible, which only a budget below the step's arguments and outputs may be."""
  try:
    _plan_within(make_fast, budget, args, kwargs)
  except jaxremat.InfeasibleBudgetError as e:
    assert e.budget_bytes < e.min_feasible_bytes == min_feasible()


# -- the two examples ---------------------------------------------------------------------


def _optimizer(fn, cache_dir, **options):
  """``budget -> jaxremat.optimize(fn, budget=budget, ...)``."""
  return lambda budget: jaxremat.optimize(
    fn, budget=budget, time_limit=TIME_LIMIT, cache_dir=cache_dir, **options
  )


def _deleted_mask(tree: Any) -> list[bool]:
  return [x.is_deleted() for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]


def _assert_flax_steps_match(fast, args, kwargs) -> None:
  """Three steps, each with a fresh dropout key and another learning rate, from the same
  state as `jax.jit` of the step with the same static and donated arguments; one plan."""
  step, _, _ = flax_cnn.make_train_step("small")
  reference = jax.jit(step, **FLAX_OPTIONS)
  params, batch_stats, opt_state, images, labels, key = args
  state = (params, batch_stats, opt_state)
  for i, lr in enumerate((1e-3, 3e-3, 3e-4)):
    step_args = (images, labels, jax.random.fold_in(key, i))
    step_kwargs = {**kwargs, "lr": lr}
    given, given_reference = _copy(state), _copy(state)
    got = fast(*given, *step_args, **step_kwargs)
    expected = reference(*given_reference, *step_args, **step_kwargs)
    # Donated as jax.jit donates: all but the learning rate in opt_state, which the step
    # replaces without reading it (XLA prunes an unread argument).
    assert _deleted_mask(given) == _deleted_mask(given_reference)
    assert sum(_deleted_mask(given)) == len(jax.tree.leaves(state)) - 1
    assert_trees_allclose(got, expected)
    assert float(got[2].hyperparams["learning_rate"]) == np.float32(lr)
    assert not np.allclose(got[1]["ConvBlock_0"]["BatchNorm_0"]["mean"], 0.0)  # updated
    state = expected[:3]
  assert len(fast.plans) == 1


def _assert_eqx_steps_match(fast, args) -> None:
  """Three steps on shifted batches from the same state as ``eqx.filter_jit`` of the step;
  one plan.

  The reference is ``eqx.filter_jit`` because `jax.jit` refuses the model's function
  leaf; it donates nothing, which changes no value.
  """
  step, _, _ = equinox_transformer.make_train_step("small")
  reference = eqx.filter_jit(step)
  model, opt_state, tokens, targets = args
  for shift in range(3):
    batch = (jnp.roll(tokens, shift, axis=1), jnp.roll(targets, shift, axis=1))
    given = _copy((model, opt_state))
    got_model, got_state, got_loss = fast(*given, *batch)
    assert all(_deleted_mask(given)), "the donated model and opt_state were not donated"
    want_model, want_state, want_loss = reference(model, opt_state, *batch)
    assert got_model.blocks[0].mlp.activation is jax.nn.gelu
    got_quiet, got_noisy = _split_key_biases(got_model, got_state)
    want_quiet, want_noisy = _split_key_biases(want_model, want_state)
    assert_trees_allclose((got_quiet, got_loss), (want_quiet, want_loss))
    _assert_normwise_close(got_noisy, want_noisy, rtol=1e-3)
    model, opt_state = want_model, want_state
  assert len(fast.plans) == 1


def _key_biases(tree: Any) -> list[jax.Array]:
  """The qkv biases of a model-shaped pytree (the model, or Adam's ``mu`` or ``nu``)."""
  return [block.attention.qkv.bias for block in tree.blocks]


def _split_key_biases(model: Any, opt_state: Any) -> tuple[Any, Any]:
  """``(everything else, the qkv biases)`` of the model and its Adam state.

  A key bias adds the same ``q . b`` to every score of a query, which the softmax
  cancels: its gradient is 0 up to rounding, and Adam scales that rounding noise to
  steps of up to the learning rate. Reordered float sums (a recomputing plan) move those
  elements by about 1e-5, far beyond an elementwise float32 tolerance, while the leaf's
  norm, set by the query and value parts, moves by about 1e-5 of itself.
  """
  adam = opt_state[0]
  trees = (eqx.filter(model, eqx.is_array), adam.mu, adam.nu)
  noisy = [_key_biases(t) for t in trees]
  quiet = [eqx.tree_at(_key_biases, t, replace_fn=jnp.zeros_like) for t in trees]
  return (quiet, adam.count, opt_state[1:]), noisy


def _assert_normwise_close(actual: Any, expected: Any, *, rtol: float) -> None:
  """Leaf by leaf, ``||actual - expected|| <= rtol * ||expected||``."""
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    assert np.linalg.norm(a - b) <= rtol * np.linalg.norm(b), (np.linalg.norm(a - b), b)


def _flax_min_feasible_bytes(step, args, kwargs) -> int:
  def flat(*leaves):
    return step(*leaves[:-1], lr=leaves[-1], train=kwargs["train"])

  return _min_feasible_bytes(flat, (*args, kwargs["lr"]), flax_cnn.DONATE_ARGNUMS)


def _eqx_min_feasible_bytes(step, args, kwargs) -> int:
  model, opt_state, tokens, targets = args
  arrays, static = eqx.partition(model, eqx.is_array)

  def flat(arrays, opt_state, tokens, targets):
    new_model, new_state, loss = step(eqx.combine(arrays, static), opt_state, tokens, targets)
    return eqx.filter(new_model, eqx.is_array), new_state, loss

  return _min_feasible_bytes(
    flat, (arrays, opt_state, tokens, targets), equinox_transformer.DONATE_ARGNUMS
  )


# What each example's step is given to optimize as: the plain step with optimize's static
# and donated arguments, or the step wrapped as its users wrap it, with those arguments in
# the wrapper (eqx.filter_jit's donation, "all" or "all-except-first", is not read by
# optimize: it is named to optimize).
WRAPPERS = {
  "flax_cnn": {
    "plain": lambda step: (step, FLAX_OPTIONS),
    "jax.jit": lambda step: (jax.jit(step, **FLAX_OPTIONS), {}),
  },
  "equinox_transformer": {
    "plain": lambda step: (step, EQX_OPTIONS),
    "eqx.filter_jit": lambda step: (eqx.filter_jit(step), EQX_OPTIONS),
  },
}
EXAMPLES = {
  "flax_cnn": (flax_cnn, _assert_flax_steps_match, _flax_min_feasible_bytes),
  "equinox_transformer": (
    equinox_transformer,
    lambda fast, args, kwargs: _assert_eqx_steps_match(fast, args),
    _eqx_min_feasible_bytes,
  ),
}
CASES = [(name, wrapper) for name in WRAPPERS for wrapper in WRAPPERS[name]]
# The plain steps run by default; each takes about a minute on two busy cores.
QUICK_CASES = [
  pytest.param(name, wrapper, marks=() if wrapper == "plain" else pytest.mark.slow)
  for name, wrapper in CASES
]


@pytest.mark.parametrize("name, wrapper", QUICK_CASES)
def test_step_plans_once_and_computes_what_jit_computes(name, wrapper, tmp_path):
  # The user's path (signature, static and donated arguments, kwargs, verification, the
  # cache) at the original's own peak, where no solver time is needed.
  module, assert_steps_match, _ = EXAMPLES[name]
  step, args, kwargs = module.make_train_step("small")
  fn, options = WRAPPERS[name][wrapper](step)
  make_fast = _optimizer(fn, tmp_path, solver="noremat", **options)
  fast, plan = _plan_within(make_fast, 1.0, args, kwargs)
  assert_steps_match(fast, args, kwargs)
  # The original meets a budget of its own peak as XLA measures it: nothing to recompute.
  # (Equinox: the model's no-remat peak is above XLA's, the no-remat plan is refused and
  # the planner falls back to its least-peak plan, which recomputes dozens of equations.)
  recomputes = plan.schedule.stats.get("n_recompute", 0)
  assert recomputes == 0, (plan.schedule.solver, recomputes, plan.measured_peak_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("name, wrapper", CASES)
def test_step_within_budget(name, wrapper, tmp_path):
  module, assert_steps_match, _ = EXAMPLES[name]
  step, args, kwargs = module.make_train_step("small")
  fn, options = WRAPPERS[name][wrapper](step)
  fast, plan = _plan_within(_optimizer(fn, tmp_path, **options), 0.7, args, kwargs)
  assert plan.measured_peak_bytes < plan.baseline_peak_bytes
  assert_steps_match(fast, args, kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("name", EXAMPLES)
def test_tighter_budget_is_met_on_retry_or_proven_infeasible(name, tmp_path):
  module, _, min_feasible_bytes = EXAMPLES[name]
  step, args, kwargs = module.make_train_step("small")
  fn, options = WRAPPERS[name]["plain"](step)
  _tighter_budget(
    _optimizer(fn, tmp_path, **options),
    0.5,
    args,
    kwargs,
    lambda: min_feasible_bytes(step, args, kwargs),
  )


@pytest.mark.parametrize("name", EXAMPLES)
def test_a_budget_below_the_arguments_and_outputs_is_proven_infeasible(name, tmp_path):
  module, _, min_feasible_bytes = EXAMPLES[name]
  step, args, kwargs = module.make_train_step("small")
  fn, options = WRAPPERS[name]["plain"](step)
  with pytest.raises(jaxremat.InfeasibleBudgetError) as info:
    _optimizer(fn, tmp_path, **options)(0.05).plan(*args, **kwargs)
  assert info.value.budget_bytes < info.value.min_feasible_bytes
  assert info.value.min_feasible_bytes == min_feasible_bytes(step, args, kwargs)


# -- Equinox modules with Python scalar fields -------------------------------------------
# eqx.filter_jit traces only arrays: a module's Python float and bool fields (eqx.nn.Dropout's
# `p` and `inference`, inside eqx.nn.MultiheadAttention) are static there, and so they are
# in optimize(eqx.filter_jit(step)). (optimize(step) traces Python scalars as jax.jit does.)


def _noremat(fn):
  return jaxremat.optimize(
    fn, budget=1.0, solver="noremat", time_limit=TIME_LIMIT, cache_dir=tempfile.mkdtemp()
  )


def test_equinox_multihead_attention_as_filter_jit_runs_it():
  attention = eqx.nn.MultiheadAttention(2, 8, key=jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (4, 8))

  def step(model, x):
    return eqx.filter_value_and_grad(lambda m: jnp.sum(m(x, x, x) ** 2))(model)

  loss, grads = _noremat(eqx.filter_jit(step))(attention, x)
  want_loss, want_grads = eqx.filter_jit(step)(attention, x)
  assert_trees_allclose(
    (loss, eqx.filter(grads, eqx.is_array)), (want_loss, eqx.filter(want_grads, eqx.is_array))
  )


class _Scaled(eqx.Module):
  w: jax.Array
  scale: float = 0.5


def _scaled_step(model, x):
  loss, grads = eqx.filter_value_and_grad(lambda m: jnp.sum(m.scale * m.w * x))(model)
  return eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads)), loss


def test_equinox_python_float_field_is_not_trained():
  model, x = _Scaled(jnp.ones(4)), jnp.arange(4.0)
  got, loss = _noremat(eqx.filter_jit(_scaled_step))(model, x)
  want, want_loss = eqx.filter_jit(_scaled_step)(model, x)
  assert want.scale == 0.5 and isinstance(want.scale, float)
  assert got.scale == want.scale and isinstance(got.scale, float), got.scale
  assert_trees_allclose((got.w, loss), (want.w, want_loss))
