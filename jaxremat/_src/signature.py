"""How a step's call splits into traced arrays and static values, as `jax.jit` splits it.

The first thing every stage needs: which leaves of ``(args, kwargs)`` are traced
(arrays, and Python scalars, which `jax.jit` traces as weakly typed arrays), which are
static (the arguments named by ``static_argnums``/``static_argnames``, and leaves that are
not arrays, such as an Equinox model's activation functions, as ``eqx.filter_jit`` keeps
them), which are donated, and the same for the outputs. A `CallSignature` has a hashable
key: one plan per signature, as one compilation per signature in `jax.jit`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxremat._src import compat
from jaxremat._src.errors import UnsupportedError

_SCALARS = (bool, int, float, complex)
MSG_WRITTEN_ARGUMENT = (
  "The step wrote a value it computed into its argument {path} in place (a Flax NNX module "
  "or optimizer updated inside the step, a dict assigned to): jaxremat plans and runs the "
  "step as a function of its arguments to its outputs, and that update would be lost. "
  "Return the updated state instead: with Flax NNX, nnx.split the model and optimizer "
  "outside the step, nnx.merge them inside it, and return their nnx.state with the loss."
)
MSG_UNHASHABLE_STATIC = (
  "{name} is a static value of type {type}, which is neither an array nor hashable; "
  "jaxremat plans once per static value, as jax.jit compiles once per static value. Pass it "
  "as a traced argument, or make it hashable (a tuple, a frozen dataclass)."
)


def is_array(x: Any, scalars: bool = True) -> bool:
  """Whether a leaf is traced: an array, an array spec, or a Python scalar (as `jax.jit`
  traces them; ``scalars=False``: as ``eqx.filter_jit`` keeps them static)."""
  kinds = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)
  return isinstance(x, (*kinds, *_SCALARS) if scalars else kinds)


def _is_array_output(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.core.Tracer))


def abstract(x: Any) -> jax.ShapeDtypeStruct:
  """The traced type of a leaf: shape, dtype and weak type, as `jax.jit` sees it, and
  its sharding where it spans several devices (`jax.jit` partitions the step by it)."""
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  aval = compat.abstract_value(x)
  return jax.ShapeDtypeStruct(
    aval.shape, aval.dtype, weak_type=aval.weak_type, sharding=mesh_sharding(x)
  )


def mesh_sharding(x: Any) -> Any:
  """The sharding of ``x`` where it spans more than one device, else None (a value on
  one device runs wherever the step runs)."""
  concrete = isinstance(x, jax.ShapeDtypeStruct) or (
    isinstance(x, jax.Array) and not isinstance(x, compat.Tracer)
  )
  sharding = x.sharding if concrete else None
  return sharding if sharding is not None and len(sharding.device_set) > 1 else None


def normalize_argnums(argnums: int | Sequence[int], n_args: int, what: str) -> tuple[int, ...]:
  """Sorted non-negative positions; negative ones count from the end, as in `jax.jit`.

  Raises:
    ValueError: a position does not exist among ``n_args`` positional arguments.
  """
  argnums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
  for i in argnums:
    if not -n_args <= i < n_args:
      raise ValueError(
        f"{what} contains {i}, but the step was given {n_args} positional arguments; name "
        "only positions that exist."
      )
  return tuple(sorted({i % n_args for i in argnums}))


def static_key(x: Any) -> Any:
  """A hashable stand-in for a static value, equal exactly when the values are.

  Arrays (which `jax.jit` refuses as static values) count by a digest of their contents,
  so that two large arrays that print alike still differ; other values by type and value
  (``1``, ``1.0`` and ``True`` differ).

  Raises:
    TypeError: ``x`` is neither an array nor hashable.
  """
  if isinstance(x, (np.ndarray, np.generic, jax.Array)):
    a = np.asarray(x)
    return ("array", a.shape, str(a.dtype), hashlib.sha256(a.tobytes()).hexdigest())
  hash(x)
  return (type(x), x)


@dataclasses.dataclass(frozen=True)
class CallSignature:
  """Which leaves of a call are traced, static or donated.

  Attributes:
    arg_tree: treedef of the whole ``(args, kwargs)``.
    dynamic_mask: per leaf of ``arg_tree``, whether it is traced.
    static_leaves: the static leaves, in order (baked into the traced program).
    specs: the traced type of each dynamic leaf.
    donated: per dynamic leaf, whether its buffer is donated to the step.
    arg_names: per dynamic leaf, its path (``"args[0]['w']"``, ``"kwargs['lr']"``).
  """

  arg_tree: Any
  dynamic_mask: tuple[bool, ...]
  static_leaves: tuple[Any, ...]
  specs: tuple[jax.ShapeDtypeStruct, ...]
  donated: tuple[bool, ...]
  arg_names: tuple[str, ...]

  @property
  def key(self) -> Any:
    """Hashable; equal for two calls that `jax.jit` would run with one compilation."""
    specs = tuple((s.shape, str(s.dtype), bool(s.weak_type), mesh_sharding(s)) for s in self.specs)
    statics = tuple(static_key(x) for x in self.static_leaves)
    return (self.arg_tree, self.dynamic_mask, statics, specs, self.donated)

  @property
  def partitioned(self) -> bool:
    """Whether a traced leaf is sharded over several devices (`jax.jit` partitions the
    step over them, and each device holds its part)."""
    return any(mesh_sharding(s) is not None for s in self.specs)

  @property
  def donated_leaves(self) -> tuple[int, ...]:
    """Positions of the donated leaves among the dynamic ones (the flat step's
    ``donate_argnums``)."""
    return tuple(i for i, d in enumerate(self.donated) if d)

  def dynamic_leaves(self, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    """The traced leaves of a call with this signature's structure.

    Raises:
      ValueError: the call's pytree structure differs from the signature's.
    """
    leaves, tree = jax.tree_util.tree_flatten((tuple(args), dict(kwargs)))
    if tree != self.arg_tree:
      raise ValueError(
        f"The arguments have structure {tree}, but the function was traced with "
        f"{self.arg_tree}; call it with arguments of the traced structure."
      )
    return [x for x, dyn in zip(leaves, self.dynamic_mask, strict=True) if dyn]

  def merge(self, dynamic: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` with these traced leaves and the signature's static ones."""
    it_dyn, it_static = iter(dynamic), iter(self.static_leaves)
    leaves = [next(it_dyn) if d else next(it_static) for d in self.dynamic_mask]
    return jax.tree_util.tree_unflatten(self.arg_tree, leaves)


def call_signature(
  args: Sequence[Any],
  kwargs: dict[str, Any],
  *,
  static_argnums: int | Sequence[int] = (),
  static_argnames: str | Sequence[str] = (),
  donate_argnums: int | Sequence[int] = (),
  donate_argnames: str | Sequence[str] = (),
  trace_scalars: bool = True,
) -> CallSignature:
  """Splits a call into traced and static leaves (see the module docstring).

  ``trace_scalars=False`` keeps Python scalars static, as ``eqx.filter_jit`` does (an
  Equinox module's float and bool fields, such as a dropout rate and its mode).

  Raises:
    ValueError: an argument position does not exist, or a static value is neither an
      array nor hashable.
  """
  args, kwargs = tuple(args), dict(kwargs)
  static_pos = normalize_argnums(static_argnums, len(args), "static_argnums")
  donate_pos = normalize_argnums(donate_argnums, len(args), "donate_argnums")
  static_names = {static_argnames} if isinstance(static_argnames, str) else set(static_argnames)
  donate_names = {donate_argnames} if isinstance(donate_argnames, str) else set(donate_argnames)
  with_paths, arg_tree = jax.tree_util.tree_flatten_with_path((args, kwargs))
  # Each whole static argument stands for all of its leaves; a donated one for all of its.
  # Marked through the same pytree, so that the marks follow JAX's leaf order.
  marked = (
    tuple(_mark(a, i in static_pos, i in donate_pos) for i, a in enumerate(args)),
    {k: _mark(v, k in static_names, k in donate_names) for k, v in kwargs.items()},
  )
  marks = [(m.static, m.donated) for m in jax.tree_util.tree_leaves(marked)]
  dynamic_mask, donated, specs, statics, names = [], [], [], [], []
  for (path, x), (static, donate) in zip(with_paths, marks, strict=True):
    # ((args, kwargs)) -> "args[0]['w']" / "kwargs['lr']"
    name = re.sub(r"^\[1\]", "kwargs", re.sub(r"^\[0\]", "args", jax.tree_util.keystr(path)))
    dynamic = not static and is_array(x, trace_scalars)
    dynamic_mask.append(dynamic)
    if dynamic:
      specs.append(abstract(x))
      donated.append(donate)
      names.append(name)
      continue
    try:
      static_key(x)
    except TypeError:
      raise ValueError(MSG_UNHASHABLE_STATIC.format(name=name, type=type(x).__name__)) from None
    statics.append(x)
  return CallSignature(
    arg_tree=arg_tree,
    dynamic_mask=tuple(dynamic_mask),
    static_leaves=tuple(statics),
    specs=tuple(specs),
    donated=tuple(donated),
    arg_names=tuple(names),
  )


@dataclasses.dataclass(frozen=True)
class _Mark:
  static: bool
  donated: bool


def _mark(value: Any, static: bool, donated: bool) -> Any:
  return jax.tree_util.tree_map(lambda _: _Mark(static, donated), value)


@dataclasses.dataclass(frozen=True)
class OutputSplit:
  """Which leaves of a step's output are arrays (the traced program's outputs) and which
  are static values returned as they are (as ``eqx.filter_jit`` returns them)."""

  out_tree: Any
  dynamic_mask: tuple[bool, ...]
  static_leaves: tuple[Any, ...]

  def merge(self, dynamic: Sequence[Any]) -> Any:
    """The output pytree from the values of its array leaves."""
    it_dyn, it_static = iter(dynamic), iter(self.static_leaves)
    leaves = [next(it_dyn) if d else next(it_static) for d in self.dynamic_mask]
    return jax.tree_util.tree_unflatten(self.out_tree, leaves)


class FlatStep:
  """``fn`` as a function of a signature's traced leaves that returns its array outputs.

  What `jax.jit`, `measure` and `verify` see of a step with static arguments or
  non-array leaves. ``outputs`` holds the output split of the last trace.
  """

  def __init__(self, fn: Callable[..., Any], signature: CallSignature):
    self.fn = fn
    self.signature = signature
    self.outputs: OutputSplit | None = None
    self.__name__ = getattr(fn, "__name__", type(fn).__name__)

  def __call__(self, *dynamic: Any) -> list[Any]:
    args, kwargs = self.signature.merge(dynamic)
    leaves, tree = jax.tree_util.tree_flatten(self.fn(*args, **kwargs))
    _check_unwritten((args, kwargs), dynamic)
    mask = tuple(_is_array_output(x) for x in leaves)
    self.outputs = OutputSplit(tree, mask, tuple(x for x, m in zip(leaves, mask) if not m))
    return [x for x, m in zip(leaves, mask) if m]


def _check_unwritten(arguments: Any, dynamic: Sequence[Any]) -> None:
  """Raises where a traced call left a value it computed in one of its arguments: a leaf
  that is a tracer but none of the traced inputs (`nnx.jit` writes a step's updates back
  into its Module arguments; traced without it, a Module's updates stay on the copy)."""
  given = {id(x) for x in dynamic}
  for path, leaf in jax.tree_util.tree_flatten_with_path(arguments)[0]:
    if isinstance(leaf, compat.Tracer) and id(leaf) not in given:
      # (args, kwargs): args[i]... or the keyword's name
      head = f"args[{path[1].idx}]" if path[0].idx == 0 else str(path[1].key)
      where = head + jax.tree_util.keystr(path[2:])
      raise UnsupportedError(MSG_WRITTEN_ARGUMENT.format(path=where))


def step_signature(
  fn: Any,
  args: Sequence[Any],
  kwargs: dict[str, Any],
  *,
  static_argnums: int | Sequence[int] = (),
  static_argnames: str | Sequence[str] = (),
  donate_argnums: int | Sequence[int] = (),
) -> CallSignature:
  """`call_signature` of a call of ``fn``, with the static and donated arguments of a
  ``jax.jit``-wrapped ``fn`` (`jit_options`) beside the ones given."""
  jitted = jit_options(fn)
  return call_signature(
    args,
    kwargs,
    static_argnums=_union(static_argnums, jitted.get("static_argnums", ())),
    static_argnames=_union(static_argnames, jitted.get("static_argnames", ())),
    donate_argnums=_union(donate_argnums, jitted.get("donate_argnums", ())),
    donate_argnames=jitted.get("donate_argnames", ()),
    trace_scalars=jitted.get("trace_scalars", True),
  )


def _union(a: int | str | Sequence, b: Sequence) -> tuple:
  a = (a,) if isinstance(a, (int, str)) else tuple(a)
  return tuple(dict.fromkeys([*a, *b]))


def jit_options(fn: Any) -> dict[str, Any]:
  """The `call_signature` options a wrapped ``fn`` implies: the static and donated
  arguments of a `jax.jit` wrapper (donated names also as positions), Python scalars kept
  static under ``eqx.filter_jit``; empty for other callables."""
  if compat.is_filter_jit(fn):
    return {"trace_scalars": False}
  info = compat.jit_info(fn)
  if info is None:
    return {}
  try:
    params = list(inspect.signature(fn).parameters)
  except (TypeError, ValueError):
    params = []
  by_name = {name: i for i, name in enumerate(params)}
  donated = {
    *info["donate_argnums"],
    *(by_name[n] for n in info["donate_argnames"] if n in by_name),
  }
  return {
    "static_argnums": info["static_argnums"],
    "static_argnames": info["static_argnames"],
    "donate_argnums": tuple(sorted(donated)),
    "donate_argnames": info["donate_argnames"],
  }
