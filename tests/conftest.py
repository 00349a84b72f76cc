"""Shared fixtures: the benchmark graph suite in ../shared/graphs."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import pathlib

import pytest

# With the CUDA plugin installed (extra gpu-aot) and no GPU, the plugin's CUDA version check
# fails when JAX starts and the H100 target cannot register (TARGETS.md); skipping the check
# lets it compile deviceless. A machine with an NVIDIA driver keeps the check.
if not os.path.exists("/proc/driver/nvidia"):
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

# XLA:CPU compiles the steps' LLVM code at level 1: a fifth less compile time, and the
# optimized HLO, memory_analysis and cost analysis of the default level, 2 (the U-Net, GPT
# and ResNet examples' steps, compared; test_measure.py checks one). Level 0 halves the
# compile time but rounds float32 differently from level 2, past the backend's tolerances.
# Not where a TPU or GPU compiler is installed (libtpu, a PJRT plugin such as CUDA's): they
# read XLA_FLAGS too.
if not importlib.util.find_spec("libtpu") and not importlib.metadata.entry_points(
  group="jax_plugins"
):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=1"

import jax  # noqa: E402

# Four host devices, for the sharded steps' mesh (tests/test_sharded.py); steps that are
# not sharded run on the first, as before. Set before JAX starts its CPU backend.
jax.config.update("jax_num_cpu_devices", 4)

from jaxremat import RematGraph  # noqa: E402 - after the environment JAX reads when it starts

SHARED_GRAPHS = pathlib.Path(__file__).resolve().parents[2] / "shared" / "graphs"
GRAPH_NAMES = sorted(p.stem for p in SHARED_GRAPHS.glob("*.json"))


def shared_graph(name: str) -> RematGraph:
  """Loads ``../shared/graphs/NAME.json`` or skips the test with the reason."""
  path = SHARED_GRAPHS / f"{name}.json"
  if not path.exists():
    pytest.skip(
      f"{path} does not exist: the benchmark graphs live in ../shared/graphs beside the checkout."
    )
  return RematGraph.load(path)


@pytest.fixture(params=GRAPH_NAMES or ["<no shared graphs>"])
def any_shared_graph(request) -> RematGraph:
  """Every graph in ../shared/graphs, one test each (skipped when the folder is absent)."""
  return shared_graph(request.param)


# ---------------------------------------------------------------------------- backends
# Tests run on whichever backend JAX selects (JAX_PLATFORMS=cpu|cuda|tpu). What each
# backend is expected to do lives in jaxremat/_src/backends.py; tests marked `accelerator`
# need a GPU or TPU and are skipped elsewhere, with the reason in the summary (-rs).


def pytest_report_header(config) -> list[str]:
  import jax

  from jaxremat._src.backends import backend_facts

  facts = backend_facts()
  return [
    f"jaxremat backend: {facts.platform} ({jax.devices()[0].device_kind}), jax {jax.__version__}, "
    f"fence {facts.fence!r}, barrier holds: {facts.barrier_holds}, "
    f"device memory_stats: {facts.device_memory_stats}"
  ]


def pytest_collection_modifyitems(config, items) -> None:
  from jaxremat._src.backends import backend_facts

  facts = backend_facts()
  if facts.platform in ("gpu", "tpu"):
    return
  skip = pytest.mark.skip(
    reason=f"needs a GPU or TPU; JAX selected the {facts.platform!r} backend "
    "(run with JAX_PLATFORMS=cuda or tpu on such a machine)"
  )
  for item in items:
    if "accelerator" in item.keywords:
      item.add_marker(skip)
