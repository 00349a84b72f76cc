"""Fuzzing with bounded example counts: random DAGs through every solver, random small JAX
programs through trace, solve and emit.

Example counts are fixed (``max_examples``) and the database is off, so that a run takes
the same time and checks the same number of cases everywhere. ``JAXREMAT_FUZZ_SCALE=N``
multiplies the counts for a longer campaign than CI's.
"""

from __future__ import annotations

import collections
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import jaxremat
from jaxremat import InfeasibleBudgetError, NoScheduleFoundError, RematGraph

_SCALE = int(os.environ.get("JAXREMAT_FUZZ_SCALE", "1"))
_SETTINGS = dict(
  deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)

# -- random DAGs through every solver ----------------------------------------------------


@st.composite
def dags(draw) -> RematGraph:
  """A DAG of 2..9 nodes: one or two inputs, random sizes, costs, edges and effects."""
  n = draw(st.integers(3, 9))
  n_inputs = draw(st.integers(1, 2))
  edges = set()
  for v in range(n_inputs, n):
    # Every computed node reads at least one earlier node; a few read more.
    edges.add((draw(st.integers(0, v - 1)), v))
    for u in draw(st.lists(st.integers(0, v - 1), max_size=2)):
      edges.add((u, v))
  effectful = draw(st.sets(st.integers(n_inputs, n - 1), max_size=2))
  nodes = [
    {
      "id": v,
      "mem": draw(st.integers(0 if v in effectful else 1, 64)),
      "cost": 0.0 if v < n_inputs else draw(st.integers(1, 20)) / 4,
      **({"effectful": True} if v in effectful else {}),
    }
    for v in range(n)
  ]
  has_succ = {u for u, _ in edges}
  outputs = [v for v in range(n_inputs, n) if v not in has_succ]
  outputs += draw(st.sets(st.integers(n_inputs, n - 1), max_size=1))
  return RematGraph.from_dict(
    {
      "format": "jaxremat.graph/1",
      "name": "fuzz",
      "nodes": nodes,
      "edges": [list(e) for e in sorted(edges)],
      "inputs": list(range(n_inputs)),
      "outputs": sorted(set(outputs)),
    }
  )


@pytest.mark.parametrize("solver", jaxremat.available_solvers())
@settings(max_examples=40 * _SCALE, **_SETTINGS)
@given(graph=dags(), fraction=st.sampled_from([0.6, 0.75, 0.9, 1.0]))
def test_random_dags_through_every_solver(solver, graph, fraction):
  baseline = jaxremat.simulate(graph, jaxremat.baseline_schedule(graph))
  budget_bytes = jaxremat.parse_budget(fraction, baseline.peak_bytes)
  try:
    schedule = jaxremat.solve(graph, budget_bytes, solver=solver, time_limit=2, workers=1)
  except InfeasibleBudgetError as e:
    assert e.budget_bytes == budget_bytes < e.min_feasible_bytes
    # Only the proven bound (its effect-pinned version is NoScheduleFoundError).
    assert e.min_feasible_bytes == graph.min_feasible_bytes
    return
  except NoScheduleFoundError:
    return
  result = jaxremat.simulate(graph, schedule)
  assert result.valid, result.error
  assert result.peak_bytes <= budget_bytes
  assert schedule.stats["peak_bytes"] == result.peak_bytes
  assert isinstance(schedule.stats["found_by"], str)
  assert schedule.stats["duration"] == pytest.approx(result.duration)
  # Effects run exactly once each, in program order.
  counts = collections.Counter(schedule.computes)
  once = graph.compute_once_nodes
  assert all(counts[v] == 1 for v in once)
  assert [v for v in schedule.computes if v in once] == list(once)


# -- random small JAX programs through trace, solve and emit --------------------------------

BATCH, WIDTH = 128, 16


def _op(name: str, h, p):
  """One layer of a random program: (BATCH, WIDTH) -> (BATCH, WIDTH)."""
  if name == "tanh":
    return jnp.tanh(h)
  if name == "sin":
    return jnp.sin(h) * 0.9
  if name == "dot":
    return h @ p["w"]
  if name == "residual":
    return h + jnp.tanh(h @ p["v"])
  if name == "normalize":  # reductions over both axes
    h = h - jnp.mean(h, axis=0)
    return h / jnp.sqrt(1.0 + jnp.sum(h * h, axis=1, keepdims=True))
  if name == "softmax":
    return jax.nn.softmax(h, axis=-1) * WIDTH
  if name == "reshape":
    return h.reshape(BATCH, WIDTH // 4, 4).transpose(0, 2, 1).reshape(BATCH, WIDTH)
  if name == "gram":  # a transpose and a dot of activations with themselves
    return h @ (h.T @ h) / (BATCH * WIDTH)
  if name == "scan":
    return jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), h, p["stack"])[0]
  if name == "while":  # a while loop on a value the gradient does not flow through
    factor = jax.lax.while_loop(
      lambda s: s[0] < 3,
      lambda s: (s[0] + 1, s[1] * 0.5 + 0.1),
      (0, jax.lax.stop_gradient(jnp.mean(h))),
    )[1]
    return h * (1.0 + factor)
  if name == "cond":
    return jax.lax.cond(jnp.sum(h) > 0, jnp.tanh, lambda a: a * 0.5, h)
  raise ValueError(name)


OPS = ("tanh", "sin", "dot", "residual", "normalize", "softmax", "reshape", "gram", "scan")
CONTROL = ("scan", "while", "cond")


def _program(names):
  def loss(p, x):
    h = x
    for name in names:
      h = _op(name, h, p)
    return jnp.sum(h**2) / BATCH

  return jax.value_and_grad(loss)


def _params():
  keys = jax.random.split(jax.random.key(0), 4)
  return {
    "w": jax.random.normal(keys[0], (WIDTH, WIDTH)) / 4,
    "v": jax.random.normal(keys[1], (WIDTH, WIDTH)) / 4,
    "stack": jax.random.normal(keys[2], (2, WIDTH, WIDTH)) / 4,
  }, jax.random.normal(keys[3], (BATCH, WIDTH))


def _assert_close(actual, expected, rtol=1e-5):
  for a, e in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected)):
    a, e = np.asarray(a), np.asarray(e)
    # Elements that cancel to near zero (dots over 128 rows, normalizations) differ by
    # float32 reassociation: bound them by rtol of the leaf's largest magnitude.
    atol = rtol * float(np.max(np.abs(e), initial=0.0))
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)


@settings(max_examples=6 * _SCALE, **_SETTINGS)
@given(
  names=st.lists(st.sampled_from(OPS + CONTROL), min_size=4, max_size=8).filter(
    lambda names: sum(n in ("dot", "residual", "gram", "scan") for n in names) >= 1
  ),
  solver=st.sampled_from(["xla-greedy", "twremat", "chen-greedy", "moccasin"]),
  fraction=st.sampled_from([0.5, 0.7, 0.9]),
)
def test_random_programs_through_trace_solve_emit(names, solver, fraction):
  step = _program(names)
  params, x = _params()
  program = jaxremat.trace_program(step, params, x, costs="shape")
  graph = program.graph
  schedule = None
  for budget in (fraction, 0.8, 1.0):  # the tightest budget the solver meets
    try:
      schedule = jaxremat.solve(graph, budget, solver=solver, time_limit=2, workers=1)
      break
    except (InfeasibleBudgetError, NoScheduleFoundError):
      continue
  if schedule is None:
    schedule = jaxremat.solve(graph, 1.0, solver="noremat")
  assert jaxremat.simulate(graph, schedule).valid
  event(f"recomputes: {schedule.stats['n_recompute'] > 0}")
  emitted = jaxremat.emit(program, schedule)
  expected = jax.jit(step)(params, x)
  _assert_close(jax.jit(emitted)(params, x), expected)
  # Differentiating the emitted step's loss gives the original gradients.
  grad = jax.jit(jax.grad(lambda p: emitted(p, x)[0]))(params)
  _assert_close(grad, expected[1])
