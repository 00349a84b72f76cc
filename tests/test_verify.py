"""`compare_outputs` and `verify`: wrong plans fail, float noise of correct ones passes.

The step under test is an MLP with BatchNorm trained by Adam. The bias before each
BatchNorm has a gradient that is 0 in exact arithmetic (the norm subtracts the batch mean),
so in float32 it is rounding noise, and Adam's first step divides that noise by its own
magnitude: two correct evaluations that sum in another order disagree by O(1) there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxremat
from jaxremat._src.verify import (
  choose_verification_device,
  compare_outputs,
  compare_with_envelope,
  device_bytes_limit,
  noise_envelope,
  verify,
)

D_IN, WIDTH, CLASSES, BATCH = 32, 64, 10, 256


def batch_norm(h, g, b, by_dot=False):
  """Training-mode BatchNorm; ``by_dot`` sums the batch statistics as a product with a
  vector of ones, a correct reordering XLA cannot turn back into the reduction."""
  if by_dot:
    ones = jnp.ones(h.shape[0], h.dtype) / h.shape[0]
    mean = ones @ h
    var = ones @ (h - mean) ** 2
  else:
    mean = h.mean(0)
    var = ((h - mean) ** 2).mean(0)
  return (h - mean) * jax.lax.rsqrt(var + 1e-5) * g + b


def init_params(key):
  sizes = (D_IN, WIDTH, WIDTH, WIDTH)
  params = []
  for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
    w = jax.random.normal(jax.random.fold_in(key, i), (a, b)) / np.sqrt(a)
    params.append({"w": w, "b": jnp.zeros(b), "g": jnp.ones(b), "beta": jnp.zeros(b)})
  head = jax.random.normal(jax.random.fold_in(key, 99), (WIDTH, CLASSES)) / np.sqrt(WIDTH)
  return {"layers": params, "head": head}


def loss(params, x, y, *, by_dot=False, residual=True, first_layer=None):
  """Cross-entropy of a residual BatchNorm MLP.

  Args:
    by_dot: batch statistics as products (the same values up to rounding).
    residual: False drops the last block's skip connection (a dropped dependency).
    first_layer: weights to use for the first layer instead of ``params``' (stale ones).
  """
  h = x
  for i, layer in enumerate(params["layers"]):
    w = first_layer if i == 0 and first_layer is not None else layer["w"]
    out = jax.nn.relu(batch_norm(h @ w + layer["b"], layer["g"], layer["beta"], by_dot))
    last = i == len(params["layers"]) - 1
    h = out + h if i and (residual or not last) else out
  logp = jax.nn.log_softmax(h @ params["head"])
  return -jnp.take_along_axis(logp, y[:, None], axis=1).mean()


OPTIMIZER = optax.adam(1e-3)


def make_step(loss_fn):
  def step(params, opt_state, x, y):
    value, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return step


STEP = make_step(loss)


def emitted_step(loss_fn, args):
  """``make_step(loss_fn)`` through `trace_program` and `emit`, and its schedule."""
  program = jaxremat.trace_program(make_step(loss_fn), *args, costs="shape")
  schedule = jaxremat.baseline_schedule(program.graph)
  return jaxremat.emit(program, schedule), schedule


@pytest.fixture(scope="module")
def state0():
  """The first step's arguments: BatchNorm biases at 0, Adam's moments at 0."""
  key = jax.random.key(0)
  params = init_params(key)
  x = jax.random.normal(jax.random.fold_in(key, 1), (BATCH, D_IN))
  y = jax.random.randint(jax.random.fold_in(key, 2), (BATCH,), 0, CLASSES)
  return params, OPTIMIZER.init(params), x, y


@pytest.fixture(scope="module")
def state1(state0):
  """The second step's arguments, and the first step's parameters (the stale ones)."""
  params, opt_state, _ = jax.jit(STEP)(*state0)
  return (params, opt_state, *state0[2:]), state0[0]


@pytest.fixture(scope="module")
def envelope1(state1):
  return noise_envelope(STEP, *state1[0])


@pytest.fixture(scope="module")
def original(state0):
  return jaxremat.measure(STEP, *state0, runs=0)


def allclose_everywhere(got, expected, rtol=1e-5, atol=1e-6) -> bool:
  return all(
    np.allclose(np.asarray(g), np.asarray(e), rtol=rtol, atol=atol)
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected))
  )


# -- noisy but correct --------------------------------------------------------------------


def test_reordered_batchnorm_adam_step_passes_where_the_old_criterion_fails(state0, original):
  emitted, schedule = emitted_step(functools.partial(loss, by_dot=True), state0)
  v = verify(STEP, emitted, schedule, *state0, original=original)
  assert v.outputs_match, v.output_report
  assert v.comparison.method == "envelope" and v.comparison.perturbation == 2.0**-17
  # The old criterion: allclose(rtol=1e-5, atol=1e-6), or a norm-wise relative error of
  # at most 1e-4 per leaf. Both fail, on the biases before BatchNorm and their moments.
  got, expected = jax.jit(emitted)(*state0), jax.jit(STEP)(*state0)
  assert not allclose_everywhere(got, expected)
  assert v.max_rel_norm_error > 1e-4
  noisy = [leaf.path for leaf in v.comparison.leaves if leaf.rel_norm_error > 1e-4]
  assert noisy and all(path.endswith("['b']") for path in noisy), noisy


def test_the_original_passes_against_itself(state1, envelope1):
  comparison = compare_with_envelope(envelope1, jax.jit(STEP)(*state1[0]))
  assert comparison.outputs_match, comparison.describe()
  assert comparison.method == "envelope" and len(comparison.leaves) == 41
  assert "all 41 output leaves within their noise" in comparison.describe()


# -- wrong plans --------------------------------------------------------------------------


def test_dropped_dependency_fails(state1, envelope1, original):
  args, _ = state1
  emitted, schedule = emitted_step(functools.partial(loss, residual=False), args)
  v = verify(STEP, emitted, schedule, *args, original=original, envelope=envelope1)
  assert not v.outputs_match and not v.ok(peak_rtol=10.0)
  assert v.noise_ratio > 100, v.output_report
  assert "fail" in v.output_report and v.worst_leaf in v.output_report


def test_stale_value_fails(state1, envelope1):
  args, stale = state1
  stale_step = make_step(functools.partial(loss, first_layer=stale["layers"][0]["w"]))
  comparison = compare_with_envelope(envelope1, jax.jit(stale_step)(*args))
  assert not comparison.outputs_match
  assert comparison.noise_ratio > 100, comparison.describe()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_one_non_finite_element_fails(state1, envelope1, bad):
  got = jax.jit(STEP)(*state1[0])
  assert compare_with_envelope(envelope1, got).outputs_match
  params, opt_state, value = got
  params = {**params, "head": params["head"].at[3, 4].set(bad)}
  comparison = compare_with_envelope(envelope1, (params, opt_state, value))
  assert not comparison.outputs_match
  assert comparison.worst_leaf == "[0]['head']" and comparison.noise_ratio == np.inf
  assert comparison.max_abs_error == np.inf and comparison.max_rel_norm_error == np.inf
  (leaf,) = [leaf for leaf in comparison.leaves if not leaf.ok]
  assert leaf.n_nonfinite_mismatch == 1 and "1 only in the optimized one" in leaf.problem
  assert "[0]['head']" in comparison.describe()


# -- the non-finite rule, exact leaves, structure -----------------------------------------


def log_and_sum(x):
  return jnp.log(x), jnp.sum(jnp.tanh(x))


X = jnp.array([2.0, -1.0, 0.0, 3.0])  # log: finite, NaN, -inf, finite


def test_same_non_finite_positions_pass_and_others_fail():
  expected = jax.jit(log_and_sum)(X)
  assert compare_outputs(log_and_sum, expected, X).outputs_match
  logs, total = expected
  for wrong in (
    logs.at[1].set(0.0),  # finite where the original is NaN
    logs.at[2].set(np.inf),  # +inf where the original is -inf
    logs.at[2].set(np.nan),  # NaN where the original is -inf
  ):
    comparison = compare_outputs(log_and_sum, (wrong, total), X)
    assert not comparison.outputs_match and comparison.worst_leaf == "[0]"
    assert comparison.leaves[0].n_nonfinite_mismatch == 1
  # The escape hatch keeps the non-finite rule.
  assert not compare_outputs(log_and_sum, (logs.at[1].set(0.0), total), X, rtol=1.0).outputs_match


def test_values_too_small_for_a_float32_norm_are_judged_in_float64():
  """Adam's second moment of an attention key's bias, whose gradient is 0 up to rounding
  (softmax does not see a shift of every logit), is about 1e-27: squared in a float32
  norm its envelope was 0, and keys taken in another order (a diffusion U-Net's plan)
  read as 7e5 times its noise."""

  def adam_nu(q, k, w):
    def loss(b):
      return jnp.sum(jax.nn.softmax(q @ (k + b).T, -1) * w)

    g = jax.grad(loss)(jnp.zeros(k.shape[1]))
    return 0.001 * g * g

  keys = jax.random.split(jax.random.key(0), 2)
  q, k = jax.random.normal(keys[0], (2, 64, 32))
  w = jax.random.normal(keys[1], (64, 64)) * 1e-6
  envelope = noise_envelope(adam_nu, q, k, w)
  reordered = jax.jit(adam_nu)(q, k[::-1], w[:, ::-1])  # the same sums in another order
  assert 0 < np.abs(envelope.expected).max() < 1e-19
  assert compare_with_envelope(envelope, reordered).outputs_match
  assert not compare_with_envelope(envelope, reordered * 40).outputs_match


def test_integer_and_key_leaves_must_be_equal_and_are_not_perturbed():
  def f(n, key, x):
    return n * 3, jax.random.split(key), jnp.argmax(x), x * 2.0

  args = (jnp.arange(5), jax.random.key(7), jnp.linspace(-1.0, 1.0, 9))
  expected = jax.jit(f)(*args)
  envelope = noise_envelope(f, *args)
  assert [s is None for s in envelope.spreads] == [True, True, True, False]
  assert compare_with_envelope(envelope, expected).outputs_match
  n, keys, i, y = expected
  for wrong in [(n.at[0].add(1), keys, i, y), (n, jax.random.split(keys[0]), i, y)]:
    comparison = compare_with_envelope(envelope, wrong)
    assert not comparison.outputs_match and "must be equal exactly" in comparison.describe()


def test_structure_shape_and_dtype_must_agree():
  f = lambda x: (x * 2.0, x + 1.0)  # noqa: E731
  x = jnp.ones(3)
  a, b = f(x)
  assert "structure" in compare_outputs(f, [a, b], x).describe()
  assert not compare_outputs(f, (a, b[:2]), x).outputs_match
  assert (
    "float16[3] where the original has float32[3]"
    in compare_outputs(f, (a, b.astype(jnp.float16)), x).describe()
  )


def test_explicit_tolerances_replace_the_envelope():
  f = lambda w, x: jnp.tanh(x @ w)  # noqa: E731
  w, x = jax.random.normal(jax.random.key(0), (2, 16, 16))
  off = f(w, x) * (1 + 1e-3)
  assert not compare_outputs(f, off, w, x).outputs_match
  loose = compare_outputs(f, off, w, x, rtol=1e-2)
  assert loose.outputs_match and loose.method == "allclose" and loose.perturbation is None
  assert not compare_outputs(f, off, w, x, rtol=1e-4).outputs_match


def test_low_precision_steps_get_a_larger_perturbation():
  f = lambda x: jnp.sum(x.astype(jnp.bfloat16) ** 2)  # noqa: E731
  x = jnp.linspace(1.0, 2.0, 256)
  assert noise_envelope(f, x).perturbation == 2.0**-5
  assert noise_envelope(lambda x: jnp.sum(x**2), x).perturbation == 64 * 2.0**-23


def test_a_step_that_computes_in_bfloat16_is_perturbed_as_bfloat16():
  """Float32 in and out, bfloat16 inside (mixed precision): a recomputation reorders its
  bfloat16 sums, so the perturbation is bfloat16's (`computed_dtypes`). The product
  summed in two halves passes; one half dropped fails, in Adam's moments, which follow
  the gradient."""
  w = jax.random.normal(jax.random.key(3), (256, 64))
  x = jax.random.normal(jax.random.key(4), (64, 256))

  def step(w, x, halves=None):
    def loss(w):
      xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
      h = xb @ wb if halves is None else sum(xb[:, i::2] @ wb[i::2] for i in halves)
      return jnp.mean(h.astype(jnp.float32) ** 2)

    updates, state = OPTIMIZER.update(jax.grad(loss)(w), OPTIMIZER.init(w), w)
    return optax.apply_updates(w, updates), state

  envelope = noise_envelope(step, w, x)
  assert envelope.perturbation == 2.0**-5
  split = jax.jit(functools.partial(step, halves=(0, 1)))(w, x)
  assert compare_with_envelope(envelope, split).outputs_match
  dropped = jax.jit(functools.partial(step, halves=(0,)))(w, x)
  assert not compare_with_envelope(envelope, dropped).outputs_match


# -- where to verify ----------------------------------------------------------------------


def test_host_mode_gives_the_device_mode_verdict(state1, envelope1):
  args, stale = state1
  host = noise_envelope(STEP, *args, device="host")
  assert host.perturbation == envelope1.perturbation
  right = jax.jit(STEP)(*args)
  wrong = jax.jit(make_step(functools.partial(loss, first_layer=stale["layers"][0]["w"])))(*args)
  for got in (right, wrong):
    on_host, on_device = compare_with_envelope(host, got), compare_with_envelope(envelope1, got)
    assert on_host.outputs_match == on_device.outputs_match
    assert on_host.noise_ratio == pytest.approx(on_device.noise_ratio, rel=1e-3)


def test_verify_on_the_host():
  f = lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)  # noqa: E731
  w, x = jax.random.normal(jax.random.key(0), (2, 32, 32))
  program = jaxremat.trace_program(f, w, x, costs="shape")
  schedule = jaxremat.baseline_schedule(program.graph)
  emitted = jaxremat.emit(program, schedule)
  for device, where in [("host", "host"), ("auto", "device"), (None, "device")]:
    v = verify(f, emitted, schedule, w, x, device=device)
    assert v.outputs_match and v.device == where
  with pytest.raises(ValueError, match="device='gpu0' is not a verification device"):
    verify(f, emitted, schedule, w, x, device="gpu0")
  with pytest.raises(ValueError, match="is not a verification device"):
    compare_outputs(f, f(w, x), w, x, device="auto")


def test_choose_verification_device():
  gib = 2**30
  assert choose_verification_device(8 * gib, 16 * gib) == "device"
  assert choose_verification_device(int(14.4 * gib), 16 * gib) == "device"
  assert choose_verification_device(int(14.5 * gib), 16 * gib) == "host"
  assert choose_verification_device(64 * gib, None) == "device"
  limit = device_bytes_limit()
  if jax.default_backend() == "cpu":
    assert limit is None
  else:
    assert limit is not None and limit > 0
