"""Training-step signatures as JAX users write them, through `jaxremat.optimize`.

Static arguments of any hashable kind (and arrays, by content), Python scalars traced as
`jax.jit` traces them, donation given to `optimize` or to the wrapped `jax.jit`, keyword
arguments, and Equinox models with non-array leaves. Each plans once per signature and
computes what the original computes.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from backend import assert_trees_allclose

import jaxremat


def _mlp_params(key, width=64, depth=3):
  keys = jax.random.split(key, depth)
  return [
    {"w": jax.random.normal(k, (width, width)) / width**0.5, "b": jnp.zeros(width)} for k in keys
  ]


def _loss(params, x, mode="tanh"):
  act = {"tanh": jnp.tanh, "relu": jax.nn.relu}[mode]
  for layer in params:
    x = act(x @ layer["w"] + layer["b"])
  return jnp.mean(x**2)


def _sgd_step(params, x, mode, lr):
  loss, grads = jax.value_and_grad(_loss)(params, x, mode)
  return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss


def _opt(fn, tmp_path, **kw):
  kw = {"budget": 1.0, "solver": "noremat", "time_limit": 20, "cache_dir": tmp_path, **kw}
  return jaxremat.optimize(fn, **kw)


X = jax.random.normal(jax.random.key(1), (32, 64))
PARAMS = _mlp_params(jax.random.key(0))


def test_static_string_mode_and_traced_float_learning_rate(tmp_path):
  fast = _opt(_sgd_step, tmp_path, static_argnums=2)
  for mode in ("tanh", "relu"):
    for lr in (0.1, 0.01):
      assert_trees_allclose(
        fast(PARAMS, X, mode, lr), jax.jit(_sgd_step, static_argnums=2)(PARAMS, X, mode, lr)
      )
  # One plan per static value; the learning rate is traced, as jax.jit traces it.
  assert len(fast.plans) == 2


def test_a_static_float_is_a_static_value(tmp_path):
  fast = _opt(_sgd_step, tmp_path, static_argnames="lr", static_argnums=2)
  for lr in (0.1, 0.5):
    expected = _sgd_step(PARAMS, X, "tanh", lr)
    assert_trees_allclose(fast(PARAMS, X, "tanh", lr=lr), expected)
  assert len(fast.plans) == 2


def test_jitted_step_keeps_its_static_and_donated_arguments(tmp_path):
  jitted = jax.jit(_sgd_step, static_argnums=2, donate_argnums=0)
  fast = _opt(jitted, tmp_path)
  params = jax.tree.map(jnp.copy, PARAMS)
  got = fast(params, X, "relu", 0.1)
  assert all(p.is_deleted() for p in jax.tree.leaves(params))  # donated, as jax.jit would
  assert_trees_allclose(got, _sgd_step(PARAMS, X, "relu", 0.1))
  plan = next(iter(fast.plans.values()))
  # The budget's fraction is of the donated original's peak.
  plain = jaxremat.measure(lambda p, x, lr: _sgd_step(p, x, "relu", lr), PARAMS, X, 0.1, runs=0)
  with_donation = jaxremat.measure(
    lambda p, x, lr: _sgd_step(p, x, "relu", lr), PARAMS, X, 0.1, runs=0, donate_argnums=0
  )
  assert with_donation.peak_bytes < plain.peak_bytes
  assert plan.baseline_peak_bytes == with_donation.peak_bytes


def test_donation_given_to_optimize(tmp_path):
  step = lambda params, x, lr: _sgd_step(params, x, "tanh", lr)  # noqa: E731
  fast = _opt(step, tmp_path, donate_argnums=(0,))
  params = jax.tree.map(jnp.copy, PARAMS)
  got = fast(params, X, 0.1)
  assert all(p.is_deleted() for p in jax.tree.leaves(params))
  assert_trees_allclose(got, step(PARAMS, X, 0.1))


def test_negative_static_argnums_and_static_arrays_by_content(tmp_path):
  """A static array keyed by repr() or a negative index not normalized reused the first
  call's plan, with its value baked in: the second call returned wrong numbers."""

  def scaled(x, scale):
    return jnp.sum(jnp.tanh(x * jnp.asarray(scale)))

  first = np.ones(2000, np.float32)
  second = first.copy()
  second[1000] = 5.0  # prints like `first`: numpy elides the middle of large arrays
  assert repr(first) == repr(second)
  x = jnp.ones(2000)
  fast = _opt(scaled, tmp_path, static_argnums=-1)
  for scale in (first, second):
    np.testing.assert_allclose(fast(x, scale), scaled(x, scale), rtol=1e-6)
  assert len(fast.plans) == 2


def test_keyword_arguments_and_unhashable_static_values(tmp_path):
  fast = _opt(_loss, tmp_path, static_argnames="mode")
  assert_trees_allclose(fast(PARAMS, x=X, mode="relu"), _loss(PARAMS, X, "relu"))
  # Keyword arguments are flattened in sorted order ('mode' before 'x'), as JAX does.
  assert_trees_allclose(fast(x=X, mode="tanh", params=PARAMS), _loss(PARAMS, X, "tanh"))
  assert len(fast.plans) == 2
  with pytest.raises(ValueError, match=r"kwargs\['mode'\] is a static value of type set"):
    fast(PARAMS, x=X, mode={"relu"})


class _Model(eqx.Module):
  layers: list
  activation: callable

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.layers = [eqx.nn.Linear(16, 32, key=k1), eqx.nn.Linear(32, 1, key=k2)]
    self.activation = jax.nn.gelu

  def __call__(self, x):
    return self.layers[1](self.activation(self.layers[0](x)))


def _eqx_step(model, opt_state, x, y):
  def loss(m):
    return jnp.mean((jax.vmap(m)(x)[:, 0] - y) ** 2)

  value, grads = eqx.filter_value_and_grad(loss)(model)
  updates, opt_state = _OPTIMIZER.update(grads, opt_state, eqx.filter(model, eqx.is_array))
  return eqx.apply_updates(model, updates), opt_state, value


_OPTIMIZER = optax.adam(1e-2)


def _eqx_args():
  model = _Model(jax.random.key(0))
  opt_state = _OPTIMIZER.init(eqx.filter(model, eqx.is_array))
  x = jax.random.normal(jax.random.key(1), (64, 16))
  y = jax.random.normal(jax.random.key(2), (64,))
  return model, opt_state, x, y


@pytest.mark.parametrize("wrap", ["plain", "filter_jit inside"])
def test_equinox_model_with_function_leaves(tmp_path, wrap):
  args = _eqx_args()
  step = eqx.filter_jit(_eqx_step) if wrap == "filter_jit inside" else _eqx_step
  fast = _opt(step, tmp_path)
  model, opt_state, loss = fast(*args)
  ref_model, ref_state, ref_loss = eqx.filter_jit(_eqx_step)(*args)
  assert model.activation is jax.nn.gelu  # a non-array leaf comes back as it is
  assert_trees_allclose(eqx.filter(model, eqx.is_array), eqx.filter(ref_model, eqx.is_array))
  assert_trees_allclose(loss, ref_loss)
  fast(*args)
  assert len(fast.plans) == 1


def test_filter_jit_outside_optimize(tmp_path):
  args = _eqx_args()
  fast = _opt(_eqx_step, tmp_path)
  outer = eqx.filter_jit(fast)
  with pytest.raises(jaxremat.UnsupportedError, match="call it once with arrays"):
    outer(*args)
  fast.plan(*args)  # planned with real arrays, it runs under the outer jit
  _, _, loss = outer(*args)
  assert_trees_allclose(loss, eqx.filter_jit(_eqx_step)(*args)[2])


def test_traced_argument_in_python_control_flow_says_how_to_fix_it(tmp_path):
  def step(x, training):
    return jnp.sum(x * 2.0) if training else jnp.sum(x)

  fast = _opt(step, tmp_path)
  with pytest.raises(jaxremat.UnsupportedError, match="static_argnums or static_argnames"):
    fast(X, True)
  assert float(_opt(step, tmp_path, static_argnums=1)(X, True)) == pytest.approx(
    float(step(X, True)), rel=1e-6
  )


def test_a_step_that_updates_its_arguments_in_place_is_refused_with_the_fix(tmp_path):
  """A Flax NNX step under `nnx.jit` updates its Module argument in place: traced as a
  function of its arguments, the update stayed on a copy, and the optimized step returned
  the loss and left the model as it was (the weights of an NNX CNN never moved). So is a
  step that assigns into a dict it was given."""
  from flax import nnx

  @nnx.jit
  def step(model, x):
    value, grads = nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))
    return value

  model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))

  def weights():
    return np.concatenate([np.ravel(w) for w in jax.tree.leaves(nnx.state(model, nnx.Param))])

  before = weights()
  with pytest.raises(jaxremat.UnsupportedError, match=r"argument args\[0\].*nnx.split"):
    _opt(step, tmp_path)(model, jnp.ones((3, 4)))
  np.testing.assert_array_equal(weights(), before)
  step(model, jnp.ones((3, 4)))  # nnx.jit itself writes the update back
  assert not np.array_equal(weights(), before)

  def dict_step(params, x):
    params["w"] = params["w"] - 0.1 * x
    return jnp.sum(x)

  with pytest.raises(jaxremat.UnsupportedError, match=r"argument args\[0\]\['w'\]"):
    _opt(dict_step, tmp_path)({"w": jnp.ones(4)}, jnp.ones(4))
