"""Which jaxpr values the target compiler materializes, read from its optimized HLO.

`trace`'s hand rules say which equations XLA fuses into their readers; they were written
for XLA:CPU and are wrong elsewhere (TPU fuses far more: on the GPT example's step, 198 of
1530 equations keep a buffer on TPU v5e, where the rules keep 539). Here the compiler
answers instead: the step's flat jaxpr is compiled for the target with each equation
under a `jax.named_scope` of its own, which XLA keeps in every instruction's ``op_name``
metadata (TARGETS.md). An equation is materialized when a top-level instruction of the
entry computation (a fusion, a custom call, a copy, ...) has it as its root, or as one of
the roots of a multi-output fusion.

Example:
  >>> import jax, jax.numpy as jnp
  >>> closed = jax.make_jaxpr(lambda x: jnp.sum(jnp.tanh(x) * 2.0))(jnp.ones((8, 128)))
  >>> sorted(materialized_equations(closed, "cpu"))  # XLA:CPU: tanh fused into the mul
  [1, 2]
"""

from __future__ import annotations

import re
from typing import Any, Final

import jax

from jaxremat._src import compat
from jaxremat._src.hlo_text import Instruction, computations
from jaxremat._src.targets import Target, compile_for

_SCOPE: Final = "jaxremat_eqn"
_SCOPED = re.compile(_SCOPE + r"(\d+)")
_CALLS = re.compile(r"calls=%([\w.-]+)")
# Instructions that hold no buffer of their own.
_NO_BUFFER: Final = frozenset({"parameter", "tuple", "get-tuple-element", "bitcast", "constant"})


def materialized_equations(closed: Any, target: str | Target | None) -> frozenset[int]:
  """Indices of the equations of flat ``closed`` whose outputs the compiler keeps.

  Args:
    closed: a flat ``ClosedJaxpr`` (`trace.flatten_jaxpr`'s output).
    target: the compiler (`jaxremat.get_target`; None: this machine's).

  Returns:
    The equations some top-level instruction of the optimized program computes last.
  """
  jaxpr, consts = compat.open_jaxpr(closed)

  def scoped(*args: Any) -> list[Any]:
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(v: Any) -> Any:
      return v.val if isinstance(v, compat.Literal) else env[v]

    for k, eqn in enumerate(jaxpr.eqns):
      with jax.named_scope(f"{_SCOPE}{k}"):
        outs = eqn.primitive.bind(*map(read, eqn.invars), **compat.bind_params(eqn))
      outs = outs if eqn.primitive.multiple_results else [outs]
      env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]

  specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.invars]
  return roots_in_hlo(compile_for(target, scoped, *specs).as_text())


def roots_in_hlo(hlo: str) -> frozenset[int]:
  """The scoped equations that top-level instructions of the entry computation root."""
  parts = computations(hlo)
  entry = next(c for c in parts.values() if c.is_entry)
  roots: set[int] = set()
  for instruction in entry.instructions:
    if instruction.opcode in _NO_BUFFER:
      continue
    called = _CALLS.search(instruction.rest)
    if instruction.opcode == "fusion" and called and called.group(1) in parts:
      roots |= _fusion_roots(parts[called.group(1)].instructions)
    roots |= _scopes(instruction.line)
  return frozenset(roots)


def _fusion_roots(body: list[Instruction]) -> set[int]:
  """The equations a fused computation outputs: its root, or a root tuple's operands."""
  root = next((i for i in body if i.is_root), None)
  if root is None:
    return set()
  if root.opcode != "tuple":
    return _scopes(root.line)
  lines = {i.name: i.line for i in body}
  operands = re.findall(r"%([\w.-]+)", root.rest.split(")", 1)[0])
  return set().union(*(_scopes(lines.get(name, "")) for name in operands))


def _scopes(line: str) -> set[int]:
  """The innermost equation scope in an instruction's metadata."""
  found = _SCOPED.findall(line)
  return {int(found[-1])} if found else set()
