"""GPU-only numerics: cuDNN's fused attention and fp8 matmuls against float32 references, with their speed.

  python tools/gpu_numerics.py            # on an NVIDIA GPU (tools/h200_check.sh numerics)

Each check draws fresh normal inputs, runs the fast path in its own precision
and the reference in float32, and prints the relative error of the output and
of every gradient (||fast - ref|| / ||ref||) and the median time of the jitted
forward and backward over 20 runs after a warm-up. bf16 operands land between
1e-3 and 1e-2 against float32; fp8 (3 mantissa bits forward, 2 backward) near
3e-2 and 1e-1.
"""

import statistics
import time

import jax
import jax.numpy as jnp

from model import fp8
from model.attention import blockwise_attention


def relative_error(fast, ref) -> float:
  fast, ref = (jnp.asarray(x, jnp.float32) for x in (fast, ref))
  return float(jnp.linalg.norm(fast - ref) / jnp.linalg.norm(ref))


def median_ms(fn, *args, runs: int = 20) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(runs):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def value_and_vjp(fn, *inputs, cotangent_key):
  """fn's output and the gradients of <output, a random cotangent> with respect to every input."""
  out, vjp = jax.vjp(fn, *inputs)
  cotangent = jax.random.normal(cotangent_key, out.shape, jnp.float32).astype(out.dtype)  # one draw for every dtype
  return out, vjp(cotangent)


def attention_rows(batch=4, length=2048, heads=12, head_dim=64) -> list[tuple]:
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v = (jax.random.normal(key, (batch, length, heads, head_dim), jnp.bfloat16) for key in keys[:3])
  positions = jnp.arange(length)
  cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
  blockwise = lambda q, k, v: blockwise_attention(q, k, v, positions, positions, 512)[0]
  run = lambda fn, *x: value_and_vjp(fn, *x, cotangent_key=keys[3])
  ref_out, ref_grads = jax.jit(lambda *x: run(blockwise, *x))(*(x.astype(jnp.float32) for x in (q, k, v)))
  rows = []
  for name, fn in (("cuDNN flash attention, bf16", cudnn), ("blockwise xla attention, bf16", blockwise)):
    step = jax.jit(lambda *x, fn=fn: run(fn, *x))
    out, grads = step(q, k, v)
    errors = [relative_error(out, ref_out)] + [relative_error(g, r) for g, r in zip(grads, ref_grads)]
    rows.append((name, f"[{batch}, {length}, {heads}, {head_dim}]", *errors, median_ms(step, q, k, v)))
  return rows


def fp8_rows(m=8192, d=4096, f=4096) -> list[tuple]:
  keys = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(keys[0], (m, d), jnp.bfloat16)
  w = (jax.random.normal(keys[1], (d, f), jnp.float32) * d ** -0.5).astype(jnp.bfloat16)
  spec = "md,df->mf"
  run = lambda fn, *a: value_and_vjp(fn, *a, cotangent_key=keys[2])
  ref_out, ref_grads = jax.jit(lambda *a: run(lambda x, w: jnp.einsum(spec, x, w), *a))(
      x.astype(jnp.float32), w.astype(jnp.float32))
  rows = []
  for name, fn in (("fp8 matmul (E4M3 / E5M2)", lambda x, w: fp8.einsum(spec, x, w)),
                   ("bf16 matmul", lambda x, w: jnp.einsum(spec, x, w, preferred_element_type=jnp.bfloat16))):
    step = jax.jit(lambda *a, fn=fn: run(fn, *a))
    out, grads = step(x, w)
    errors = [relative_error(out, ref_out)] + [relative_error(g, r) for g, r in zip(grads, ref_grads)] + [None]
    hlo = step.lower(x, w).compile().as_text()
    fp8_gemms = hlo.count('custom_call_target="__cublas$lt$matmul$f8"')  # cuBLAS's fp8 GEMMs, 3 if all ran
    rows.append((f"{name}; fp8 cuBLAS calls: {fp8_gemms}", f"[{m}, {d}] x [{d}, {f}]", *errors,
                 median_ms(step, x, w)))
  return rows


def main():
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
  print("| path | shape | out | d first | d second | d third | ms fwd+bwd |")
  print("| --- | --- | --- | --- | --- | --- | --- |")
  for rows in (attention_rows, fp8_rows):
    for name, shape, *errors, ms in rows():
      cells = " | ".join("" if e is None else f"{e:.1e}" for e in errors)
      print(f"| {name} | {shape} | {cells} | {ms:.2f} |", flush=True)


if __name__ == "__main__":
  main()
