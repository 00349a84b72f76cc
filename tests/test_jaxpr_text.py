"""The jaxpr text parser against the live jaxprs JAX printed the text from."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxremat import FormatError
from jaxremat._src.jaxpr_text import parse_jaxpr_text
from jaxremat._src.trace import graph_from_jaxpr_text, trace


def _mlp_grad():
  @jax.jit
  def layer(w, x):
    return jnp.tanh(x @ w)

  def loss(ws, x):
    for w in ws:
      x = layer(w, x)
    return jnp.sum(jax.nn.relu(x)) + 1.0

  ws = [jnp.ones((4, 4))] * 2
  return jax.value_and_grad(loss), (ws, jnp.ones((3, 4)))


def _control_flow():
  def f(x):
    c, ys = jax.lax.scan(lambda c, a: (c * a, c.sum()), x, jnp.ones((5, 3)))
    w = jax.lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, s[1] * 2.0), (0, c))
    y = jax.lax.cond(x[0] > 0, lambda y: y + 1, lambda y: y * 2, w[1])
    return y, ys, jax.random.normal(jax.random.key(0), (2,), jnp.bfloat16)

  return f, (jnp.ones(3),)


def _custom_and_remat():
  @jax.custom_vjp
  def f(x):
    return jnp.sin(x)

  f.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (c * g,))

  def g(x):
    y = jax.checkpoint(lambda z: jnp.sin(z) * 2)(x)
    return f(y).sum() + jnp.inf, jnp.zeros((0, 3)), jnp.ones(4, jnp.int4), True

  return jax.grad(lambda x: g(x)[0]), (jnp.ones(3),)


def _consts_and_dtypes():
  table = np.arange(6.0, dtype=np.float32).reshape(2, 3)

  def f(x, i):
    return (
      jnp.asarray(table) * x,
      i.astype(jnp.bfloat16),
      (i > 2),
      x.astype(jnp.float16),
      jnp.zeros((), jnp.uint8),
      x,
    )

  return f, (jnp.float32(2.0), jnp.arange(3, dtype=jnp.int32))


CASES = {
  "mlp_grad": _mlp_grad,
  "control_flow": _control_flow,
  "custom_and_remat": _custom_and_remat,
  "consts_and_dtypes": _consts_and_dtypes,
}


def _same_avals(live_vars, parsed_vars):
  assert len(live_vars) == len(parsed_vars)
  for live, parsed in zip(live_vars, parsed_vars):
    assert tuple(live.aval.shape) == parsed.aval.shape
    if isinstance(parsed.aval.dtype, str):
      assert parsed.aval.dtype.startswith("key<")
    else:
      assert np.dtype(live.aval.dtype) == parsed.aval.dtype


def _assert_same_jaxpr(live, parsed):
  _same_avals(live.invars, parsed.invars)
  _same_avals(live.constvars, parsed.constvars)
  _same_avals(live.outvars, parsed.outvars)
  assert [e.primitive.name for e in live.eqns] == [e.primitive.name for e in parsed.eqns]
  for le, pe in zip(live.eqns, parsed.eqns):
    _same_avals(le.invars, pe.invars)
    _same_avals(le.outvars, pe.outvars)
    live_subs = {
      k: v if isinstance(v, (tuple, list)) else (v,)
      for k, v in le.params.items()
      if k in pe.subjaxprs
    }
    assert set(live_subs) == set(pe.subjaxprs)
    for key, subs in live_subs.items():
      for ls, ps in zip(subs, pe.subjaxprs[key]):
        _assert_same_jaxpr(getattr(ls, "jaxpr", ls), ps)


@pytest.mark.parametrize("name", sorted(CASES))
def test_parsed_text_matches_the_live_jaxpr(name):
  fn, args = CASES[name]()
  closed = jax.make_jaxpr(fn)(*args)
  parsed = parse_jaxpr_text(str(closed))
  _assert_same_jaxpr(closed.jaxpr, parsed)


def test_literals_and_dropped_results_are_kept():
  fn, args = CASES["custom_and_remat"]()
  parsed = parse_jaxpr_text(str(jax.make_jaxpr(fn)(*args)))
  assert any(e.outvars[0].name == "_" for e in parsed.eqns)  # `_:f32[] = reduce_sum ...`
  mul = next(e for e in parsed.eqns if e.primitive.name == "mul")
  assert mul.invars[1].val == "2.0" and mul.invars[1].aval.shape == ()


@pytest.mark.parametrize(
  "text,words",
  [
    ("{ lambda ; a:f32[3]. let b:f32[3] = sin c in (b,) }", "variable 'c' is used before"),
    ("{ lambda ; a:f32[n]. let in (a,) }", "dimension 'n' is symbolic"),
    ("{ lambda ; a:f33[3]. let in (a,) }", "unknown dtype 'f33'"),
    ("{ lambda ; a:f32[3]. let b:f32[3] = sin a in (b,) } extra", "unexpected text"),
    ("{ lambda ; a:f32[3]. let b:f32[3] = sin a", "expected"),
    ("print(x)", "expected '{'"),
  ],
)
def test_bad_text_names_line_and_column(text, words):
  with pytest.raises(FormatError, match="line 1 column") as info:
    parse_jaxpr_text(text, source="dump.txt")
  assert words in str(info.value) and "dump.txt" in str(info.value)


def _example_steps():
  from examples import gpt, mlp, resnet, unet

  for module in (mlp, gpt, unet, resnet):
    for make in (module.make_grad_fn, module.make_train_step):
      yield f"{module.__name__.split('.')[-1]}.{make.__name__}", make


@pytest.mark.parametrize(
  "name,make", list(_example_steps()), ids=lambda x: x if isinstance(x, str) else ""
)
def test_graph_from_text_equals_the_traced_graph(name, make):
  fn, args = make()
  live = trace(fn, *args, costs="shape", model="rules")  # a printed jaxpr has no program
  printed = str(jax.make_jaxpr(fn)(*args))
  parsed = graph_from_jaxpr_text(printed, name=name)
  assert parsed.n == live.n
  assert parsed.edges == live.edges
  assert (parsed.inputs, parsed.outputs, parsed.order) == (live.inputs, live.outputs, live.order)
  assert parsed.mem == live.mem
  assert [n.attrs["primitive"] for n in parsed.nodes] == [n.attrs["primitive"] for n in live.nodes]
  assert parsed.meta["jaxpr"] == printed
