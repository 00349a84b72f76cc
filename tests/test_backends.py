"""Backend expectations (jaxremat/_src/backends.py) checked on whichever backend JAX selects."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from backend import FACTS, assert_trees_allclose
from test_emit import mlp_loss

import jaxremat
from jaxremat._src import compat
from jaxremat._src.backends import backend_facts
from jaxremat._src.emit import default_fence, emit
from jaxremat._src.measure import isolated_device_peak
from jaxremat._src.segments import segment_schedule
from jaxremat._src.trace import trace_program
from jaxremat._src.verify import (
  count_hlo_ops,
  noise_envelope,
  perturbation_size,
  planned_recomputes,
)

TESTS = pathlib.Path(__file__).resolve().parent
LAYERS, BATCH, WIDTH = 6, 256, 64


def mlp_args(dtype=jnp.float32):
  rng = np.random.default_rng(0)
  params = [
    jnp.asarray(rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH), dtype) for _ in range(LAYERS)
  ]
  return params, jnp.asarray(rng.standard_normal((BATCH, WIDTH)), dtype)


@pytest.fixture(scope="module")
def mlp():
  args = mlp_args()
  step = jax.value_and_grad(mlp_loss)
  program = trace_program(step, *args, costs="shape")
  return step, program, args, segment_schedule(program.graph, 3)


def dots(fn, *args) -> int:
  return count_hlo_ops(jax.jit(fn).lower(*args).compile().as_text()).get("dot", 0)


def test_default_fence_is_the_backends_and_keeps_every_planned_recomputation(mlp):
  step, program, args, schedule = mlp
  assert default_fence() == FACTS.fence
  planned = planned_recomputes(program, schedule)["dot"]
  assert planned >= 2
  assert dots(emit(program, schedule), *args) == dots(step, *args) + planned


def test_barrier_holds_exactly_where_the_facts_say(mlp):
  step, program, args, schedule = mlp
  kept = planned_recomputes(program, schedule)["dot"] if FACTS.barrier_holds else 0
  assert dots(emit(program, schedule, fence="barrier"), *args) == dots(step, *args) + kept


def test_device_memory_figures_exist_where_the_facts_say(mlp):
  step, _, args, _ = mlp
  m = jaxremat.measure(step, *args, runs=1)
  assert m.peak_bytes == m.argument_bytes + m.output_bytes + m.temp_bytes - m.alias_bytes > 0
  assert (m.device_peak_bytes is not None) == FACTS.device_memory_stats
  if FACTS.device_memory_stats:
    assert m.device_peak_bytes >= m.argument_bytes


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_emitted_step_is_within_the_backend_tolerance_for_each_dtype(dtype):
  args = mlp_args(dtype)
  step = jax.value_and_grad(mlp_loss)
  program = trace_program(step, *args, costs="shape")
  schedule = segment_schedule(program.graph, 3)
  assert jaxremat.simulate(program.graph, schedule).n_recompute > 0
  assert_trees_allclose(jax.jit(emit(program, schedule))(*args), jax.jit(step)(*args))


def test_integer_and_boolean_outputs_match_exactly(mlp):
  _, _, args, _ = mlp

  def loss_and_labels(params, x):
    h = x
    for w in params:
      h = jnp.tanh(h @ w)
    return jnp.sum(h * h), (jnp.argmax(h, axis=-1), h > 0)

  step = jax.value_and_grad(loss_and_labels, has_aux=True)
  program = trace_program(step, *args, costs="shape")
  schedule = segment_schedule(program.graph, 3)
  assert jaxremat.simulate(program.graph, schedule).n_recompute > 0
  (loss, labels), grads = jax.jit(emit(program, schedule))(*args)
  (loss_0, labels_0), grads_0 = jax.jit(step)(*args)
  assert_trees_allclose(labels, labels_0, exact=True)
  assert_trees_allclose((loss, grads), (loss_0, grads_0))


def test_tolerances_are_stated_per_dtype_and_exact_for_integers():
  rtol32, _ = FACTS.tolerance(jnp.float32)
  assert 0 < rtol32 < FACTS.tolerance(jnp.bfloat16)[0]
  assert FACTS.tolerance(jnp.int32) == FACTS.tolerance(jnp.bool_) == (0.0, 0.0)
  assert FACTS.tolerance(jax.random.key(0).dtype) == (0.0, 0.0)
  assert jaxremat._src.backends.backend_facts("cuda").platform == "gpu"


def _reduction_blocks(fn, *args) -> list[set[str]]:
  """The opcodes of each computation of the optimized HLO that reduces."""
  hlo = jax.jit(fn).lower(*args).compile().as_text()
  return [
    set(re.findall(r"= \S+ ([a-z][\w-]*)\(", block))
    for block in hlo.split("\n\n")
    if re.search(r"= \S+ reduce\(", block)
  ]


def test_reductions_duplicate_producers_exactly_where_the_facts_say():
  """What `jaxremat.trace` folds into a reduction's node is what XLA fuses into it."""
  x = jnp.ones((256, 64))
  # Read by the reduction alone: fused on every backend.
  (alone,) = _reduction_blocks(lambda x, y: jnp.sum(jnp.exp(x - 1.0) * y, axis=0), x, x)
  assert {"exponential", "multiply"} <= alone
  # Read by the reduction and by another fusion: duplicated into both, or materialized.
  blocks = _reduction_blocks(lambda x, y: (jnp.sum(x * y, axis=0), x * y - 2.0), x, x)
  assert blocks
  assert any("multiply" in ops for ops in blocks) == FACTS.reductions_duplicate_producers
  # An integer sum is a loop fusion on every backend: a compare it shares is duplicated.
  hlo = jax.jit(lambda x: (jnp.sum(x > 0.5, dtype=jnp.int32), jnp.where(x > 0.5, x, 0.0) * 2))
  assert hlo.lower(x).compile().as_text().count(" compare(") >= 2


def test_a_step_runs_alone_in_a_fresh_process_with_its_arguments():
  x = jnp.ones((64, 64))
  compiled = jax.jit(lambda x: jnp.sin(x) @ x).lower(x).compile()
  run = isolated_device_peak(compiled, x)
  assert run["device_kind"] == jax.devices()[0].device_kind
  assert (run["device_peak_bytes"] is not None) == FACTS.device_memory_stats
  if FACTS.device_memory_stats:
    assert run["device_peak_bytes"] >= run["bytes_in_use_before_run"] >= x.nbytes


@pytest.mark.accelerator
def test_device_peak_of_an_isolated_run_follows_the_plan():
  """The 16-layer MLP of ARCHITECTURE.md (batch 4096, width 256), plain and emitted from a
  4-segment plan: the device's peak, run alone, against XLA's figure and the plan's."""
  rng = np.random.default_rng(0)
  params = [rng.standard_normal((256, 256), np.float32) / 16 for _ in range(16)]
  x = rng.standard_normal((4096, 256), np.float32)
  step = jax.value_and_grad(mlp_loss)
  program = trace_program(step, params, x, costs="shape")
  runs = []
  for schedule in (jaxremat.baseline_schedule(program.graph), segment_schedule(program.graph, 4)):
    compiled = jax.jit(emit(program, schedule)).lower(params, x).compile()
    run = isolated_device_peak(compiled, params, x)
    predicted = jaxremat.simulate(program.graph, schedule).peak_bytes
    # The allocator counts each buffer rounded to 256 bytes (an H100: within 2 KiB).
    assert run["device_peak_bytes"] == pytest.approx(compat.memory_peak_bytes(compiled), rel=0.01)
    assert run["device_peak_bytes"] == pytest.approx(predicted, rel=0.10), run
    runs.append((run["device_peak_bytes"], predicted))
  (original, original_predicted), (emitted, emitted_predicted) = runs
  assert original - emitted >= 0.5 * (original_predicted - emitted_predicted)


@pytest.mark.skipif(FACTS.platform in ("gpu", "tpu"), reason="runs the accelerator tests instead")
def test_accelerator_tests_are_skipped_with_their_reason_here():
  # One process: the test it selects needs no workers of its own.
  args = ["-m", "pytest", "-n", "0", str(TESTS / "test_backends.py"), "-k", "isolated_run"]
  out = subprocess.run(
    [sys.executable, *args],
    capture_output=True,
    text=True,
    cwd=TESTS.parent,
    timeout=300,
  )
  assert out.returncode == 0, out.stdout + out.stderr
  assert "1 skipped" in out.stdout
  assert f"needs a GPU or TPU; JAX selected the {FACTS.platform!r} backend" in out.stdout


def test_float32_dots_are_verified_at_the_precision_the_backend_computes_them():
  """A recomputed dot may take another algorithm; on GPU and TPU float32 dots run in a
  narrower format, so the verifier's perturbation follows it (H200: GPT's plan at 0.7 was
  rejected at float32's own)."""
  assert backend_facts("cpu").float32_dot_eps() == np.finfo(np.float32).eps
  assert backend_facts("gpu").float32_dot_eps() == 2.0**-10  # TensorFloat-32
  assert backend_facts("tpu").float32_dot_eps() == 2.0**-7  # one bfloat16 pass
  with jax.default_matmul_precision("highest"):
    assert backend_facts("gpu").float32_dot_eps() == np.finfo(np.float32).eps
  envelope = noise_envelope(mlp_loss, [jnp.ones((8, 8))], jnp.ones((4, 8)))
  assert envelope.perturbation == perturbation_size([jnp.float32], FACTS.float32_dot_eps())
