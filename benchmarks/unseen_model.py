"""A model no part of jaxremat was tuned on: a ConvMixer-style network (4x4 patch
embedding, 6 blocks of depthwise 5x5 + pointwise convolutions with residuals, GELU), Adam,
batch 32 of 128x128 images. Compiles it for a target with each `jax.checkpoint` variant a
user would try by hand, plans it with `jaxremat.optimize` at each budget, and prints the
target compiler's peak and FLOPs of each (the plan's predicted peak beside its own);
results in ``benchmarks/results/unseen_model_<target>.json``.

  python -m benchmarks.unseen_model h100 0.7,0.5
"""

import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import optax

import jaxremat
from examples._common import CHECKPOINT_VARIANTS, checkpointed_loss, run_blocks

tgt, budgets = sys.argv[1], [float(b) for b in sys.argv[2].split(",")]
D, DEPTH, K = 64, 6, 5


def init(key):
  ks = jax.random.split(key, 2 * DEPTH + 2)
  p = {
    "embed": jax.random.normal(ks[0], (4, 4, 3, D)) * 0.1,
    "head": jax.random.normal(ks[1], (D, 10)) * 0.1,
    "blocks": [],
  }
  for i in range(DEPTH):
    p["blocks"].append(
      {
        "dw": jax.random.normal(ks[2 + 2 * i], (K, K, 1, D)) * 0.1,
        "pw": jax.random.normal(ks[3 + 2 * i], (1, 1, D, D)) * 0.1,
      }
    )
  return p


dn = ("NHWC", "HWIO", "NHWC")


def block(b, h):
  h = h + jax.nn.gelu(
    jax.lax.conv_general_dilated(
      h, b["dw"], (1, 1), "SAME", dimension_numbers=dn, feature_group_count=D
    )
  )
  return jax.nn.gelu(jax.lax.conv_general_dilated(h, b["pw"], (1, 1), "SAME", dimension_numbers=dn))


def loss(p, x, y, checkpoint=None):
  h = jax.nn.gelu(
    jax.lax.conv_general_dilated(x, p["embed"], (4, 4), "VALID", dimension_numbers=dn)
  )
  h = run_blocks([(block, b) for b in p["blocks"]], h, checkpoint)
  logits = h.mean((1, 2)) @ p["head"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


opt = optax.adam(1e-3)


def train_step(loss_fn):
  def step(p, s, x, y):
    v, g = jax.value_and_grad(loss_fn)(p, x, y)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s, v

  return step


step = train_step(loss)


p = init(jax.random.PRNGKey(0))
s = opt.init(p)
x = jax.random.normal(jax.random.PRNGKey(1), (32, 128, 128, 3))
y = jnp.arange(32) % 10
args = (p, s, x, y)
base = jaxremat.measure(step, *args, runs=0, target=tgt)
print(f"{tgt} no remat {base.peak_bytes / 2**20:.2f} MiB", flush=True)
rows = [{"method": "no remat", "peak_bytes": base.peak_bytes, "flops": base.flops}]
for variant in CHECKPOINT_VARIANTS:
  variant_loss = checkpointed_loss(sys.modules[__name__], variant)  # this module's loss
  m = jaxremat.measure(train_step(variant_loss), *args, runs=0, target=tgt)
  rows.append({"method": f"ckpt {variant}", "peak_bytes": m.peak_bytes, "flops": m.flops})
  print(
    f"ckpt {variant}: {m.peak_bytes / 2**20:.2f} MiB x{m.peak_bytes / base.peak_bytes:.3f} "
    f"flops x{m.flops / base.flops:.3f}",
    flush=True,
  )
for b in budgets:
  t = time.time()
  f = jaxremat.optimize(step, budget=b, time_limit=120, use_cache=False, progress=False, target=tgt)
  try:
    plan = f.plan(*args)
    met = "met"
  except jaxremat.BudgetNotMetError as e:
    plan = e.plan
    met = "NOT met"
  model = plan.schedule.stats["optimize"]
  pred = model["predicted_peak_bytes"]
  model_flops = model["predicted_flops"] / model["predicted_baseline_flops"]
  rows.append(
    {
      "method": f"jaxremat auto @{b}",
      "met": met == "met",
      "peak_bytes": plan.measured_peak_bytes,
      "predicted_peak_bytes": pred,
      "flops": plan.measurement.flops,
      "predicted_flops_ratio": model_flops,
      "solver": plan.schedule.stats.get("found_by", plan.schedule.solver),
      "plans": len(plan.attempts),
      "attempts": model["attempts"],
      "seconds": time.time() - t,
    }
  )
  print(
    f"{b}: {met} measured {plan.measured_peak_bytes / 2**20:.2f} MiB x{plan.measured_peak_bytes / base.peak_bytes:.3f} predicted {pred / 2**20:.2f} flops x{plan.measurement.flops / base.flops:.3f} (model x{model_flops:.3f}) solver {plan.schedule.solver} plans {len(plan.attempts)} {time.time() - t:.0f}s",
    flush=True,
  )
out = pathlib.Path(__file__).parent / "results" / f"unseen_model_{tgt}.json"
out.write_text(json.dumps({"target": tgt, "budgets": budgets, "rows": rows}, indent=1))
