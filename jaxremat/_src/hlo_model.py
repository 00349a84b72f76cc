"""Which jaxpr values the target compiler materializes, read from its optimized HLO.

`fusion`'s hand rules say which equations XLA fuses into their readers; they were written
for XLA:CPU and are wrong elsewhere (TPU fuses far more: on the GPT example's step, 198 of
1530 equations keep a buffer on TPU v5e, where the rules keep 539). Here the compiler
answers instead: the step's flat jaxpr is compiled for the target with each equation
under a `jax.named_scope` of its own, which XLA keeps in every instruction's ``op_name``
metadata (TARGETS.md). An equation is materialized when a top-level instruction of the
entry computation (a fusion, a custom call, a copy, ...) has it as its root, or as one of
the roots of a multi-output fusion, itself or through conversions that only change how the
value is stored.

Sizes come from the same program: each kept value's bytes are its instruction's shape as
the target lays it out (TPU pads minor dimensions to (8, 128) tiles), each argument's bytes
its parameter's, and the copies XLA makes for one reader (transposed operands, library
scratch) are that reader's scratch. The entry computation lists its instructions in the
order they run, which `trace` takes as the graph's order. The compile is the step's own
(with its donation), so its figures are the step's baseline measurement.

Example:
  >>> import jax, jax.numpy as jnp
  >>> closed = jax.make_jaxpr(lambda x: jnp.sum(jnp.tanh(x) * 2.0))(jnp.ones((8, 128)))
  >>> values = compiled_values(closed, "cpu")
  >>> sorted(values.kept), values.bytes[2]  # XLA:CPU: tanh fused into the mul
  ([1, 2], 4)
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Final

import jax

from jaxremat._src import compat
from jaxremat._src.hlo_text import Instruction, buffers, computations
from jaxremat._src.measure import Measurement, measure
from jaxremat._src.targets import Target

_SCOPE: Final = "jaxremat_eqn"
_SCOPED = re.compile(_SCOPE + r"(\d+)")
_CALLS = re.compile(r"calls=%([\w.-]+)")
# Instructions that hold no buffer of their own.
_NO_BUFFER: Final = frozenset({"parameter", "tuple", "get-tuple-element", "bitcast", "constant"})
_PARAMETER = re.compile(r"parameter\((\d+)\)")
# Instructions that hold their operand's value in another dtype or layout.
_STORAGE_ONLY: Final = frozenset({"convert", "copy", "bitcast", "reshape", "bitcast-convert"})


@dataclasses.dataclass(frozen=True)
class CompiledValues:
  """What the target compiler keeps of a flat jaxpr's values, and at what size."""

  kept: frozenset[int]  # equations some top-level instruction computes last
  bytes: dict[int, int]  # kept equation -> its outputs' bytes in device memory
  scratch: dict[int, int]  # equation -> bytes of the copies only it reads, while it runs
  position: dict[int, int]  # kept equation -> where the compiler's schedule first makes it
  argument_bytes: tuple[int, ...]  # per jaxpr input, as the compiled parameter holds it
  measurement: Measurement  # the compiler's figures for the program (the same as the step's)


def compiled_values(
  closed: Any,
  target: str | Target | None,
  donate_argnums: tuple[int, ...] = (),
  scopes: tuple[int, ...] | None = None,
) -> CompiledValues:
  """Which values of flat ``closed`` the compiler keeps, read from its optimized program.

  Args:
    closed: a flat ``ClosedJaxpr`` (`capture.flatten_jaxpr`).
    target: the compiler (`jaxremat.get_target`; None: this machine's).
    donate_argnums: the donated inputs, so that the measurement is the step's own.
    scopes: per equation, the number that names it in the result (default: its index);
      `trace` names repeats after the equation that `capture.merge_repeats` keeps.
  """
  jaxpr, consts = compat.open_jaxpr(closed)
  scopes = scopes or range(len(jaxpr.eqns))

  def scoped(*args: Any) -> list[Any]:
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(v: Any) -> Any:
      return v.val if isinstance(v, compat.Literal) else env[v]

    for k, eqn in zip(scopes, jaxpr.eqns, strict=True):
      with jax.named_scope(f"{_SCOPE}{k}"):
        outs = eqn.primitive.bind(*map(read, eqn.invars), **compat.bind_params(eqn))
      outs = outs if eqn.primitive.multiple_results else [outs]
      env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]

  specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.invars]
  measured = measure(scoped, *specs, runs=0, donate_argnums=donate_argnums, target=target)
  return CompiledValues(*values_in_hlo(measured.hlo_text, len(jaxpr.invars)), measured)


def values_in_hlo(
  hlo: str, n_arguments: int
) -> tuple[frozenset[int], dict[int, int], dict[int, int], dict[int, int], tuple[int, ...]]:
  """The scoped equations that top-level instructions of the entry computation root, the
  bytes of what they hold in device memory, and where the schedule makes them (the entry
  computation of an optimized module lists its instructions in execution order).

  A buffer that is not an equation's first (an unnamed copy: a layout change, a transposed
  operand, XLA:CPU's float32 for a bfloat16 value; or a second buffer under the same name)
  is scratch of the one equation that reads it, where one does; a second named buffer read
  by more is more of its equation's value. A named buffer that only its own equation's
  next instructions read (split-K partial products) is that equation's scratch. Unnamed
  buffers read by several equations are left out: their lifetimes are not known (XLA:CPU
  drops the names of bfloat16 arithmetic).
  """
  parts = computations(hlo)
  entry = next(c for c in parts.values() if c.is_entry)
  roots_of: dict[str, list[int | None]] = {}  # instruction -> the equation of each output
  readers: dict[str, set[int | None]] = {}  # instruction -> the equations reading it
  passed_on: set[str] = set()  # instructions some bufferless instruction reads
  last_read: dict[str, int] = {}  # instruction -> where its last reader runs
  for at, instruction in enumerate(entry.instructions):
    roots = [_scope(instruction.line)]
    called = _CALLS.search(instruction.rest)
    if instruction.opcode == "fusion" and called and called.group(1) in parts:
      roots = _fusion_roots(parts[called.group(1)].instructions) or roots
    roots_of[instruction.name] = roots
    reader = next((k for k in roots if k is not None), None)
    for name in instruction.operands:
      readers.setdefault(name, set()).add(reader)
      last_read[name] = at
      if instruction.opcode in _NO_BUFFER:  # read on through a tuple, a bitcast, ...
        passed_on.add(name)
  sizes: dict[int, int] = {}
  scratch: dict[int, int] = {}
  position: dict[int, int] = {}
  arguments = [0] * n_arguments
  for at, instruction in enumerate(entry.instructions):
    held = [b.bytes for b in buffers(instruction.shape)] or [0]
    if instruction.opcode == "parameter":
      index = int(_PARAMETER.search(instruction.line).group(1))
      if index < n_arguments:
        arguments[index] = sum(held)
      continue
    if instruction.opcode in _NO_BUFFER:
      continue
    roots = roots_of[instruction.name]
    if len(roots) != len(held):  # one value and a library call's scratch, or a tuple root
      roots = roots[:1] + [None] * (len(held) - 1)
    read_by = readers.get(instruction.name, set())
    for k, size in zip(roots, held):
      if (
        k is not None
        and read_by == {k}
        and instruction.name not in passed_on
        and _own_step(entry.instructions, roots_of, k, at, last_read[instruction.name])
      ):
        # A step of its own equation's work that only the equation's next instructions
        # read (XLA:GPU's split-K partial products, summed by a reduction after them).
        scratch[k] = scratch.get(k, 0) + size
        continue
      if k is not None and k not in sizes:
        sizes[k] = size
        position[k] = at
        continue
      if len(read_by) == 1 and None not in read_by:
        (reader,) = read_by
        scratch[reader] = scratch.get(reader, 0) + size
      elif k is not None:
        sizes[k] += size
  return frozenset(sizes), sizes, scratch, position, tuple(arguments)


def _own_step(
  instructions: list[Instruction], roots_of: dict, k: int, start: int, end: int
) -> bool:
  """Whether nothing but equation ``k``'s own or unnamed work runs between ``start`` and
  ``end``: a buffer it holds across another equation's values is no scratch."""
  return all(
    set(roots_of[i.name]) <= {k, None}
    for i in instructions[start + 1 : end]
    if i.opcode not in _NO_BUFFER
  )


def _fusion_roots(body: list[Instruction]) -> list[int | None]:
  """The equation of each output of a fused computation (its root, or a root tuple's
  operands in order); empty where none is named."""
  root = next((i for i in body if i.is_root), None)
  if root is None:
    return []
  by_name = {i.name: i for i in body}
  outputs = [by_name.get(name) for name in root.operands] if root.opcode == "tuple" else [root]
  roots = [_value_scope(i, by_name) for i in outputs]
  return roots if any(k is not None for k in roots) else []


def _value_scope(instruction: Instruction | None, by_name: dict[str, Instruction]) -> int | None:
  """The equation whose value ``instruction`` holds: its own scope, or through unnamed
  conversions that only change how the value is stored. XLA:TPU writes a float32
  cotangent out of its fusion as an unnamed bfloat16 ``convert`` for the next product
  (the MLP example's backward pass); without this the value read as never kept, and its
  readers as reading the whole chain of cotangents before it."""
  while instruction is not None:
    found = _scope(instruction.line)
    if found is not None or instruction.opcode not in _STORAGE_ONLY:
      return found
    operands = instruction.operands
    instruction = by_name.get(operands[0]) if len(operands) == 1 else None
  return None


def _scope(line: str) -> int | None:
  """The innermost equation scope in an instruction's metadata."""
  found = _SCOPED.findall(line)
  return int(found[-1]) if found else None
