"""Per-equation costs from the target compiler's own cost analysis, cached by signature.

Each distinct equation signature (primitive, params, input avals, backend) is compiled
alone once, for the target (deviceless where this machine lacks its devices); its cost
analysis' flops and bytes accessed become seconds through a roofline. This machine's
roofline is measured once by a micro-benchmark (ARCHITECTURE.md fact 4); a deviceless
target's is its published peak rates (`jaxremat._src.targets.Target.peak_rates`).
Results live in memory and in a versioned JSON file per target under
``$JAXREMAT_CACHE_DIR`` (default ``~/.cache/jaxremat``). Equations XLA cannot compile
alone get a shape-based estimate, and say so (``source="shape"``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import math
import os
import platform
import re
import time
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxremat._src import compat
from jaxremat._src.errors import FormatError
from jaxremat._src.graph import read_json, write_json_atomic
from jaxremat._src.targets import Target, compile_for, get_target

CACHE_FORMAT = "jaxremat.costs/1"
ROOFLINE_FORMAT = "jaxremat.roofline/1"
# Threads that compile equations at once (at most one per core).
_COMPILE_THREADS = 8


@dataclasses.dataclass(frozen=True)
class EqnCost:
  """The cost of one equation.

  Attributes:
    flops: floating-point operations (XLA's count, or the shape estimate).
    bytes_accessed: bytes read and written.
    seconds: estimated (roofline) or measured run time.
    source: ``"xla"``, ``"measured"`` or ``"shape"`` (XLA could not compile it alone).
  """

  flops: float
  bytes_accessed: float
  seconds: float
  source: str


def scaled(cost: EqnCost, share: float) -> EqnCost:
  """``cost`` for ``share`` of the equation's work (one device's part of a partitioned
  equation)."""
  if share == 1.0:
    return cost
  return dataclasses.replace(
    cost,
    flops=cost.flops * share,
    bytes_accessed=cost.bytes_accessed * share,
    seconds=cost.seconds * share,
  )


@dataclasses.dataclass(frozen=True)
class Roofline:
  """Peak rates of a device: measured here (`measure_roofline`) or published (deviceless).

  ``source`` is ``"measured"`` or ``"published"``.
  """

  flops_per_s: float
  bytes_per_s: float
  backend: str
  device_kind: str
  source: str = "measured"

  def seconds(self, flops: float, bytes_accessed: float) -> float:
    return max(flops / self.flops_per_s, bytes_accessed / self.bytes_per_s)


def link_bytes_per_s(target: Target | None, memory_bytes_per_s: float | None) -> float:
  """What each device of a partitioned step sends per second: the target's published
  chip-to-chip rate, or where it has none (host CPU devices, which copy through memory)
  the memory's; infinite without either."""
  return (target and target.interconnect_rate()) or memory_bytes_per_s or math.inf


def kernel_seconds(
  eqn_costs: Sequence[EqnCost], kernel_bytes: float, roof: Roofline | None
) -> float:
  """The time of equations that XLA runs as one kernel: all their FLOPs, and only
  ``kernel_bytes`` moved (the values passed between them stay on chip).

  Summing each equation's roofline would charge every intermediate a write and a read.
  Measured times, and shape estimates without a roofline, are summed as they are.
  """
  if roof is None or any(c.source == "measured" for c in eqn_costs):
    return float(sum(c.seconds for c in eqn_costs))
  moved = min(float(sum(c.bytes_accessed for c in eqn_costs)), kernel_bytes)
  return roof.seconds(float(sum(c.flops for c in eqn_costs)), moved)


def cache_dir(path: str | os.PathLike | None = None) -> str:
  """The cost cache directory: ``path``, ``$JAXREMAT_CACHE_DIR`` or ``~/.cache/jaxremat``."""
  if path is not None:
    return os.fspath(path)
  return os.environ.get("JAXREMAT_CACHE_DIR") or os.path.join(
    os.path.expanduser("~"), ".cache", "jaxremat"
  )


# -- roofline --------------------------------------------------------------------------------


def _device_tag(target: Target | None = None) -> tuple[str, str]:
  """(backend, file-name-safe device tag): this machine's device, or a deviceless target's."""
  if target is not None and not target.local:
    return target.platform, re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{target.device_kind}-deviceless")
  dev = jax.devices()[0]
  kind = f"{dev.device_kind}-{os.cpu_count()}cpu" if dev.platform == "cpu" else dev.device_kind
  return jax.default_backend(), re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{kind}-{platform.node()}")


def _best_time_s(fn, *args, repeats: int = 5) -> float:
  jax.block_until_ready(fn(*args))
  best = math.inf
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - t0)
  return best


def measure_roofline() -> Roofline:
  """Measures peak flop/s (a 1024^3 matmul) and byte/s (a 32 MiB elementwise add)."""
  backend, kind = _device_tag()
  n = 1024
  a = jnp.ones((n, n), jnp.float32)
  matmul = jax.jit(lambda x, y: x @ y)
  flops_per_s = 2 * n**3 / _best_time_s(matmul, a, a)
  x = jnp.ones((8 * 2**20,), jnp.float32)
  add = jax.jit(lambda x, y: x + y)
  bytes_per_s = 3 * x.nbytes / _best_time_s(add, x, x)
  return Roofline(float(flops_per_s), float(bytes_per_s), backend, kind)


_ROOFLINES: dict[tuple[str, str], Roofline] = {}


def roofline(directory: str | os.PathLike | None = None, target: Target | None = None) -> Roofline:
  """The roofline of ``target``'s device (None: this machine's).

  Measured once per machine and kept on disk beside the cost cache; a target without
  devices here has its published peak rates.
  """
  tag = _device_tag(target)
  if tag in _ROOFLINES:
    return _ROOFLINES[tag]
  if target is not None and not target.local:
    flops_per_s, bytes_per_s = target.peak_rates()
    _ROOFLINES[tag] = Roofline(
      flops_per_s, bytes_per_s, target.platform, target.device_kind, source="published"
    )
    return _ROOFLINES[tag]
  path = os.path.join(cache_dir(directory), f"roofline-{tag[0]}-{tag[1]}.json")
  try:
    data = read_json(path)
    if data.get("format") != ROOFLINE_FORMAT:
      raise FormatError(path, "format", "is not the current roofline format.")
    result = Roofline(float(data["flops_per_s"]), float(data["bytes_per_s"]), *tag)
  except (FormatError, KeyError, TypeError, ValueError, AttributeError):
    result = measure_roofline()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_json_atomic(
      path,
      {
        "format": ROOFLINE_FORMAT,
        "flops_per_s": result.flops_per_s,
        "bytes_per_s": result.bytes_per_s,
        "backend": tag[0],
        "device_kind": tag[1],
      },
    )
  _ROOFLINES[tag] = result
  return result


def roofline_meta(
  mode: str, directory: str | os.PathLike | None = None, target: Target | None = None
) -> dict[str, Any] | None:
  """The roofline as graph metadata (None in shape mode, which measures nothing)."""
  if mode == "shape":
    return None
  r = roofline(directory, target)
  return {
    "flops_per_s": r.flops_per_s,
    "bytes_per_s": r.bytes_per_s,
    "device_kind": r.device_kind,
    "source": r.source,
  }


# -- shape-based estimates ---------------------------------------------------------------------


def _size(aval: Any) -> int:
  return math.prod(getattr(aval, "shape", ()))


def shape_flops(eqn: Any) -> float:
  """Flops from shapes alone: 2*M*N*K for dots and convolutions, one per element else."""
  name = eqn.primitive.name
  out = sum(_size(v.aval) for v in eqn.outvars)
  if name == "dot_general":
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    k = math.prod(eqn.invars[0].aval.shape[d] for d in lhs_contract)
    return 2.0 * out * k
  if name == "conv_general_dilated":
    rhs = eqn.invars[1].aval.shape
    spec = eqn.params["dimension_numbers"].rhs_spec  # (out feature, in feature, *spatial)
    k = math.prod(rhs[d] for d in spec[1:])
    return 2.0 * out * k
  if name in ("scan", "while", "cond"):
    trips = eqn.params.get("length", 1) if name == "scan" else 1
    bodies = compat.inner_jaxprs(eqn)
    inner = max((sum(shape_flops(e) for e in b.eqns) for b in bodies), default=0.0)
    return float(trips) * inner
  return float(out)


def shape_bytes(eqn: Any) -> float:
  """Bytes read and written: every input and output once."""
  ins = sum(compat.aval_bytes(v.aval) for v in eqn.invars)
  outs = sum(compat.aval_bytes(v.aval) for v in eqn.outvars)
  return float(ins + outs)


# -- XLA cost analysis per signature ---------------------------------------------------------

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def signature(eqn: Any, backend: str) -> str:
  """A stable key for (primitive, params, input avals, backend)."""
  ins = ",".join(
    f"lit:{v.val!r}:{v.aval}" if isinstance(v, compat.Literal) else str(v.aval) for v in eqn.invars
  )
  params = _ADDRESS.sub("", repr(sorted((k, str(v)) for k, v in eqn.params.items())))
  text = f"{eqn.primitive.name}|{params}|{ins}|{backend}"
  return hashlib.sha256(text.encode()).hexdigest()


def _compile_alone(eqn: Any, target: Target | None):
  params = compat.bind_params(eqn)
  literals = {i: v.val for i, v in enumerate(eqn.invars) if isinstance(v, compat.Literal)}
  specs = [
    jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
    for v in eqn.invars
    if not isinstance(v, compat.Literal)
  ]

  def run(*xs):
    it = iter(xs)
    args = [literals[i] if i in literals else next(it) for i in range(len(eqn.invars))]
    return eqn.primitive.bind(*args, **params)

  if target is not None and not target.local:
    return compile_for(target, run, *specs), specs
  return jax.jit(run).lower(*specs).compile(), specs


def _measure_seconds(compiled: Any, specs: Sequence[jax.ShapeDtypeStruct]) -> float:
  args = []
  for s in specs:
    if compat.is_extended_dtype(s.dtype):
      args.append(jax.random.split(jax.random.key(0), s.shape) if s.shape else jax.random.key(0))
    else:
      args.append(jnp.zeros(s.shape, s.dtype))
  return _best_time_s(compiled, *args, repeats=3)


class CostCache:
  """In-memory and on-disk store of per-signature costs for one backend and device."""

  def __init__(self, directory: str | os.PathLike | None = None, target: Target | None = None):
    backend, kind = _device_tag(target)
    self.path = os.path.join(cache_dir(directory), f"costs-{backend}-{kind}.json")
    self.entries: dict[str, list[Any]] = {}
    self.dirty = False
    if not os.path.exists(self.path):
      return
    try:
      data = read_json(self.path)
      if isinstance(data, dict) and data.get("format") == CACHE_FORMAT:
        entries = data.get("entries")
        if not isinstance(entries, dict):
          raise FormatError(self.path, "entries", "expected a JSON object.")
        self.entries = entries
    except FormatError as e:  # damaged: start empty, rewrite it whole on save
      warnings.warn(f"Ignoring the damaged cost cache {e}", stacklevel=2)
      self.dirty = True

  def save(self) -> None:
    if not self.dirty:
      return
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    # Merge with what another process may have written meanwhile.
    try:
      data = read_json(self.path)
      if isinstance(data, dict) and isinstance(data.get("entries"), dict):
        self.entries = {**data["entries"], **self.entries}
    except FormatError:
      pass
    write_json_atomic(self.path, {"format": CACHE_FORMAT, "entries": self.entries})
    self.dirty = False


_CACHES: dict[tuple[str, tuple[str, str]], CostCache] = {}


def _cache(directory: str | os.PathLike | None, target: Target | None) -> CostCache:
  key = (cache_dir(directory), _device_tag(target))
  if key not in _CACHES:
    _CACHES[key] = CostCache(directory, target)
  return _CACHES[key]


def clear_memory_cache() -> None:
  """Forgets the in-memory caches (the disk cache stays)."""
  _CACHES.clear()
  _ROOFLINES.clear()


def equation_costs(
  eqns: Sequence[Any],
  *,
  mode: str = "xla",
  cache_dir: str | os.PathLike | None = None,
  time_limit_s: float | None = None,
  target: str | Target | None = None,
) -> list[EqnCost]:
  """The cost of each equation on ``target``'s device.

  Args:
    eqns: jaxpr equations.
    mode: ``"xla"`` (the target compiler's cost analysis + roofline), ``"measured"``
      (timed on this machine's device) or ``"shape"`` (shape estimates, nothing compiled).
    cache_dir: the cost cache directory.
    time_limit_s: seconds for compiling equations that are not in the cache yet; the
      ones left after it get shape estimates (not cached, so a later call costs them).
    target: the device (`jaxremat.get_target`; None: this machine's). Without its
      devices here, each equation is compiled deviceless and the roofline is the
      target's published peak rates.

  Returns:
    One `EqnCost` per equation.

  Raises:
    ValueError: ``mode="measured"`` for a target without devices on this machine.
  """
  if mode == "shape":
    return [_shape_cost(e, None) for e in eqns]
  target = get_target(target)
  if target.local:
    target = None  # this machine's device: the measured roofline and jax.jit's compiler
  elif mode == "measured":
    raise ValueError(
      f"costs='measured' times equations on the device, and target {target.name!r} has "
      "none on this machine: use costs='xla' (its compiler's cost analysis) instead."
    )
  else:
    target.devices()  # a compiler that cannot start fails here, not as shape estimates
  roof = roofline(cache_dir, target)
  cache = _cache(cache_dir, target)
  deadline = None if time_limit_s is None else time.perf_counter() + time_limit_s
  keys = [None if e.effects else f"{mode}:{signature(e, roof.backend)}" for e in eqns]
  missing = {k: e for k, e in zip(keys, eqns, strict=True) if k and k not in cache.entries}

  def analyze(eqn: Any) -> list[Any] | None:
    if deadline is not None and time.perf_counter() > deadline:
      return None  # left to shape estimates, and to a later call
    return _analyze(eqn, mode, target)

  # XLA compiles with the GIL released: equations compile side by side, except where
  # each is timed on the device.
  workers = 1 if mode == "measured" else min(os.cpu_count() or 1, _COMPILE_THREADS)
  pool = concurrent.futures.ThreadPoolExecutor(workers)
  try:
    for key, entry in zip(missing, pool.map(analyze, missing.values()), strict=True):
      if entry is not None:
        cache.entries[key] = entry
        cache.dirty = True
  finally:  # an interrupt starts no more compiles
    pool.shutdown(cancel_futures=True)
  out = []
  for eqn, key in zip(eqns, keys, strict=True):
    entry = cache.entries.get(key) if key else None
    if entry is None:
      out.append(_shape_cost(eqn, roof))
      continue
    flops, bytes_accessed, measured_s = entry
    if flops is None or _counted_nothing(eqn, flops):
      out.append(_shape_cost(eqn, roof))
    elif mode == "measured" and measured_s is not None:
      out.append(EqnCost(flops, bytes_accessed, measured_s, "measured"))
    else:
      out.append(EqnCost(flops, bytes_accessed, roof.seconds(flops, bytes_accessed), "xla"))
  cache.save()
  return out


def _analyze(eqn: Any, mode: str, target: Target | None) -> list[Any]:
  """``[flops, bytes_accessed, measured_s]``; ``[None, None, None]`` if it won't compile."""
  try:
    compiled, specs = _compile_alone(eqn, target)
    costs = compat.hlo_cost_analysis(compiled)
    flops = float(costs.get("flops", 0.0)) + float(costs.get("transcendentals", 0.0))
    bytes_accessed = float(costs.get("bytes accessed", 0.0))
    measured = _measure_seconds(compiled, specs) if mode == "measured" else None
  except Exception:  # noqa: BLE001 - any failure means "estimate from shapes"
    return [None, None, None]
  return [max(flops, 0.0), max(bytes_accessed, 0.0), measured]


def _counted_nothing(eqn: Any, flops: float) -> bool:
  """XLA:GPU's cost analysis counts nothing for a convolution it runs through cuDNN (nor
  its bytes: measured for H100 with jax 0.10.2): its shapes say what it does."""
  return flops == 0 and eqn.primitive.name in ("conv_general_dilated", "dot_general")


def _shape_cost(eqn: Any, roof: Roofline | None) -> EqnCost:
  flops, bytes_accessed = shape_flops(eqn), shape_bytes(eqn)
  # Without a roofline, one flop or one byte per nanosecond keeps units of seconds.
  seconds = roof.seconds(flops, bytes_accessed) if roof else max(flops, bytes_accessed) * 1e-9
  return EqnCost(flops, bytes_accessed, seconds, "shape")
