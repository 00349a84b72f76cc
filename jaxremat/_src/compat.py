"""Every private or moving JAX import, in one place (ARCHITECTURE.md fact 5).

jaxremat supports jax 0.10.x (this machine) and 0.11.x (GPU machines). Code elsewhere
imports JAX internals only through this module, so a JAX upgrade touches one file.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from typing import Any

import jax
import numpy as np

try:  # jax >= 0.6
  from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal, Var
except ImportError:  # pragma: no cover - older jax
  from jax.core import ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal, Var  # type: ignore

from jax._src import dtypes as _dtypes
from jax._src import source_info_util as _source_info_util
from jax._src.core import ShapedArray as _ShapedArray
from jax._src.core import Tracer

try:  # a value's type names its sharding over a mesh with explicit axes (jax >= 0.6)
  from jax._src.core import ShardingTypeError
except ImportError:  # pragma: no cover - older JAX has no such types

  class ShardingTypeError(Exception):
    pass


__all__ = [
  "ClosedJaxpr",
  "DropVar",
  "Jaxpr",
  "JaxprEqn",
  "Literal",
  "Tracer",
  "Var",
  "abstract_value",
  "aval_bytes",
  "cost_analysis_dict",
  "current_name_stack",
  "eqn_source",
  "inner_jaxprs",
  "is_extended_dtype",
  "jit_info",
  "name_stack_str",
  "open_jaxpr",
  "user_context",
]

# The call-like primitives the tracer inlines: their body runs exactly once, in place.
# `pjit` was renamed `jit` in jax 0.7; `checkpoint` is `remat2` in 0.10.
CHECKPOINT_PRIMITIVES = frozenset({"remat2", "checkpoint", "remat"})
INLINE_PRIMITIVES = CHECKPOINT_PRIMITIVES | frozenset(
  {
    "jit",
    "pjit",
    "closed_call",
    "core_call",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
  }
)
BODY_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
# Elementwise primitives newer JAX versions emit where older ones emitted several:
# jax 0.11 writes tanh's derivative `1 - y^2` as one `one_minus_square`.
NEW_ELEMENTWISE_PRIMITIVES = frozenset({"one_minus_square"})
# XLA:CPU up to jaxlib 0.10 expands `optimization_barrier` before CSE and merges the
# recomputation behind it away (ARCHITECTURE.md fact 1, JAX issue 19822); jaxlib 0.11.2
# keeps it: the 16-layer MLP emitted from a 3-segment plan with fence="barrier" compiles
# to 20 dots there, 17 plus the 3 planned (tests/test_backends.py).
CPU_BARRIER_HOLDS = tuple(map(int, jax.__version__.split(".")[:2])) >= (0, 11)


def open_jaxpr(jaxpr: Any) -> tuple[Any, list[Any]]:
  """Returns ``(jaxpr, consts)`` for a closed or open jaxpr.

  jax 0.11 merged ``ClosedJaxpr`` into ``Jaxpr``: there ``.jaxpr`` may be the object
  itself, and its ``consts`` still belong to its constvars.
  """
  consts = getattr(jaxpr, "consts", None)
  inner = getattr(jaxpr, "jaxpr", jaxpr)
  return inner, list(consts) if consts is not None else []


def close_jaxpr(jaxpr: Any, constvars: list[Any], invars: list[Any], consts: list[Any]) -> Any:
  """A closed jaxpr like ``jaxpr`` with new constvars (bound to ``consts``) and invars."""
  return ClosedJaxpr(jaxpr.replace(constvars=constvars, invars=invars), consts)


def replace_body(closed: Any, eqns: list[Any], outvars: list[Any]) -> Any:
  """A closed jaxpr like ``closed`` (same inputs and constants) with new equations and
  outputs."""
  jaxpr, consts = open_jaxpr(closed)
  return ClosedJaxpr(jaxpr.replace(eqns=eqns, outvars=outvars), consts)


def broadcast_as(x: Any, like: Any) -> Any:
  """Scalar ``x`` broadcast to ``like``'s shape, and to its sharding where its type names
  one (a mesh with explicit axes: elementwise operands must agree in sharding there)."""
  sharding = getattr(jax.typeof(like), "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None or all(p is None for p in spec):
    return jax.numpy.broadcast_to(x, jax.numpy.shape(like))
  return jax.lax.broadcast_in_dim(x, jax.numpy.shape(like), (), out_sharding=sharding)


def map_params(closed: Any, change: Any) -> Any:
  """``closed`` with ``change(value)`` applied to every equation parameter value that is
  not a jaxpr (inside tuples and lists), in nested jaxprs (call bodies, loop bodies,
  branches) too."""

  def value(v: Any) -> Any:
    if type(v) in (tuple, list):  # not named tuples (a gather's dimension numbers)
      return type(v)(value(x) for x in v)
    if isinstance(v, ClosedJaxpr):
      return map_params(v, change)
    if hasattr(v, "eqns") and hasattr(v, "invars"):
      return open_jaxpr(map_params(ClosedJaxpr(v, []), change))[0]
    return change(v)

  jaxpr, consts = open_jaxpr(closed)
  eqns = [e.replace(params={k: value(v) for k, v in e.params.items()}) for e in jaxpr.eqns]
  return ClosedJaxpr(jaxpr.replace(eqns=eqns), consts)


def eval_closed_jaxpr(closed: Any, *args: Any) -> list[Any]:
  """Evaluates a closed jaxpr on flat arguments."""
  from jax.extend.core import jaxpr_as_fun

  return list(jaxpr_as_fun(closed)(*args))


def inline_body(eqn: Any) -> tuple[Any, list[Any]] | None:
  """The body ``(jaxpr, consts)`` of an inlinable call equation, else None."""
  if eqn.primitive.name not in INLINE_PRIMITIVES:
    return None
  for key in BODY_PARAMS:
    body = eqn.params.get(key)
    if body is not None:
      return open_jaxpr(body)
  return None


def call_shardings(eqn: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
  """A jit equation's ``(in_shardings, out_shardings)``, None where one is unspecified or
  left to the partitioner (``AUTO``) or names one device; empty for other equations."""
  if eqn.primitive.name not in ("jit", "pjit"):
    return (), ()

  def placed(shardings: Any) -> tuple[Any, ...]:
    return tuple(
      s if isinstance(s, jax.sharding.Sharding) and len(s.device_set) > 1 else None
      for s in shardings
    )

  return placed(eqn.params.get("in_shardings", ())), placed(eqn.params.get("out_shardings", ()))


def barrier_operands(eqn: Any) -> tuple[bool, ...]:
  """Which operands of a checkpoint equation JAX lowers behind one `optimization_barrier`:
  in a backward pass (``differentiated``), those ``prevent_cse`` marks; none elsewhere."""
  n = len(eqn.invars)
  if eqn.primitive.name not in CHECKPOINT_PRIMITIVES or not eqn.params.get("differentiated"):
    return (False,) * n
  prevent_cse = eqn.params.get("prevent_cse", True)
  return (bool(prevent_cse),) * n if isinstance(prevent_cse, bool) else tuple(prevent_cse)


def inner_jaxprs(eqn: Any) -> list[Any]:
  """The open jaxprs in an equation's params (scan/while/cond bodies, branches)."""
  out = []
  for value in eqn.params.values():
    items = value if isinstance(value, (tuple, list)) else (value,)
    for item in items:
      if hasattr(item, "eqns"):
        out.append(item)
      elif hasattr(getattr(item, "jaxpr", None), "eqns"):
        out.append(item.jaxpr)
  return out


def scan_counts(eqn: Any) -> tuple[int, int]:
  """``(constants, carried values)`` among a scan's flat operands: jax 0.10 names the
  counts in its params, jax 0.11 gives the operands' tree (``ft_in``: constants, carry,
  stacked inputs)."""
  params = eqn.params
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = (len(part) for part in params["ft_in"].unpack())
  return consts, carry


def policy_saves(policy: Any, eqn: Any) -> bool:
  """Whether `jax.checkpoint` with ``policy`` (a `jax.checkpoint_policies` policy) saves
  ``eqn``'s outputs for the backward pass, as it asks the policy: True or `Saveable`
  (an `Offloadable` answer is a store to another memory, not one here)."""
  saves = policy(eqn.primitive, *(v.aval for v in eqn.invars), **eqn.params)
  return saves is True or type(saves).__name__ == "SaveableType"


def is_extended_dtype(dtype: Any) -> bool:
  """Whether ``dtype`` is an extended dtype (PRNG keys) stored as a base array."""
  return isinstance(dtype, _dtypes.ExtendedDType)


def aval_bytes(aval: Any) -> int:
  """Bytes of one value of abstract type ``aval`` as the device stores it.

  Sub-byte types (int4) are packed; bool takes a byte; PRNG key arrays count their
  physical base array (e.g. two uint32 per threefry key). Tokens take nothing.
  """
  shape = getattr(aval, "shape", None)
  dtype = getattr(aval, "dtype", None)
  if shape is None or dtype is None:
    return 0
  size = math.prod(shape)
  if is_extended_dtype(dtype):
    elt = dtype._rules.physical_element_aval(dtype)  # noqa: SLF001 - the only public path
    size *= math.prod(elt.shape)
    dtype = np.dtype(elt.dtype)
  bits = _dtypes.itemsize_bits(dtype)
  return (size * bits + 7) // 8


# -- source information -----------------------------------------------------------------


def eqn_source(eqn: Any) -> str:
  """``"file.py:12 (fn)"`` for the user frame that created ``eqn``, or ``"unknown"``: the
  innermost outside JAX, jaxremat and installed packages (Flax's `nn.scan` calls
  `lax.scan` in flax/core/axes_scan.py; the user's line is the one that calls it)."""
  frame = first = None
  for frame in _source_info_util.user_frames(eqn.source_info.traceback):
    if frame.file_name.startswith(_OWN):
      continue
    first = first or frame
    if not _INSTALLED.search(frame.file_name):
      break
  else:
    frame = first
  if frame is None:
    return "unknown"
  return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"


# Where installed packages live, and jaxremat itself (an editable install lives elsewhere).
_INSTALLED = re.compile(r"[/\\](site|dist)-packages[/\\]")
_OWN = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def name_stack_str(eqn: Any) -> str:
  return str(eqn.source_info.name_stack)


def current_name_stack() -> Any:
  return _source_info_util.current_name_stack()


def user_context(eqn: Any, outer_name_stack: Any):
  """Context that gives re-traced equations ``eqn``'s traceback and full name stack."""
  return _source_info_util.user_context(
    eqn.source_info.traceback, name_stack=outer_name_stack + eqn.source_info.name_stack
  )


def eqn_ctx_manager(eqn: Any):
  return eqn.ctx.manager


def bind_params(eqn: Any) -> dict[str, Any]:
  return eqn.primitive.get_bind_params(eqn.params)


# -- compiled executables ---------------------------------------------------------------


def cost_analysis_dict(compiled: Any) -> dict[str, float]:
  """``compiled.cost_analysis()`` as a dict (a one-element list in old jax)."""
  costs = compiled.cost_analysis()
  if isinstance(costs, (list, tuple)):
    costs = costs[0] if costs else {}
  return dict(costs or {})


def memory_peak_bytes(compiled: Any, platform: str | None = None) -> int:
  """XLA's peak of an executable compiled for ``platform`` (default: JAX's backend).

  Measured with jax 0.10.2 on the 16-layer tanh MLP grad (tests/test_targets.py):
  - TPU: ``peak_memory_in_bytes`` (83.75 MiB); temp reads 0 there, so argument + output +
    temp - alias (12.0 MiB) is only the parameters and the result.
  - GPU: argument + output + temp - alias (80.0 MiB). XLA:GPU allocates temp as one
    block, so that is what the device holds; ``peak_memory_in_bytes`` reads up to
    alignment less.
  - CPU: argument + output + temp - alias; ``peak_memory_in_bytes`` counts only the
    arguments and output there (ARCHITECTURE.md fact 3).
  """
  m = compiled.memory_analysis()
  if (platform or jax.default_backend()) == "tpu":
    return int(m.peak_memory_in_bytes)
  return int(
    m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
  )


def backend_name() -> str:
  return jax.default_backend()


def abstract_value(x: Any) -> Any:
  """The abstract value `jax.jit` traces ``x`` as (Python scalars are weakly typed)."""
  typeof = getattr(jax, "typeof", None)
  if typeof is None:  # pragma: no cover - jax < 0.6
    return jax.core.get_aval(x)
  return typeof(x)


def is_filter_jit(fn: Any) -> bool:
  """Whether ``fn`` is wrapped by ``eqx.filter_jit``, which traces arrays only (Python
  scalars stay static), unlike `jax.jit`. Equinox keeps the wrapper class private."""
  cls = type(fn)
  return cls.__module__.startswith("equinox") and cls.__name__ == "_JitWrapper"


def jit_info(fn: Any) -> dict[str, tuple] | None:
  """The static and donated arguments of a `jax.jit`-wrapped function (None otherwise).

  `jax.jit` keeps them only in the private ``_jit_info``; its public ``lower().args_info``
  says which leaves are donated but drops static arguments from the structure.
  """
  info = getattr(fn, "_jit_info", None)
  if info is None:
    return None
  return {
    name: tuple(getattr(info, name, ()) or ())
    for name in ("static_argnums", "static_argnames", "donate_argnums", "donate_argnames")
  }


# -- building jaxprs from their printed text (jaxremat._src.jaxpr_text) ---------------------


def primitive_by_name(name: str, multiple_results: bool) -> Any:
  """JAX's own primitive of that name where `jax.extend.core.primitives` has it, else a
  stand-in that is never bound (a parsed jaxpr is planned, not run)."""
  from jax.extend.core import Primitive, primitives

  table = {p.name: p for p in vars(primitives).values() if isinstance(p, Primitive)}
  if name in table:
    return table[name]
  prim = Primitive(name)
  prim.multiple_results = multiple_results
  return prim


def shaped_array(shape: tuple[int, ...], dtype: Any) -> Any:
  """The abstract value of an array; ``dtype`` ``"key<fry>"`` etc. makes a PRNG key type."""
  if isinstance(dtype, str) and dtype.startswith("key<"):
    impl = {"fry": "threefry2x32"}.get(dtype[4:-1], dtype[4:-1])
    dtype = jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype
  return _ShapedArray(shape, dtype)


def new_var(aval: Any) -> Any:
  return Var(aval)


def new_dropvar(aval: Any) -> Any:
  return DropVar(aval)


def new_literal(value: Any, aval: Any) -> Any:
  return Literal(value, aval)


def new_closed_jaxpr(constvars, invars, outvars, eqns_spec, consts) -> Any:
  """A ClosedJaxpr from ``eqns_spec``: ``(invars, outvars, primitive, params)`` tuples."""
  from jax.extend.core import new_jaxpr_eqn

  eqns = [new_jaxpr_eqn(i, o, p, params, frozenset()) for i, o, p, params in eqns_spec]
  with warnings.catch_warnings():  # no DebugInfo: there is no Python function behind it
    warnings.simplefilter("ignore", DeprecationWarning)
    return ClosedJaxpr(Jaxpr(constvars, invars, outvars, eqns), consts)


# -- compiling for devices this machine lacks (jaxremat._src.targets) -----------------------
# jax.experimental.topologies describes TPU and GPU devices without the hardware; a plugin
# (libtpu, the CUDA PJRT plugin) compiles for them. ../shared/design/TARGETS.md has the recipe.


def plugins_discovered() -> bool:
  """Whether JAX has already imported its PJRT plugins (they read the environment then)."""
  from jax._src import xla_bridge

  return bool(getattr(xla_bridge, "_plugins_registered", True))


def tpu_library_path() -> str | None:
  """Where libtpu lies (``$TPU_LIBRARY_PATH`` or the ``libtpu`` package), None if absent."""
  try:
    from jax._src.cloud_tpu_init import get_tpu_library_path
  except ImportError:  # pragma: no cover - jax moved it
    from jax._src.xla_bridge import get_tpu_library_path  # type: ignore
  return get_tpu_library_path()


def topology_devices(platform: str, topology_name: str = "", **options: Any) -> list[Any]:
  """Compile-only devices of a topology: ``get_topology_desc(...).devices``.

  Args:
    platform: ``"tpu"`` or ``"cuda"``.
    topology_name: e.g. ``"v5e:2x2"`` (TPU); the GPU plugin ignores it.
    **options: passed to the plugin, e.g. ``topology="1x1x1", target_config=TEXT`` (GPU).
  """
  from jax.experimental import topologies

  return list(topologies.get_topology_desc(topology_name, platform, **options).devices)


def lower_for_platform(jitted: Any, platform: str, *args: Any, **kwargs: Any) -> Any:
  """``jitted.trace(*args, **kwargs).lower(lowering_platforms=(platform,))``.

  ``lowering_platforms`` lowers for a platform no local backend serves (jax >= 0.4.31);
  older JAX spelled it ``_experimental_lowering_parameters``.
  """
  return jitted.trace(*args, **kwargs).lower(lowering_platforms=(platform,))


def hlo_cost_analysis(compiled: Any) -> dict[str, float]:
  """Flops, transcendentals and bytes accessed of a compiled executable.

  ``compiled.cost_analysis()`` where the backend answers; else (a compile-only GPU
  executable says "GetCostAnalysis is not supported") XLA's HLO cost analysis of the
  optimized modules, run through the CPU client, summed over the modules. Empty when
  neither is available (no CPU backend in this process).
  """
  try:
    costs = cost_analysis_dict(compiled)
  except Exception:  # jaxlib raises JaxRuntimeError or NotImplementedError
    costs = {}
  if costs:
    return costs
  from jax._src import xla_bridge
  from jax._src.lib import _jax

  try:
    cpu = xla_bridge.get_backend("cpu")
    modules = compiled.runtime_executable().hlo_modules()
  except Exception:  # no CPU backend, or an executable without modules
    return {}
  total: dict[str, float] = {}
  for module in modules:
    for key, value in _jax.hlo_module_cost_analysis(cpu, module).items():
      total[key] = total.get(key, 0.0) + float(value)
  return total
