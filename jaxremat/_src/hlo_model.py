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

import collections
import dataclasses
import functools
import math
import re
from collections.abc import Mapping
from typing import Any, Final

import jax

from jaxremat._src import compat
from jaxremat._src.hlo_text import (
  COLLECTIVES,
  Buffer,
  Instruction,
  aliased_outputs,
  aliased_parameters,
  buffers,
  collectives,
  computations,
  on_chip_peak,
  partitions,
)
from jaxremat._src.measure import Measurement, compile_and_measure
from jaxremat._src.targets import Target

# The scope each equation is compiled under, in the model and in `emit(..., scoped=True)`.
EQUATION_SCOPE: Final = "jaxremat_eqn"
_SCOPED = re.compile(EQUATION_SCOPE + r"(\d+)")
_STEP = re.compile(EQUATION_SCOPE + r"\d+/([^/\"]+)")
_CALLS = re.compile(r"calls=%([\w.-]+)")
# Instructions that hold no buffer of their own.
_NO_BUFFER: Final = frozenset({"parameter", "tuple", "get-tuple-element", "bitcast", "constant"})
_PARAMETER = re.compile(r"parameter\((\d+)\)")
# Instructions that XLA runs in the buffer of the operand they update, as their output.
_IN_PLACE: Final = frozenset({"scatter", "dynamic-update-slice"})
# Instructions that hold their operand's value in another dtype or layout.
_STORAGE_ONLY: Final = frozenset({"convert", "copy", "bitcast", "reshape", "bitcast-convert"})
# What a fused computation of conversions only holds.
_CONVERTING: Final = _STORAGE_ONLY | {"parameter"}
# Instructions whose output is no elementwise function or layout of their operands.
_REDUCING: Final = frozenset({"reduce", "reduce-window", "select-and-scatter", "sort"})
# Instructions that compute new values from their operands, more than moving them.
_COMPUTING: Final = _REDUCING | {"convolution", "dot", "custom-call"}
# Instructions whose every output element reads each operand's element at its index alone
# (XLA's ``IsElementwise``).
_ELEMENTWISE: Final = frozenset(
  """abs add and atan2 cbrt ceil clamp clz compare complex convert copy cos divide erf exp
  expm1 floor imag is-finite log log1p logistic maximum minimum multiply negate not or
  popcnt power real reduce-precision remainder round-nearest-afz round-nearest-even rsqrt
  select shift-left shift-right-arithmetic shift-right-logical sign sin sqrt subtract tan
  tanh xor""".split()
)
# Fusions whose output XLA may write into an operand's buffer (loop and input fusions).
_LOOP_FUSION = re.compile(r"kind=k(?:Loop|Input)\b")


@dataclasses.dataclass(frozen=True)
class CompiledValues:
  """What the target compiler keeps of a flat jaxpr's values, and at what size."""

  kept: frozenset[int]  # equations some top-level instruction computes last
  bytes: dict[int, int]  # kept equation -> its outputs' bytes in device memory
  scratch: dict[int, int]  # equation -> the most bytes of its own copies and work held at once
  position: dict[int, int]  # kept equation -> where the compiler's schedule first makes it
  argument_bytes: tuple[int, ...]  # per jaxpr input, as the compiled parameter holds it
  read_for: dict[int, set[int]]  # kept equation -> the others whose instructions read it
  constants: dict[int, int]  # equation -> bytes XLA makes once that no equation owns (from
  # constants, or copies of arguments), held from the start until it runs
  hoisted: frozenset[int]  # equations whose output buffer XLA makes at the start
  # kept equation -> equations of later instructions that compute it again from its
  # operands instead of reading its buffer
  remade_for: dict[int, set[int]] = dataclasses.field(default_factory=dict)
  # equation in constants -> the kept equation whose value the reader of those bytes reads
  # last, and the equations that reader works for: it runs where the copy of that value
  # they read is made (a max pool gradient's argmax, where the pool's input is made)
  constants_for: dict[int, tuple[int, frozenset[int]]] = dataclasses.field(default_factory=dict)
  measurement: Measurement | None = None  # the compiler's figures for the program
  executable: Any = None  # the program compiled (``jax.jit``'s ``Compiled``)
  partitions: int = 1  # devices the step is partitioned over; sizes are one device's
  collective_bytes: dict[int, int] = dataclasses.field(default_factory=dict)  # equation ->
  # the bytes each device sends for the collectives the partitioner made for it
  on_chip_peak_bytes: int = 0  # the most bytes of temporaries held on chip at once
  evicts_from_chip: bool = False  # whether it evicts temporaries from chip (`on_chip_peak`)
  off_chip: frozenset[int] = frozenset()  # kept equations held in device memory beside it
  aliased_outputs: frozenset[int] = frozenset()  # outputs written into donated arguments
  # kept equation -> the kept equations one multi-output instruction computes with it
  made_with: dict[int, frozenset[int]] = dataclasses.field(default_factory=dict)
  # kept equation -> its buffer's bytes, and the kept equations whose buffer of as many
  # bytes its instruction reads elementwise and last: XLA writes it into one of them
  writes_into: dict[int, tuple[int, frozenset[int]]] = dataclasses.field(default_factory=dict)


def compiled_values(
  closed: Any,
  target: str | Target | None,
  donate_argnums: tuple[int, ...] = (),
  scopes: tuple[int, ...] | None = None,
  specs: tuple[jax.ShapeDtypeStruct, ...] | None = None,
) -> CompiledValues:
  """Which values of flat ``closed`` the compiler keeps, read from its optimized program.

  Args:
    closed: a flat ``ClosedJaxpr`` (`capture.flatten_jaxpr`).
    target: the compiler (`jaxremat.get_target`; None: this machine's).
    donate_argnums: the donated inputs, so that the measurement is the step's own.
    scopes: per equation, the number that names it in the result (default: its index);
      `trace` names repeats after the equation that `capture.merge_repeats` keeps.
    specs: per jaxpr input, its traced type with its sharding over a device mesh, where
      the step is partitioned (default: the inputs' types, on one device). The compiled
      program is then one device's part of the step, and so are the sizes read from it.
  """
  jaxpr, consts = compat.open_jaxpr(closed)
  scopes = scopes or range(len(jaxpr.eqns))

  def scoped(*args: Any) -> list[Any]:
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(v: Any) -> Any:
      return v.val if isinstance(v, compat.Literal) else env[v]

    for k, eqn in zip(scopes, jaxpr.eqns, strict=True):
      with jax.named_scope(f"{EQUATION_SCOPE}{k}"):
        outs = eqn.primitive.bind(*map(read, eqn.invars), **compat.bind_params(eqn))
      outs = outs if eqn.primitive.multiple_results else [outs]
      env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]

  specs = specs or [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.invars]
  executable, measured = compile_and_measure(
    scoped, *specs, donate_argnums=donate_argnums, target=target
  )
  values = values_in_hlo(measured.hlo_text, len(jaxpr.invars), _equations(jaxpr, scopes))
  return dataclasses.replace(
    values,
    measurement=measured,
    executable=executable,
    collective_bytes=collective_bytes(measured.hlo_text),
  )


def scoped_values(hlo: str, jaxpr: Any) -> CompiledValues:
  """`values_in_hlo` of the optimized ``hlo`` of flat ``jaxpr``'s equations, each compiled
  under the scope of its index (`emit(..., scoped=True)`)."""
  return values_in_hlo(hlo, len(jaxpr.invars), _equations(jaxpr, range(len(jaxpr.eqns))))


def _equations(jaxpr: Any, scopes: Any) -> dict[int, tuple[str, int]]:
  """Per scoped equation, its primitive and the elements of its smallest output."""
  return {
    k: (eqn.primitive.name, min(math.prod(v.aval.shape) for v in eqn.outvars))
    for k, eqn in zip(scopes, jaxpr.eqns)
    if eqn.outvars
  }


def collective_bytes(hlo: str) -> dict[int, int]:
  """Per scoped equation, the bytes each device sends for the collectives that the SPMD
  partitioner made for it (an FSDP weight's all-gather before its product, a gradient's
  all-reduce; `hlo_text.sent_bytes`). A collective that XLA combined from several (one
  all-reduce of every gradient) names each output's equation in turn in its metadata.

  Example:
    >>> line = ('  %g = f32[64]{0} all-gather(%p), replica_groups={{0,1,2,3}}, '
    ...         'dimensions={0}, metadata={op_name="jit(f)/jaxremat_eqn3/dot_general"}')
    >>> collective_bytes("ENTRY %main (p: f32[16]) -> f32[64] {\\n" + line + "\\n}")
    {3: 192}
  """
  found = collectives(hlo)
  readers: dict[str, list[Instruction]] = collections.defaultdict(list)
  if any(not _scopes(i.line) for i, _ in found):
    for computation in computations(hlo).values():
      for i in computation.instructions:
        for o in i.operands:
          readers[o].append(i)

  def first_scope(instruction: Instruction) -> int | None:
    """The first equation that reads what an unnamed instruction makes (newer JAX names
    a gathered argument after the argument, not after the product that reads it)."""
    seen, todo = set(), [instruction]
    while todo:
      i = todo.pop(0)
      if (k := _scope(i.line)) is not None:
        return k
      todo += [r for r in readers[i.name] if r.name not in seen]
      seen.update(r.name for r in readers[i.name])
    return None

  out: dict[int, int] = {}
  for instruction, sent in found:
    scopes = _scopes(instruction.line) or [first_scope(instruction)]
    for j, size in enumerate(sent):
      k = scopes[j] if len(scopes) == len(sent) else scopes[0]
      if k is not None:
        out[k] = out.get(k, 0) + size
  return out


def values_in_hlo(
  hlo: str, n_arguments: int, equations: Mapping[int, tuple[str, int]] | None = None
) -> CompiledValues:
  """The scoped equations that top-level instructions of the entry computation root, the
  bytes of what they hold in device memory, and where the schedule makes them (the entry
  computation of an optimized module lists its instructions in execution order).

  Reads are followed through tuples, their elements and bitcasts to the buffer read, and
  through unnamed instructions to the equations that read what those make: each kept
  equation's readers in the compiled program, which may be more than the jaxpr's (XLA
  recomputes cheap producers inside their readers' fusions). A buffer that is not an
  equation's first (an unnamed copy: a layout change, a transposed operand, XLA:CPU's
  float32 for a bfloat16 value; or a second buffer under the same name) is scratch of the
  one equation that reads it, where one does and nothing else runs in between; so is an
  equation's first buffer where the equation makes another after it, in the layout of the
  one reader that runs right after it (XLA:CPU computes a value that one product reads
  transposed twice, once in that layout), and so is every buffer of an equation that makes
  each only for the one reader right after it (XLA:GPU pads a transposed convolution's
  input for it, and transposes it again for the weight's gradient). One that its equation
  makes to hold across other equations' work is more of that equation's value. One that a
  reduction named after no equation makes and holds across other equations' work for its
  one reader (XLA:GPU's argmax indices of a max pool, made in the forward pass for the
  gradient's scatter) is held like the buffers made from constants below; an unnamed copy
  in another layout held so (XLA:CPU's transposed activations for the backward pass)
  stands for a value that the graph holds, and stays scratch. A named buffer that only its
  own equation's next instructions read (split-K partial products) is that equation's
  scratch, and so is one that an unnamed computation (a convolution, a product, a
  reduction, a library call) makes for the one equation that the unnamed instructions
  reading it work for, wherever it runs (XLA:CPU computes a depthwise convolution's
  weight gradient as a dense one and masks it into another buffer); an equation's scratch
  is the most of its buffers live at one instruction. A buffer that nothing reads is its
  instruction's working memory. A buffer made
  from constants alone, whichever instruction makes it (a max pool gradient's zeros; on
  XLA:GPU the zeros of every ReLU's gradient, a second output of the forward ReLU's
  fusion), is no equation's value: XLA makes it once, wherever a plan remakes its maker,
  and holds it for its last reader, or it is the output of the one reader that updates it
  in place. An unnamed conversion that several equations read holds a value in another
  dtype or layout (XLA:CPU computes bfloat16 arithmetic in float32 and names neither
  copy): of a value's buffers, those held for at least half of its life make its size; a
  copy of an argument held beside it across other equations' work is held like the buffers
  made from constants, and so is one into another memory space (XLA:TPU's prefetch of a
  weight into VMEM, held there for the backward pass). An unnamed fusion that computes,
  from the step's values, one equation that no instruction keeps holds that equation's
  value in another form (XLA:TPU's ReLU masks, packed). Outputs of the step made on chip
  and copied out after (XLA:TPU's optimizer updates) are scratch of each equation their
  instruction makes, and a copy of an argument on its way into another memory space is
  scratch of each equation made meanwhile. Other unnamed buffers read by
  several equations are left out: their lifetimes are not known. A buffer that an inner
  step of its equation's lowering makes, smaller than one device's share of every output
  of the equation (``equations``: per scoped equation, its primitive and the elements of
  its smallest output), is no value of it and named after no equation. A value's instruction
  that reads another value's buffer of its size and element type last, and elementwise
  only (a loop fusion, or an elementwise instruction), writes into that buffer where no
  step output is involved (``writes_into``).
  """
  equations = equations or {}
  parts = partitions(hlo)

  def lowering_step(k: int | None, holder: Instruction | None, made: Buffer) -> bool:
    """Whether ``holder`` makes a part of equation ``k``'s work, not its value: an inner
    step of its lowering with fewer elements than one device's share of every output
    (the per-axis counters of threefry's random bits, which XLA:TPU computes into each
    reader). A conversion that XLA moves before a broadcast holds the value, in fewer
    elements, under the equation's own primitive."""
    if holder is None or k not in equations:
      return False
    primitive, fewest = equations[k]
    return _step(holder.line) not in (None, primitive) and made.elements * parts < fewest

  computed = computations(hlo)
  entry = next(c for c in computed.values() if c.is_entry)
  roots_of: dict[str, list[int | None]] = {}  # instruction -> the equation of each output
  own: dict[str, int | None] = {}  # instruction -> the equation it runs for, if named
  held: dict[str, list[int]] = {}  # instruction -> the bytes of each of its buffers
  spaces: dict[str, list[int]] = {}  # instruction -> the memory space of each buffer
  elements: dict[str, list[tuple[str, int]]] = {}  # name -> the buffers its value is
  read_by: dict[tuple[str, int], list[str]] = {}  # buffer -> the instructions reading it
  last_read: dict[tuple[str, int], int] = {}  # buffer -> where its last reader runs
  outputs: set[tuple[str, int]] = set()
  # instruction that updates an operand's buffer in place -> that operand, where one is
  updates: dict[str, str | None] = {}
  constant_names: set[str] = set()
  parameter_index: dict[str, int] = {}  # parameter instruction -> its number
  argument_reads: collections.Counter[str] = collections.Counter()  # parameter -> readers
  aliased = aliased_parameters(hlo)  # parameters whose buffers outputs are written into
  from_constants: dict[str, set[int]] = {}  # instruction -> its outputs made from constants
  reducing: set[str] = set()  # instructions that reduce (`_REDUCING`)
  computing: set[str] = set()  # instructions that compute (`_COMPUTING`)
  conversions: dict[str, str] = {}  # instruction that only converts -> its one operand
  moves: dict[str, str] = {}  # unnamed instruction that moves (part of) one argument -> it
  inside: dict[str, set[int]] = {}  # fusion -> the equations its body computes
  bodies: dict[str, list[Instruction]] = {}  # instruction -> its called computation's
  by_name = {i.name: i for i in entry.instructions}
  index_of = {i.name: at for at, i in enumerate(entry.instructions)}
  for at, instruction in enumerate(entry.instructions):
    name, operands = instruction.name, instruction.operands
    if instruction.opcode in ("parameter", "constant"):
      elements[name] = []
      if instruction.opcode == "parameter":
        parameter_index[name] = int(_PARAMETER.search(instruction.line).group(1))
        spaces[name] = [b.space for b in buffers(instruction.shape)]
      if instruction.opcode == "constant":
        constant_names.add(name)
    elif instruction.opcode in ("bitcast", "tuple"):
      elements[name] = [b for o in operands for b in elements.get(o, [])]
    elif instruction.opcode == "get-tuple-element":
      whole = elements.get(operands[0], [])
      index = instruction.tuple_index
      elements[name] = whole[index : index + 1] if len(whole) > 1 else whole
    else:
      called = _CALLS.search(instruction.rest)
      body = (
        computed[called.group(1)].instructions if called and called.group(1) in computed else []
      )
      bodies[name] = body
      made = buffers(instruction.shape)
      sizes_of = [b.bytes for b in made]
      spaces[name] = [b.space for b in made]
      holders: list[Instruction | None] = [instruction]
      roots = [_scope(instruction.line)]
      if instruction.opcode == "fusion" and body:
        found = _fusion_outputs(body)
        if any(i is not None for i in found):
          holders = found
          roots = [None if i is None else _scope(i.line) for i in found]
        inside[name] = {k for i in body if (k := _scope(i.line)) is not None}
      elif len(listed := _scopes(instruction.line)) == len(sizes_of) > 1:
        roots = listed  # ops XLA combined (one all-reduce of every gradient) name each output
        holders = [None] * len(listed)
      roots = [
        None if lowering_step(k, i, b) else k for k, i, b in zip(roots, holders, made)
      ] + roots[len(made) :]
      roots_of[name] = roots
      own[name] = next((k for k in roots if k is not None), _scope(instruction.line))
      held[name] = sizes_of or [0]
      elements[name] = [(name, j) for j in range(len(sizes_of))]
      if instruction.opcode == "while":
        # A loop runs in its initial state's buffers and returns them (the dropout
        # step's random bits, four buffers per layer where XLA:CPU holds two).
        held[name] = []
        elements[name] = list(elements.get(operands[0], []))
      if len(operands) == 1 and all(i.opcode in _CONVERTING for i in body or [instruction]):
        conversions[name] = operands[0]
      (source, *others) = {o if o in parameter_index else moves.get(o) for o in operands} or {None}
      if instruction.opcode != "fusion" and own[name] is None and source and not others:
        moves[name] = source
      root = next((i for i in body if i.is_root), instruction)
      if root.opcode in _IN_PLACE:
        updates[name] = _updated_operand(instruction, body, root)
      if any(i.opcode in _REDUCING for i in body or [instruction]):
        reducing.add(name)
      if any(i.opcode in _COMPUTING for i in body or [instruction]):
        computing.add(name)
      if all(o in constant_names for o in operands):
        from_constants[name] = set(range(len(sizes_of)))
      elif instruction.opcode == "fusion" and body:
        from_constants[name] = _constant_outputs(body)
      for o in operands:
        if o in parameter_index:
          argument_reads[o] += 1
        for b in elements.get(o, []):
          read_by.setdefault(b, []).append(name)
          last_read[b] = at
    if instruction.is_root:
      outputs.update(elements[name])

  def started(name: str) -> int:
    """Where the first instruction of the moves that make ``name`` runs."""
    return min([index_of[name]] + [started(o) for o in by_name[name].operands if o in moves])

  def copied_out(name: str) -> bool:
    """Whether unnamed ``name`` copies what it reads into the step's outputs."""
    return own[name] is None and any(
      b in outputs or any(map(copied_out, read_by.get(b, []))) for b in elements[name]
    )

  # An argument moved into another memory space, whole (``copy-start``/``copy-done``) or
  # in slices put together there: XLA:TPU prefetches a weight into VMEM for its product
  # and may hold it there for the backward pass. The copy that equations read is one of
  # the argument.
  elsewhere: set[str] = set()  # those copies, which no argument's buffer can hold
  for name, argument in moves.items():
    onward = any(r in moves for b in elements[name] for r in read_by.get(b, []))
    moved = spaces[name][:1] != spaces[argument][:1]
    if moved and not onward:
      conversions[name] = argument
      elsewhere.add(name)

  def argument(name: str) -> bool:
    """Whether ``name`` is an argument, or a copy or conversion of one."""
    while name in conversions:
      name = conversions[name]
    return name in parameter_index or name in moves

  # An unnamed fusion of one output that computes, from the step's values, one equation
  # that no instruction keeps holds that equation's value in another form: XLA:TPU packs a
  # ReLU's mask 32 to a word in the forward pass and unpacks it in the backward one, where
  # the mask's operand, the convolution's output, is long gone (the U-Net example: 128
  # KiB, not 4 MiB, held). (From an argument it is a copy of the argument: XLA:CPU's
  # reversed convolution kernels for the backward pass stay their readers' scratch.)
  rooted = {k for roots in roots_of.values() for k in roots}
  for name in roots_of:
    computes = inside.get(name, set())
    unnamed = own[name] is None and not from_constants.get(name)
    if unnamed and len(held[name]) == len(computes) == 1 and not computes & rooted:
      if not any(map(argument, by_name[name].operands)):
        (k,) = computes
        roots_of[name], own[name] = [k], k
  named: dict[str, frozenset[int | None]] = {}  # instruction -> the equations it serves

  def readers_of(b: tuple[str, int]) -> frozenset[int | None]:
    return frozenset().union(*(serves(r) for r in read_by.get(b, [])))

  def serves(name: str) -> frozenset[int | None]:
    if name not in named:
      if own[name] is not None:
        named[name] = frozenset({own[name]})
      else:  # an unnamed copy or conversion: whom what it makes is for
        made = [readers_of(b) for b in elements[name]]
        named[name] = frozenset().union(*made) or frozenset({None})
    return named[name]

  sizes: dict[int, int] = {}
  # equation -> each scratch buffer: where it is made, where its last reader runs, bytes
  scratch: dict[int, list[tuple[int, int, int]]] = collections.defaultdict(list)
  position: dict[int, int] = {}
  read_for: dict[int, set[int]] = {}
  constants: dict[int, int] = {}
  hoisted: set[int] = set()
  # bytes made from constants (or indices no equation makes), where their last reader runs
  early: list[tuple[int, int, bool]] = []
  arguments = [0] * n_arguments
  # kept equation -> each buffer of its value: where it is made, its last reader, its
  # bytes, and the buffer (None: a step output, held to the end)
  pieces: dict[int, list[tuple[int, int, int, tuple[str, int] | None]]] = {}
  writes_into: dict[int, tuple[int, frozenset[int]]] = {}

  def between(k: int | None, start: int, end: int, *also: int) -> bool:
    return k is not None and _own_step(entry.instructions, roots_of, {k, *also}, start, end)

  def updated(b: tuple[str, int], size: int) -> bool:
    """Whether ``b`` is the buffer its one reader updates and returns (a scatter's zeros)."""
    return {sum(held[r]) if r in updates else None for r in read_by[b]} == {size}

  def updates_in_place(instruction: Instruction, size: int) -> int | None:
    """The kept equation whose buffer of ``size`` bytes ``instruction`` updates in place
    and returns, where nothing reads it after."""
    found = elements.get(updates.get(instruction.name), [])
    if len(found) != 1 or found[0][0] not in roots_of or read_by[found[0]] != [instruction.name]:
      return None
    ((maker, j),) = found
    u = output_roots(maker)[j]
    return u if u in sizes and held[maker][j] == size else None

  def relaid_for(instruction: Instruction, at: int, size: int) -> int | None:
    """The kept equation whose buffer, dying here, unnamed ``instruction`` reads alone and
    copies into ``size`` bytes at most (another layout of its value), if it does."""
    read = [b for o in instruction.operands for b in elements.get(o, [])]
    if own[instruction.name] is not None or len(read) != 1:
      return None
    ((maker, i),) = read
    u = output_roots(maker)[i] if maker in roots_of else None
    if u in sizes and last_read.get((maker, i)) == at and size <= held[maker][i]:
      return u
    return None

  def replaced(instruction: Instruction, k: int) -> int:
    """The bytes of equation ``k``'s buffers that only ``instruction`` reads."""
    return sum(
      held[maker][j]
      for o in instruction.operands
      for maker, j in elements.get(o, [])
      if maker in roots_of
      and output_roots(maker)[j] == k
      and read_by.get((maker, j)) == [instruction.name]
    )

  def output_roots(name: str) -> list[int | None]:
    """The equation of each buffer ``name`` makes."""
    sizes_of, roots = held[name], roots_of[name]
    if len(roots) != len(sizes_of):  # one value and a library call's scratch, or a tuple root
      return (roots[:1] + [None] * (len(sizes_of) - 1))[: len(sizes_of)]
    return roots

  @functools.cache
  def read_elementwise(fusion: str) -> frozenset[int]:
    """`_read_elementwise` of the body of ``fusion``, once per fusion, not per output."""
    return _read_elementwise(bodies[fusion])

  def dying_operands(instruction: Instruction, j: int, at: int) -> frozenset[int]:
    """The kept equations whose buffer in device memory, of the element type, elements and
    bytes of the instruction's output ``j``, the instruction reads last and elementwise
    only, where neither is a step output: XLA's buffer assignment writes that output into
    one of them (HloDataflowAnalysis's buffer sharing: XLA:CPU writes each tanh of the MLP
    example into its product's buffer, and the tanh's gradient into the tanh's). Not on
    chip: XLA:TPU shared none of the GPT example's VMEM buffers so."""
    body = bodies[instruction.name]
    if not (_LOOP_FUSION.search(instruction.rest) if body else instruction.opcode in _ELEMENTWISE):
      return frozenset()
    output = buffers(instruction.shape)[j]
    if output.space:  # on chip (TPU's VMEM), where memory-space assignment places buffers
      return frozenset()
    taken = set()
    for operand, o in enumerate(instruction.operands):
      read = elements.get(o, [])
      if len(read) != 1 or read[0] in outputs or last_read.get(read[0]) != at:
        continue
      ((maker, i),) = read
      u = output_roots(maker)[i] if maker in roots_of else None
      if (
        any(piece[3] == read[0] for piece in pieces.get(u, ()))
        and buffers(by_name[maker].shape)[i] == output
        and (not body or operand in read_elementwise(instruction.name))
      ):
        taken.add(u)
    return frozenset(taken)

  def converts(name: str) -> int | None:
    """The equation whose value unnamed conversion ``name`` holds in another dtype or
    layout, if it converts one."""
    source = elements.get(conversions[name], []) if own[name] is None else []
    if len(source) != 1 or source[0][0] not in roots_of:
      return None
    maker, j = source[0]
    return None if j in from_constants.get(maker, ()) else output_roots(maker)[j]

  # A value that only an unnamed conversion reads is held as that conversion makes it:
  # XLA:CPU computes a bfloat16 product in float32 and converts it for storage.
  converted: set[tuple[str, int]] = set()
  dropped: set[tuple[str, int]] = set()  # buffers a conversion's copy stands for
  for name, operand in conversions.items():
    if (k := converts(name)) is not None and read_by[elements[operand][0]] == [name]:
      roots_of[name], own[name] = [k], k
      converted.add(elements[operand][0])
  # The buffers each equation has yet to make: XLA:CPU may make a value twice, once in
  # the layout of the one product that reads it next (the Equinox step's attention).
  to_come = collections.Counter(k for name in roots_of for k in output_roots(name))
  relaid: set[int] = set()  # equations made so far only in their readers' layouts
  for at, instruction in enumerate(entry.instructions):
    if instruction.opcode == "parameter":
      index = parameter_index[instruction.name]
      if index < n_arguments:
        arguments[index] = sum(b.bytes for b in buffers(instruction.shape))
      continue
    if instruction.name not in roots_of:
      continue
    sizes_of, roots = held[instruction.name], output_roots(instruction.name)
    owner = own[instruction.name]
    # Outputs of the step made on chip and copied to their output buffers after (XLA:TPU
    # makes each weight's optimizer update in VMEM): while the instruction runs, those
    # buffers are there beside the outputs, for each equation it makes.
    staged = sum(
      size
      for j, (size, space) in enumerate(zip(sizes_of, spaces[instruction.name]))
      if space and any(map(copied_out, read_by.get((instruction.name, j), [])))
    )
    for j, (k, size) in enumerate(zip(roots, sizes_of)):
      b = (instruction.name, j)
      readers, end = readers_of(b), last_read.get(b, at)
      direct = {own[r] for r in read_by.get(b, [])}
      (reader,) = direct if len(direct) == 1 else (None,)
      if b in outputs:
        readers = readers | {None}
        reader = None
      holder = owner if k is None else k
      to_come[k] -= 1
      if b in converted:  # the equation's result before it is stored
        scratch[k].append((at, end, size))
        continue
      if j in from_constants.get(instruction.name, ()) and readers - {None}:
        # Zeros or indices made from constants alone: held for their last reader.
        if reader is not None and updated(b, size):
          if not between(reader, at, end):  # else made for its reader as it runs (XLA:GPU)
            hoisted.add(reader)
        else:
          early.append((size, end, True))
        continue
      if k is not None and (u := updates_in_place(instruction, size)) not in (None, k):
        # Another value's buffer, dying here, updated in place (XLA:CPU adds a
        # cross-entropy's one-hot gradient into the softmax's): one buffer, held by that
        # value until this one's readers have run.
        read_for[u].update(readers - {u, None})
        if k not in sizes:
          sizes[k], position[k] = 0, at
        continue
      collective = instruction.opcode.removesuffix("-start") in COLLECTIVES
      if k is not None and readers == {k} and (collective or between(k, at, end)):
        # A collective's result only its own equation reads (an FSDP weight gathered for
        # its product), wherever the schedule puts it, is scratch of that equation too.
        # A step of its own equation's work that only the equation's next instructions
        # read (XLA:GPU's split-K partial products, summed by a reduction after them).
        scratch[k].append((at, end, size))
        continue
      made_later = k is not None and (to_come[k] or k in relaid)
      if made_later and k not in sizes and between(reader, at, end, k):
        # The value in one reader's layout, made for it alone; the value is made later,
        # or never but so (XLA:GPU pads a transposed convolution's input for it, and
        # transposes it for the weight's gradient: the value is its operand's).
        scratch[reader].append((at, end, size))
        relaid.add(k)
        continue
      if k is not None and k not in sizes:
        if b not in outputs and (taken := dying_operands(instruction, j, at)):
          writes_into[k] = (size, taken)
        sizes[k] = size
        position[k] = at
        pieces[k] = [(at, end, size, None if b in outputs else b)]
        read_for.setdefault(k, set()).update(readers - {k, None})
        if staged:
          scratch[k].append((at, at, staged))
        continue
      if holder is None and reader is None and instruction.name in conversions:
        # An unnamed conversion that several equations read: the value, or an argument,
        # in another dtype or layout (XLA:CPU's float32 copies of bfloat16 activations
        # and weights, for the next product and for the weight's gradient).
        source, operand = converts(instruction.name), conversions[instruction.name]
        if source in sizes:
          # The value's one size is that of its buffers XLA holds for at least half of
          # the value's life (a product's float32 result that dies into its bfloat16
          # copy is no more of it; a copy that dies in the forward pass neither).
          (original,) = elements[operand]
          start, dies = position[source], last_read.get(original, at)
          life = max(end, dies) - start
          pieces.pop(source, None)  # a conversion's buffers follow this rule instead
          if 2 * (end - at) >= life:
            sizes[source] += size
            read_for[source].update(readers - {source, None})
          first = entry.instructions[start].name == original[0]
          if first and 2 * (dies - start) < life and original not in dropped:
            dropped.add(original)
            sizes[source] -= held[original[0]][original[1]]
          continue
        copied = (
          parameter_index.get(operand) in aliased
          and argument_reads[operand] == 1
          and instruction.name not in elsewhere
        )
        if (
          operand in parameter_index
          and not copied
          and not _own_step(entry.instructions, roots_of, readers - {None}, at, end)
        ):
          # A copy held beside its argument across others' work: XLA makes it once,
          # wherever a plan moves its readers. (A donated argument that only its copy
          # reads holds the copy in its own buffer, the Equinox step's weights, unless the
          # copy is in another memory space: TPU's VMEM.)
          early.append((size, end, False))
          continue
      if not readers:
        if holder is not None:  # what the instruction works in, read by nothing after it
          scratch[holder].append((at, at, size))
      elif (
        reader is not None
        and holder is None
        and instruction.name in reducing
        and not between(reader, at, end)
      ):
        # New values that no equation makes, held for one reader: a plan that moves the
        # reader does not move them (the U-Net example on H100: 0.74 MB of argmax
        # indices; a plan at 0.5 read 19% under XLA with them as scratch).
        early.append((size, end, False))
      elif reader is not None and (holder not in sizes or between(reader, at, end)):
        if (u := relaid_for(instruction, at, size)) is not None and not between(reader, at, end):
          # The last copy of a value, in its reader's layout, made long before the reader
          # runs: the value itself, held until then (XLA:CPU transposes a U-Net's
          # concatenated skip in the forward pass for its weight's gradient: 24 MiB).
          read_for.setdefault(u, set()).add(reader)
        elif not updated(b, size):  # else it is its reader's output
          scratch[reader].append((at, end, size))
        if instruction.name in elsewhere:
          # An argument prefetched for its reader from where the move started: XLA:TPU
          # moves the moments of later optimizer updates into VMEM during the first.
          since = started(instruction.name)
          for meanwhile, made_at in position.items():
            if since <= made_at < at:
              scratch[meanwhile].append((made_at, made_at, size))
      elif (
        holder is None
        and direct == {None}
        and instruction.name in computing
        and len(readers) == 1
        and None not in readers
      ):
        # A computation for the one equation that the unnamed instructions reading it
        # work for: XLA:CPU computes a depthwise convolution's weight gradient as a dense
        # one (256 x 256 channels, 2.25 MiB) and masks it into another buffer for it.
        scratch[next(iter(readers))].append((at, end, size))
      elif holder in sizes:
        # A collective's result replaces its operands of the same value that die there
        # (a gradient's partial sums, all-reduced): both are not held at once for long.
        sizes[holder] += max(size - replaced(instruction, holder), 0) if collective else size
        read_for.setdefault(holder, set()).update(readers - {holder, None})
        if not collective and holder in pieces:
          pieces[holder].append((at, end, size, None if b in outputs else b))

  def readers_while(k: int, at: int, end: int) -> frozenset[int]:
    """The equations whose instructions read a buffer of value ``k`` after ``at``, up to
    ``end``: while a buffer of it made at ``at`` and last read at ``end`` is held."""
    made = [b for *_, b in pieces[k] if b is not None]
    return frozenset(
      own[r] for b in made for r in read_by.get(b, []) if at < index_of[r] <= end
    ) - {None}

  held_while = {
    k: [(at, end, size, readers_while(k, at, end) if b else None) for at, end, size, b in made]
    for k, made in pieces.items()
  }
  _short_lived_to_scratch(held_while, sizes, scratch)
  remade_for = _remade_for(entry.instructions, inside, elements, roots_of, sizes)
  # Each is held until the first value made after its last reader runs (XLA:CPU runs a
  # pool gradient's argmax with the forward pool, under the gradient's name). A reader of
  # bytes made from constants runs where the kept value it reads last is made: a plan that
  # makes a max pool's input again in the backward pass moves the argmax there, and the
  # iotas it reads are held until then (the U-Net example: 3.5 MiB).
  by_position = sorted((at, k) for k, at in position.items())
  constants_for: dict[int, tuple[int, frozenset[int]]] = {}
  for size, end, made_from_constants in early:
    k = next((k for at, k in by_position if at >= end), by_position[-1][1])
    constants[k] = constants.get(k, 0) + size
    if not made_from_constants:
      continue
    reader = entry.instructions[end]
    read = {
      output_roots(m)[j] for o in reader.operands for m, j in elements.get(o, []) if m in roots_of
    }
    if made := [u for u in read if u in position]:
      u = max(made, key=position.get)
      if k not in constants_for or position[u] > position[constants_for[k][0]]:
        constants_for[k] = (u, serves(reader.name) - {None})
  made_with = {
    k: together
    for roots in roots_of.values()
    if len(together := frozenset(roots) & sizes.keys()) > 1
    for k in together
  }
  chip = on_chip_peak(entry)
  off_chip = {
    roots_of[name][j] for name, j in chip.off_chip if j < len(roots_of.get(name, ()))
  } & set(sizes)
  return CompiledValues(
    frozenset(sizes),
    sizes,
    {k: _most_at_once(made) for k, made in scratch.items()},
    position,
    tuple(arguments),
    read_for,
    constants,
    frozenset(hoisted),
    remade_for,
    constants_for,
    partitions=parts,
    on_chip_peak_bytes=chip.peak_bytes,
    evicts_from_chip=chip.evicts,
    off_chip=frozenset(off_chip),
    aliased_outputs=frozenset(aliased_outputs(hlo)),
    made_with=made_with,
    writes_into=writes_into,
  )


def _short_lived_to_scratch(
  pieces: dict[int, list[tuple[int, int, int, frozenset[int] | None]]],
  sizes: dict[int, int],
  scratch: dict[int, list[tuple[int, int, int]]],
) -> None:
  """Moves each buffer of a value that dies in the first half of the value's life, or is
  made in the second half, and is no step output, from the value's size to the scratch of
  the equations that read the value while it is held. XLA makes a value in several
  layouts, each for its readers: a product's operand transposed for the forward product,
  and again for the weight's gradient in the backward pass (an einsum over experts: two
  32 MiB copies, the first dead four instructions later); a gradient, and after its
  first readers a transposed copy for the weight's gradient (a ConvNeXt block's 4 MiB).
  Held as one value from where it is made until its last reader, both read as live
  through the forward pass, or beside the operands the value was made from. A buffer
  held to the value's end stays the value's, and so does the one that lives longest,
  and each that an instruction makes with others of the value (the elements of XLA:TPU's
  asynchronous collectives of a sharded step, which it holds together)."""
  for k, made in pieces.items():
    if len(made) < 2:
      continue
    start, last = min(at for at, *_ in made), max(end for _, end, *_ in made)
    longest = max(range(len(made)), key=lambda j: made[j][1] - made[j][0])
    makers = collections.Counter(at for at, *_ in made)
    for j, (at, end, size, readers) in enumerate(made):
      early, late = 2 * (end - start) < last - start, 2 * (at - start) >= last - start
      if j != longest and makers[at] == 1 and readers and (early or late):
        sizes[k] -= size
        for reader in readers:
          scratch[reader].append((at, end, size))


def _read_elementwise(body: list[Instruction]) -> frozenset[int]:
  """The parameters that fused computation ``body`` reads through elementwise instructions
  alone, up to its outputs (XLA's ``AreTransitiveUsesElementwiseOrTuple``)."""
  users: dict[str, list[Instruction]] = collections.defaultdict(list)
  for i in body:
    for o in i.operands:
      users[o].append(i)

  def elementwise(name: str) -> bool:
    stack, seen = [name], {name}
    while stack:
      for user in users[stack.pop()]:
        if user.opcode not in _ELEMENTWISE and user.opcode != "tuple":
          return False
        if user.name not in seen:
          seen.add(user.name)
          stack.append(user.name)
    return True

  return frozenset(
    int(_PARAMETER.search(i.line).group(1))
    for i in body
    if i.opcode == "parameter" and elementwise(i.name)
  )


def _most_at_once(buffers: list[tuple[int, int, int]]) -> int:
  """The most bytes of ``buffers`` (made, last read, bytes) live at one instruction: XLA
  reuses a dead scratch buffer's memory for the next one, so an equation's scratch is no
  sum of its buffers."""
  return max(sum(n for a, b, n in buffers if a <= at <= b) for at, _, _ in buffers)


def _updated_operand(
  instruction: Instruction, body: list[Instruction], root: Instruction
) -> str | None:
  """The operand of ``instruction`` whose buffer its in-place ``root`` (a scatter, a
  dynamic-update-slice; inside a fusion, of its ``body``) updates, if one is."""
  if not root.operands:
    return None
  if root is instruction:
    return instruction.operands[0]
  updated = next((i for i in body if i.name == root.operands[0]), None)
  if updated is None or updated.opcode != "parameter":
    return None
  return instruction.operands[int(_PARAMETER.search(updated.line).group(1))]


def _remade_for(
  instructions: list[Instruction],
  inside: dict[str, set[int]],
  elements: dict[str, list[tuple[str, int]]],
  roots_of: dict[str, list[int | None]],
  kept: dict[int, int],
) -> dict[int, set[int]]:
  """Kept equation -> the equations of the fusions that compute it again from its
  operands, reading none of its buffers. XLA:CPU computes a batch norm's output into the
  forward pass's ReLU and again inside the backward pass's ReLU gradient, from the held
  convolution output: the 4 MiB buffer it keeps of the value lives through the forward
  pass only (the Flax CNN step)."""
  made: dict[int, set[tuple[str, int]]] = {}
  for name, roots in roots_of.items():
    for j, k in enumerate(roots):
      made.setdefault(k, set()).add((name, j))
  # A collective's element named for the equation is its value too: XLA:TPU all-reduces
  # an FSDP step's gradients in one tuple, and each optimizer update slices its own
  # gradient out of the element named for it.
  collective = {i.name for i in instructions if i.opcode.removesuffix("-done") in COLLECTIVES}
  named = {
    i.name: _scope(i.line)
    for i in instructions
    if i.opcode == "get-tuple-element" and i.operands[0] in collective
  }
  out: dict[int, set[int]] = {}
  for instruction in instructions:
    computed = inside.get(instruction.name, set())
    reads = {b for o in instruction.operands for b in elements.get(o, [])}
    read_named = {named.get(o) for o in instruction.operands}
    for k in computed & kept.keys() - read_named:
      if k not in roots_of[instruction.name] and not reads & made.get(k, set()):
        out.setdefault(k, set()).update(computed - {k})
  return out


def _own_step(
  instructions: list[Instruction], roots_of: dict, ks: set[int], start: int, end: int
) -> bool:
  """Whether nothing but equations ``ks``' own or unnamed work runs between ``start`` and
  ``end``: a buffer held across other equations' values is no scratch."""
  return all(
    set(roots_of[i.name]) <= {*ks, None}
    for i in instructions[start + 1 : end]
    if i.opcode not in _NO_BUFFER
  )


def _fusion_outputs(body: list[Instruction]) -> list[Instruction | None]:
  """The named instruction that holds each output of a fused computation (its root, or a
  root tuple's operands in order), where one does."""
  root = next((i for i in body if i.is_root), None)
  if root is None:
    return []
  by_name = {i.name: i for i in body}
  outputs = [by_name.get(name) for name in root.operands] if root.opcode == "tuple" else [root]
  return [_value_holder(i, by_name) for i in outputs]


def _constant_outputs(body: list[Instruction]) -> set[int]:
  """The outputs of a fused computation that read none of its parameters."""
  by_name = {i.name: i for i in body}
  root = next((i for i in body if i.is_root), None)
  if root is None:
    return set()
  outputs = root.operands if root.opcode == "tuple" else [root.name]
  reads_parameter: dict[str, bool] = {}

  def reads(name: str) -> bool:
    if name not in reads_parameter:
      instruction = by_name.get(name)
      reads_parameter[name] = instruction is None or (
        instruction.opcode == "parameter" or any(map(reads, instruction.operands))
      )
    return reads_parameter[name]

  return {j for j, name in enumerate(outputs) if not reads(name)}


def _value_holder(
  instruction: Instruction | None, by_name: dict[str, Instruction]
) -> Instruction | None:
  """The instruction named after the equation whose value ``instruction`` holds: itself,
  or the one before unnamed conversions that only change how the value is stored.
  XLA:TPU writes a float32 cotangent out of its fusion as an unnamed bfloat16 ``convert``
  for the next product (the MLP example's backward pass); without this the value read as
  never kept, and its readers as reading the whole chain of cotangents before it."""
  while instruction is not None:
    if _scope(instruction.line) is not None:
      return instruction
    if instruction.opcode not in _STORAGE_ONLY:
      return None
    operands = instruction.operands
    instruction = by_name.get(operands[0]) if len(operands) == 1 else None
  return None


def _step(line: str) -> str | None:
  """What the innermost equation scope in an instruction's metadata names next: the
  equation's primitive, or a step of its lowering ("iota_2x32_shape" of `random_bits`)."""
  found = _STEP.findall(line)
  return found[-1] if found else None


def _scope(line: str) -> int | None:
  """The innermost equation scope in an instruction's metadata."""
  found = _scopes(line)
  return found[-1] if found else None


def _scopes(line: str) -> list[int]:
  """Every equation scope in an instruction's metadata, in order."""
  return [int(k) for k in _SCOPED.findall(line)]
