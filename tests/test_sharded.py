"""Sharded steps: planned per device on a mesh of four host CPU devices (conftest.py).

Each device holds its part of a partitioned step; the budget is bytes per device, and the
compiler's `memory_analysis` of the partitioned program is the judge.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxremat
from examples import sharded
from jaxremat._src import hlo_model
from jaxremat._src.hlo_text import count_hlo_ops
from jaxremat._src.signature import FlatStep, call_signature
from jaxremat._src.xla_memory import xla_accounted_peak_bytes

GPT = {"vocab": 64, "d_model": 64, "n_layers": 2, "seq_len": 32, "batch": 8}
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

pytestmark = pytest.mark.skipif(
  len(jax.devices()) < 4, reason="needs 4 devices (conftest.py asks JAX for 4 CPU devices)"
)


def _collectives(hlo: str) -> dict[str, int]:
  counts = count_hlo_ops(hlo)
  return {c: sum(n for op, n in counts.items() if op.startswith(c)) for c in COLLECTIVES}


@pytest.fixture(scope="module")
def fsdp_gpt():
  return sharded.sharded_train_step("gpt", "fsdp", jax.devices()[:4], **GPT)


def test_a_sharded_steps_graph_holds_what_one_device_holds(fsdp_gpt, tmp_path):
  step, args, _ = fsdp_gpt
  program = jaxremat.trace_program(step, *args, cache_dir=tmp_path)
  measured = jaxremat.measure(step, *args, runs=0, donate_argnums=(0, 1))
  whole = jaxremat.measure(
    step.__wrapped__, *jax.tree.map(np.asarray, args), runs=0, donate_argnums=(0, 1)
  )
  predicted = xla_accounted_peak_bytes(program.graph, None, measured.alias_bytes)
  assert program.graph.meta["model"] == "compiler"  # the rules know one device
  assert measured.peak_bytes < 0.5 * whole.peak_bytes  # four devices share the step
  assert abs(predicted / measured.peak_bytes - 1) < 0.10
  # Each equation is costed at one device's share of its work, its collectives' bytes
  # over the link beside it.
  graph_flops = sum(n.attrs.get("flops", 0.0) for n in program.graph.nodes)
  assert graph_flops == pytest.approx(measured.flops, rel=0.15)
  assert graph_flops < 0.5 * whole.flops
  gathered = [n for n in program.graph.nodes if n.attrs.get("collective_bytes")]
  assert any(n.attrs["primitive"] == "dot_general" for n in gathered)


def test_optimize_meets_a_per_device_budget_and_keeps_the_shardings(fsdp_gpt, tmp_path):
  step, args, place = fsdp_gpt
  host = jax.tree.map(np.asarray, args)
  expected = step(*place(host))
  fast = jaxremat.optimize(step, budget=0.7, time_limit=60, cache_dir=tmp_path)
  got = fast(*place(host))
  plan = fast.plan(*place(host))
  assert plan.measured_peak_bytes <= 0.7 * plan.baseline_peak_bytes
  chosen = next(a for a in plan.attempts if a.measured_peak_bytes == plan.measured_peak_bytes)
  # The model of a sharded plan is not yet within 10% (-9% to +21% on the sharded GPT of
  # benchmarks/README.md, "Sharded steps"); at this size it errs high, so the budget holds.
  assert (
    chosen.measured_peak_bytes <= chosen.predicted_peak_bytes <= 1.2 * chosen.measured_peak_bytes
  )
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    scale = float(jnp.max(jnp.abs(b))) or 1.0
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5 * scale, rtol=1e-4)
  text = str(fast.report(*place(host), runs=1))
  assert "per device of 4" in text and "sent, model" in text and "sent, XLA" in text
  # Every plan's collectives are measured; one that sends what nothing planned is handed
  # out only after the other fence, and the report says what it sends beyond the plan.
  assert all(a.sent_bytes > 0 for a in plan.attempts)
  as_planned = plan.verification.collectives_as_planned
  assert ("neither the step nor the plan's recomputations" in text) == (not as_planned)
  if not as_planned:
    assert {a.pin for a in plan.attempts} >= {"all", "recomputations"}
  # The same collectives, and those the recomputations need: none dropped.
  original = jaxremat.measure(step, *place(host), runs=0, donate_argnums=(0, 1))
  before, after = _collectives(original.hlo_text), _collectives(plan.measurement.hlo_text)
  assert all(after[c] >= n for c, n in before.items())


@pytest.mark.slow  # 60-160 s; the optimize test above checks each plan's collectives too
def test_verify_finds_collectives_that_nothing_planned(fsdp_gpt, tmp_path):
  # Fencing every equation on the one before it routes each product's FSDP weight through
  # a fence; XLA then gathers the weight for each of its readers instead of once for all:
  # collectives that no recomputation asked for (the baseline schedule recomputes nothing).
  step, args, _ = fsdp_gpt
  program = jaxremat.trace_program(step, *args, cache_dir=tmp_path)
  schedule = jaxremat.baseline_schedule(program.graph)
  signature = call_signature(args, {}, donate_argnums=(0, 1))
  leaves = signature.dynamic_leaves(args, {})
  original = jaxremat.measure(step, *args, runs=0, donate_argnums=(0, 1))
  found = {
    pin: jaxremat.verify(
      FlatStep(step, signature),
      FlatStep(jaxremat.emit(program, schedule, pin=pin), signature),
      schedule,
      *leaves,
      program=program,
      original=original,
      donate_argnums=signature.donated_leaves,
    )
    for pin in ("recomputations", "all")
  }
  unfenced, fenced = found["recomputations"], found["all"]
  assert unfenced.planned_sent_bytes == fenced.planned_sent_bytes == 0
  assert unfenced.emitted.sent_bytes == original.sent_bytes > 0
  assert unfenced.collectives_as_planned and unfenced.unplanned_sent_bytes == 0
  assert fenced.outputs_match and fenced.emitted.sent_bytes > original.sent_bytes
  assert fenced.unplanned_sent_bytes > 0.2 * original.sent_bytes
  assert not fenced.collectives_as_planned and not fenced.ok(peak_rtol=10.0)


def test_an_inlined_jits_out_shardings_are_kept(tmp_path):
  mesh = sharded.make_mesh(jax.devices()[:4], "dp")
  split, whole = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
  step = jax.jit(lambda x: (jnp.tanh(x) @ x.T).sum(0) * 2.0, out_shardings=whole)
  x = jax.device_put(jnp.arange(64.0 * 16).reshape(64, 16) / 1024, split)
  program = jaxremat.trace_program(step, x, cache_dir=tmp_path)
  emitted = jax.jit(jaxremat.emit(program, jaxremat.baseline_schedule(program.graph)))
  assert emitted(x).sharding.is_equivalent_to(step(x).sharding, 1)
  assert "sharding_constraint" in str(program.jaxpr)


def test_collective_bytes_are_what_each_device_sends(tmp_path):
  mesh = sharded.make_mesh(jax.devices()[:4], "fsdp")
  w = jax.device_put(jnp.ones((256, 128)), NamedSharding(mesh, P("data")))  # FSDP weight
  x = jax.device_put(jnp.ones((64, 256)), NamedSharding(mesh, P("data")))
  closed = jax.make_jaxpr(lambda w, x: jnp.tanh(x @ w))(w, x)
  specs = call_signature((w, x), {}).specs
  values = hlo_model.compiled_values(closed, None, specs=specs)
  assert values.partitions == 4
  # The weight gathered whole on each device before the product: 3/4 of it sent.
  assert values.collective_bytes == {0: 256 * 128 * 4 * 3 // 4}


def test_the_plan_key_tells_shardings_apart():
  mesh = sharded.make_mesh(jax.devices()[:4], "dp")
  x = jnp.ones((8, 8))
  keys = {
    call_signature((jax.device_put(x, s),), {}).key
    for s in (NamedSharding(mesh, P("data")), NamedSharding(mesh, P()), jax.devices()[0])
  }
  assert len(keys) == 3


def test_a_mesh_with_explicit_axes_is_planned_and_fenced(tmp_path):
  # jax.make_mesh names its axes Explicit in newer JAX: values are sharded in their types,
  # and XLA:CPU's fence must read and broadcast its predicate in those types.
  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])

  def step(w, x):
    def loss(w):
      h = x
      for i in range(w.shape[0]):
        h = jnp.tanh(h @ w[i])
      return (h**2).mean()

    value, grad = jax.value_and_grad(loss)(w)
    return w - 0.1 * grad, value

  rng = np.random.default_rng(0)
  w = jax.device_put(rng.random((4, 128, 128), np.float32) / 8, NamedSharding(mesh, P()))
  x = jax.device_put(rng.random((256, 128), np.float32), NamedSharding(mesh, P("data")))
  fast = jaxremat.optimize(jax.jit(step), budget=0.9, cache_dir=tmp_path)
  got, want = fast(w, x), jax.jit(step)(w, x)
  assert fast.plan(w, x).measured_peak_bytes <= 0.9 * fast.plan(w, x).baseline_peak_bytes
  for a, b in zip(got, want, strict=True):
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
