"""A parser for jaxprs as `print(jax.make_jaxpr(f)(*args))` prints them.

Jaxprs cannot be pickled and their text is lossy (ARCHITECTURE.md, fact 6), but the text
keeps what planning needs: every equation's primitive, operands, result shapes and
dtypes, and the sub-jaxprs of higher-order primitives. `parse_jaxpr_text` reads that text
(including the ``let NAME = { ... } in`` headers of recent JAX) into plain objects that
mimic the attributes of JAX's own jaxpr types (``eqn.primitive.name``, ``var.aval.shape``),
so that the graph builder serves live and parsed jaxprs alike.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxremat._src.errors import FormatError

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_']*")
_PRIMITIVE = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")  # e.g. scatter-add
_DTYPE = re.compile(r"[a-z][a-z0-9_]*(?:<[a-z_]+>)?")
_NUMBER = re.compile(r"-?(?:[0-9]+\.?[0-9]*(?:e[+-]?[0-9]+)?|inf|nan)")
_LITERAL_WORDS = ("True", "False", "inf", "nan")


@dataclasses.dataclass(frozen=True)
class TextAval:
  """Shape and dtype of a value; ``dtype`` is a numpy dtype, or a str for PRNG keys."""

  shape: tuple[int, ...]
  dtype: Any

  def str_short(self) -> str:
    return f"{self.dtype}[{','.join(map(str, self.shape))}]"


@dataclasses.dataclass(eq=False)
class TextVar:
  """A variable; identity, not name, tells variables apart (names repeat across scopes)."""

  name: str
  aval: TextAval

  def __repr__(self) -> str:
    return f"{self.name}:{self.aval.str_short()}"


@dataclasses.dataclass(eq=False)
class TextLiteral:
  """A literal operand such as ``1.0:f32[]``; ``val`` is its text."""

  val: str
  aval: TextAval


@dataclasses.dataclass(frozen=True)
class TextPrimitive:
  name: str


@dataclasses.dataclass(eq=False)
class TextEqn:
  """One equation. ``params`` holds each parameter's text; ``subjaxprs`` its jaxprs.

  A dropped result (printed ``_``) is a `TextVar` named ``_``.
  """

  primitive: TextPrimitive
  params: dict[str, str]
  subjaxprs: dict[str, tuple[TextJaxpr, ...]]
  invars: list[TextVar | TextLiteral]
  outvars: list[TextVar]


@dataclasses.dataclass(eq=False)
class TextJaxpr:
  constvars: list[TextVar]
  invars: list[TextVar]
  eqns: list[TextEqn]
  outvars: list[TextVar | TextLiteral]


def parse_dtype(text: str) -> Any:
  """``"f32"`` -> float32, ``"bf16"`` -> bfloat16, ``"key<fry>"`` stays a str."""
  if text.startswith("key<"):
    return text
  if text == "bool":
    return np.dtype(bool)
  long = re.sub(
    r"^(bf|f|u|i|c)(?=[0-9])",
    lambda m: {"bf": "bfloat", "f": "float", "u": "uint", "i": "int", "c": "complex"}[m.group(1)],
    text,
  )
  import ml_dtypes  # noqa: F401  (registers bfloat16, int4, float8 with numpy)

  try:
    return np.dtype(getattr(ml_dtypes, long, long))
  except TypeError:
    raise ValueError(f"unknown dtype {text!r}") from None


class _Parser:
  def __init__(self, text: str, source: str):
    self.text = text
    self.pos = 0
    self.source = source
    self.named: dict[str, TextJaxpr] = {}

  # -- low level -----------------------------------------------------------------------

  def error(self, problem: str) -> FormatError:
    line = self.text.count("\n", 0, self.pos) + 1
    column = self.pos - (self.text.rfind("\n", 0, self.pos) + 1) + 1
    snippet = self.text[self.pos : self.pos + 30].split("\n")[0]
    return FormatError(self.source, f"line {line} column {column}", f"{problem} (at {snippet!r}).")

  def skip(self) -> None:
    while self.pos < len(self.text) and self.text[self.pos].isspace():
      self.pos += 1

  def peek(self, s: str) -> bool:
    self.skip()
    return self.text.startswith(s, self.pos)

  def peek_keyword(self, word: str) -> bool:
    self.skip()
    end = self.pos + len(word)
    return self.text.startswith(word, self.pos) and not (
      end < len(self.text) and (self.text[end].isalnum() or self.text[end] in "_'")
    )

  def expect(self, s: str) -> None:
    if not self.peek(s):
      raise self.error(f"expected {s!r}")
    self.pos += len(s)

  def match(self, pattern: re.Pattern, what: str) -> str:
    self.skip()
    m = pattern.match(self.text, self.pos)
    if not m:
      raise self.error(f"expected {what}")
    self.pos = m.end()
    return m.group(0)

  # -- grammar -------------------------------------------------------------------------

  def program(self) -> TextJaxpr:
    while self.peek_keyword("let"):
      self.pos += 3
      name = self.match(_NAME, "a jaxpr name")
      self.expect("=")
      self.named[name] = self.jaxpr()
      if not self.peek_keyword("in"):
        raise self.error("expected 'in' after a named jaxpr")
      self.pos += 2
    jaxpr = self.jaxpr()
    self.skip()
    if self.pos != len(self.text):
      raise self.error("unexpected text after the jaxpr")
    self.resolve_names([jaxpr, *self.named.values()])
    return jaxpr

  def resolve_names(self, jaxprs: list[TextJaxpr]) -> None:
    """Replaces ``jaxpr=NAME`` references (to `let` headers, also later ones) by the jaxpr."""
    seen: set[int] = set()
    stack = list(jaxprs)
    while stack:
      j = stack.pop()
      if id(j) in seen:
        continue
      seen.add(id(j))
      for e in j.eqns:
        for key, subs in e.subjaxprs.items():
          for x in subs:
            if isinstance(x, str) and x not in self.named:
              raise FormatError(
                self.source,
                f"{e.primitive.name}[{key}]",
                f"refers to {x!r}, which no `let` header defines.",
              )
          e.subjaxprs[key] = tuple(self.named[x] if isinstance(x, str) else x for x in subs)
          stack.extend(e.subjaxprs[key])

  def jaxpr(self) -> TextJaxpr:
    self.expect("{")
    self.expect("lambda")
    scope: dict[str, TextVar] = {}
    constvars = self.binders(scope, until=";")
    self.expect(";")
    invars = self.binders(scope, until=".")
    self.expect(".")
    if not self.peek_keyword("let"):
      raise self.error("expected 'let'")
    self.pos += 3
    eqns = []
    while not (self.peek_keyword("in") and self._in_then_paren()):
      eqns.append(self.eqn(scope))
    self.pos += 2
    self.expect("(")
    outvars = []
    while not self.peek(")"):
      outvars.append(self.operand(scope))
      if self.peek(","):
        self.pos += 1
    self.expect(")")
    self.expect("}")
    return TextJaxpr(constvars, invars, eqns, outvars)

  def _in_then_paren(self) -> bool:
    rest = self.text[self.pos + 2 :].lstrip()
    return rest.startswith("(")

  def binders(self, scope: dict[str, TextVar], until: str) -> list[TextVar]:
    out = []
    while not self.peek(until):
      var = self.binder()
      scope[var.name] = var
      out.append(var)
    return out

  def binder(self) -> TextVar:
    name = self.match(_NAME, "a variable name")
    self.expect(":")
    return TextVar(name, self.aval())

  def aval(self) -> TextAval:
    dtype_text = self.match(_DTYPE, "a dtype")
    self.expect("[")
    dims_end = self.text.index("]", self.pos)
    dims_text = self.text[self.pos : dims_end].strip()
    dims = []
    for d in filter(None, (x.strip() for x in dims_text.split(","))):
      if not d.isdigit():
        raise self.error(f"dimension {d!r} is symbolic; only concrete shapes can be planned")
      dims.append(int(d))
    self.pos = dims_end + 1
    try:
      dtype = parse_dtype(dtype_text)
    except ValueError as e:
      raise self.error(str(e)) from None
    return TextAval(tuple(dims), dtype)

  def eqn(self, scope: dict[str, TextVar]) -> TextEqn:
    outvars: list[TextVar] = []
    while not self.peek("="):
      outvars.append(self.binder())
    self.expect("=")
    primitive = self.match(_PRIMITIVE, "a primitive name")
    params: dict[str, str] = {}
    subjaxprs: dict[str, tuple[TextJaxpr, ...]] = {}
    if self.text.startswith("[", self.pos):
      self.pos += 1
      while not self.peek("]"):
        key = self.match(_NAME, "a parameter name")
        self.expect("=")
        params[key], found = self.param_value(key)
        if found:
          subjaxprs[key] = tuple(found)
      self.pos += 1
    invars = []
    while not self._at_eqn_end():
      invars.append(self.operand(scope))
    for var in outvars:
      if var.name != "_":
        scope[var.name] = var
    return TextEqn(TextPrimitive(primitive), params, subjaxprs, invars, outvars)

  def _at_eqn_end(self) -> bool:
    self.skip()
    if self.peek_keyword("in") and self._in_then_paren():
      return True
    m = _NAME.match(self.text, self.pos)
    if m and m.group(0) not in _LITERAL_WORDS:
      return self.text[m.end() :].lstrip().startswith(":")  # the next eqn's first binder
    return self.pos >= len(self.text)

  def operand(self, scope: dict[str, TextVar]) -> TextVar | TextLiteral:
    self.skip()
    m = _NAME.match(self.text, self.pos)
    if m and m.group(0) not in _LITERAL_WORDS:
      self.pos = m.end()
      if m.group(0) not in scope:
        raise self.error(f"variable {m.group(0)!r} is used before it is defined")
      return scope[m.group(0)]
    m = _NUMBER.match(self.text, self.pos) or re.compile("True|False").match(self.text, self.pos)
    if not m:
      raise self.error("expected a variable or a literal")
    self.pos = m.end()
    self.expect(":")
    return TextLiteral(m.group(0), self.aval())

  def param_value(self, key: str) -> tuple[str, list[TextJaxpr]]:
    """Reads one parameter value: raw text to the next top-level space or ']'."""
    self.skip()
    start, depth, found = self.pos, 0, []
    while self.pos < len(self.text):
      c = self.text[self.pos]
      if c == "{" and self.text[self.pos + 1 :].lstrip().startswith("lambda"):
        found.append(self.jaxpr())
        continue
      if depth == 0 and (c.isspace() or c == "]"):
        break
      if c in "([<{":
        depth += 1
      elif c in ")]>}":
        depth -= 1
      self.pos += 1
    raw = self.text[start : self.pos]
    # `jaxpr=_uniform` refers to a `let` header, maybe one printed later (resolved then);
    # `name=_uniform` is just a name.
    if not found and _NAME.fullmatch(raw) and (key.endswith("jaxpr") or key == "branches"):
      found.append(raw)
    return raw, found


def parse_jaxpr_text(text: str, source: str = "<jaxpr text>") -> TextJaxpr:
  """Parses the printed form of a (closed) jaxpr.

  Args:
    text: what ``print(jax.make_jaxpr(f)(*args))`` printed.
    source: the file it came from, for error messages.

  Returns:
    The top-level `TextJaxpr`; sub-jaxprs are in each equation's ``subjaxprs``.

  Raises:
    FormatError: naming the line and column of the first thing it cannot read.
  """
  return _Parser(text, source).program()


def inline_calls(
  jaxpr: TextJaxpr,
  primitives: frozenset[str],
  body_params: Sequence[str],
  source: str = "<jaxpr text>",
) -> TextJaxpr:
  """Inlines the equations of call-like ``primitives`` (jit, custom_jvp_call, ...).

  Each inlined body gets fresh variables, since one named body (a ``let`` header) may be
  called in several places.

  Raises:
    FormatError: a call body closes over constants, which the text does not show.
  """
  eqns: list[TextEqn] = []

  def walk(body: TextJaxpr, env: dict, fresh: bool) -> None:
    def read(x):
      return env.get(x, x) if isinstance(x, TextVar) else x

    for e in body.eqns:
      ins = [read(x) for x in e.invars]
      inner = next((e.subjaxprs[k][0] for k in body_params if k in e.subjaxprs), None)
      if e.primitive.name in primitives and inner is not None:
        if inner.constvars:
          raise FormatError(
            source,
            e.primitive.name,
            "has a body that closes over constants; "
            "print the jaxpr of a function without closed-over arrays.",
          )
        inner_env = dict(zip(inner.invars, ins, strict=True))
        walk(inner, inner_env, fresh=True)
        for o, r in zip(e.outvars, inner.outvars, strict=True):
          env[o] = inner_env.get(r, r) if isinstance(r, TextVar) else r
        continue
      outs = e.outvars
      if fresh:
        outs = [TextVar(o.name, o.aval) for o in e.outvars]
        env.update(zip(e.outvars, outs))
      eqns.append(TextEqn(e.primitive, e.params, e.subjaxprs, ins, outs))

  env: dict = {}
  walk(jaxpr, env, fresh=False)
  outvars = [env.get(x, x) if isinstance(x, TextVar) else x for x in jaxpr.outvars]
  return TextJaxpr(jaxpr.constvars, jaxpr.invars, eqns, outvars)


# -- to JAX's own jaxpr types ----------------------------------------------------------

_PARAM_TYPES = ("ConvDimensionNumbers", "GatherDimensionNumbers", "ScatterDimensionNumbers")


def _param_value(raw: str) -> Any:
  """A parameter's Python value where the text determines it, else the text itself.

  Sequences become tuples and dtype names dtypes, as equations hold them (JAX requires
  hashable parameters to bind them again).
  """
  try:
    return _as_bound(ast.literal_eval(raw))
  except (ValueError, SyntaxError, MemoryError, RecursionError):
    pass
  if raw in _DTYPE_NAMES:
    import jax.numpy as jnp  # knows bfloat16

    return jnp.dtype(raw)
  try:
    call = ast.parse(raw, mode="eval").body
  except SyntaxError:
    return raw
  if (
    isinstance(call, ast.Call) and getattr(call.func, "id", None) in _PARAM_TYPES and not call.args
  ):
    from jax import lax

    try:
      kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
      return getattr(lax, call.func.id)(**kwargs)
    except (ValueError, TypeError):
      return raw
  return raw


_DTYPE_NAMES = frozenset(
  {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"}
  | {"float16", "bfloat16", "float32", "float64", "complex64", "complex128"}
)


def _as_bound(value: Any) -> Any:
  if isinstance(value, (list, tuple)):
    return tuple(_as_bound(v) for v in value)
  return value


def _literal_value(lit: TextLiteral) -> Any:
  text = lit.val
  value = {"True": True, "False": False}.get(text, None)
  if value is None:
    value = float(text) if any(c in text for c in ".eni") else int(text)
  return np.asarray(value, dtype=lit.aval.dtype)


_MISSING_PARAMS = re.compile(r"missing \d+ required keyword-only arguments?: (.*)")


def _with_omitted_params(prim: Any, params: dict[str, Any], avals: list[Any]) -> dict[str, Any]:
  """``params`` with those the printer left out for being None (``precision``,
  ``out_sharding``, ...) set back to None, so that the equation binds again."""
  for _ in range(4):
    try:
      prim.abstract_eval(*avals, **params)
      return params
    except TypeError as e:
      missing = _MISSING_PARAMS.search(str(e))
      if not missing:
        return params
      params = {**params, **dict.fromkeys(re.findall(r"'(\w+)'", missing.group(1)))}
    except Exception:  # noqa: BLE001 - a stand-in primitive, or params the text garbled
      return params
  return params


def to_closed_jaxpr(jaxpr: TextJaxpr) -> Any:
  """The parsed jaxpr as JAX's own ``ClosedJaxpr`` (for planning: it is never run).

  Parameters become Python values where their text determines them; constants (whose
  values the text does not show) become zeros of their type.
  """
  from jaxremat._src import compat

  env: dict[TextVar, Any] = {}

  def var(v: TextVar) -> Any:
    if v not in env:
      aval = compat.shaped_array(v.aval.shape, v.aval.dtype)
      env[v] = compat.new_dropvar(aval) if v.name == "_" else compat.new_var(aval)
    return env[v]

  def atom(x: TextVar | TextLiteral) -> Any:
    if isinstance(x, TextLiteral):
      return compat.new_literal(_literal_value(x), compat.shaped_array(x.aval.shape, x.aval.dtype))
    return var(x)

  def convert(j: TextJaxpr, consts: list[Any]) -> Any:
    spec = []
    for e in j.eqns:
      params = {k: _param_value(v) for k, v in e.params.items()}
      for key, subs in e.subjaxprs.items():
        closed = tuple(convert(sub, []) for sub in subs)
        params[key] = closed if key == "branches" else closed[0]
      prim = compat.primitive_by_name(e.primitive.name, len(e.outvars) > 1)
      invars = [atom(x) for x in e.invars]
      params = _with_omitted_params(prim, params, [x.aval for x in invars])
      spec.append((invars, [var(o) for o in e.outvars], prim, params))
    return compat.new_closed_jaxpr(
      [var(v) for v in j.constvars],
      [var(v) for v in j.invars],
      [atom(x) for x in j.outvars],
      spec,
      consts,
    )

  consts = [
    np.zeros(v.aval.shape, v.aval.dtype) if not isinstance(v.aval.dtype, str) else None
    for v in jaxpr.constvars
  ]
  return convert(jaxpr, consts)
