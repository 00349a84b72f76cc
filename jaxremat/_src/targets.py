"""`targets`: compile and measure a function for a TPU or GPU this machine does not have.

XLA decides device memory at compile time on TPU and GPU, so a compiled program's
``memory_analysis()`` is the figure a plan must meet there. libtpu and the CUDA PJRT plugin
compile for a described device without the hardware (``../shared/design/TARGETS.md``), so a
CPU-only machine can plan and verify for a TPU v5e or an H100:

- `get_target` names the device (``"cpu"``, ``"tpu-v5e"``, ``"h100"``, ...);
- `compile_for` lowers and compiles a function for it, deviceless where needed;
- `jaxremat.measure(fn, *args, runs=0, target=...)` reads XLA's figures of the result.

The plugins are optional extras: ``pip install -e ".[tpu-aot]"`` (libtpu) and
``pip install -e ".[gpu-aot]"`` (the CUDA PJRT plugin, without the CUDA libraries). This
module imports without them; asking for a target that needs one raises
`TargetUnavailableError` naming the extra.

Example:
  >>> target = get_target()  # this machine's default backend
  >>> target.local, target.platform == jax.default_backend()
  (True, True)
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import importlib.metadata
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, Final

import jax
import jax.numpy as jnp
import numpy as np

from jaxremat._src import compat
from jaxremat._src.backends import BackendFacts, backend_facts
from jaxremat._src.errors import TargetUnavailableError
from jaxremat._src.hlo_text import computations, count_hlo_ops, library_convolution_flops
from jaxremat._src.signature import FlatStep, mesh_sharding, step_signature

PLATFORMS: Final = ("cpu", "tpu", "gpu")
TPU_AOT_EXTRA: Final = "tpu-aot"
GPU_AOT_EXTRA: Final = "gpu-aot"

MSG_MISSING_PACKAGE: Final = (
  "target {name!r} compiles for {platform} devices through {package}, which is not installed "
  'in this environment ({python}). Install it with `pip install -e ".[{extra}]"` (or '
  '`pip install "jaxremat[{extra}]"`), which takes the release that matches the installed '
  "jax {jax_version}."
)
MSG_CUDA_PLUGIN_UNREGISTERED: Final = (
  "target {name!r} needs the CUDA PJRT plugin, which is installed but did not register: JAX "
  "started before jaxremat could prepare it, and the plugin's CUDA version check failed on "
  "this machine (no CUDA libraries). Set JAX_PLATFORMS=cpu (or "
  "JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1) in the environment before JAX starts, e.g. in the "
  "test session's configuration or the shell that runs Python."
)


# ---------------------------------------------------------------------------- devices
# TPU topologies must be divisible by libtpu's default host bounds (2x2x1): "v5e:1x1" is
# refused, "v5e:2x2" and "v4:2x2x1" work (TARGETS.md). One device of them is compiled for.
_TPU_TOPOLOGIES: Final = {
  "tpu-v5e": ("v5e:2x2", "TPU v5 lite"),
  "tpu-v4": ("v4:2x2x1", "TPU v4"),
  "tpu-v6e": ("v6e:2x2", "TPU v6 lite"),
}

# GpuTargetConfigProto texts (xla/stream_executor/device_description.proto): the device
# facts XLA:GPU reads when it compiles without a GPU, from NVIDIA's published figures for
# each part (SMs, clocks, memory size and bandwidth, L2, shared memory per SM, compute
# capability). Only fields jaxlib 0.10.2 parses (TARGETS.md). The H100's figures give the
# peaks TARGETS.md measured (tests/test_targets.py).
H100_SXM_TARGET_CONFIG: Final = """\
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84942979072
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {
    major: 9
  }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
}
platform_name: "CUDA"
dnn_version_info {
  major: 9
  minor: 1
}
device_description_str: "NVIDIA H100 80GB HBM3"
"""

A100_SXM_80_TARGET_CONFIG: Final = """\
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 167936
  threads_per_core_limit: 2048
  core_count: 108
  fpus_per_core: 64
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 2039040000000
  l2_cache_size: 41943040
  clock_rate_ghz: 1.41
  device_memory_size: 85100068864
  shared_memory_per_block_optin: 166912
  cuda_compute_capability {
    major: 8
  }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
}
platform_name: "CUDA"
dnn_version_info {
  major: 8
  minor: 9
}
device_description_str: "NVIDIA A100-SXM4-80GB"
"""

# Published peak rates per device kind, (flop/s, byte/s of device memory), for the roofline
# that turns a deviceless target's cost analysis into seconds. The flop rate is the
# matrix unit's at the precision XLA uses for float32 dots by default: bfloat16 passes on
# TPU (jax_default_matmul_precision), TF32 tensor cores on NVIDIA GPUs (dense). Sources:
# Google Cloud TPU system architecture pages (v4, v5e, v5p, v6e); NVIDIA H100 and A100
# datasheets (SXM parts).
PEAK_RATES: Final = {
  "TPU v4": (275e12, 1200e9),
  "TPU v5 lite": (197e12, 819e9),
  "TPU v5": (459e12, 2765e9),
  "TPU v6 lite": (918e12, 1640e9),
  "NVIDIA H100 80GB HBM3": (494.7e12, 3352e9),
  "NVIDIA A100-SXM4-80GB": (156e12, 2039e9),
}
# Published chip-to-chip bandwidth per device, bytes/s each chip sends (ICI on TPU,
# NVLink on NVIDIA GPUs), for the collectives of a partitioned step. Same sources.
INTERCONNECT_RATES: Final = {
  "TPU v4": 2400e9 / 8,
  "TPU v5 lite": 1600e9 / 8,
  "TPU v5": 4800e9 / 8,
  "TPU v6 lite": 3584e9 / 8,
  "NVIDIA H100 80GB HBM3": 900e9,
  "NVIDIA A100-SXM4-80GB": 600e9,
}
_GPU_CONFIG_FIELD = re.compile(r"^\s*(\w+):\s*([0-9.eE+-]+)\s*$", re.MULTILINE)

_GPU_CONFIGS: Final = {
  "h100": (H100_SXM_TARGET_CONFIG, "NVIDIA H100 80GB HBM3"),
  "a100": (A100_SXM_80_TARGET_CONFIG, "NVIDIA A100-SXM4-80GB"),
}
# The CUDA plugin describes one GPU at a time.
_GPU_TOPOLOGY: Final = "1x1x1"
# The CUDA plugin's modules (their distributions are named with dashes).
_CUDA_PLUGINS: Final = ("jax_cuda12_plugin", "jax_cuda13_plugin")


@dataclasses.dataclass(frozen=True)
class Target:
  """A device XLA compiles for, here or (deviceless) elsewhere.

  Build one with `get_target`; a user topology is ``get_target("tpu:v5p:2x2x1")`` or a
  ``Target(name, "gpu", target_config=TEXT)`` with a ``GpuTargetConfigProto`` text.

  Attributes:
    name: ``"cpu"``, ``"tpu-v5e"``, ``"tpu-v4"``, ``"tpu-v6e"``, ``"h100"``, ``"a100"``, or
      a user topology's name.
    platform: ``"cpu"``, ``"tpu"`` or ``"gpu"``.
    device_kind: what ``device.device_kind`` reads on it, e.g. ``"TPU v5 lite"``.
    topology: the TPU topology (``"v5e:2x2"``) or the GPU one (``"1x1x1"``); empty for CPU.
    target_config: a GPU's ``GpuTargetConfigProto`` in text format; empty elsewhere.
  """

  name: str
  platform: str
  device_kind: str = ""
  topology: str = ""
  target_config: str = dataclasses.field(default="", repr=False)

  @property
  def lowering_platform(self) -> str:
    """The platform name `jax.jit` lowers for (``"cuda"`` for a GPU)."""
    return "cuda" if self.platform == "gpu" else self.platform

  @property
  def facts(self) -> BackendFacts:
    """What jaxremat expects of XLA on this target (`jaxremat._src.backends`)."""
    return backend_facts(self.platform)

  @property
  def local(self) -> bool:
    """Whether this machine has devices of this kind (then nothing is compiled deviceless)."""
    return bool(_local_devices(self))

  def on_chip_bytes(self) -> int:
    """Bytes of temporaries the compiler's peak leaves out when more are live: on TPU,
    memory-space assignment keeps up to that many in on-chip VMEM, and
    ``peak_memory_in_bytes`` charges device memory only with the rest (`device_peak_bytes`
    says how). 0 off TPU. Measured once per target (`_on_chip_bytes`)."""
    return _on_chip_bytes(self) if self.platform == "tpu" else 0

  def counts_library_convolutions(self) -> bool:
    """Whether the compiler's cost analysis counts the FLOPs of convolutions that it runs
    as library calls (cuDNN). Measured once per target (`_counts_library_convolutions`)."""
    return _counts_library_convolutions(self)

  def peak_rates(self) -> tuple[float, float]:
    """(flop/s, byte/s): the device's published peak rates (`PEAK_RATES`).

    A GPU of another kind gets them from its ``target_config``: CUDA cores x 2 flops x
    clock (its float32 rate without tensor cores, a lower bound) and its memory bandwidth.

    Raises:
      ValueError: a device kind without published rates here and no target config.
    """
    if self.device_kind in PEAK_RATES:
      return PEAK_RATES[self.device_kind]
    fields = {k: float(v) for k, v in _GPU_CONFIG_FIELD.findall(self.target_config)}
    if {"core_count", "fpus_per_core", "clock_rate_ghz", "memory_bandwidth"} <= set(fields):
      flops_per_s = 2 * fields["core_count"] * fields["fpus_per_core"] * fields["clock_rate_ghz"]
      return flops_per_s * 1e9, fields["memory_bandwidth"]
    raise ValueError(
      f"target {self.name!r} ({self.device_kind!r}) has no published peak rates in "
      f"jaxremat (known: {sorted(PEAK_RATES)}), so its equations cannot be costed in "
      "seconds without the device: trace it with costs='shape', or add its (flop/s, "
      "byte/s) to jaxremat._src.targets.PEAK_RATES."
    )

  def interconnect_rate(self) -> float | None:
    """Bytes/s the device sends to another over its chip-to-chip links
    (`INTERCONNECT_RATES`); None where none is published (host CPU devices)."""
    return INTERCONNECT_RATES.get(self.device_kind)

  def devices(self) -> tuple[Any, ...]:
    """The devices compiled for: this machine's own, else the topology's compile-only ones.

    Cached per target: libtpu and the CUDA plugin build a topology once per process.

    Raises:
      TargetUnavailableError: the package that describes the devices is absent, or the
        CUDA plugin did not register.
      ValueError: the plugin refuses the topology or the target config.
    """
    return _devices(self)


# ---------------------------------------------------------------------------- naming


def available_targets() -> tuple[str, ...]:
  """The names `get_target` knows (user TPU topologies are ``"tpu:<topology>"``)."""
  return ("cpu", *_TPU_TOPOLOGIES, *_GPU_CONFIGS)


def get_target(name_or_target: str | Target | None = None) -> Target:
  """The `Target` of that name; None is this machine's default backend.

  Getting a TPU or GPU target checks that its compiler is installed; the devices are
  described on first use (`Target.devices`). On a machine without an NVIDIA driver this
  also sets ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` if JAX has not started yet and
  ``JAX_PLATFORMS`` is unset, so that the CUDA plugin registers for deviceless compiles
  instead of failing its CUDA version check (TARGETS.md).

  Args:
    name_or_target: ``"cpu"``, ``"tpu-v5e"``, ``"tpu-v4"``, ``"tpu-v6e"``, ``"h100"``,
      ``"a100"``, ``"tpu:<topology>"`` (e.g. ``"tpu:v5p:2x2x1"``), a `Target`, or None.

  Returns:
    The target, with its ``device_kind`` filled in.

  Raises:
    TargetUnavailableError: its package is not installed (the message names the extra).
    ValueError: an unknown name or platform.

  Example:
    >>> get_target("cpu").platform
    'cpu'
  """
  _prepare_cuda_plugin()
  if name_or_target is None:
    return _default_target()
  if isinstance(name_or_target, Target):
    target = name_or_target
    if target.platform not in PLATFORMS:
      raise ValueError(
        f"Target {target.name!r} has platform={target.platform!r}; use one of {PLATFORMS}."
      )
    if target.platform == "gpu" and not target.target_config and not target.local:
      raise ValueError(
        f"Target {target.name!r} is a GPU this machine lacks and has no target_config: pass "
        "a GpuTargetConfigProto text (OpenXLA's xla/backends/gpu/target_config/specs/)."
      )
    _require_compiler(target)
    if not target.device_kind:
      target = dataclasses.replace(target, device_kind=target.devices()[0].device_kind)
    return target
  name = str(name_or_target)
  if name == "cpu":
    return Target("cpu", "cpu", device_kind="cpu")
  if name in _TPU_TOPOLOGIES:
    topology, kind = _TPU_TOPOLOGIES[name]
    return _require_compiler(Target(name, "tpu", device_kind=kind, topology=topology))
  if name in _GPU_CONFIGS:
    config, kind = _GPU_CONFIGS[name]
    target = Target(name, "gpu", kind, _GPU_TOPOLOGY, config)
    return _require_compiler(target)
  if name.startswith("tpu:") and len(name) > 4:
    target = _require_compiler(Target(name, "tpu", topology=name[4:]))
    return dataclasses.replace(target, device_kind=target.devices()[0].device_kind)
  raise ValueError(
    f"get_target({name!r}): unknown target. Use one of {available_targets()}, "
    "'tpu:<topology>' (e.g. 'tpu:v5p:2x2x1'), a Target, or None for this machine's backend."
  )


def _default_target() -> Target:
  return _target_of_device(jax.devices()[0])


def _target_of_device(device: Any) -> Target:
  """The named target whose devices ``device`` is like, else one named after its kind."""
  platform = backend_facts(device.platform).platform
  for name in available_targets():
    if name != "cpu" and _registry_platform_kind(name) == (platform, device.device_kind):
      return get_target(name)
  if platform == "cpu":
    return Target("cpu", "cpu", device_kind="cpu")
  return Target(f"{platform}:{device.device_kind}", platform, device_kind=device.device_kind)


def _registry_platform_kind(name: str) -> tuple[str, str]:
  if name in _TPU_TOPOLOGIES:
    return "tpu", _TPU_TOPOLOGIES[name][1]
  return "gpu", _GPU_CONFIGS[name][1]


def _cuda_plugin_installed() -> bool:
  return any(importlib.util.find_spec(module) is not None for module in _CUDA_PLUGINS)


def _jax_platforms() -> str:
  return os.environ.get("JAX_PLATFORMS", "") or (jax.config.jax_platforms or "")


def _prepare_cuda_plugin() -> None:
  """Lets the CUDA plugin register on a machine without CUDA, before JAX starts.

  The plugin checks the CUDA libraries' versions when JAX imports it, unless
  ``JAX_PLATFORMS`` leaves CUDA out; without the libraries the check fails and the plugin
  never registers ("topology not implemented for cuda"). Skipping the check changes
  nothing else: with no NVIDIA driver JAX's CUDA client fails and JAX falls back to CPU.
  """
  if compat.plugins_discovered() or _jax_platforms() or os.path.exists("/proc/driver/nvidia"):
    return
  if _cuda_plugin_installed():
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def _share_tpu_library() -> None:
  """Lets several processes compile for TPU at once on a machine without TPU chips.

  libtpu takes /tmp/libtpu_lockfile for the chips when it starts and refuses a second
  process ("Internal error when accessing libtpu multi-process lockfile"); a deviceless
  compile uses no chip, so sharing is safe where there is none (TPU VMs show them as
  /dev/accel* or /dev/vfio/<n>).
  """
  if not glob.glob("/dev/accel*") and not glob.glob("/dev/vfio/[0-9]*"):
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def _require_compiler(target: Target) -> Target:
  """``target``, if this process can compile for it; else a TargetUnavailableError."""
  if target.platform == "tpu" and compat.tpu_library_path() is None and not target.local:
    package, extra = "libtpu", TPU_AOT_EXTRA
  elif target.platform == "gpu" and not _cuda_plugin_installed() and not target.local:
    package, extra = "the CUDA PJRT plugin (jax-cuda12-plugin)", GPU_AOT_EXTRA
  else:
    return target
  raise TargetUnavailableError(
    MSG_MISSING_PACKAGE.format(
      name=target.name,
      platform=target.platform.upper(),
      package=package,
      python=sys.prefix,
      extra=extra,
      jax_version=jax.__version__,
    )
  )


@functools.cache
def _local_devices(target: Target) -> tuple[Any, ...]:
  try:
    devices = jax.local_devices(backend=target.platform)
  except RuntimeError:  # no such backend here ("Unknown backend", "failed to initialize")
    return ()
  if target.platform == "cpu":
    return tuple(devices)
  return tuple(d for d in devices if not target.device_kind or d.device_kind == target.device_kind)


@functools.cache
def _devices(target: Target) -> tuple[Any, ...]:
  local = _local_devices(target)
  if local:
    return local
  _require_compiler(target)
  try:
    if target.platform == "tpu":
      _share_tpu_library()
      devices = compat.topology_devices("tpu", target.topology)
    elif target.platform == "gpu":
      devices = compat.topology_devices(
        "cuda", topology=target.topology or _GPU_TOPOLOGY, target_config=target.target_config
      )
    else:
      raise TargetUnavailableError(f"target {target.name!r}: this machine has no CPU backend.")
  except NotImplementedError as e:  # the CUDA plugin is installed but did not register
    raise TargetUnavailableError(MSG_CUDA_PLUGIN_UNREGISTERED.format(name=target.name)) from e
  except jax.errors.JaxRuntimeError as e:
    raise ValueError(
      f"target {target.name!r}: the {target.platform.upper()} compiler refused topology="
      f"{target.topology!r}{' and its target_config' if target.target_config else ''}: {e}"
    ) from e
  return tuple(devices)


# ---------------------------------------------------------------------------- compiling


# The probe of `_on_chip_bytes`: this many buffers of this many bytes, all live at once,
# past any TPU's on-chip memory (v5e's VMEM is 128 MiB).
_PROBE_BUFFERS: Final = 128
_PROBE_BUFFER_BYTES: Final = 4 * 2**20


@functools.cache
def _on_chip_bytes(target: Target) -> int:
  """What the compiler's peak leaves out of a program that holds `_PROBE_BUFFERS` buffers
  at once, past on-chip memory: the bytes its memory-space assignment keeps on chip.

  Measured 2026-11-25 (jax 0.10.2, libtpu 0.0.42.1): TPU v5e 108 MiB, v6e 92 MiB, v4 60
  MiB. Buffers of other sizes pack differently (v5e: 112 MiB of 8 or 16 MiB buffers, 96
  MiB of 32 MiB ones); the GPT example's step at batch 64 held 112 MiB in VMEM at its peak.
  """
  rows = _PROBE_BUFFER_BYTES // (4 * 1024)

  def probe(x: Any) -> Any:
    held = jax.lax.optimization_barrier([x + (i + 1) for i in range(_PROBE_BUFFERS)])
    return sum(jnp.sum(y) for y in held)

  compiled = compile_for(target, probe, jax.ShapeDtypeStruct((rows, 1024), jnp.float32))
  memory = compiled.memory_analysis()
  held_bytes = memory.argument_size_in_bytes + _PROBE_BUFFERS * _PROBE_BUFFER_BYTES
  return max(0, held_bytes - memory.peak_memory_in_bytes)


@functools.cache
def _counts_library_convolutions(target: Target) -> bool:
  """Whether one convolution's FLOPs appear in its compile's cost analysis, where the
  compiler runs it as a library call. Measured 2026-11-26 (jax 0.10.2): XLA:GPU's count
  for H100 leaves cuDNN convolutions out; CPU and TPU compile them as HLO and count them.
  """
  shape = jax.ShapeDtypeStruct((8, 16, 16, 32), jnp.float32)
  kernel = jax.ShapeDtypeStruct((3, 3, 32, 32), jnp.float32)

  def conv(x, w):
    numbers = ("NHWC", "HWIO", "NHWC")
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=numbers)

  compiled = compile_for(target, conv, shape, kernel)
  library = library_convolution_flops(compiled.as_text())
  return not library or compat.hlo_cost_analysis(compiled).get("flops", 0.0) >= library / 2


def compile_for(
  target: str | Target | None,
  fn: Callable[..., Any],
  *args: Any,
  donate_argnums: int | Sequence[int] = (),
  **kwargs: Any,
) -> Any:
  """Compiles ``fn`` on ``args`` for ``target``, without its hardware where needed.

  Array arguments (and `jax.ShapeDtypeStruct`) become ``ShapeDtypeStruct`` placed on the
  target's first device; a struct whose sharding already lies on the target's devices
  (e.g. a ``NamedSharding`` on a mesh of them, for SPMD) keeps it. A step laid out on a
  mesh of this machine's devices is laid over as many of the target's (`_on_devices`),
  its other arguments replicated there. Static arguments of a jitted ``fn`` are left
  alone.

  Args:
    target: a `get_target` name, a `Target`, or None (this machine's backend).
    fn: the function (jitted or not).
    *args: its positional arguments: arrays, ``ShapeDtypeStruct``s, pytrees of them.
    donate_argnums: as for `jax.jit`.
    **kwargs: its keyword arguments.

  Returns:
    The ``jax.stages.Compiled`` executable; it can run only where ``target.local``.

  Raises:
    TargetUnavailableError: the target's compiler is not installed.

  Example:
    >>> import jax.numpy as jnp
    >>> compiled = compile_for("cpu", jnp.tanh, jnp.ones((8, 128)))
    >>> " tanh(" in compiled.as_text()
    True
  """
  target = get_target(target)
  devices = target.devices()
  sharding = jax.sharding.SingleDeviceSharding(devices[0])
  if not target.local and _meshes_elsewhere((args, kwargs), devices):
    fn, args, kwargs, donate_argnums = _on_devices(fn, args, kwargs, donate_argnums, devices)
  mesh = next(
    (
      s.mesh
      for x in jax.tree.leaves((args, kwargs))
      if isinstance(s := mesh_sharding(x), jax.sharding.NamedSharding)
    ),
    None,
  )
  if mesh is not None:  # the other leaves of a partitioned step: replicated over its mesh
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  info = compat.jit_info(fn)
  jitted = (
    fn if info is not None and not donate_argnums else jax.jit(fn, donate_argnums=donate_argnums)
  )
  static_nums = set(info["static_argnums"]) if info else set()
  static_names = set(info["static_argnames"]) if info else set()

  def place(x: Any) -> Any:
    return jax.tree.map(lambda leaf: _placed(leaf, sharding, devices), x)

  args = tuple(a if i in static_nums else place(a) for i, a in enumerate(args))
  kwargs = {k: v if k in static_names else place(v) for k, v in kwargs.items()}
  return compat.lower_for_platform(jitted, target.lowering_platform, *args, **kwargs).compile()


def _meshes_elsewhere(tree: Any, devices: tuple[Any, ...]) -> bool:
  """Whether a leaf of ``tree`` is sharded over several devices that are not ``devices``
  (a step laid out on this machine's mesh, compiled for a topology of as many chips)."""
  return any(
    (s := mesh_sharding(leaf)) is not None and not set(s.device_set) <= set(devices)
    for leaf in jax.tree.leaves(tree)
  )


def _on_devices(
  fn: Callable[..., Any],
  args: tuple[Any, ...],
  kwargs: dict[str, Any],
  donate_argnums: int | Sequence[int],
  devices: tuple[Any, ...],
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], tuple[int, ...]]:
  """``fn`` and its arguments moved onto the target's ``devices``: each mesh of as many
  devices (in the arguments' shardings, the jit's ``in_shardings``/``out_shardings`` and
  the sharding constraints inside) becomes a mesh of the same shape and axis names over
  them, so that the partitioner splits the step as it would on this machine's mesh.
  Returns the flat step (traced leaves in, array leaves out), its leaves and donation.

  Raises:
    ValueError: a mesh has another number of devices than the target's topology.
  """
  signature = step_signature(fn, args, kwargs, donate_argnums=donate_argnums)
  meshes: dict[Any, Any] = {}

  def moved(x: Any) -> Any:
    if (
      isinstance(x, jax.sharding.Mesh)
      and x.devices.size > 1
      and not set(x.devices.flat) <= set(devices)
    ):
      if x.devices.size != len(devices):
        raise ValueError(
          f"The step is laid out on a mesh of {x.devices.size} devices {dict(x.shape)}, but "
          f"the target has {len(devices)}; name a topology of {x.devices.size} chips (e.g. "
          "'tpu:v5e:4x4' for 16) or lay the step out on as many devices as the target has."
        )
      if x not in meshes:
        meshes[x] = jax.sharding.Mesh(
          np.asarray(devices).reshape(x.devices.shape), x.axis_names, axis_types=x.axis_types
        )
      return meshes[x]
    if isinstance(x, jax.sharding.NamedSharding) and moved(x.mesh) is not x.mesh:
      return jax.sharding.NamedSharding(moved(x.mesh), x.spec, memory_kind=x.memory_kind)
    return x

  closed = compat.map_params(jax.make_jaxpr(FlatStep(fn, signature))(*signature.specs), moved)
  specs = tuple(
    jax.ShapeDtypeStruct(s.shape, s.dtype, weak_type=s.weak_type, sharding=moved(s.sharding))
    for s in signature.specs
  )
  return (
    jax.jit(functools.partial(compat.eval_closed_jaxpr, closed)),
    specs,
    {},
    signature.donated_leaves,
  )


def _placed(leaf: Any, sharding: Any, devices: tuple[Any, ...]) -> Any:
  """``leaf`` as a ShapeDtypeStruct on the target (non-array leaves as they are)."""
  if isinstance(leaf, jax.ShapeDtypeStruct):
    own = leaf.sharding
    if own is not None and set(own.device_set) <= set(devices):
      return leaf
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding, weak_type=leaf.weak_type)
  if isinstance(leaf, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)):
    aval = compat.abstract_value(leaf)
    return jax.ShapeDtypeStruct(
      aval.shape, aval.dtype, sharding=sharding, weak_type=getattr(aval, "weak_type", False)
    )
  return leaf


# ---------------------------------------------------------------------------- facts


def measure_facts(target: str | Target | None = None) -> dict[str, bool]:
  """What ``target``'s compiler does, measured on two small programs' optimized HLO.

  - ``barrier_holds``: a product computed twice, the second time from operands behind
    ``lax.optimization_barrier``, is still computed twice (not merged by CSE).
  - ``reductions_duplicate_producers``: a product read by a column sum and by another
    fusion is computed inside the sum's fusion too, not read from memory.
  - ``pool_gradient_buffers_at_start``: a max pool's gradient takes argmax iotas of its
    own (each the whole of a fused computation, so made with no operands at the start),
    not computed inside the pool's fusion.

  `BackendFacts` states what jaxremat expects of each platform; the tests and
  ``jaxremat targets`` compare the two.

  Example:
    >>> facts = measure_facts("cpu")
    >>> facts["reductions_duplicate_producers"], facts["pool_gradient_buffers_at_start"]
    (False, True)
  """
  target = get_target(target)
  x = jax.ShapeDtypeStruct((256, 64), np.float32)

  def recomputed(x):
    product = x @ x.T  # two readers: materialized, not fused into either
    first = jnp.sum(jnp.tanh(product)) + jnp.sum(jnp.cos(product))
    _, again = jax.lax.optimization_barrier((first, x))
    return first + jnp.sum(jnp.sin(again @ again.T))

  def shared(x, y):
    return jnp.sum(x * y, axis=0), x * y - 2.0

  def pooled(images):
    window = (1, 2, 2, 1)  # TPU pools only over major dimensions
    pooled = jax.lax.reduce_window(images, -jnp.inf, jax.lax.max, window, window, "VALID")
    return jnp.sum(pooled * pooled)

  barrier_hlo = compile_for(target, recomputed, x).as_text()
  shared_hlo = compile_for(target, shared, x, x).as_text()
  images = jax.ShapeDtypeStruct((2, 32, 32, 8), np.float32)
  pool_hlo = compile_for(target, jax.grad(pooled), images).as_text()
  products = count_hlo_ops(barrier_hlo)
  reducing = [
    {i.opcode for i in c.instructions}
    for c in computations(shared_hlo).values()
    if any(i.opcode == "reduce" for i in c.instructions)
  ]
  return {
    "barrier_holds": products.get("dot", 0) + products.get("convolution", 0) == 2,
    "reductions_duplicate_producers": any("multiply" in ops for ops in reducing),
    "pool_gradient_buffers_at_start": any(
      {i.opcode for i in c.instructions} == {"iota"} for c in computations(pool_hlo).values()
    ),
  }


def facts_report(names: Sequence[str] | None = None) -> tuple[str, bool]:
  """A table of each target: where it compiles, and its facts expected against measured.

  Args:
    names: the targets (default: `available_targets`).

  Returns:
    The table, and whether every measured fact is what `BackendFacts` expects. A target
    whose compiler is not installed is listed with the extra it needs.
  """
  cuda = [m.replace("_", "-") for m in _CUDA_PLUGINS if importlib.util.find_spec(m)]
  versions = ", ".join(
    f"{package} {installed_version(package)}"
    for package in ("jax", "libtpu", *(cuda or ["jax-cuda12-plugin"]))
  )
  lines = [
    f"jaxremat targets ({versions})",
    f"{'target':9} {'device':24} {'compiles':11} {'fence':8} {'barrier holds':22} "
    f"{'reductions duplicate producers':32} {'pool gradient buffers at start':32} "
    f"{'on chip':8} {'conv FLOPs counted':19} peak flop/s, byte/s",
  ]
  all_match = True
  for name in names or available_targets():
    try:
      target = get_target(name)
      target.devices()
    except TargetUnavailableError:
      extra = TPU_AOT_EXTRA if name.startswith("tpu") else GPU_AOT_EXTRA
      lines.append(f'{name:9} its compiler is not installed here: pip install -e ".[{extra}]"')
      continue
    measured = measure_facts(target)
    cells = []
    for fact, value in measured.items():
      expected = getattr(target.facts, fact)
      all_match &= value == expected
      mark = "" if value == expected else "  MISMATCH"
      cells.append(f"{_yes(expected)} (measured {_yes(value)}){mark}")
    rates = (
      "measured here (roofline)" if target.local else "{:.3g}, {:.3g}".format(*target.peak_rates())
    )
    lines.append(
      f"{name:9} {target.device_kind[:24]:24} {'here' if target.local else 'deviceless':11} "
      f"{target.facts.fence:8} {cells[0]:22} {cells[1]:32} {cells[2]:32} "
      f"{f'{target.on_chip_bytes() / 2**20:.0f} MiB':8} "
      f"{_yes(target.counts_library_convolutions()):19} {rates}"
    )
  return "\n".join(lines), all_match


def _yes(value: bool) -> str:
  return "yes" if value else "no"


def installed_version(package: str) -> str:
  """``package``'s installed version, or "not installed" (e.g. a source checkout on the path)."""
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return "not installed"
