"""Test helpers that read the backend's expectations from jaxremat/_src/backends.py."""

from __future__ import annotations

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
