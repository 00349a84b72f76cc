"""Reading XLA's optimized HLO text: its computations, instructions, opcode counts and sizes.

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
import itertools
import math
import re
from typing import Final

# One instruction: its name, its shape, its opcode and the rest of the line.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.-]+) = (.*?) ([a-z][\w-]*)\((.*)$")
# One array shape: element type, dimensions and the layout in braces, if any.
_ARRAY = re.compile(r"([a-z]\w*)\[([^\]]*)\](?:\{([^}]*)\})?")
_BITS = re.compile(r"^[a-z]+?(\d+)")
_TILES = re.compile(r"T((?:\([\d,]+\))+)")
_INDEX = re.compile(r"index=(\d+)")
_HEADER = re.compile(r"^(ENTRY )?%([\w.-]+) ")
_PARTITIONS = re.compile(r"num_partitions=(\d+)")
# One entry of a module's input_output_alias: the output's index, then its parameter's.
_ALIAS = re.compile(r"\{([\d,\s]*)\}:\s*\((\d+),")
_CUSTOM_CALL_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_DIM_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")
# Library calls that stand for an HLO opcode: XLA:GPU runs convolutions through cuDNN and
# may run dots through cuBLAS (measured on deviceless H100 compiles).
_CUSTOM_CALL_OPCODES: Final = (("__cudnn$conv", "convolution"), ("__cublas", "dot"))


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  shape: str  # e.g. "f32[8,128]{1,0}", or a tuple "(f32[8]{0}, u8[64]{0})"
  opcode: str  # a cuDNN convolution or cuBLAS product reads as the opcode it stands for
  rest: str  # the line after the opcode's opening parenthesis
  line: str

  @property
  def operands(self) -> list[str]:
    """The names of the instructions it reads, in order."""
    return re.findall(r"%([\w.-]+)", self.rest.split(")", 1)[0])

  @property
  def tuple_index(self) -> int:
    """The element of its operand that a ``get-tuple-element`` reads."""
    return int(_INDEX.search(self.rest).group(1))

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
        Instruction(
          match.group(1), match.group(2), _opcode(match.group(3), line), match.group(4), line
        )
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


def library_convolution_flops(hlo_text: str) -> float:
  """FLOPs of the convolutions ``hlo_text`` runs as cuDNN calls: 2 x the forward output's
  elements x each output's filter elements (its window times its input features).

  A cuDNN call describes the forward convolution whatever it computes; which of its
  operands and result is the forward output and which the filter follows its kind
  (XLA:GPU's ``CudnnConvKind``).

  Example:
    >>> text = ("ENTRY %e (x: f32[1,4,4,2], w: f32[3,3,2,8]) -> f32[1,4,4,8] {\\n"
    ...   '  %x = f32[1,4,4,2]{3,2,1,0} parameter(0)\\n  %w = f32[3,3,2,8]{3,2,1,0} parameter(1)\\n'
    ...   "  %c = (f32[1,4,4,8]{3,2,1,0}, u8[0]{0}) custom-call(%x, %w), "
    ...   'dim_labels=b01f_01io->b01f, custom_call_target="__cudnn$convForward"\\n}')
    >>> library_convolution_flops(text)  # 2 x 128 outputs x (3 x 3 x 2)
    4608.0
  """
  total = 0.0
  if "__cudnn$conv" not in hlo_text:  # most programs: nothing to parse
    return total
  for computation in computations(hlo_text).values():
    shapes = {i.name: i.shape for i in computation.instructions}
    for i in computation.instructions:
      called = _CUSTOM_CALL_TARGET.search(i.line)
      labels = _DIM_LABELS.search(i.line)
      if not (called and labels and called.group(1).startswith("__cudnn$conv")):
        continue
      operands = [_dims(shapes.get(name, "")) for name in i.operands]
      result = _dims(i.shape)
      kind = called.group(1)
      if "BackwardInput" in kind:
        output, kernel = operands[0], operands[1]
      elif "BackwardFilter" in kind:
        output, kernel = operands[1], result
      else:
        output, kernel = result, operands[1]
      out_features = kernel[labels.group(2).index("o")]
      total += 2.0 * math.prod(output) * math.prod(kernel) / out_features
  return total


def collectives(hlo_text: str) -> list[tuple[Instruction, list[int]]]:
  """Each collective of ``hlo_text`` (an async one by its start), with the bytes each
  device sends for each of its results, as ring algorithms send them: an all-gather
  (n - 1) / n of its result, a reduce-scatter n - 1 times its result, an all-reduce twice
  (n - 1) / n of it, over groups of n devices."""
  out = []
  if not any(f" {kind}" in hlo_text for kind in COLLECTIVES):  # one device's program
    return out
  for computation in computations(hlo_text).values():
    for i in computation.instructions:
      kind = i.opcode.removesuffix("-start")
      if kind not in COLLECTIVES:
        continue
      sizes = [b.bytes for b in buffers(i.shape)]
      if i.opcode.endswith("-start") and len(sizes) > 1:  # (operands..., results...)
        sizes = sizes[len(sizes) // 2 :]
      n = _group_size(i.rest)
      out.append((i, [round(size * COLLECTIVES[kind](n)) if n > 1 else 0 for size in sizes]))
  return out


def partitions(hlo_text: str) -> int:
  """How many devices the module is one part of (its ``num_partitions``; 1 unpartitioned)."""
  found = _PARTITIONS.search(hlo_text)
  return int(found.group(1)) if found else 1


def aliased_parameters(hlo_text: str) -> set[int]:
  """The parameters whose buffers the module writes outputs into (donated arguments)."""
  return {parameter for _, parameter in _aliases(hlo_text)}


def aliased_outputs(hlo_text: str) -> set[int]:
  """The outputs (indices into the result tuple) the module writes into donated arguments."""
  return {int(output.split(",")[0]) for output, _ in _aliases(hlo_text) if output.strip()}


def _aliases(hlo_text: str) -> list[tuple[str, int]]:
  header = next((line for line in hlo_text.splitlines() if line.startswith("HloModule")), "")
  return [(output, int(parameter)) for output, parameter in _ALIAS.findall(header)]


def sent_bytes(hlo_text: str) -> int:
  """The bytes each device sends for all of ``hlo_text``'s collectives (`collectives`)."""
  return sum(sum(sent) for _, sent in collectives(hlo_text))


@dataclasses.dataclass(frozen=True)
class OnChip:
  """What a compiled program holds on chip (`on_chip_peak`)."""

  peak_bytes: int  # the most bytes of temporaries held on chip at once
  evicts: bool  # whether it evicts temporaries from there into device memory
  off_chip: frozenset[tuple[str, int]]  # (instruction, element): the arrays of temporaries
  # held in device memory, made there or evicted there


def on_chip_peak(entry: Computation) -> OnChip:
  """The most bytes of temporaries ``entry`` (a module's entry computation, as
  `computations` reads it) holds on chip at once (memory space 1, TPU's VMEM), whether it
  evicts temporaries from there into device memory (where it does, the compiler's
  memory-space assignment filled what it had on chip for this program), and which it
  holds in device memory. Nothing without such a memory space.

  XLA:TPU keeps less on chip for some programs than for others: a graph network's step
  (gathers and segment sums) held at most 57.2 MiB in VMEM at 3 to 8 layers, evicting
  the rest, where other steps held up to 112 MiB (their buffer assignments, jax 0.10.2,
  libtpu 0.0.42.1). The buffers' live ranges are read from the schedule: each array from
  the instruction that makes it (``copy-start``, ``async-start``: their results) to its
  last reader, through tuples, their elements, bitcasts and ``-done`` instructions.
  """
  if not any("S(1)" in i.shape for i in entry.instructions):
    return OnChip(0, False, frozenset())
  by_name = {i.name: i for i in entry.instructions}
  elements: dict[str, list[tuple[str, int] | None]] = {}  # name -> the array of each element
  made: dict[tuple[str, int], tuple[int, int, int]] = {}  # array -> bytes, space, where made
  last_read: dict[tuple[str, int], int] = {}
  evicted: dict[tuple[str, int], tuple[str, int] | None] = {}  # eviction -> array copied
  for at, i in enumerate(entry.instructions):
    arrays, operands = buffers(i.shape), i.operands
    for o in operands:
      for array in elements.get(o, []):
        if array is not None:
          last_read[array] = at
    if i.opcode in ("parameter", "constant"):
      elements[i.name] = [None] * len(arrays)
    elif i.opcode in ("bitcast", "tuple", "opt-barrier"):
      elements[i.name] = [a for o in operands for a in elements.get(o, [None])]
    elif i.opcode == "while":  # runs in its initial state's buffers
      elements[i.name] = list(elements.get(operands[0], []))
    elif i.opcode == "get-tuple-element":
      start, stop = _tuple_spans(by_name[operands[0]].shape)[i.tuple_index]
      elements[i.name] = elements[operands[0]][start:stop]
    elif i.opcode.endswith("-done"):  # the result of its start, in place
      start, stop = _result(by_name[operands[0]])
      elements[i.name] = elements[operands[0]][start:stop]
    else:
      start, stop = _result(i)
      elements[i.name] = [(i.name, j) if start <= j < stop else None for j in range(len(arrays))]
      for j in range(start, stop):
        made[(i.name, j)] = (arrays[j].bytes, arrays[j].space, at)
      if i.opcode == "copy-start" and arrays[0].space == 0 and arrays[1].space == 1:
        evicted[(i.name, 0)] = elements.get(operands[0], [None])[0]
  root = next((i for i in entry.instructions if i.is_root), entry.instructions[-1])
  outputs = set(elements.get(root.name, []))
  change = [0] * (len(entry.instructions) + 1)  # bytes on chip made, less freed, at each
  for array, (size, space, at) in made.items():
    if space == 1 and array not in outputs:
      change[at] += size
      change[last_read.get(array, at) + 1] -= size
  temporaries = evicted.keys() - outputs
  off_chip = {evicted[a] for a in temporaries} | {
    a for a, (_, space, _) in made.items() if space == 0 and a not in outputs and a not in evicted
  }
  return OnChip(max(itertools.accumulate(change)), bool(temporaries), frozenset(off_chip - {None}))


def _result(instruction: Instruction) -> tuple[int, int]:
  """The range of the arrays ``instruction`` makes among its shape's: of an asynchronous
  start's tuple, the element that holds its result (a copy-start makes (destination,
  source, context), the others ((operands...), results, context...))."""
  spans = _tuple_spans(instruction.shape)
  if instruction.opcode.endswith("-start") and len(spans) > 1:
    return spans[0 if instruction.opcode == "copy-start" else 1]
  return 0, len(buffers(instruction.shape))


def _tuple_spans(shape: str) -> list[tuple[int, int]]:
  """Per top-level element of ``shape``, the range of its arrays among `buffers`' (one
  range for an array)."""
  spans, depth, count = [], 0, 0
  for token in re.findall(r"[()]|[a-z]\w*\[", re.sub(r"\{[^}]*\}", "", shape)):
    if token == "(":
      depth += 1
      if depth == 2:
        spans.append((count, count))
    elif token == ")":
      depth -= 1
    elif depth <= 1:
      spans.append((count, count + 1))
      count += 1
    else:
      spans[-1] = (spans[-1][0], count + 1)
      count += 1
  return spans


# Bytes each device sends per byte of a collective's result, over n devices (ring).
COLLECTIVES: Final = {
  "all-gather": lambda n: (n - 1) / n,
  "all-reduce": lambda n: 2 * (n - 1) / n,
  "reduce-scatter": lambda n: n - 1,
  "all-to-all": lambda n: (n - 1) / n,
  "collective-permute": lambda n: 1.0,
}
_GROUPS_LISTED = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[\d+,(\d+)\]")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


def _group_size(rest: str) -> int:
  """How many devices each of a collective's groups spans (2 where it cannot be read: a
  collective-permute sends to one other device whatever its pairs)."""
  if m := _GROUPS_LISTED.search(rest):
    return len(m.group(1).split(","))
  if m := _GROUPS_IOTA.search(rest):
    return int(m.group(1))
  if m := _GROUPS_MESH.search(rest):
    axes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
    return math.prod(int(axes.get(a, 1)) for a in re.findall(r"'(\w+)'", m.group(2)))
  return 2


def _dims(shape: str) -> list[int]:
  """The dimensions of ``shape``'s first array."""
  found = _ARRAY.search(shape)
  return _parse_dims(found.group(2)) if found else []


def _parse_dims(dims_text: str) -> list[int]:
  """``"8,<=128"`` as ``[8, 128]`` (a bounded dynamic dimension at its bound)."""
  return [int(d.lstrip("<=")) for d in dims_text.split(",") if d.strip()]


@dataclasses.dataclass(frozen=True)
class Buffer:
  """One array of an instruction's shape as the device stores it."""

  dtype: str
  bytes: int  # with the layout's tile padding
  elements: int  # without it
  space: int = 0  # memory space: 0 device memory, 1 TPU's on-chip VMEM (``S(1)``)


def buffers(shape: str) -> list[Buffer]:
  """The arrays of ``shape`` (one, or a tuple's elements in order), padded to their tiles.

  A tiled layout (TPU: ``{1,0:T(8,128)(2,1)}``) pads the minor dimensions, in layout order,
  to multiples of its first tile; ``E(bits)`` overrides the element size. The memory space
  (``S(1)``, TPU's on-chip memory) does not change the size: TPU's `memory_analysis` peak
  counts those buffers too (measured: the MLP example's step on TPU v5e).

  Example:
    >>> buffers("(bf16[30,100]{1,0:T(8,128)(2,1)}, u8[64]{0:S(1)})")
    [Buffer(dtype='bf16', bytes=8192, elements=3000, space=0), Buffer(dtype='u8', bytes=64, elements=64, space=1)]
  """
  return [_buffer(*match.groups()) for match in _ARRAY.finditer(shape)]


def _buffer(dtype: str, dims_text: str, layout: str | None) -> Buffer:
  dims = _parse_dims(dims_text)
  elements = math.prod(dims)
  bits, space = _element_bits(dtype), 0
  if layout:
    order, _, attributes = layout.partition(":")
    minor_to_major = [int(d) for d in order.split(",") if d.strip()]
    if len(minor_to_major) == len(dims):
      dims = [dims[d] for d in reversed(minor_to_major)]
    if tiles := _TILES.search(attributes):
      tile = [int(t) for t in tiles.group(1)[1:].split(")", 1)[0].split(",")]
      dims = [1] * (len(tile) - len(dims)) + dims
      for j, t in enumerate(tile, start=len(dims) - len(tile)):
        dims[j] = -(-dims[j] // t) * t
    if element := re.search(r"E\((\d+)\)", attributes):
      bits = int(element.group(1))
    if memory := re.search(r"S\((\d+)\)", attributes):
      space = int(memory.group(1))
  return Buffer(dtype, -(-math.prod(dims) * bits // 8), elements, space)


def _element_bits(dtype: str) -> int:
  if dtype == "pred":
    return 8
  if dtype == "token":
    return 0
  found = _BITS.match(dtype)
  if found is None:
    raise ValueError(f"HLO element type {dtype!r} has no size; jaxremat cannot read it.")
  return int(found.group(1))
