"""Reading XLA's optimized HLO text: its computations, instructions and opcode counts.

One reader for the modules that look into what a compiler made of a program: the
recomputation check (`verify`), the compiler-derived memory model (`hlo_model`) and the
backend facts (`targets.measure_facts`).

Example:
  >>> text = "ENTRY %main (x: f32[4]) -> f32[4] {\\n  ROOT %t = f32[4]{0} tanh(%x)\\n}"
  >>> count_hlo_ops(text), [i.opcode for i in computations(text)["main"].instructions]
  ({'tanh': 1}, ['tanh'])
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Final

# One instruction: its name, its opcode and the rest of the line.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.-]+) = .*? ([a-z][\w-]*)\((.*)$")
_HEADER = re.compile(r"^(ENTRY )?%([\w.-]+) ")
_CUSTOM_CALL_TARGET = re.compile(r'custom_call_target="([^"]+)"')
# Library calls that stand for an HLO opcode: XLA:GPU runs convolutions through cuDNN and
# may run dots through cuBLAS (measured on deviceless H100 compiles).
_CUSTOM_CALL_OPCODES: Final = (("__cudnn$conv", "convolution"), ("__cublas", "dot"))


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  opcode: str  # a cuDNN convolution or cuBLAS product reads as the opcode it stands for
  rest: str  # the line after the opcode's opening parenthesis
  line: str

  @property
  def is_root(self) -> bool:
    return self.line.lstrip().startswith("ROOT ")


@dataclasses.dataclass(frozen=True)
class Computation:
  is_entry: bool
  instructions: list[Instruction]


def computations(hlo_text: str) -> dict[str, Computation]:
  """Each computation of ``hlo_text`` by name, with its instructions in order."""
  out: dict[str, Computation] = {}
  current: list[Instruction] | None = None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header and line.rstrip().endswith("{"):
      current = []
      out[header.group(2)] = Computation(bool(header.group(1)), current)
    elif line.startswith("}"):
      current = None
    elif current is not None and (match := _INSTRUCTION.match(line)):
      current.append(
        Instruction(match.group(1), _opcode(match.group(2), line), match.group(3), line)
      )
  return out


def count_hlo_ops(hlo_text: str) -> dict[str, int]:
  """Instructions per opcode, fused computations and branches included."""
  counts = collections.Counter(
    i.opcode for c in computations(hlo_text).values() for i in c.instructions
  )
  return dict(counts)


def _opcode(opcode: str, line: str) -> str:
  if opcode == "custom-call" and (called := _CUSTOM_CALL_TARGET.search(line)):
    return next(
      (op for prefix, op in _CUSTOM_CALL_OPCODES if called.group(1).startswith(prefix)), opcode
    )
  return opcode
