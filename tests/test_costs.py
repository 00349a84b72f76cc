"""Tests for jaxremat._src.costs: XLA cost analysis, roofline, cache, shape fallback."""

import json

import jax
import jax.numpy as jnp
import pytest

import jaxremat
from jaxremat._src import compat, costs


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
  costs.clear_memory_cache()
  yield tmp_path
  costs.clear_memory_cache()


def _step(x, w):
  return jnp.tanh(x @ w).sum()


ARGS = (jnp.ones((64, 32)), jnp.ones((32, 16)))


def test_xla_costs_and_cache_round_trip(cache_dir):
  p = jaxremat.trace_program(_step, *ARGS, cache_dir=cache_dir)
  dot = next(n for n in p.graph.nodes if n.attrs["primitive"] == "dot_general")
  assert dot.attrs["cost_source"] == "xla"
  assert dot.attrs["flops"] == 2 * 64 * 32 * 16  # XLA's count for the matmul alone
  roof = p.graph.meta["roofline"]
  assert roof["flops_per_s"] > 1e6 and roof["bytes_per_s"] > 1e6
  expected = max(
    dot.attrs["flops"] / roof["flops_per_s"], dot.attrs["bytes_accessed"] / roof["bytes_per_s"]
  )
  assert dot.cost == pytest.approx(expected, rel=1e-12)
  files = sorted(f.name for f in cache_dir.iterdir())
  assert any(f.startswith("costs-") for f in files) and any(
    f.startswith("roofline-") for f in files
  )
  cost_file = next(cache_dir.glob("costs-*.json"))
  data = json.loads(cost_file.read_text())
  assert data["format"] == costs.CACHE_FORMAT and len(data["entries"]) >= 2
  # From the disk cache alone (memory cleared) the costs are identical.
  costs.clear_memory_cache()
  cache = costs.CostCache(cache_dir)
  assert cache.entries == data["entries"]
  again = jaxremat.trace_program(_step, *ARGS, cache_dir=cache_dir)
  assert again.graph.cost == p.graph.cost
  assert json.loads(cost_file.read_text())["entries"] == data["entries"]


def test_recomputed_elementwise_work_costs_its_arithmetic(cache_dir):
  # Recomputed inside the kernel that reads it, the chain moves no bytes of its own;
  # costed equation by equation, each would write its value out and read it back.
  x = jnp.ones((256, 256))
  g = jaxremat.trace(lambda x, w: (jnp.tanh(x) * 2.0 + 1.0) @ w, x, x, cache_dir=cache_dir)
  roof = g.meta["roofline"]
  chain = next(n for n in g.nodes if n.attrs.get("fused") == ["tanh", "mul", "add"])
  assert chain.attrs["bytes_accessed"] >= 3 * 2 * x.nbytes
  assert chain.cost == pytest.approx(chain.attrs["flops"] / roof["flops_per_s"], rel=1e-12)
  dot = next(n for n in g.nodes if n.attrs["primitive"] == "dot_general")
  assert dot.cost > 10 * chain.cost


def test_a_value_computed_inside_its_readers_is_paid_by_each_reader(cache_dir):
  # XLA computes y inside the fusion of each of its two readers: each pays its arithmetic
  # (so the graph counts the FLOPs XLA counts), y costs nothing itself, and y * x reads x
  # once, so recomputed it adds only its arithmetic.
  x = jnp.ones((256, 256))

  def f(x, w):
    y = x * 3.0
    return (y * x) @ w + (y - 1.0) @ w

  g = jaxremat.trace(f, x, x, cache_dir=cache_dir)
  flops_per_s = g.meta["roofline"]["flops_per_s"]
  duplicated = next(n for n in g.nodes if n.attrs.get("duplicated"))
  assert duplicated.cost == 0 and duplicated.attrs["flops"] == 0
  readers = [n for n in g.nodes if n.attrs["primitive"] in ("mul", "sub") and n is not duplicated]
  assert [n.attrs["flops"] for n in readers] == [2 * x.size, 2 * x.size]
  for node in readers:
    assert node.cost == pytest.approx(node.attrs["flops"] / flops_per_s, rel=1e-12)
  graph_flops = sum(n.attrs.get("flops", 0) for n in g.nodes)
  assert graph_flops == jaxremat.measure(f, x, x, runs=0).flops


def test_equations_compiled_side_by_side_get_their_own_costs(cache_dir):
  """Equations are compiled in threads; each result lands under its own signature, as
  compiling them one by one gives it, and a repeated equation is compiled once."""

  def f(x, w):
    h = jnp.tanh(x @ w)
    return jnp.sum(jnp.exp(h) @ w.T) + jnp.sum(jnp.tanh(x @ w)) + jnp.max(x)

  eqns = jax.make_jaxpr(f)(*ARGS).jaxpr.eqns
  got = costs.equation_costs(eqns, cache_dir=cache_dir)
  entries = costs._cache(cache_dir, None).entries
  assert len(entries) < len(eqns)  # the repeated tanh(x @ w) shares its entries
  for eqn, cost in zip(eqns, got, strict=True):
    flops, bytes_accessed, _ = costs._analyze(eqn, "xla", None)
    assert (cost.source, cost.flops, cost.bytes_accessed) == ("xla", flops, bytes_accessed)
  assert len({c.flops for c in got}) > 3  # the equations differ, and so do their costs


def test_corrupt_cache_is_rebuilt(cache_dir):
  jaxremat.trace(_step, *ARGS, cache_dir=cache_dir)
  cost_file = next(cache_dir.glob("costs-*.json"))
  cost_file.write_text("{not json")
  costs.clear_memory_cache()
  g = jaxremat.trace(_step, *ARGS, cache_dir=cache_dir)
  assert all(n.attrs["cost_source"] == "xla" for n in g.nodes if not g.is_input[n.id])
  assert json.loads(cost_file.read_text())["format"] == costs.CACHE_FORMAT


def test_shape_fallback_for_effects_and_shape_mode(cache_dir):
  def f(x):
    jax.debug.callback(lambda v: None, x)
    return x @ x

  g = jaxremat.trace(f, jnp.ones((8, 8)), cache_dir=cache_dir)
  sources = {n.attrs["primitive"]: n.attrs["cost_source"] for n in g.nodes if not g.is_input[n.id]}
  assert sources == {"debug_callback": "shape", "dot_general": "xla"}
  shaped = jaxremat.trace(f, jnp.ones((8, 8)), costs="shape")
  dot = next(n for n in shaped.nodes if n.attrs["primitive"] == "dot_general")
  assert dot.attrs["cost_source"] == "shape" and dot.attrs["flops"] == 2 * 8 * 8 * 8
  assert shaped.meta["roofline"] is None


def test_measured_mode(cache_dir):
  g = jaxremat.trace(_step, *ARGS, costs="measured", cache_dir=cache_dir)
  computed = [n for n in g.nodes if not g.is_input[n.id]]
  assert all(n.attrs["cost_source"] == "measured" and n.cost > 0 for n in computed)


def test_signature_distinguishes_params_and_avals():
  def two(x):
    return jnp.sum(x, axis=0), jnp.sum(x, axis=1), jnp.sum(x[:2], axis=1)

  eqns = jax.make_jaxpr(two)(jnp.ones((3, 4))).jaxpr.eqns
  sums = [e for e in eqns if e.primitive.name == "reduce_sum"]
  keys = {costs.signature(e, "cpu") for e in sums}
  assert len(keys) == 3
  assert costs.signature(sums[0], "cpu") != costs.signature(sums[0], "gpu")


def test_cost_analysis_dict_accepts_old_list_form():
  class OldCompiled:  # jax < 0.4.30 returned a one-element list
    def cost_analysis(self):
      return [{"flops": 3.0}]

  assert compat.cost_analysis_dict(OldCompiled()) == {"flops": 3.0}
  compiled = jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile()
  assert "bytes accessed" in compat.cost_analysis_dict(compiled)
