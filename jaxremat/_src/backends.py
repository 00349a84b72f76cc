"""What each XLA backend does with a plan, in one place: fence, memory figures, tolerances.

Everything that differs between XLA:CPU, GPU and TPU and that jaxremat or its tests rely on
is stated here, so that the same code and the same tests run unchanged on any backend
(``JAX_PLATFORMS=cpu|cuda|tpu``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import numpy as np

from jaxremat._src import compat

# (rtol, atol) for an optimized function's outputs against the original's, by dtype name.
# Recomputation runs the same equations on the same values; what differs is how XLA fuses
# and orders the reductions around them, which moves results by a few ulps of the
# accumulated sums.
_CPU_TOLERANCES = {
  "float64": (1e-10, 1e-12),
  "float32": (1e-5, 1e-6),
  "float16": (2e-3, 1e-3),
  "bfloat16": (2e-2, 1e-2),
}
# GPU reductions are tree-shaped across threads and the tree depends on the fusion.
_GPU_TOLERANCES = {**_CPU_TOLERANCES, "float32": (1e-4, 1e-5)}
# TPU float32 dots run in bfloat16 passes by default (jax_default_matmul_precision).
_TPU_TOLERANCES = {**_CPU_TOLERANCES, "float32": (1e-3, 1e-4), "float64": (1e-5, 1e-7)}


@dataclasses.dataclass(frozen=True)
class BackendFacts:
  """What jaxremat expects of one XLA backend.

  Attributes:
    platform: ``"cpu"``, ``"gpu"`` or ``"tpu"`` (``jax.default_backend()``).
    fence: the fence `jaxremat.emit` uses there by default.
    barrier_holds: whether recomputation behind ``lax.optimization_barrier`` survives XLA's
      optimizations. XLA:CPU up to jaxlib 0.10 merges it away, 0.11 keeps it
      (`compat.CPU_BARRIER_HOLDS`); GPU and TPU keep it.
    device_memory_stats: whether ``device.memory_stats()`` reports ``peak_bytes_in_use``.
      ``compiled.memory_analysis()`` exists everywhere; the device's own high-water mark
      only on GPU and TPU.
    tolerances: (rtol, atol) by dtype name for outputs of an optimized function against
      the original; integer and boolean outputs must match exactly.
    reductions_duplicate_producers: whether a reduction's fusion may compute a value that
      other fusions also read (XLA duplicates cheap values into each reader). XLA:CPU runs
      sums, maxima and minima as YNNPACK fusions (``__ynn_fusion``) that take in only
      values they alone read: a value read by a reduction and by anything else is
      materialized, and `jaxremat.trace` keeps it as a node. TPU duplicates into
      reductions as into loops. GPU does not: a shared value is computed once and written
      out, by its own loop fusion or as a second output of the reduction's multi-output
      fusion. Both measured on deviceless compiles for TPU v5e/v4/v6e and H100
      (tests/test_targets.py); tests/test_backends.py checks it on whichever backend runs.
    pool_gradient_buffers_at_start: whether a max pool's gradient (``select_and_scatter_add``)
      takes buffers made at the program start: XLA:CPU lowers it to a reduce-window that
      carries argmax iotas and a scatter into zeros, both with constant operands, so
      scheduled first (`fusion.pool_gradient_buffers`). TPU runs it as one op; GPU
      computes the iotas inside the pool's fusion: the model with those buffers put a max
      pool's gradient for H100 at 28 MiB, which its compiler measured at 13 MiB
      (tests/test_targets.py).
    float32_dot_eps_default: the unit roundoff of a float32 dot or convolution at JAX's
      default matmul precision: XLA:GPU runs them in TensorFloat-32 (10 mantissa bits) on
      Ampere and newer, TPU in one bfloat16 pass (7 bits). A plan whose recomputed dots
      take other algorithms differs from the original by that much: on an H200 the GPT
      step's plan at 0.7 moved one 128-element gradient leaf by a norm-wise 12.5% and was
      rejected at float32's eps, and ``dots_saveable`` moved ResNet's gradient by 3.6%
      (1e-7 on XLA:CPU). The verifier takes `float32_dot_eps` (benchmarks/README.md).
    pin_first: the fence a plan that recomputes is compiled with first (`emit`'s ``pin``;
      the planner then measures per step which holds less, `planner._Loop.try_schedule`).
      The first plan of `optimize` on the six examples at 0.7 and 0.5 measured lower with
      its whole order pinned on every XLA:CPU budget and on most H100 ones, and lower with
      only its recomputations fenced on most TPU v5e ones (benchmarks/pinning.py).
    outputs_hold_temporaries: whether XLA places values in the buffer of a step output that
      is not written yet (BufferAssigner reuses an output's allocation for any value no
      larger whose live range ends before the output's begins), so that only the rest
      counts as temp in ``memory_analysis`` (`xla_memory.xla_accounted_peak_bytes`). On
      XLA:CPU and H100 a bfloat16 Llama step (benchmarks/zoo.py) held its activations in
      the buffers of the weights' updates: the model without it read +15.4% and +13.0%
      of the compiler's peak, with it -0.4% and -0.6%. TPU v5e's figures hold no such
      reuse (the same step: +0.8% without, -7.5% with).
  """

  platform: str
  fence: str
  barrier_holds: bool
  device_memory_stats: bool
  tolerances: Mapping[str, tuple[float, float]]
  reductions_duplicate_producers: bool
  pool_gradient_buffers_at_start: bool
  float32_dot_eps_default: float
  pin_first: str
  outputs_hold_temporaries: bool

  def float32_dot_eps(self) -> float:
    """``float32_dot_eps_default``, or float32's own eps where JAX's default matmul
    precision is set to full float32 (``jax.default_matmul_precision("highest")``)."""
    if str(jax.config.jax_default_matmul_precision).lower() in ("highest", "float32"):
      return float(np.finfo(np.float32).eps)
    return self.float32_dot_eps_default

  def tolerance(self, dtype: object) -> tuple[float, float]:
    """(rtol, atol) for arrays of ``dtype``; (0, 0) for integers, booleans and keys."""
    name = np.dtype(dtype).name if not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) else ""
    return self.tolerances.get(name, (0.0, 0.0))


_FACTS = {
  # XLA:CPU up to jaxlib 0.10 needs a data-dependent fence: "select" held on every
  # schedule of benchmarks/emit.py and stayed closest to the planned peak ("cond" copies
  # every routed value at once). It holds on 0.11 too, where the barrier also does.
  "cpu": BackendFacts(
    "cpu",
    "select",
    compat.CPU_BARRIER_HOLDS,
    False,
    _CPU_TOLERANCES,
    False,
    True,
    2.0**-23,
    "all",
    True,
  ),
  # The barrier holds on GPU and TPU, and a cond would cost a host round trip there.
  "gpu": BackendFacts(
    "gpu", "barrier", True, True, _GPU_TOLERANCES, False, False, 2.0**-10, "all", True
  ),
  "tpu": BackendFacts(
    "tpu", "barrier", True, True, _TPU_TOLERANCES, True, False, 2.0**-7, "recomputations", False
  ),
}


def backend_facts(platform: str | None = None) -> BackendFacts:
  """The facts for ``platform`` (default: JAX's default backend).

  A platform jaxremat has not been measured on gets the cautious choices: the
  data-dependent fence, which holds everywhere, and no device memory figures.

  Example:
    >>> backend_facts("cpu").fence
    'select'
    >>> backend_facts("cuda").platform
    'gpu'
  """
  name = platform or jax.default_backend()
  name = "gpu" if name in ("cuda", "rocm") else name
  return _FACTS.get(name, dataclasses.replace(_FACTS["cpu"], platform=name))
