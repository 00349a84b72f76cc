"""`verify`: proof that an emitted function computes the same values and keeps its plan.

Four checks, each against XLA rather than the model: the outputs equal the original's up to
the original's own float noise (`compare_outputs`); the recomputed expensive equations of
the plan are still in the optimized HLO (XLA did not merge them away, ARCHITECTURE.md fact
1); a partitioned step's collectives send what the step's and the recomputations' need,
no more (`collectives_as_planned`); XLA's peak is the simulator's prediction.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxremat._src import compat
from jaxremat._src.backends import backend_facts
from jaxremat._src.capture import value_dtypes
from jaxremat._src.emit import live_computes
from jaxremat._src.fusion import KERNEL_PRIMITIVES
from jaxremat._src.hlo_text import count_hlo_ops
from jaxremat._src.measure import Measurement, fresh_donated, measure
from jaxremat._src.schedule import Schedule
from jaxremat._src.simulate import baseline_schedule, simulate
from jaxremat._src.targets import Target, get_target
from jaxremat._src.xla_memory import xla_accounted_peak_bytes

# XLA rewrites some convolutions as dots (1x1 kernels on XLA:CPU), so a planned
# convolution may survive as a dot: opcodes in one group are counted together.
_OPCODE_GROUPS = (("dot", "convolution"), ("fft",), ("sort",))
# What a partitioned step's emitted program may send beyond the original's and the plan's
# collectives, as a share of the original's (`collectives_as_planned`).
SENT_RTOL: Final = 0.10

# -- output comparison: constants ---------------------------------------------------------

# How far the optimized outputs may be from the original's, in units of the original's
# noise envelope (`compare_outputs`). Correct reorderings reached 0.35 of it on BatchNorm +
# Adam steps (tests/test_verify.py); dropped terms and stale values reach 1e3 and more.
NOISE_FACTOR: Final = 8.0
# The perturbation of the inputs, in ulps of the lowest-precision floating dtype: far above
# the last-bit noise of reassociated sums, far below what a wrong plan changes.
_PERTURBATION_ULPS: Final = 64
# bfloat16 and float16 would get 1/2 and 1/16; a perturbation that large is no longer small.
_MAX_PERTURBATION: Final = 2.0**-5
# Each element is scaled up with this probability and down otherwise. The +-1 part flips
# near-cancelling values to both sides; the mean of +1/2 moves long sums of like-signed
# terms (losses, means, variances) by about delta/2, which random signs alone would cancel
# to below their summation-order noise.
_SCALE_UP_PROBABILITY: Final = 0.75
# The envelope never goes below this many ulps of (|value| + the leaf's rms).
_FLOOR_ULPS: Final = 4.0
# A leaf whose envelope's norm is at least this fraction of its own is mostly float noise
# (well-conditioned leaves: about delta times their condition number, 1e-5 to 1e-3).
_NOISE_DOMINATED: Final = 0.01
# `choose_verification_device`: the original runs on the device up to this fraction of its
# memory.
DEVICE_MEMORY_FRACTION: Final = 0.9

VerificationDevice = Literal["device", "host"]
MSG_BAD_DEVICE: Final = (
  "device={device!r} is not a verification device; pass None or 'device' (JAX's default "
  "device) or 'host' (the host CPU, for a step too large for the device){auto}."
)
_MSG_AUTO: Final = ", or 'auto' (the host only when the original's peak would not fit)"


# -- output comparison --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LeafComparison:
  """How one output leaf of the optimized function compares with the original's.

  Attributes:
    path: the leaf's pytree path (``jax.tree_util.keystr``), e.g. ``"[1].mu['w']"``.
    shape: the original's shape.
    dtype: the original's dtype name.
    noise_ratio: how far the leaf is from the original's, over what its noise allows; at
      most 1 passes (`compare_outputs` states the rule). Infinite when the non-finite
      positions, the integer values, the shape or the dtype differ.
    n_outside: elements outside their own tolerance, ``NOISE_FACTOR * envelope + floor``
      (or ``atol + rtol * |expected|``). Only a diagnostic in the envelope test, which
      judges the leaf as a whole: an element whose value is all float noise may be outside
      its own envelope and still pass.
    n_nonfinite_mismatch: elements that are NaN or Inf in one output and not the same
      NaN or Inf in the other.
    max_abs_error: the largest ``|got - expected|`` where both are finite; infinite when
      ``n_nonfinite_mismatch`` is not 0 or the shapes differ.
    rel_norm_error: ``||got - expected|| / ||expected||`` where both are finite; infinite
      like ``max_abs_error``.
    problem: why the leaf fails, in words; None when it passes.
  """

  path: str
  shape: tuple[int, ...]
  dtype: str
  noise_ratio: float
  n_outside: int
  n_nonfinite_mismatch: int
  max_abs_error: float
  rel_norm_error: float
  problem: str | None = None

  @property
  def ok(self) -> bool:
    """Whether the leaf passes."""
    return self.problem is None and self.noise_ratio <= 1.0


@dataclasses.dataclass(frozen=True)
class OutputComparison:
  """What `compare_outputs` found.

  Attributes:
    outputs_match: same structure, shapes and dtypes, and every leaf passes.
    noise_ratio: the largest leaf's noise ratio (at most 1 passes).
    worst_leaf: the pytree path of that leaf (None when there are no leaves).
    n_outside: elements outside their own tolerance, over all leaves (a diagnostic).
    max_abs_error: the largest absolute difference where both are finite, over all leaves
      (infinite when a non-finite position or a shape differs).
    max_rel_norm_error: the largest norm-wise relative error over the leaves.
    method: ``"envelope"`` (the noise test) or ``"allclose"`` (explicit ``rtol``/``atol``).
    perturbation: the relative input perturbation ``delta`` of the envelope (None for
      ``"allclose"``).
    leaves: one `LeafComparison` per output leaf, in ``jax.tree.leaves`` order.
    problem: what differs in the outputs' structure; None when it agrees.
  """

  outputs_match: bool
  noise_ratio: float
  worst_leaf: str | None
  n_outside: int
  max_abs_error: float
  max_rel_norm_error: float
  method: str
  perturbation: float | None
  leaves: tuple[LeafComparison, ...] = dataclasses.field(repr=False)
  problem: str | None = None

  def describe(self, max_leaves: int = 3) -> str:
    """One line for an error message: the worst leaf and what fails.

    Args:
      max_leaves: at most this many failing leaves are named.
    """
    if self.problem:
      return self.problem
    failing = sorted((leaf for leaf in self.leaves if not leaf.ok), key=lambda x: -x.noise_ratio)
    head = (
      f"noise ratio {self.noise_ratio:.3g} at output {self.worst_leaf} ({self.method}; at "
      f"most 1 passes), max abs error {self.max_abs_error:.3g}, norm-wise relative error "
      f"{self.max_rel_norm_error:.3g}"
    )
    if not failing:
      return f"all {len(self.leaves)} output leaves within their noise: {head}"
    parts = [
      f"{leaf.path}: {leaf.problem or f'noise ratio {leaf.noise_ratio:.3g}'}"
      + (
        f", {leaf.n_outside} of {math.prod(leaf.shape)} elements outside" if leaf.n_outside else ""
      )
      for leaf in failing[:max_leaves]
    ]
    more = f"; and {len(failing) - max_leaves} more leaves" if len(failing) > max_leaves else ""
    return (
      f"{len(failing)} of {len(self.leaves)} output leaves fail ({head}): "
      + "; ".join(parts)
      + more
    )

  def summary(self) -> dict[str, Any]:
    """Every figure and every leaf, as a JSON-ready dict."""
    out = dataclasses.asdict(self)
    out["leaves"] = [dataclasses.asdict(leaf) | {"shape": list(leaf.shape)} for leaf in self.leaves]
    return out


def compare_outputs(
  fn: Callable[..., Any],
  got: Any,
  *args: Any,
  rtol: float | None = None,
  atol: float | None = None,
  device: str | None = None,
  seed: int = 0,
  **kwargs: Any,
) -> OutputComparison:
  """Checks ``got`` against ``fn(*args, **kwargs)`` up to ``fn``'s own float noise.

  The rule, per output leaf:

  * Structure, shapes and dtypes agree; integer, boolean and PRNG-key leaves are equal.
  * Non-finite positions agree: NaN or Inf in ``got`` where the original is finite fails,
    and so does the reverse; where both hold the same NaN or Inf the element is left out
    of the numeric test.
  * The numeric test is against a noise envelope taken from ``fn`` itself. ``fn`` runs on
    two perturbed copies of its inputs, ``x * (1 + delta * s)`` and ``x * (1 - delta * s)``,
    with ``s`` a fixed pseudo-random +-1 per element (+1 with probability 3/4, from
    ``seed``) on floating-point input leaves only; ``delta = min(64 * eps, 2**-5)`` for the
    lowest-precision floating dtype among the inputs, the outputs and the values it computes
    (`computed_dtypes`), float32 counted at
    the precision the backend's float32 dots have (TensorFloat-32 on GPU, bfloat16 on
    TPU: `BackendFacts.float32_dot_eps`, since a recomputed dot may take another
    algorithm). An element's
    envelope is ``max_k |f_k - expected|``. With ``d = |got - expected|`` and ``floor = 4 *
    eps(leaf) * (|expected| + rms(expected))``, a leaf's noise ratio is
    ``||d|| / (C ||envelope|| + ||floor||)``, ``C = NOISE_FACTOR`` (8), and also, unless the
    leaf is mostly noise (``||envelope|| >= 0.01 ||expected||``), ``max d / (C max
    envelope + max floor)``, whichever is larger; at most 1 passes. Elements where a
    perturbed run overflows and the original does not are left out of both.

  Why: delta is about 64 ulps, far above the noise that fusing or reordering sums adds,
  so the envelope of a well-conditioned element covers that noise, while a dropped term, a
  stale value or a wrong dependency moves it far beyond. The +-1 signs push
  near-cancelling values (Adam on a gradient that is 0 up to rounding, a ReLU input at 0)
  to both sides, which gives them an envelope as large as the values; the mean of +1/2
  moves long sums of like-signed terms (losses, variances) by about ``delta / 2``, which
  random signs would cancel. Values that are only rounding noise are quantized: two
  perturbed runs often land on the original's value exactly, so one element's envelope can
  be 0 by chance, and the largest of many noise values grows with their number. A leaf is
  therefore judged by the norm of its envelope, which is stable, and by its largest
  element only where its values are not noise (so that one wrong element cannot hide in a
  large leaf's norm).

  Limits: a leaf of a few elements that are all rounding noise (a scalar gradient that is 0
  in exact arithmetic) is judged on two samples of that noise; a wrong plan that changes
  only such values, or a few elements of a leaf that is mostly noise, is not caught.

  Explicit ``rtol`` or ``atol`` replace the envelope with ``|d| <= atol + rtol *
  |expected|`` elementwise (the non-finite rule still holds); a missing one is the
  backend's for the dtype (`backends.BackendFacts.tolerance`). ``fn`` then runs once.

  Args:
    fn: the original function; it is jitted here (once: the perturbed runs reuse the
      compilation, their scale is an argument).
    got: the outputs to check, a pytree of arrays (e.g. the optimized function's).
    *args: the arguments ``got`` was computed from.
    rtol, atol: the escape hatch above; None for the noise envelope.
    device: where ``fn`` runs: None or ``"device"`` for JAX's default device, ``"host"``
      for the host CPU (``jax.devices("cpu")[0]``: the arguments are copied there), for a
      function too large for the device without its plan.
    seed: the seed of the signs ``s``.
    **kwargs: keyword arguments ``got`` was computed from.

  Returns:
    An `OutputComparison`; ``outputs_match`` is the verdict and ``describe()`` says why.

  Raises:
    ValueError: ``device`` is not one of the choices above.

  Example:
    >>> import jax, jax.numpy as jnp, jaxremat
    >>> from jaxremat._src.verify import compare_outputs
    >>> f = lambda x: jnp.tanh(x @ x).sum(0)
    >>> x = jax.random.normal(jax.random.key(0), (64, 64))
    >>> compare_outputs(f, f(x), x).outputs_match
    True
    >>> compare_outputs(f, f(x).at[3].set(jnp.nan), x).outputs_match
    False
  """
  perturb = rtol is None and atol is None
  envelope = _noise_envelope(fn, args, kwargs, device=device, seed=seed, perturb=perturb)
  return compare_with_envelope(envelope, got, rtol=rtol, atol=atol)


def perturbation_size(dtypes: Sequence[Any], float32_eps: float = 2.0**-23) -> float:
  """``delta = min(64 * eps, 2**-5)`` for the lowest-precision floating dtype in ``dtypes``.

  Args:
    dtypes: the dtypes of a function's inputs and outputs; non-floating ones are ignored.
    float32_eps: the eps float32 values are computed with: larger than float32's own
      where the backend runs float32 dots in a narrower format (`BackendFacts.float32_dot_eps`).

  Returns:
    delta, a power of two, so ``1 +- delta`` is exact in every dtype of ``dtypes`` (but
    float8 ones, where 2**-5 is below an ulp of 1). 0 when none is floating.

  Example:
    >>> import jax.numpy as jnp
    >>> perturbation_size([jnp.float32, jnp.int32]) == 64 * 2.0**-23
    True
    >>> perturbation_size([jnp.float32, jnp.bfloat16])
    0.03125
    >>> perturbation_size([jnp.float32], float32_eps=2.0**-10)  # TensorFloat-32 dots
    0.03125
  """
  eps = [
    max(float(jnp.finfo(d).eps), float32_eps if d == jnp.float32 else 0.0)
    for d in dtypes
    if _is_inexact(d)
  ]
  return min(_PERTURBATION_ULPS * max(eps), _MAX_PERTURBATION) if eps else 0.0


@dataclasses.dataclass(frozen=True)
class NoiseEnvelope:
  """A function's outputs and how far perturbing its inputs by ``delta`` moves them.

  Attributes:
    expected: the outputs, a pytree of numpy arrays (PRNG keys as their key data).
    spreads: per output leaf (``jax.tree.leaves`` order), ``max_k |f_k - expected|`` over
      the two perturbed runs; None for non-floating leaves and where nothing was perturbed.
      Infinite where the original is finite and a perturbed run is not.
    perturbation: delta; 0 when no input is floating point (or nothing was perturbed).
  """

  expected: Any = dataclasses.field(repr=False)
  spreads: tuple[np.ndarray | None, ...] = dataclasses.field(repr=False)
  perturbation: float


def noise_envelope(
  fn: Callable[..., Any], *args: Any, device: str | None = None, seed: int = 0, **kwargs: Any
) -> NoiseEnvelope:
  """Runs ``fn`` on its arguments and on two perturbed copies (`compare_outputs`' rule).

  Made once, it checks any number of candidate outputs with `compare_with_envelope`.

  Args:
    fn: the original function; jitted once for all three runs.
    *args: its arguments.
    device: None or ``"device"``: JAX's default device; ``"host"``: the host CPU.
    seed: the seed of the perturbation's signs.
    **kwargs: its keyword arguments.

  Returns:
    A `NoiseEnvelope`.

  Raises:
    ValueError: ``device`` is not one of the choices above.
  """
  return _noise_envelope(fn, args, kwargs, device=device, seed=seed, perturb=True)


def _noise_envelope(
  fn: Callable[..., Any],
  args: tuple[Any, ...],
  kwargs: dict[str, Any],
  *,
  device: str | None,
  seed: int,
  perturb: bool,
  executable: Any = None,
  donate_argnums: int | Sequence[int] = (),
  computed: Sequence[Any] | None = None,
) -> NoiseEnvelope:
  """`noise_envelope`; with ``executable`` (``fn`` compiled for the default device with
  ``donate_argnums``), ``fn`` runs in it on copies of the donated arguments, perturbed by
  a function of their own: the original step is not compiled again. ``computed``: the
  dtypes of the values ``fn`` computes, where its traced program holds them (else
  `computed_dtypes` traces ``fn``)."""
  place = _verification_device(device)
  args, kwargs = _put((args, kwargs), place)
  if executable is not None and place is None:
    perturbing = jax.jit(functools.partial(_perturbed, seed=seed))

    def run(scale: np.float32, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
      if scale:
        args, kwargs = perturbing(scale, args, kwargs)
      return executable(*fresh_donated(args, donate_argnums), **kwargs)

  else:
    run = jax.jit(_perturbing(fn, seed))

  def outputs(scale: float) -> Any:
    # Each run's outputs go to the host at once: the device holds one run at a time.
    with _default_device(place):
      return _to_host(run(np.float32(scale), args, kwargs))

  expected = outputs(0.0)
  leaves = jax.tree.leaves(expected)
  inputs = [x.dtype for x in jax.tree.leaves((args, kwargs)) if hasattr(x, "dtype")]
  spreads: list[np.ndarray | None] = [None] * len(leaves)
  if not (perturb and any(map(_is_inexact, inputs)) and any(_is_inexact(x.dtype) for x in leaves)):
    return NoiseEnvelope(expected, tuple(spreads), 0.0)
  # The optimized step ran on the default backend, whose float32 dots may be narrower.
  if computed is None:
    computed = computed_dtypes(fn, args, kwargs)
  dtypes = [*inputs, *(x.dtype for x in leaves), *computed]
  delta = perturbation_size(dtypes, backend_facts().float32_dot_eps())
  for scale in (delta, -delta):
    for i, f in enumerate(jax.tree.leaves(outputs(scale))):
      spreads[i] = _widen(spreads[i], leaves[i], f)
  return NoiseEnvelope(expected, tuple(spreads), delta)


def computed_dtypes(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]):
  """The dtypes of the values ``fn`` computes, in inner jaxprs too: a step that keeps its
  parameters in float32 and computes in bfloat16 sums in bfloat16, and a recomputation
  reorders those sums (a Llama-style decoder with Adam: one near-zero gradient of 256,
  -8e-8 against a median of 3e-5, changed sign, and Adam's first step moved its weight
  by 1.6e-3 the other way; float32 perturbations had left it where it was)."""
  return list(value_dtypes(jax.make_jaxpr(fn)(*args, **kwargs).jaxpr))


def compare_with_envelope(
  envelope: NoiseEnvelope, got: Any, *, rtol: float | None = None, atol: float | None = None
) -> OutputComparison:
  """Checks ``got`` against a `noise_envelope`, by `compare_outputs`' rule.

  Args:
    envelope: the original's outputs and noise.
    got: the outputs to check, a pytree of arrays.
    rtol, atol: None for the noise test; either one for elementwise ``allclose``.

  Returns:
    An `OutputComparison`.
  """
  got = _to_host(got)
  allclose = rtol is not None or atol is not None
  if jax.tree.structure(envelope.expected) != jax.tree.structure(got):
    return _structure_mismatch(envelope.expected, got, allclose)
  expected = jax.tree_util.tree_leaves_with_path(envelope.expected)
  leaves = tuple(
    _compare_leaf(jax.tree_util.keystr(path), e, g, spread, rtol, atol, allclose)
    for (path, e), g, spread in zip(expected, jax.tree.leaves(got), envelope.spreads)
  )
  worst = max(leaves, key=lambda leaf: leaf.noise_ratio, default=None)
  return OutputComparison(
    outputs_match=all(leaf.ok for leaf in leaves),
    noise_ratio=worst.noise_ratio if worst else 0.0,
    worst_leaf=worst.path if worst else None,
    n_outside=sum(leaf.n_outside for leaf in leaves),
    max_abs_error=max((leaf.max_abs_error for leaf in leaves), default=0.0),
    max_rel_norm_error=max((leaf.rel_norm_error for leaf in leaves), default=0.0),
    method="allclose" if allclose else "envelope",
    perturbation=None if allclose else envelope.perturbation,
    leaves=leaves,
  )


def _structure_mismatch(expected: Any, got: Any, allclose: bool) -> OutputComparison:
  return OutputComparison(
    outputs_match=False,
    noise_ratio=math.inf,
    worst_leaf=None,
    n_outside=0,
    max_abs_error=math.inf,
    max_rel_norm_error=math.inf,
    method="allclose" if allclose else "envelope",
    perturbation=None,
    leaves=(),
    problem=(
      f"the outputs' structure differs: the original returns {jax.tree.structure(expected)}, "
      f"the optimized one {jax.tree.structure(got)}"
    ),
  )


def _perturbing(fn: Callable[..., Any], seed: int) -> Callable[..., Any]:
  """``fn`` on its inputs scaled by ``1 + scale * s``; ``scale = 0`` runs ``fn`` itself.

  The scale is an argument, so every run shares one compilation, and the signs are made
  where the inputs are.
  """

  def run(scale: jax.Array, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    args, kwargs = _perturbed(scale, args, kwargs, seed)
    return fn(*args, **kwargs)

  return run


def _perturbed(scale: jax.Array, args: tuple[Any, ...], kwargs: dict[str, Any], seed: int):
  """The arguments, each inexact leaf scaled by ``1 + scale * s`` (`_perturb`)."""
  leaves, tree = jax.tree.flatten((args, kwargs))
  return jax.tree.unflatten(tree, [_perturb(x, scale, seed, i) for i, x in enumerate(leaves)])


def _perturb(x: Any, scale: jax.Array, seed: int, leaf: int) -> Any:
  # Python scalars are left alone: they are often sizes or flags, not data.
  if not _is_inexact(getattr(x, "dtype", None)):
    return x
  up = _random_bits(jnp.shape(x), seed, leaf) < np.uint32(_SCALE_UP_PROBABILITY * 2**32)
  # delta is a power of two: 1 +- delta is exact, and scale = 0 multiplies by exactly 1.
  return x * (1 + jnp.where(up, scale, -scale).astype(x.dtype))


def _random_bits(shape: tuple[int, ...], seed: int, leaf: int) -> jax.Array:
  """Fixed pseudo-random uint32 per element: the murmur3 finalizer of its flat index.

  A few integer operations that XLA fuses into the multiply; `jax.random.bernoulli` per
  leaf made a small training step's compile several times slower on XLA:CPU.
  """
  salt = np.uint32((seed * 0x632BE5AB + leaf * 0x85157AF5 + 1) % 2**32)
  h = lax.iota(jnp.uint32, math.prod(shape)).reshape(shape) * np.uint32(0x9E3779B1) + salt
  h = (h ^ (h >> 16)) * np.uint32(0x85EBCA6B)
  h = (h ^ (h >> 13)) * np.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _widen(spread: np.ndarray | None, expected: np.ndarray, perturbed: np.ndarray):
  """``max(spread, |perturbed - expected|)`` for a floating leaf (None for others).

  Where the original is NaN or Inf the non-finite rule compares the element (spread 0);
  where only the perturbed run is, the function overflows within delta of its inputs
  there, and the element is unbounded (inf).
  """
  if not _is_inexact(expected.dtype):
    return None
  e, p = _wide(expected), _wide(perturbed)
  with np.errstate(invalid="ignore"):
    new = np.where(np.isfinite(e), np.where(np.isfinite(p), np.abs(p - e), np.inf), 0.0)
  new = new.astype(np.float64 if jnp.finfo(expected.dtype).bits == 64 else np.float32)
  return new if spread is None else np.maximum(spread, new)


def _compare_leaf(
  path: str,
  expected: np.ndarray,
  got: np.ndarray,
  envelope: np.ndarray | None,
  rtol: float | None,
  atol: float | None,
  allclose: bool,
) -> LeafComparison:
  """One leaf of `compare_outputs`: the rule in its docstring."""
  got = np.asarray(got)

  def fail(problem: str, n_outside: int = 0, n_nonfinite: int = 0) -> LeafComparison:
    return LeafComparison(
      path,
      expected.shape,
      str(expected.dtype),
      math.inf,
      n_outside,
      n_nonfinite,
      math.inf,
      math.inf,
      problem,
    )

  if got.shape != expected.shape or got.dtype != expected.dtype:
    return fail(
      f"{got.dtype.name}{list(got.shape)} where the original has "
      f"{expected.dtype.name}{list(expected.shape)}"
    )
  if not _is_inexact(expected.dtype):
    n = int(np.count_nonzero(got != expected))
    if n:
      return fail(f"{n} of {expected.size} elements differ (must be equal exactly)", n)
    return LeafComparison(path, expected.shape, expected.dtype.name, 0.0, 0, 0, 0.0, 0.0)
  e, g = _wide(expected), _wide(got)
  finite_e, finite_g = np.isfinite(e), np.isfinite(g)
  both = finite_e & finite_g
  same_nonfinite = ~finite_e & ~finite_g & ((np.isnan(e) & np.isnan(g)) | (e == g))
  n_nonfinite = int(np.count_nonzero(~both & ~same_nonfinite))
  diff = np.abs(np.subtract(g, e, out=np.zeros_like(e), where=both))
  scale = np.abs(np.where(both, e, 0.0))
  max_abs = float(diff.max(initial=0.0))
  rel_norm = _ratio(float(np.linalg.norm(diff)), float(np.linalg.norm(scale)))
  if allclose:
    default_rtol, default_atol = backend_facts().tolerance(expected.dtype)
    rtol = default_rtol if rtol is None else rtol
    tol = (default_atol if atol is None else atol) + rtol * scale
    outside = diff > tol
    ratio = _max_ratio(diff, tol)
  else:
    # In float64 like the differences: the squares in a float32 norm of values below
    # 1e-19 are 0 (Adam's second moment of a gradient that is 0 up to rounding).
    envelope = np.zeros_like(diff) if envelope is None else np.where(both, _wide(envelope), 0.0)
    rms = math.sqrt(float(np.mean(scale**2))) if scale.size else 0.0
    floor = _FLOOR_ULPS * float(jnp.finfo(expected.dtype).eps) * (scale + rms)
    outside = diff > NOISE_FACTOR * envelope + floor
    # An unbounded element (the function overflows near it) passes and is left out of the
    # leaf's norms, which it would make infinite.
    bounded = np.isfinite(envelope)
    d, env, fl = diff[bounded], envelope[bounded], floor[bounded]
    norm_ratio = _ratio(
      float(np.linalg.norm(d)),
      NOISE_FACTOR * float(np.linalg.norm(env)) + float(np.linalg.norm(fl)),
    )
    # The peak test keeps one wrong element from hiding in a large leaf's norm. A leaf of
    # float noise has no meaningful peak: its largest values are the tail of the noise of
    # two different summation orders.
    noisy = np.linalg.norm(env) >= _NOISE_DOMINATED * np.linalg.norm(scale[bounded])
    peak_ratio = (
      0.0
      if noisy
      else _ratio(
        float(d.max(initial=0.0)),
        NOISE_FACTOR * float(env.max(initial=0.0)) + float(fl.max(initial=0.0)),
      )
    )
    ratio = max(norm_ratio, peak_ratio)
  n_outside = int(np.count_nonzero(outside))
  if n_nonfinite:
    only_got = int(np.count_nonzero(finite_e & ~finite_g))
    only_expected = int(np.count_nonzero(~finite_e & finite_g))
    return fail(
      f"{n_nonfinite} of {expected.size} elements are NaN or Inf in one output and not the "
      f"same in the other ({only_got} only in the optimized one, {only_expected} only in "
      f"the original)",
      n_outside,
      n_nonfinite,
    )
  problem = None if ratio <= 1.0 else f"noise ratio {ratio:.3g}"
  return LeafComparison(
    path, expected.shape, expected.dtype.name, ratio, n_outside, 0, max_abs, rel_norm, problem
  )


def _ratio(num: float, den: float) -> float:
  """``num / den`` with 0/0 = 0 and x/0 = inf."""
  return 0.0 if num == 0 else (math.inf if den == 0 else num / den)


def _max_ratio(num: np.ndarray, den: np.ndarray) -> float:
  """``max(num / den)`` elementwise, with 0/0 = 0 and x/0 = inf; 0 when empty."""
  with np.errstate(divide="ignore", invalid="ignore"):
    return float(np.where(num > 0, num / den, 0.0).max(initial=0.0))


def _is_inexact(dtype: Any) -> bool:
  return (
    dtype is not None
    and not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    and jnp.issubdtype(dtype, jnp.inexact)
  )


def _wide(x: np.ndarray) -> np.ndarray:
  """``x`` in float64 (complex128 for complex): differences of float32 values are exact."""
  return x.astype(np.complex128 if jnp.issubdtype(x.dtype, jnp.complexfloating) else np.float64)


def _to_host(tree: Any) -> Any:
  """A pytree of numpy arrays; PRNG keys become their key data."""
  tree = jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)
  return jax.tree.map(np.asarray, jax.device_get(tree))


def _is_key(x: Any) -> bool:
  dtype = getattr(x, "dtype", None)
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


# -- where to verify ----------------------------------------------------------------------


def choose_verification_device(
  baseline_peak_bytes: int, device_bytes_limit: int | None
) -> VerificationDevice:
  """Where to verify a plan: on the device, or on the host when the original won't fit.

  Verification runs the original function (three times, `compare_outputs`), which the
  plan exists to avoid when the device cannot hold it. The perturbed runs also hold a
  perturbed copy of the floating-point inputs; the 10% margin covers it only when the
  inputs are small next to the peak. This is the documented default of
  ``jaxremat.optimize(verify="auto")``.

  Args:
    baseline_peak_bytes: XLA's peak for the original (`Measurement.peak_bytes`).
    device_bytes_limit: the memory the device can allocate (`device_bytes_limit`); None
      when unknown (XLA:CPU).

  Returns:
    ``"host"`` when the original's peak is above ``DEVICE_MEMORY_FRACTION`` (90%) of the
    limit, else ``"device"`` (also when the limit is unknown).

  Example:
    >>> choose_verification_device(10 * 2**30, 16 * 2**30)
    'device'
    >>> choose_verification_device(15 * 2**30, 16 * 2**30)
    'host'
    >>> choose_verification_device(15 * 2**30, None)
    'device'
  """
  if (
    device_bytes_limit is None or baseline_peak_bytes <= DEVICE_MEMORY_FRACTION * device_bytes_limit
  ):
    return "device"
  return "host"


def device_bytes_limit() -> int | None:
  """``memory_stats()["bytes_limit"]`` of JAX's default device; None where unreported (CPU)."""
  stats = jax.devices()[0].memory_stats()
  limit = stats.get("bytes_limit") if stats else None
  return None if limit is None else int(limit)


def _verification_device(device: str | None) -> jax.Device | None:
  """The device to put the arguments on (None: leave them where they are)."""
  if device is None or device == "device":
    return None
  if device == "host":
    return jax.devices("cpu")[0]
  raise ValueError(MSG_BAD_DEVICE.format(device=device, auto=""))


def _put(tree: Any, place: jax.Device | None) -> Any:
  """``tree``'s arrays on ``place``, but those already on its platform stay (a step laid
  out on a mesh of host devices runs there)."""
  if place is None:
    return tree

  def put(x: Any) -> Any:
    devices = x.sharding.device_set if isinstance(x, jax.Array) else set()
    here = devices and all(d.platform == place.platform for d in devices)
    return x if here else jax.device_put(x, place)

  return jax.tree.map(put, tree)


def _default_device(place: jax.Device | None) -> Any:
  # Constants the functions create follow the committed arguments only if they agree.
  return contextlib.nullcontext() if place is None else jax.default_device(place)


# -- verify -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Verification:
  """What `verify` found.

  Attributes:
    outputs_match: the outputs agree with the original's up to its float noise
      (`compare_outputs`: same structure and non-finite positions, every leaf's noise
      ratio at most 1), or within explicit ``rtol``/``atol``.
    max_abs_error: the largest absolute difference where both outputs are finite, over all
      leaves; infinite where a NaN or Inf is in one output only.
    max_rel_norm_error: the largest ``||got - expected|| / ||expected||`` over the leaves,
      where both are finite (a figure, not the verdict: it is O(1) on correct plans for
      leaves whose values are all float noise, such as Adam's step on a bias before
      BatchNorm, whose gradient is 0 up to rounding).
    noise_ratio: the worst leaf's distance from the original over what its noise allows
      (at most 1 passes).
    worst_leaf: the pytree path of that output leaf.
    n_outside: output elements outside their own noise envelope (a diagnostic, see
      `LeafComparison.n_outside`).
    planned_recomputes: recomputed expensive equations in the plan, by HLO opcode.
    surviving_recomputes: extra instructions of those opcodes in the emitted function's
      optimized HLO over the original's (fusions and control-flow branches included).
    planned_sent_bytes: what the collectives of the recomputations send, per device (the
      graph's ``collective_bytes``): the communication the plan adds to the step's.
    predicted_peak_bytes: the simulator's peak for the schedule.
    measured_peak_bytes: XLA's peak (argument + output + temp - alias) of the emitted one.
    predicted_xla_peak_bytes: the simulator's peak as XLA counts it (output buffers
      held from the start, `xla_memory.xla_accounted_peak_bytes`).
    predicted_baseline_peak_bytes: the simulator's peak for the no-remat baseline.
    planned_flops_increase: extra flops of the recomputations over the graph's total
      (a fraction; None when the graph's nodes carry no ``flops``).
    measured_flops_increase: emitted over original flops from XLA's cost analysis, less 1.
    device: where the outputs were computed, ``"device"`` or ``"host"``.
    original: `measure` of the original function.
    emitted: `measure` of the emitted function.
    comparison: the output comparison, leaf by leaf.
  """

  outputs_match: bool
  max_abs_error: float
  max_rel_norm_error: float
  noise_ratio: float
  worst_leaf: str | None
  n_outside: int
  planned_recomputes: Mapping[str, int]
  surviving_recomputes: Mapping[str, int]
  planned_sent_bytes: int
  predicted_peak_bytes: int
  measured_peak_bytes: int
  predicted_xla_peak_bytes: int
  predicted_baseline_peak_bytes: int
  planned_flops_increase: float | None
  measured_flops_increase: float | None
  device: str
  original: Measurement = dataclasses.field(repr=False)
  emitted: Measurement = dataclasses.field(repr=False)
  comparison: OutputComparison = dataclasses.field(repr=False)

  @property
  def output_report(self) -> str:
    """One line on how the outputs compare (`OutputComparison.describe`)."""
    return self.comparison.describe()

  @property
  def recomputes_survive(self) -> bool:
    """Every planned expensive recomputation is in the optimized HLO.

    Dots and convolutions count together: XLA lowers some convolutions to dots.
    """
    return recomputes_survive(self.planned_recomputes, self.surviving_recomputes)

  @property
  def n_planned_recomputes(self) -> int:
    """Planned expensive recomputations, all opcodes together."""
    return sum(self.planned_recomputes.values())

  @property
  def n_surviving_recomputes(self) -> int:
    """Of those, how many XLA kept (at most the planned number per opcode group)."""
    return sum(
      min(
        sum(self.surviving_recomputes.get(op, 0) for op in group),
        sum(self.planned_recomputes.get(op, 0) for op in group),
      )
      for group in _OPCODE_GROUPS
    )

  @property
  def unplanned_sent_bytes(self) -> int:
    """Bytes each device sends beyond the original step's and the plan's collectives."""
    return unplanned_sent_bytes(
      self.original.sent_bytes, self.emitted.sent_bytes, self.planned_sent_bytes
    )

  @property
  def collectives_as_planned(self) -> bool:
    """XLA added no collective that the plan did not ask for (`collectives_as_planned`)."""
    return collectives_as_planned(self.unplanned_sent_bytes, self.original.sent_bytes)

  @property
  def peak_error(self) -> float:
    """XLA's peak over the simulator's, less 1 (0.05: XLA needs 5% more)."""
    return self.measured_peak_bytes / max(self.predicted_peak_bytes, 1) - 1.0

  @property
  def xla_peak_error(self) -> float:
    """XLA's peak over the simulator's peak as XLA counts it, less 1."""
    return self.measured_peak_bytes / max(self.predicted_xla_peak_bytes, 1) - 1.0

  def summary(self) -> dict[str, Any]:
    """Every check and figure (not the `Measurement` objects), as a JSON-ready dict."""
    out = {
      f.name: getattr(self, f.name)
      for f in dataclasses.fields(self)
      if f.name not in ("original", "emitted", "comparison")
    }
    out.update(
      planned_recomputes=dict(self.planned_recomputes),
      surviving_recomputes=dict(self.surviving_recomputes),
      recomputes_survive=self.recomputes_survive,
      n_planned_recomputes=self.n_planned_recomputes,
      n_surviving_recomputes=self.n_surviving_recomputes,
      unplanned_sent_bytes=self.unplanned_sent_bytes,
      collectives_as_planned=self.collectives_as_planned,
      peak_error=self.peak_error,
      xla_peak_error=self.xla_peak_error,
      output_comparison=self.comparison.method,
      output_report=self.output_report,
      original_peak_bytes=self.original.peak_bytes,
      original_temp_bytes=self.original.temp_bytes,
      emitted_temp_bytes=self.emitted.temp_bytes,
      emitted_output_bytes=self.emitted.output_bytes,
      emitted_flops=self.emitted.flops,
      original_wall_time_s=self.original.wall_time_s,
      emitted_wall_time_s=self.emitted.wall_time_s,
      emitted_device_peak_bytes=self.emitted.device_peak_bytes,
      ok=self.ok(),
    )
    return out

  def ok(self, peak_rtol: float = 0.10) -> bool:
    """Outputs match, recomputations survive, collectives are as planned, and XLA's peak
    is within ``peak_rtol``."""
    return (
      self.outputs_match
      and self.recomputes_survive
      and self.collectives_as_planned
      and abs(self.peak_error) <= peak_rtol
    )


def verify(
  fn: Callable[..., Any],
  emitted: Callable[..., Any],
  schedule_or_program: Any = None,
  *args: Any,
  rtol: float | None = None,
  atol: float | None = None,
  runs: int = 0,
  original: Measurement | None = None,
  emitted_measurement: Measurement | None = None,
  program: Any = None,
  device: str | None = None,
  donate_argnums: int | Sequence[int] = (),
  envelope: NoiseEnvelope | None = None,
  target: str | Target | None = None,
  emitted_executable: Any = None,
  original_executable: Any = None,
  **kwargs: Any,
) -> Verification:
  """Checks ``emitted`` (from `jaxremat.emit`) against the original ``fn``.

  Args:
    fn: the original function.
    emitted: the function `emit` returned for it.
    schedule_or_program: the plan to compare with: a `Schedule`, a `Program`, or None;
      whatever is not given is read from ``emitted.schedule`` / ``emitted.program``.
    *args: arguments to run both functions on.
    rtol, atol: None compares the outputs with the original's float noise
      (`compare_outputs`); either one compares them elementwise within ``atol + rtol *
      |expected|`` instead (a missing one is the backend's for the dtype).
    runs: timed calls per function for `measure` (0: compile and analyse only).
    original: a `measure` of ``fn`` on these arguments to reuse (when verifying many
      schedules of one function); measured here when None.
    emitted_measurement: a `measure` of ``emitted`` to reuse (the planner has compiled it
      already); measured here when None.
    program: the traced program, when neither ``schedule_or_program`` nor ``emitted``
      carries it.
    device: where the outputs are computed: None or ``"device"`` on JAX's default device;
      ``"host"`` on the host CPU, for a step the device cannot hold without the plan;
      ``"auto"`` picks with `choose_verification_device`. `measure` compiles for the
      default backend in every case (and runs there when ``runs`` > 0).
    donate_argnums: as for `jax.jit`, for `measure` and the executables only: the
      outputs are computed on calls that donate the caller's arguments to nothing, since
      ``fn`` runs three times on the same arguments.
    envelope: a `noise_envelope` of ``fn`` on these arguments to reuse (when verifying
      many schedules of one function); made here when None.
    target: what `measure` compiles for (`jaxremat.get_target`; None: this machine's
      backend). On a target without devices here the outputs are computed on the host.
    emitted_executable: ``emitted`` compiled already for JAX's default device with
      ``donate_argnums`` (the planner's, which the optimized step runs), to compute its
      outputs on the device without compiling it again; its donated arguments get
      copies. None: ``emitted`` is jitted here without donation.
    original_executable: ``fn`` compiled likewise (the planner's baseline), for its runs
      on the device; None: ``fn`` is jitted here, with the perturbation inside.
    **kwargs: keyword arguments to run both functions on.

  Returns:
    A `Verification`; ``ok()`` says whether every check passed.

  Raises:
    ValueError: the plan cannot be found (pass the schedule and the program's function
      through `emit`), or ``device`` is not one of the choices above.

  Example:
    >>> import jax.numpy as jnp, jaxremat
    >>> f = lambda x: jnp.sum(jnp.tanh(x @ x))
    >>> p = jaxremat.trace_program(f, jnp.ones((8, 8)), costs="shape")
    >>> s = jaxremat.baseline_schedule(p.graph)
    >>> v = jaxremat.verify(f, jaxremat.emit(p, s), s, jnp.ones((8, 8)))
    >>> v.outputs_match, v.recomputes_survive, v.planned_recomputes
    (True, True, {})
  """
  schedule = getattr(emitted, "schedule", None)
  program = getattr(emitted, "program", None) if program is None else program
  if isinstance(schedule_or_program, Schedule):
    schedule = schedule_or_program
  elif schedule_or_program is not None:
    program = schedule_or_program
  if schedule is None or program is None:
    raise ValueError(
      f"verify needs the schedule and the traced program behind emitted={emitted!r}; pass "
      "a function returned by jaxremat.emit, or the missing one as schedule_or_program."
    )
  if device not in (None, "device", "host", "auto"):
    raise ValueError(MSG_BAD_DEVICE.format(device=device, auto=_MSG_AUTO))
  target = get_target(target)
  measured = dict(runs=runs if target.local else 0, donate_argnums=donate_argnums, target=target)
  if original is None:
    original = measure(fn, *args, **measured, **kwargs)
  if not target.local:
    device = "host"
  if device == "auto":
    device = choose_verification_device(original.peak_bytes, device_bytes_limit())
  place = _verification_device(device)
  placed_args, placed_kwargs = _put((args, kwargs), place)
  if emitted_executable is not None and place is None:
    got = _to_host(emitted_executable(*fresh_donated(args, donate_argnums), **kwargs))
  else:
    with _default_device(place):
      got = _to_host(jax.jit(emitted)(*placed_args, **placed_kwargs))
  del placed_args, placed_kwargs
  if envelope is None:
    perturb = rtol is None and atol is None
    envelope = _noise_envelope(
      fn,
      args,
      kwargs,
      device=device,
      seed=0,
      perturb=perturb,
      executable=original_executable,
      donate_argnums=donate_argnums,
      computed=list(value_dtypes(program.jaxpr.jaxpr)),
    )
  comparison = compare_with_envelope(envelope, got, rtol=rtol, atol=atol)
  emitted_m = emitted_measurement or measure(emitted, *args, **measured, **kwargs)
  planned = planned_recomputes(program, schedule)
  surviving = surviving_recomputes(original.hlo_text, emitted_m.hlo_text)
  graph = program.graph
  return Verification(
    outputs_match=comparison.outputs_match,
    max_abs_error=comparison.max_abs_error,
    max_rel_norm_error=comparison.max_rel_norm_error,
    noise_ratio=comparison.noise_ratio,
    worst_leaf=comparison.worst_leaf,
    n_outside=comparison.n_outside,
    planned_recomputes=planned,
    surviving_recomputes={op: n for op, n in surviving.items() if n or op in planned},
    planned_sent_bytes=planned_sent_bytes(program, schedule),
    predicted_peak_bytes=simulate(graph, schedule).peak_bytes,
    measured_peak_bytes=emitted_m.peak_bytes,
    predicted_xla_peak_bytes=xla_accounted_peak_bytes(graph, schedule),
    predicted_baseline_peak_bytes=simulate(graph, baseline_schedule(graph)).peak_bytes,
    planned_flops_increase=planned_flops_increase(program, schedule),
    measured_flops_increase=(
      emitted_m.flops / original.flops - 1.0 if original.flops and emitted_m.flops else None
    ),
    device="host" if place is not None else "device",
    original=original,
    emitted=emitted_m,
    comparison=comparison,
  )


# -- plan checks --------------------------------------------------------------------------


def recomputes_survive(planned: Mapping[str, int], surviving: Mapping[str, int]) -> bool:
  """Whether at least the planned expensive recomputations (by HLO opcode) survive; dots
  and convolutions count together, since XLA lowers some convolutions to dots."""
  return all(
    sum(surviving.get(op, 0) for op in group) >= sum(planned.get(op, 0) for op in group)
    for group in _OPCODE_GROUPS
  )


def surviving_recomputes(original_hlo: str, emitted_hlo: str) -> dict[str, int]:
  """Extra instructions of each `KERNEL_PRIMITIVES` opcode in the emitted HLO over the original's."""
  before, after = count_hlo_ops(original_hlo), count_hlo_ops(emitted_hlo)
  return {op: after.get(op, 0) - before.get(op, 0) for op in KERNEL_PRIMITIVES.values()}


def planned_recomputes(program: Any, schedule: Schedule) -> dict[str, int]:
  """Expensive equations the schedule runs again, by the HLO opcode they lower to.

  Recomputations whose values nobody reads are left out: `emit` drops them (as XLA would).
  """
  counts: collections.Counter[str] = collections.Counter()
  for v, recompute in live_computes(program, schedule):
    if recompute:
      for i in program.node_eqns[v]:
        _count_kernels(program.jaxpr.jaxpr.eqns[i], counts)
  return dict(counts)


def planned_sent_bytes(program: Any, schedule: Schedule) -> int:
  """Bytes each device sends for the collectives of the schedule's (used) recomputations:
  an FSDP weight gathered again for a recomputed product, say."""
  sent = [node.attrs.get("collective_bytes", 0) for node in program.graph.nodes]
  if not any(sent):  # one device's program: no plan to read
    return 0
  return sum(sent[v] for v, again in live_computes(program, schedule) if again)


def unplanned_sent_bytes(original_bytes: int, emitted_bytes: int, planned_bytes: int) -> int:
  """What each device of the emitted step sends beyond the original's and the plan's."""
  return max(emitted_bytes - original_bytes - planned_bytes, 0)


def collectives_as_planned(unplanned_bytes: int, original_bytes: int) -> bool:
  """Whether what each device of the emitted step sends beyond the original's and the
  plan's collectives (`unplanned_sent_bytes`) is within `SENT_RTOL` of the original's:
  the partitioner decides every collective of the emitted program afresh and combines and
  splits them otherwise (a tensor-parallel GPT plan: 4% of the step's bytes moved between
  all-reduces and all-gathers beyond what its recomputations gather), where a collective
  that nothing planned, such as a fence that gathered a split value whole (20.8 MiB per
  device against the step's 11.7), is well beyond it."""
  return unplanned_bytes <= SENT_RTOL * original_bytes


def _count_kernels(eqn: Any, counts: collections.Counter) -> None:
  op = KERNEL_PRIMITIVES.get(eqn.primitive.name)
  if op:
    counts[op] += 1
  for inner in compat.inner_jaxprs(eqn):
    for sub in inner.eqns:
      _count_kernels(sub, counts)


def planned_flops_increase(program: Any, schedule: Schedule) -> float | None:
  """Flops of the (used) recomputations over the flops of one run of every node.

  None unless every node carries a ``flops`` attribute.
  """
  graph = program.graph
  flops = [graph.nodes[v].attrs.get("flops") for v in graph.order]
  if any(f is None for f in flops):
    return None
  total = float(sum(flops))
  extra = sum(
    graph.nodes[v].attrs["flops"] for v, again in live_computes(program, schedule) if again
  )
  return extra / total if total else None
