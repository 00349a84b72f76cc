"""The examples' training steps sharded over a device mesh, as multi-chip jobs run them.

``sharded_train_step("gpt", "fsdp", devices)`` returns the Adam step of an example module
under ``jax.jit`` with ``in_shardings``/``out_shardings`` over a mesh of ``devices`` and
the donated state, and its arguments placed on the mesh:

- ``"dp"``: data parallel. The batch is split over the ``"data"`` axis; parameters and
  optimizer state are replicated.
- ``"fsdp"``: data parallel with parameters and optimizer state sharded too, each array
  along its largest dimension that the mesh divides (ZeRO-3). XLA gathers each weight
  before its product, in the forward and again in the backward pass.
- ``"tp"``: tensor parallel over a ``("data", "model")`` mesh: each matrix is split over
  ``"model"`` along its wider dimension (Megatron's column split of the up-projections,
  row split of the down-projections), the batch over ``"data"``.

With no accelerator, a mesh of host devices stands in for the chips:
``XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m examples.sharded``, or
``jax.config.update("jax_num_cpu_devices", 4)`` before JAX starts.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from examples import _common

MODES = ("dp", "fsdp", "tp")


def make_mesh(devices: Sequence[Any], mode: str) -> Mesh:
  """A ``("data",)`` mesh, or for ``"tp"`` ``("data", "model")`` with 2 on ``"data"``
  where the devices split evenly (else all on ``"model"``)."""
  devices = np.asarray(devices)
  if mode not in MODES:
    raise ValueError(f"mode={mode!r} is not a sharding mode; use one of {MODES}.")
  if mode != "tp":
    return Mesh(devices.reshape(-1), ("data",))
  data = 2 if devices.size % 2 == 0 and devices.size > 2 else 1
  return Mesh(devices.reshape(data, -1), ("data", "model"))


def param_sharding(x: Any, mesh: Mesh, mode: str) -> NamedSharding:
  """Where one parameter (or optimizer state leaf of its shape) lives (module docstring)."""
  spec: list[Any] = [None] * np.ndim(x)
  shape = np.shape(x)
  if mode == "fsdp":
    n = mesh.shape["data"]
    for axis in sorted(range(len(shape)), key=lambda a: -shape[a]):
      if shape[axis] % n == 0:
        spec[axis] = "data"
        break
  elif mode == "tp" and len(shape) == 2:
    axis = 1 if shape[1] > shape[0] else 0  # column split up, row split down
    if shape[axis] % mesh.shape["model"] == 0:
      spec[axis] = "model"
  return NamedSharding(mesh, P(*spec))


def batch_sharding(x: Any, mesh: Mesh) -> NamedSharding:
  """The batch split over ``"data"`` along its first dimension."""
  n = mesh.shape["data"]
  spec = ["data"] + [None] * (np.ndim(x) - 1) if np.ndim(x) and np.shape(x)[0] % n == 0 else []
  return NamedSharding(mesh, P(*spec))


def sharded_train_step(
  module_name: str,
  mode: str,
  devices: Sequence[Any] | None = None,
  checkpoint: str | None = None,
  **sizes: Any,
) -> tuple[Any, tuple[Any, Any, Any], Any]:
  """``(step, args, place)``: the example's Adam step jitted over a mesh (module docstring),
  its loss under a `jax.checkpoint` variant if one is named
  (`_common.CHECKPOINT_VARIANTS`), its arguments on the mesh, and ``place(args)``, which
  puts host copies of them there again (a donated step consumes its state)."""
  module = importlib.import_module(f"examples.{module_name}")
  params, batch = _common.example_args(module, **sizes)
  loss = _common.checkpointed_loss(module, checkpoint)
  train_step, (params, opt_state, batch) = _common.make_train_step(loss, params, batch)
  mesh = make_mesh(devices if devices is not None else jax.devices(), mode)
  state = (params, opt_state)
  state_shardings = jax.tree.map(lambda x: param_sharding(x, mesh, mode), state)
  batch_shardings = jax.tree.map(lambda x: batch_sharding(x, mesh), batch)
  replicated = NamedSharding(mesh, P())
  step = jax.jit(
    train_step,
    in_shardings=(*state_shardings, batch_shardings),
    out_shardings=(*state_shardings, replicated),
    donate_argnums=(0, 1),
  )
  host = jax.tree.map(np.asarray, (params, opt_state, batch))
  shardings = (*state_shardings, batch_shardings)

  def place(args: Any = host) -> tuple[Any, Any, Any]:
    return tuple(jax.device_put(jax.tree.map(np.asarray, args), shardings))

  return step, place(), place


def main(argv: Sequence[str] | None = None) -> None:
  """``python -m examples.sharded [--model gpt] [--mode fsdp] [--budget 0.5]``."""
  import jaxremat

  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="gpt")
  parser.add_argument("--mode", default="fsdp", choices=MODES)
  parser.add_argument("--budget", default="0.5")
  parser.add_argument("--host-devices", type=int, default=4, help="CPU devices, with no chips")
  args = parser.parse_args(argv)
  jax.config.update("jax_num_cpu_devices", args.host_devices)  # before JAX starts
  step, _, place = sharded_train_step(args.model, args.mode)
  fast = jaxremat.optimize(step, budget=args.budget)
  fast(*place())
  mesh = make_mesh(jax.devices(), args.mode)
  print(f"{args.model} step, {args.mode} over a {dict(mesh.shape)} mesh; bytes are per device")
  print(fast.report(*place()))


if __name__ == "__main__":
  main()
