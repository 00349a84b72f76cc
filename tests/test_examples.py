"""The examples: each traces, trains one step, checkpoints by hand exactly, and runs from the CLI."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from backend import assert_trees_allclose

import examples
import jaxremat
from examples import _common


def _n_checkpoints(fn, *args) -> int:
  """Top-level jax.checkpoint equations (named remat2 in jax 0.10, checkpoint later)."""
  eqns = jax.make_jaxpr(fn)(*args).eqns
  return sum(e.primitive.name in ("remat2", "checkpoint") for e in eqns)


# The two largest examples take 25-60 s each to trace and train; `pytest -m slow` runs them.
EXAMPLES_QUICK = [
  pytest.param(n, marks=pytest.mark.slow) if n in ("mobilenet", "vgg16") else n
  for n in examples.EXAMPLES
]


@pytest.mark.parametrize("name", EXAMPLES_QUICK)
def test_example_traces_and_trains_one_step(name):
  module = examples.load(name)
  step, args = module.make_train_step(**module.SMALL)
  graph = jaxremat.trace(step, *args, costs="shape")
  n_leaves = len(jax.tree.leaves(args))
  assert len(graph.inputs) <= n_leaves and graph.outputs and graph.n > 2 * n_leaves

  params, opt_state, value = jax.jit(step)(*args)
  assert np.isfinite(float(value))
  assert jax.tree.structure(params) == jax.tree.structure(args[0])
  changed = [not np.array_equal(a, b) for a, b in zip(*map(jax.tree.leaves, (params, args[0])))]
  assert all(changed), f"{name}: {changed.count(False)} parameter leaves did not move"


@pytest.mark.parametrize("name", EXAMPLES_QUICK)
def test_block_checkpointing_computes_the_same_loss_and_gradient(name):
  module = examples.load(name)
  params, batch = _common.example_args(module, **module.SMALL)

  def both(params, batch):
    return [
      jax.value_and_grad(_common.checkpointed_loss(module, v))(params, batch)
      for v in (None, "per_block")
    ]

  plain, checkpointed = jax.jit(both)(params, batch)
  assert_trees_allclose(checkpointed, plain)
  # The checkpoints are there: one remat equation per block (the small sizes have few
  # blocks, so sqrt_n segments are per-block ones too), fewer with sqrt_n on 16 blocks.
  assert _n_checkpoints(_common.checkpointed_loss(module, "per_block"), params, batch) > 1


def test_sqrt_n_checkpoints_segments_of_sqrt_n_blocks():
  from examples import mlp

  params, batch = _common.example_args(mlp, **{**mlp.SMALL, "depth": 16})
  counts = {
    v: _n_checkpoints(_common.checkpointed_loss(mlp, v), params, batch)
    for v in ("per_block", "sqrt_n")
  }
  assert counts == {"per_block": 16, "sqrt_n": 4}


def test_example_args_routes_sizes_and_rejects_unknown_ones():
  from examples import gpt

  params, tokens = _common.example_args(gpt, seq_len=16, batch=3, vocab=64, d_model=32)
  assert tokens.shape == (3, 17) and int(tokens.max()) < 64
  assert params["pos"].shape == (16, 32) and params["embed"].shape == (64, 32)
  with pytest.raises(ValueError, match=r"sizes \['depth'\] are not sizes of examples.gpt"):
    _common.example_args(gpt, depth=3)
  with pytest.raises(ValueError, match="not a jax.checkpoint variant"):
    _common.checkpointed_loss(gpt, "everything")


def test_cli_runs_the_plain_step(capsys):
  from examples import resnet

  assert _common.main(resnet, ["--small", "--steps", "2", "--runs", "1"])
  out = capsys.readouterr().out
  assert "without jaxremat: XLA peak" in out and "step 1: loss" in out


def test_cli_runs_jaxremat_at_a_budget_and_the_losses_match(capsys, tmp_path, monkeypatch):
  from examples import mlp

  monkeypatch.setenv("JAXREMAT_CACHE_DIR", str(tmp_path))
  argv = ["--small", "--budget", "0.9", "--steps", "2", "--runs", "1", "--time-limit", "20"]
  assert _common.main(mlp, argv)
  out = capsys.readouterr().out
  assert "budget" in out and ": met (XLA measured" in out
  assert "losses match: True" in out
