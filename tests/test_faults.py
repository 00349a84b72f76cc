"""Faults: time limits, interruptions, damaged or foreign cache files.

Nothing here is mocked: solves are real, interruptions are real KeyboardInterrupts raised
from inside a solve or a file write, and damaged files are real files on disk.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import shared_graph

import jaxremat
from jaxremat._src.costs import CACHE_FORMAT, CostCache
from jaxremat._src.graph import write_json_atomic
from jaxremat._src.plan_cache import PlanCache
from jaxremat._src.solvers.base import get_solver

# A solver may overrun its limit by model building, a last improvement step and Python
# start-up of OR-Tools: at most half the limit plus this, even on a loaded 2-core machine.
_SLACK_S = 1.0


@pytest.mark.parametrize("solver", jaxremat.available_solvers())
def test_time_limit_is_honored(solver):
  graph = shared_graph("moccasin_rl1000")
  get_solver(solver)  # imports (OR-Tools: ~1 s) happen once per process, not per solve
  time_limit_s = 0.5
  start = time.perf_counter()
  try:
    schedule = jaxremat.solve(graph, 0.8, solver=solver, time_limit=time_limit_s, workers=2)
  except (jaxremat.NoScheduleFoundError, jaxremat.InfeasibleBudgetError):
    schedule = None
  elapsed_s = time.perf_counter() - start
  load = os.getloadavg()[0]
  assert elapsed_s <= 1.5 * time_limit_s + _SLACK_S, (
    f"{solver} ran {elapsed_s:.2f} s for time_limit={time_limit_s} s (load {load:.1f})"
  )
  if schedule is not None:
    assert jaxremat.simulate(graph, schedule).peak_bytes <= schedule.budget


def _interrupt(progress: jaxremat.Progress) -> None:
  raise KeyboardInterrupt


@pytest.mark.parametrize("solver", ["moccasin", "auto"])
def test_interrupt_from_a_progress_callback_reaches_the_caller(solver):
  graph = shared_graph("moccasin_rl100")
  with pytest.raises(KeyboardInterrupt):
    jaxremat.solve(graph, 0.9, solver=solver, time_limit=20, progress=_interrupt)


def _mlp_step(w, x):
  def loss(w):
    h = x
    for i in range(w.shape[0]):
      h = jnp.tanh(h @ w[i])
    return jnp.sum(h**2)

  value, grad = jax.value_and_grad(loss)(w)
  return w - 0.01 * grad, value


W = jax.random.normal(jax.random.key(0), (6, 64, 64)) / 8
X = jnp.linspace(-1.0, 1.0, 256 * 64, dtype=jnp.float32).reshape(256, 64)


def _files(root) -> list[str]:
  return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_interrupted_optimize_leaves_no_cache_file(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXREMAT_CACHE_DIR", str(tmp_path))
  calls = []

  def interrupt(progress):
    calls.append(progress)
    raise KeyboardInterrupt

  step = jaxremat.optimize(_mlp_step, budget=0.7, solver="moccasin", progress=interrupt)
  with pytest.raises(KeyboardInterrupt):
    step(W, X)
  assert calls  # the interrupt came from inside the solve
  files = _files(tmp_path)
  assert not [f for f in files if f.startswith("plans")], files
  assert not [f for f in files if ".tmp" in f], files
  for f in files:  # whatever else was written (the cost cache) is whole JSON
    json.loads((tmp_path / f).read_text())
  # The next run plans from scratch and writes one whole plan.
  step = jaxremat.optimize(_mlp_step, budget=1.0, solver="noremat", progress=False)
  np.testing.assert_allclose(step(W, X)[1], _mlp_step(W, X)[1], rtol=1e-5)
  assert len(list(tmp_path.glob("plans/*.json"))) == 1


class _InterruptingDict(dict):
  """A JSON object whose serialization is cut off by a KeyboardInterrupt half-way."""

  def items(self):
    for k, (key, value) in enumerate(super().items()):
      if k == len(self) // 2:
        raise KeyboardInterrupt
      yield key, value


def test_interrupted_write_keeps_the_old_file_and_leaves_no_partial_one(tmp_path):
  path = tmp_path / "plan.json"
  write_json_atomic(path, {"old": True})
  data = _InterruptingDict({f"k{i}": list(range(1000)) for i in range(100)})
  with pytest.raises(KeyboardInterrupt):
    write_json_atomic(path, data)
  assert json.loads(path.read_text()) == {"old": True}
  assert _files(tmp_path) == ["plan.json"]
  with pytest.raises(KeyboardInterrupt):
    write_json_atomic(tmp_path / "new.json", data)
  assert _files(tmp_path) == ["plan.json"]


@pytest.fixture
def planned(tmp_path):
  """An optimized step with its plan in a fresh cache; returns (cache dir, plan file)."""
  step = jaxremat.optimize(
    _mlp_step, budget=0.8, solver="xla-greedy", cache_dir=tmp_path, progress=False
  )
  plan = step.plan(W, X)
  assert not plan.from_cache and plan.schedule.stats["n_recompute"] > 0
  (path,) = tmp_path.glob("plans/*.json")
  return tmp_path, path


def _replan(cache_dir) -> jaxremat.Plan:
  step = jaxremat.optimize(
    _mlp_step, budget=0.8, solver="xla-greedy", cache_dir=cache_dir, progress=False
  )
  plan = step.plan(W, X)
  np.testing.assert_allclose(step(W, X)[1], _mlp_step(W, X)[1], rtol=1e-5)
  return plan


def test_a_cached_plan_is_reused(planned):
  assert _replan(planned[0]).from_cache


def _entry(path):
  return json.loads(path.read_text())


DAMAGE = [
  ("truncated", lambda path: path.write_text(path.read_text()[:100]), "not valid JSON"),
  ("empty", lambda path: path.write_text(""), "not valid JSON"),
  ("binary", lambda path: path.write_bytes(b"\x00\xff" * 50), "is not UTF-8 text"),
  ("deep nesting", lambda path: path.write_text("[" * 100_000), "nested too deeply"),
  (
    "another format",
    lambda path: path.write_text(json.dumps({**_entry(path), "format": "jaxremat.plan/0"})),
    "expected 'jaxremat.plan/1'",
  ),
  (
    "events not a list",
    lambda path: path.write_text(
      json.dumps({**_entry(path), "schedule": {**_entry(path)["schedule"], "events": 3}})
    ),
    "events: expected a list",
  ),
  (
    "an invalid program",
    lambda path: path.write_text(
      json.dumps(
        {**_entry(path), "schedule": {**_entry(path)["schedule"], "events": [["compute", 9]]}}
      )
    ),
    "not a valid schedule of this graph",
  ),
]


@pytest.mark.parametrize("damage,warning", [d[1:] for d in DAMAGE], ids=[d[0] for d in DAMAGE])
def test_damaged_cache_file_is_ignored_with_a_warning(planned, damage, warning):
  cache_dir, path = planned
  damage(path)
  with pytest.warns(UserWarning, match=warning):
    plan = _replan(cache_dir)
  assert not plan.from_cache
  assert _entry(path)["format"] == "jaxremat.plan/1"  # rewritten whole


def test_a_cached_plan_is_measured_not_trusted(planned, caplog):
  """A cached schedule that XLA measures over the budget (here the no-remat one, valid for
  the graph) is not used: the planner compiles and measures every plan it reads."""
  cache_dir, path = planned
  entry = _entry(path)
  graph = jaxremat.trace(_mlp_step, W, X, costs="shape")
  entry["schedule"] = jaxremat.baseline_schedule(graph).to_dict()
  path.write_text(json.dumps(entry))
  with caplog.at_level("INFO", logger="jaxremat"):
    plan = _replan(cache_dir)
  assert not plan.from_cache and plan.measured_peak_bytes <= plan.budget_bytes
  assert (
    plan.attempts[0].origin == "cache" and plan.attempts[0].measured_peak_bytes > plan.budget_bytes
  )
  assert "(cache, pin=recomputations) measures" in caplog.text


def _other_step(w, x):
  """The same shapes and graph as `_mlp_step`, another body (tanh of twice the product)."""

  def loss(w):
    h = x
    for i in range(w.shape[0]):
      h = jnp.tanh(2.0 * (h @ w[i]))
    return jnp.sum(h**2)

  value, grad = jax.value_and_grad(loss)(w)
  return w - 0.01 * grad, value


def test_a_plan_is_never_applied_to_a_different_jaxpr(planned):
  cache_dir, path = planned
  first = jaxremat.trace(_mlp_step, W, X, costs="shape")
  other = jaxremat.trace(_other_step, W, X, costs="shape")
  assert (first.edges, first.mem) == (other.edges, other.mem)
  step = jaxremat.optimize(
    _other_step, budget=0.8, solver="xla-greedy", cache_dir=cache_dir, progress=False
  )
  plan = step.plan(W, X)
  assert not plan.from_cache  # another jaxpr, another key
  assert len(list(cache_dir.glob("plans/*.json"))) == 2
  np.testing.assert_allclose(step(W, X)[1], _other_step(W, X)[1], rtol=1e-5)
  # A plan file copied under the other step's key is refused: its key does not match.
  other_path = next(p for p in cache_dir.glob("plans/*.json") if p != path)
  other_path.write_text(path.read_text())
  with pytest.warns(UserWarning, match="belongs to another plan"):
    again = jaxremat.optimize(
      _other_step, budget=0.8, solver="xla-greedy", cache_dir=cache_dir, progress=False
    )
    assert not again.plan(W, X).from_cache
  np.testing.assert_allclose(again(W, X)[1], _other_step(W, X)[1], rtol=1e-5)


def test_plan_cache_store_is_atomic(tmp_path):
  graph = jaxremat.RematGraph.build(mem=[4, 2, 3], cost=[0, 1, 1], edges=[(0, 1), (1, 2)])
  cache = PlanCache(tmp_path)
  cache.store("k", jaxremat.baseline_schedule(graph))
  assert _files(tmp_path) == ["plans/k.json"]
  assert cache.load("k", graph).events == jaxremat.baseline_schedule(graph).events


@pytest.mark.parametrize(
  "content,warning",
  [("{", "not valid JSON"), ('{"format": "%s", "entries": []}', "entries: expected a JSON")],
  ids=["truncated", "entries a list"],
)
def test_damaged_cost_cache_is_ignored_with_a_warning_and_rewritten(tmp_path, content, warning):
  path = CostCache(tmp_path).path
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    f.write(content.replace("%s", CACHE_FORMAT))
  with pytest.warns(UserWarning, match=f"damaged cost cache.*{warning}"):
    graph = jaxremat.trace(_mlp_step, W, X, cache_dir=tmp_path)
  # Measured again: every product costs time (a squeeze of a split's part costs none).
  dots = [v for v in graph.order if graph.nodes[v].attrs["primitive"] == "dot_general"]
  assert dots and all(graph.nodes[v].cost > 0 for v in dots)
  with open(path) as f:
    assert json.load(f)["entries"]  # rewritten whole, with the costs just measured
