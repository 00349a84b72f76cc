"""Test helpers that read the backend's expectations from jaxremat/_src/backends.py."""

from __future__ import annotations

import collections
import contextlib

import jax
import numpy as np

from jaxremat._src.backends import backend_facts

FACTS = backend_facts()


def assert_trees_allclose(actual, expected, *, exact: bool = False) -> None:
  """Same pytree structure, dtypes and shapes, and values within this backend's tolerance.

  Args:
    actual, expected: pytrees of arrays.
    exact: demand bitwise equality (for results that must not move at all, e.g. random bits).
  """
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    rtol, atol = (0.0, 0.0) if exact else FACTS.tolerance(b.dtype)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


@contextlib.contextmanager
def counted_compiles():
  """Counts XLA's compiles by JAX's name for each (``"jit(step)"``) while the block runs."""
  compiled = collections.Counter()

  def count(event, duration_s, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
      compiled[kwargs["fun_name"]] += 1

  jax.monitoring.register_event_duration_secs_listener(count)
  try:
    yield compiled
  finally:
    jax.monitoring.unregister_event_duration_listener(count)
