"""Training steps no part of jaxremat was tuned on, planned in each memory model.

Six steps written as their libraries' users write them, none of them an example that a
rule or a test was fitted to: ``vit`` (Flax linen attention), ``convnext`` (depthwise 7x7
convolutions, LayerNorm, AdamW), ``vae`` (a reparameterized key argument, two losses),
``unet_resize`` (average pools, nearest ``jax.image.resize``, concatenated skips),
``llama_bf16`` (bfloat16 compute on float32 parameters: RMSNorm, rotary attention, SwiGLU)
and ``eqx_cnn`` (Equinox convolutions and GroupNorm under ``jax.vmap``). For each, the
target compiler's peak of the step beside each model's, and `jaxremat.optimize` at each
budget in each model: the compiler's peak and FLOPs of the plan it hands out beside the
model's, and how many plans it compiled. Results: ``benchmarks/results/zoo_<target>.json``.

  python -m benchmarks.zoo                                   # XLA:CPU, both models, 0.7,0.5
  python -m benchmarks.zoo --target h100 --models compiler --steps vit,llama_bf16
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jaxremat

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def _optax_step(loss, optimizer):
  def step(params, opt_state, *batch):
    value, grads = jax.value_and_grad(loss)(params, *batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return step


def _linen(module, inputs, labels, optimizer, loss_of_outputs):
  params = module.init(jax.random.key(0), inputs)
  loss = lambda p, x, y: loss_of_outputs(module.apply(p, x), y)  # noqa: E731
  return _optax_step(loss, optimizer), (params, optimizer.init(params), inputs, labels)


def _xent(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class _ViTBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = x + nn.MultiHeadDotProductAttention(num_heads=4)(nn.LayerNorm()(x))
    h = nn.gelu(nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x)))
    return x + nn.Dense(x.shape[-1])(h)


class _ViT(nn.Module):
  @nn.compact
  def __call__(self, images):
    x = nn.Conv(128, (4, 4), strides=(4, 4))(images)
    x = x.reshape(x.shape[0], -1, x.shape[-1])
    x = x + self.param("pos", nn.initializers.normal(0.02), x.shape[1:])
    for _ in range(4):
      x = _ViTBlock()(x)
    return nn.Dense(10)(nn.LayerNorm()(x).mean(1))


def vit():
  images = jax.random.normal(jax.random.key(1), (32, 32, 32, 3))
  return _linen(_ViT(), images, jnp.arange(32) % 10, optax.adamw(1e-3), _xent)


class _ConvNeXt(nn.Module):
  @nn.compact
  def __call__(self, images):
    x = nn.LayerNorm()(nn.Conv(64, (4, 4), strides=(4, 4))(images))
    for _ in range(4):
      h = nn.Conv(64, (7, 7), feature_group_count=64)(x)
      h = nn.Dense(64)(nn.gelu(nn.Dense(256)(nn.LayerNorm()(h))))
      x = x + h
    return nn.Dense(10)(x.mean((1, 2)))


def convnext():
  images = jax.random.normal(jax.random.key(1), (16, 64, 64, 3))
  return _linen(_ConvNeXt(), images, jnp.arange(16) % 10, optax.adamw(1e-3), _xent)


def vae():
  sizes = (784, 512, 256, 32)
  keys = iter(jax.random.split(jax.random.key(0), 8))
  dense = lambda i, o: {"w": jax.random.normal(next(keys), (i, o)) / i**0.5, "b": jnp.zeros(o)}  # noqa: E731
  params = {
    "enc": [dense(sizes[0], sizes[1]), dense(sizes[1], sizes[2])],
    "mu": dense(sizes[2], sizes[3]),
    "logvar": dense(sizes[2], sizes[3]),
    "dec": [dense(sizes[3], sizes[2]), dense(sizes[2], sizes[1]), dense(sizes[1], sizes[0])],
  }

  def loss(p, x, key):
    h = x
    for layer in p["enc"]:
      h = jax.nn.relu(h @ layer["w"] + layer["b"])
    mu = h @ p["mu"]["w"] + p["mu"]["b"]
    logvar = h @ p["logvar"]["w"] + p["logvar"]["b"]
    z = mu + jnp.exp(0.5 * logvar) * jax.random.normal(key, mu.shape)
    for layer in p["dec"][:-1]:
      z = jax.nn.relu(z @ layer["w"] + layer["b"])
    logits = z @ p["dec"][-1]["w"] + p["dec"][-1]["b"]
    reconstruction = optax.sigmoid_binary_cross_entropy(logits, x).sum(-1)
    kl = -0.5 * (1 + logvar - mu**2 - jnp.exp(logvar)).sum(-1)
    return (reconstruction + kl).mean()

  x = jax.random.uniform(jax.random.key(1), (2048, sizes[0]))
  optimizer = optax.adam(1e-3)
  return _optax_step(loss, optimizer), (params, optimizer.init(params), x, jax.random.key(2))


def unet_resize():
  widths = (16, 32, 64)
  keys = iter(jax.random.split(jax.random.key(0), 16))
  conv = lambda i, o: jax.random.normal(next(keys), (3, 3, i, o)) / (9 * i) ** 0.5  # noqa: E731
  params = {
    "down": [conv(3, widths[0]), conv(widths[0], widths[1]), conv(widths[1], widths[2])],
    "up": [conv(widths[2] + widths[1], widths[1]), conv(widths[1] + widths[0], widths[0])],
    "out": conv(widths[0], 1),
  }
  dn = ("NHWC", "HWIO", "NHWC")

  def apply(w, x):
    return jax.nn.gelu(jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn))

  def loss(p, x, y):
    skips = []
    for i, w in enumerate(p["down"]):
      x = apply(w, x)
      if i < len(p["down"]) - 1:
        skips.append(x)
        x = jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4
    for w in p["up"]:
      skip = skips.pop()
      x = jax.image.resize(x, (*skip.shape[:3], x.shape[3]), "nearest")
      x = apply(w, jnp.concatenate([x, skip], axis=-1))
    out = jax.lax.conv_general_dilated(x, p["out"], (1, 1), "SAME", dimension_numbers=dn)
    return jnp.mean((out - y) ** 2)

  x = jax.random.normal(jax.random.key(1), (8, 64, 64, 3))
  y = jax.random.normal(jax.random.key(2), (8, 64, 64, 1))
  optimizer = optax.sgd(1e-2, momentum=0.9)
  return _optax_step(loss, optimizer), (params, optimizer.init(params), x, y)


class _LlamaBlock(nn.Module):
  heads: int = 4

  @nn.compact
  def __call__(self, x):
    b, t, d = x.shape
    dense = lambda n: nn.Dense(n, use_bias=False, dtype=jnp.bfloat16)  # noqa: E731
    q, k, v = (
      dense(d)(nn.RMSNorm(dtype=jnp.bfloat16)(x)).reshape(b, t, self.heads, -1) for _ in range(3)
    )
    half = d // self.heads // 2
    angle = jnp.arange(t)[:, None] / 10000 ** (jnp.arange(half) / half)
    cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]

    def rotate(u):
      u1, u2 = u[..., :half], u[..., half:]
      return jnp.concatenate([u1 * cos - u2 * sin, u1 * sin + u2 * cos], -1).astype(u.dtype)

    attn = jax.nn.dot_product_attention(rotate(q), rotate(k), v, is_causal=True)
    x = x + dense(d)(attn.reshape(b, t, d))
    h = nn.RMSNorm(dtype=jnp.bfloat16)(x)
    return x + dense(d)(nn.silu(dense(4 * d)(h)) * dense(4 * d)(h))


class _Llama(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(512, 256, dtype=jnp.bfloat16)(tokens)
    for _ in range(4):
      x = _LlamaBlock()(x)
    return nn.Dense(512, dtype=jnp.bfloat16)(nn.RMSNorm(dtype=jnp.bfloat16)(x)).astype(jnp.float32)


def llama_bf16():
  tokens = jax.random.randint(jax.random.key(1), (8, 128), 0, 512)
  return _linen(_Llama(), tokens, jnp.roll(tokens, -1, 1), optax.adam(1e-3), _xent)


class _EqxCNN(eqx.Module):
  layers: list

  def __init__(self, key):
    keys = jax.random.split(key, 4)
    self.layers = [
      eqx.nn.Conv2d(3, 32, 3, padding=1, key=keys[0]),
      eqx.nn.GroupNorm(8, 32),
      eqx.nn.Conv2d(32, 64, 3, padding=1, key=keys[1]),
      eqx.nn.GroupNorm(8, 64),
      eqx.nn.Conv2d(64, 64, 3, padding=1, key=keys[2]),
      eqx.nn.Linear(64, 10, key=keys[3]),
    ]

  def __call__(self, x):
    for layer in self.layers[:-1]:
      x = layer(x)
      if isinstance(layer, eqx.nn.GroupNorm):
        x = eqx.nn.AvgPool2d(2, 2)(jax.nn.relu(x))
    return self.layers[-1](jax.nn.relu(x).mean((1, 2)))


def eqx_cnn():
  model = _EqxCNN(jax.random.key(0))
  optimizer = optax.adam(1e-3)

  @eqx.filter_value_and_grad
  def loss(m, x, y):
    return _xent(jax.vmap(m)(x), y)

  def step(model, opt_state, x, y):
    value, grads = loss(model, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, value

  x = jax.random.normal(jax.random.key(1), (64, 3, 64, 64))
  args = (model, optimizer.init(eqx.filter(model, eqx.is_array)), x, jnp.arange(64) % 10)
  return eqx.filter_jit(step, donate="all-except-first"), args


STEPS = {f.__name__: f for f in (vit, convnext, vae, unet_resize, llama_bf16, eqx_cnn)}


def plan_row(step, args, budget: float, model: str, target, time_limit_s: float) -> dict:
  """`optimize` at ``budget`` in ``model``: the plan handed out, as its compiler measures it."""
  start = time.perf_counter()
  fast = jaxremat.optimize(
    step,
    budget=budget,
    model=model,
    target=target,
    time_limit=time_limit_s,
    use_cache=False,
    progress=False,
  )
  try:
    plan, error = fast.plan(*args), None
  except jaxremat.BudgetNotMetError as e:
    plan, error = e.plan, str(e)
  except jaxremat.InfeasibleBudgetError as e:
    return {"budget": budget, "model": model, "error": str(e)}
  stats = plan.schedule.stats["optimize"]
  return {
    "budget": budget,
    "model": model,
    "met": error is None,
    "error": error,
    "measured_peak_bytes": plan.measured_peak_bytes,
    "predicted_peak_bytes": stats["predicted_peak_bytes"],
    "predicted_baseline_peak_bytes": stats["predicted_baseline_peak_bytes"],
    "flops": plan.measurement.flops,
    "predicted_flops_ratio": stats["predicted_flops"] / stats["predicted_baseline_flops"],
    "plans": len(plan.attempts),
    "seconds": time.perf_counter() - start,
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--target", help="a jaxremat target (default: this machine)")
  parser.add_argument("--steps", default=",".join(STEPS), help="comma-separated")
  parser.add_argument("--models", default="rules,compiler", help="comma-separated")
  parser.add_argument("--budgets", default="0.7,0.5", help="comma-separated fractions")
  parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per optimize")
  a = parser.parse_args()
  target = jaxremat.get_target(a.target)
  results = []
  for name in a.steps.split(","):
    step, args = STEPS[name]()
    original = jaxremat.measure(step, *args, runs=0, target=target)
    row = {"step": name, "peak_bytes": original.peak_bytes, "flops": original.flops, "plans": []}
    print(f"{name}: no remat {original.peak_bytes / 2**20:.2f} MiB", flush=True)
    for model in a.models.split(","):
      for budget in map(float, a.budgets.split(",")):
        r = plan_row(step, args, budget, model, target, a.time_limit)
        row["plans"].append(r)
        if "measured_peak_bytes" not in r:
          print(f"  {model} @{budget}: {r['error'][:120]}", flush=True)
          continue
        print(
          f"  {model} @{budget}: {'met' if r['met'] else 'MISSED'} "
          f"x{r['measured_peak_bytes'] / original.peak_bytes:.3f} at FLOPs "
          f"x{r['flops'] / original.flops:.3f} (model x{r['predicted_flops_ratio']:.3f}), "
          f"predicted / measured MiB {r['predicted_peak_bytes'] / 2**20:.2f} / "
          f"{r['measured_peak_bytes'] / 2**20:.2f}, no remat in the model "
          f"{r['predicted_baseline_peak_bytes'] / 2**20:.2f}, {r['plans']} plans, "
          f"{r['seconds']:.0f} s",
          flush=True,
        )
    results.append(row)
  RESULTS.mkdir(exist_ok=True)
  out = RESULTS / f"zoo_{target.name}.json"
  out.write_text(json.dumps({"target": target.name, "steps": results}, indent=1))
  print(f"results in {out}")


if __name__ == "__main__":
  main()
