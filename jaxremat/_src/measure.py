"""`measure`: what XLA says a function costs (memory analysis, flops, wall time)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.experimental.serialize_executable import deserialize_and_load, serialize

from jaxremat._src import compat
from jaxremat._src.hlo_text import library_convolution_flops, partitions, sent_bytes
from jaxremat._src.targets import Target, compile_for, get_target


@dataclasses.dataclass(frozen=True)
class Measurement:
  """XLA's figures for one compiled function (ARCHITECTURE.md facts 3 and 4).

  Attributes:
    backend: the platform it was compiled for (``"cpu"``, ``"gpu"``, ``"tpu"``).
    target: the target's name (`jaxremat.get_target`: ``"cpu"``, ``"tpu-v5e"``, ...).
    device_kind: the device compiled for.
    argument_bytes, output_bytes, temp_bytes, alias_bytes, generated_code_bytes: the
      fields of ``compiled.memory_analysis()``.
    peak_bytes: XLA's peak: argument + output + temp - alias on CPU and GPU,
      ``peak_memory_in_bytes`` on TPU (`compat.memory_peak_bytes`).
    flops, transcendentals, bytes_accessed: XLA's cost analysis of the optimized program
      (None where the backend reports nothing). Where the target's cost analysis leaves
      out the convolutions it runs as library calls (XLA:GPU's cuDNN calls,
      `Target.counts_library_convolutions`), ``flops`` adds theirs, counted from the
      optimized HLO (`hlo_text.library_convolution_flops`).
    compile_time_s: seconds to lower and compile.
    wall_time_s: median seconds per call over ``wall_times_s`` (None with ``runs=0``).
    wall_times_s: each timed call, after the warm-up calls.
    device_peak_bytes: ``device.memory_stats()["peak_bytes_in_use"]`` after the runs on
      backends that keep it (GPU, TPU); the process's high-water mark, None on CPU.
    hlo_text: the optimized HLO (``compiled.as_text()``).
  """

  backend: str
  target: str
  device_kind: str
  argument_bytes: int
  output_bytes: int
  temp_bytes: int
  alias_bytes: int
  generated_code_bytes: int
  peak_bytes: int
  flops: float | None
  transcendentals: float | None
  bytes_accessed: float | None
  compile_time_s: float
  wall_time_s: float | None
  wall_times_s: tuple[float, ...]
  device_peak_bytes: int | None
  hlo_text: str = dataclasses.field(repr=False, default="")

  @functools.cached_property
  def partitions(self) -> int:
    """Devices the step is partitioned over; the figures are one device's."""
    return partitions(self.hlo_text)

  @functools.cached_property
  def sent_bytes(self) -> int:
    """Bytes each device sends for the step's collectives (`hlo_text.collectives`)."""
    return sent_bytes(self.hlo_text)

  def summary(self) -> dict[str, Any]:
    """Every field but the HLO text, as a JSON-ready dict."""
    out = dataclasses.asdict(self)
    del out["hlo_text"]
    out["wall_times_s"] = list(self.wall_times_s)
    return out


def compile_fn(
  fn: Callable[..., Any], *args: Any, donate_argnums: int | Sequence[int] = (), **kwargs: Any
) -> Any:
  """``jax.jit(fn, donate_argnums=...).lower(*args, **kwargs).compile()``."""
  return jax.jit(fn, donate_argnums=donate_argnums).lower(*args, **kwargs).compile()


def measure(
  fn: Callable[..., Any],
  *args: Any,
  runs: int = 10,
  warmup: int = 1,
  donate_argnums: int | Sequence[int] = (),
  target: str | Target | None = None,
  **kwargs: Any,
) -> Measurement:
  """Compiles ``fn`` on ``args`` and reports XLA's memory, flops and wall time.

  Args:
    fn: the function (jitted or not; it is jitted here).
    *args: its positional arguments.
    runs: timed calls; the median is reported. 0 compiles and analyses only: nothing
      runs, so ``args`` may be ``jax.ShapeDtypeStruct`` and the step need not fit.
    warmup: untimed calls before the timed ones (none when ``runs`` is 0).
    donate_argnums: as for `jax.jit`; donated arguments are copied before each call
      (outside the timed region) so that every call gets live buffers.
    target: what to compile for (`jaxremat.get_target`): None for this machine's
      backend, or e.g. ``"tpu-v5e"`` / ``"h100"``, compiled without the device (then
      ``runs`` must be 0).
    **kwargs: its keyword arguments.

  Returns:
    A `Measurement`.

  Raises:
    ValueError: ``runs`` or ``warmup`` is negative, or ``runs`` asks to run on a target
      without devices here.
    TargetUnavailableError: the target's compiler is not installed.

  Example:
    >>> import jax.numpy as jnp, jaxremat
    >>> m = jaxremat.measure(lambda x: jnp.sin(x) @ x, jnp.ones((64, 64)), runs=3)
    >>> m.peak_bytes == m.argument_bytes + m.output_bytes + m.temp_bytes - m.alias_bytes
    True
  """
  if runs < 0 or warmup < 0:
    raise ValueError(f"runs={runs!r} and warmup={warmup!r} must be non-negative call counts.")
  target = get_target(target)
  if runs and not target.local:
    raise ValueError(
      f"runs={runs!r}, but target {target.name!r} has no devices on this machine: pass "
      "runs=0 to compile and analyse only."
    )
  compiled, measured = compile_and_measure(
    fn, *args, donate_argnums=donate_argnums, target=target, **kwargs
  )
  if not runs:
    return measured
  times = []
  for k in range(warmup + runs):
    call_args = fresh_donated(args, donate_argnums)
    jax.block_until_ready(call_args)
    start = time.perf_counter()
    jax.block_until_ready(compiled(*call_args, **kwargs))
    if k >= warmup:
      times.append(time.perf_counter() - start)
  stats = jax.devices()[0].memory_stats()
  device_peak = stats.get("peak_bytes_in_use") if stats else None
  return dataclasses.replace(
    measured,
    wall_time_s=statistics.median(times),
    wall_times_s=tuple(times),
    device_peak_bytes=None if device_peak is None else int(device_peak),
  )


def compile_and_measure(
  fn: Callable[..., Any],
  *args: Any,
  donate_argnums: int | Sequence[int] = (),
  target: str | Target | None = None,
  **kwargs: Any,
) -> tuple[Any, Measurement]:
  """`measure` with ``runs=0``, and the executable it compiled besides (``jax.jit``'s
  ``Compiled``, runnable where the target has devices here): a caller that runs the step
  later runs it without compiling it again."""
  target = get_target(target)
  target.devices()  # describe a deviceless target's devices outside the compile time
  start = time.perf_counter()
  if target == get_target():
    compiled = compile_fn(fn, *args, donate_argnums=donate_argnums, **kwargs)
  else:
    compiled = compile_for(target, fn, *args, donate_argnums=donate_argnums, **kwargs)
  compile_time_s = time.perf_counter() - start
  memory = compiled.memory_analysis()
  costs = compat.hlo_cost_analysis(compiled)

  def cost(key: str) -> float | None:
    return float(costs[key]) if key in costs else None

  hlo_text = compiled.as_text()
  flops = cost("flops")
  library_flops = library_convolution_flops(hlo_text)
  if flops is not None and library_flops and not target.counts_library_convolutions():
    flops += library_flops

  return compiled, Measurement(
    backend=target.platform,
    target=target.name,
    device_kind=target.device_kind,
    argument_bytes=int(memory.argument_size_in_bytes),
    output_bytes=int(memory.output_size_in_bytes),
    temp_bytes=int(memory.temp_size_in_bytes),
    alias_bytes=int(memory.alias_size_in_bytes),
    generated_code_bytes=int(memory.generated_code_size_in_bytes),
    peak_bytes=compat.memory_peak_bytes(compiled, target.platform),
    flops=flops,
    transcendentals=cost("transcendentals"),
    bytes_accessed=cost("bytes accessed"),
    compile_time_s=compile_time_s,
    wall_time_s=None,
    wall_times_s=(),
    device_peak_bytes=None,
    hlo_text=hlo_text,
  )


def fresh_donated(args: Sequence[Any], donate_argnums: int | Sequence[int]) -> list[Any]:
  """``args`` with a copy of each donated one: a call that donates them leaves the
  caller's arrays alive."""
  donated = {donate_argnums} if isinstance(donate_argnums, int) else set(donate_argnums)
  return [jax.tree.map(lambda a: a.copy(), a) if i in donated else a for i, a in enumerate(args)]


# The share of the GPU that the process running a step alone preallocates: 12 GiB of an
# H100, beside the 75% that the measuring process may hold.
ISOLATED_POOL_FRACTION = 0.15


def isolated_device_peak(compiled: Any, *args: Any) -> dict[str, Any]:
  """Runs ``compiled`` once on ``args``, alone in a fresh process; the device's figures.

  ``memory_stats()["peak_bytes_in_use"]`` is a process's high-water mark and cannot be
  reset, and compiling for a GPU allocates autotuning buffers larger than a small step
  (on an H200, 160 to 194 MiB peaks after compiling steps of 14 to 74 MiB, before any
  ran). So the executable is serialized and run by a process that only loads it: there
  the device holds the arguments, copied through the host, and what the step allocates.
  On an H100 that peak is the compiler's `memory_analysis` figure to within 2 KiB.

  Returns:
    ``device_kind``, ``bytes_in_use_before_run`` (the arguments) and
    ``device_peak_bytes``; the figures are None where the device reports no
    ``memory_stats`` (CPU).
  """
  leaves = jax.device_get(jax.tree.leaves(args))
  with tempfile.TemporaryDirectory() as tmp:
    path = pathlib.Path(tmp, "step.pickle")
    path.write_bytes(pickle.dumps((serialize(compiled), leaves)))
    command = [sys.executable, "-m", "jaxremat._src.measure", str(path)]
    # One preallocated pool, as JAX gives a GPU by default: the allocator carves each
    # buffer out of it and counts the bytes asked for. A pool grown on demand
    # (PREALLOCATE=false) adds regions of doubling size, and a buffer that fills most of
    # a region is counted as the whole region (an H100: 84.5 MiB for a GPT step the
    # compiler puts at 73.9, and at 73.9 with the pool). The pool is small because this
    # process may hold most of the device already (JAX preallocates 75% of a GPU).
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="true")
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(ISOLATED_POOL_FRACTION)
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
  if done.returncode:
    raise RuntimeError(f"Running the step alone failed: {done.stderr.strip()[-2000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def _run_saved(path: str) -> dict[str, Any]:
  """The other side of `isolated_device_peak`: load, run once, read the device's figures."""
  (executable, in_tree, out_tree), leaves = pickle.loads(pathlib.Path(path).read_bytes())
  device = jax.devices()[0]
  args, kwargs = jax.tree.unflatten(in_tree, jax.device_put(leaves, device))
  step = deserialize_and_load(executable, in_tree, out_tree)
  before = device.memory_stats() or {}
  jax.block_until_ready(step(*args, **kwargs))
  after = device.memory_stats() or {}
  return {
    "device_kind": device.device_kind,
    "bytes_in_use_before_run": before.get("bytes_in_use"),
    "device_peak_bytes": after.get("peak_bytes_in_use"),
  }


if __name__ == "__main__":
  print(json.dumps(_run_saved(sys.argv[1])))
