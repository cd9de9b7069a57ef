"""Prefill benchmark of the ragged paged attention kernel (issue 3).

GPU (H200):  PYTHONUNBUFFERED=1 python benchmarks/bench_prefill.py [--md PATH]
CPU smoke:   python benchmarks/bench_prefill.py --smoke

GPU mode:
  1. compiled correctness of ours vs ``kvjax.reference.unified_attention`` on ragged mixes
     (prefill + cached prefix + decode + padding), under jax.jit with traced metadata;
  2. 4 x 4096 causal prefill (bf16, Hq=32, H=8, D=128, block 16) through the paged cache:
     ours (Pallas Triton lowering; a sweep of tile configs, NHD and HND), torch SDPA
     (FlashAttention, dense KV), JAX's Pallas ``mha`` (dense KV), cuDNN through
     ``jax.nn.dot_product_attention`` (dense KV);
  3. two serving-like mixes (chunked prefill on a cached prefix; prefill + many decodes).
Causal FLOPs of an S x L prefill are counted as 4 * S * L^2 / 2 * Hq * D (QK^T and PV,
2 FLOPs a multiply-add, half the square); mixes count 4 * Hq * D * (visible query-key pairs).
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import kvjax  # noqa: E402
from kvjax.reference import unified_attention as ref_attention  # noqa: E402
from kvjax.reference import write_kv  # noqa: E402
from pallas_kernels.triton.ragged import ragged_paged_attention  # noqa: E402
from pallas_kernels.triton.ragged_kernel import TileConfig  # noqa: E402


# -- problems ---------------------------------------------------------------------------------
def ragged_batch(rng, spec, q_lens, ctx_lens, hq, pad=0, extra_blocks=4, fill="write"):
  """A ragged batch over a paged cache with shuffled pages.

  fill="write": every token of every sequence written with kvjax's reference writer;
  fill="random": the whole cache random (fast, for big timing problems).
  Returns q [T, Hq, D], cache, query_start_loc, seq_lens, block_table.
  """
  n = spec.block_size
  q_lens, ctx_lens = np.asarray(q_lens), np.asarray(ctx_lens)
  seq_lens = q_lens + ctx_lens
  pages = -(-seq_lens // n)
  num_blocks = int(pages.sum()) + extra_blocks
  max_blocks = max(1, int(pages.max()))
  perm = rng.permutation(num_blocks)
  bt = np.zeros((len(q_lens), max_blocks), np.int32)
  used = 0
  for s, p in enumerate(pages):
    bt[s, :p] = perm[used:used + p]
    bt[s, p:] = perm[used] if p else 0
    used += p
  if fill == "random":
    key = jax.random.PRNGKey(int(rng.integers(1 << 30)))
    shape = spec.physical_shape(num_blocks)
    cache = jax.random.normal(key, shape, jnp.float32).astype(spec.storage_dtype)
  else:
    cache = spec.allocate(num_blocks)
    slots = np.concatenate([bt[s, np.arange(L) // n] * n + np.arange(L) % n
                            for s, L in enumerate(seq_lens)]).astype(np.int32)
    kv_shape = (len(slots), spec.num_kv_heads, spec.head_size)
    k = jnp.asarray(rng.standard_normal(kv_shape), spec.dtype)
    v = jnp.asarray(rng.standard_normal(kv_shape), spec.dtype)
    cache = write_kv(cache, k, v, jnp.asarray(slots), spec)
  t = int(q_lens.sum()) + pad
  q = jnp.asarray(rng.standard_normal((t, hq, spec.head_size)), spec.dtype)
  qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  return q, cache, jnp.asarray(qsl), jnp.asarray(seq_lens, jnp.int32), jnp.asarray(bt)


def visible_pairs(q_lens, ctx_lens):
  """Causal (query, key) pairs: query i of a sequence sees ctx + i + 1 keys."""
  return sum(int(q) * int(c) + int(q) * (int(q) + 1) // 2 for q, c in zip(q_lens, ctx_lens))


# -- timing -----------------------------------------------------------------------------------
def time_jax(f, *args, reps=5, inner=10):
  """Median over ``reps`` of the mean time of ``inner`` back-to-back calls, in seconds."""
  jax.block_until_ready(f(*args))
  jax.block_until_ready(f(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(inner):
      out = f(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / inner)
  return statistics.median(times)


def time_torch(f, reps=5, inner=10):
  import torch
  f()
  f()
  torch.cuda.synchronize()
  times = []
  for _ in range(reps):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(inner):
      f()
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end) / 1e3 / inner)
  return statistics.median(times)


# -- runners ----------------------------------------------------------------------------------
def ours_fn(spec, scale, cfg=None, interpret=False, max_query_len=None, **kw):
  @jax.jit
  def f(q, cache, qsl, sl, bt):
    return ragged_paged_attention(q, cache, spec, query_start_loc=qsl, seq_lens=sl,
                                  block_table=bt, scale=scale, max_query_len=max_query_len,
                                  interpret=interpret, tile_config=cfg, **kw)
  return f


def ref_fn(spec, scale, **kw):
  @jax.jit
  def f(q, cache, qsl, sl, bt):
    return ref_attention(q, cache, spec, query_start_loc=qsl, seq_lens=sl, block_table=bt,
                         scale=scale, **kw)
  return f


def check_mix(name, rng, spec, q_lens, ctx_lens, hq, pad, interpret, **kw):
  q, cache, qsl, sl, bt = ragged_batch(rng, spec, q_lens, ctx_lens, hq, pad=pad)
  scale = spec.head_size ** -0.5
  out = ours_fn(spec, scale, interpret=interpret, max_query_len=int(max(q_lens)), **kw)(
      q, cache, qsl, sl, bt)
  ref = ref_fn(spec, scale, **kw)(q, cache, qsl, sl, bt)
  o, r = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  real = int(np.sum(q_lens))
  rel = float(np.linalg.norm(o[:real] - r[:real]) / np.linalg.norm(r[:real]))
  pad_ok = bool(np.all(o[real:] == 0))
  ok = rel < 2e-2 and pad_ok and np.isfinite(o).all()
  print(f"[check] {name}: rel err {rel:.2e}, padding rows zero: {pad_ok} -> "
        f"{'OK' if ok else 'FAIL'}", flush=True)
  return dict(name=name, rel_err=rel, padding_zero=pad_ok, ok=bool(ok))


def checks(interpret):
  rng = np.random.default_rng(0)
  res = []
  bf = jnp.bfloat16
  if interpret:
    spec = kvjax.KVCacheSpec(num_kv_heads=2, head_size=64, block_size=16, dtype=bf)
    res.append(check_mix("smoke NHD bf16 G=2", rng, spec, [20, 1, 9], [0, 40, 17], 4, 3,
                         interpret))
    return res
  spec = kvjax.KVCacheSpec(num_kv_heads=8, head_size=128, block_size=16, dtype=bf)
  res.append(check_mix("NHD bf16 G=4 D=128: prefill/prefix/decode + pad", rng, spec,
                       [300, 1, 1, 77, 512, 1], [0, 1000, 37, 500, 64, 3], 32, 13, interpret))
  spec = kvjax.KVCacheSpec(num_kv_heads=2, head_size=96, block_size=32, layout="HND",
                           cache_dtype="int8_per_token_head", dtype=bf)
  res.append(check_mix("HND int8/token-head G=7 D=96 N=32 window+softcap+sinks", rng, spec,
                       [200, 1, 64, 3], [100, 700, 0, 90], 14, 5, interpret,
                       sliding_window=128, soft_cap=30.0,
                       sinks=jnp.asarray(rng.standard_normal(14), jnp.float32)))
  spec = kvjax.KVCacheSpec(num_kv_heads=4, head_size=64, block_size=64, cache_dtype="fp8",
                           dtype=bf)
  res.append(check_mix("NHD fp8 per-tensor G=1 D=64 N=64", rng, spec, [128, 5, 1],
                       [64, 300, 1000], 4, 0, interpret))
  return res


def bench_gpu(sweep):
  import torch
  import torch.nn.functional as tf
  rows = []
  s_, l_, hq, h, d, n = 4, 4096, 32, 8, 128, 16
  scale = d ** -0.5
  flops = 4 * s_ * l_ ** 2 / 2 * hq * d
  rng = np.random.default_rng(1)

  def add(name, sec, fl=flops, note=""):
    tflops = fl / sec / 1e12
    rows.append(dict(name=name, ms=sec * 1e3, tflops=tflops, note=note))
    print(f"[bench] {name}: {sec * 1e3:.3f} ms, {tflops:.1f} TFLOP/s {note}", flush=True)

  for layout in ("NHD", "HND"):
    spec = kvjax.KVCacheSpec(num_kv_heads=h, head_size=d, block_size=n, layout=layout,
                             dtype=jnp.bfloat16)
    q, cache, qsl, sl, bt = ragged_batch(rng, spec, [l_] * s_, [0] * s_, hq, fill="random")
    configs = [None] + (sweep if layout == "NHD" else [])
    for cfg in configs:
      name = f"ours Triton {layout} " + ("default" if cfg is None else
                                          f"rows={cfg.rows} bk={cfg.block_kv} "
                                          f"w={cfg.num_warps} st={cfg.num_stages}")
      try:
        add(name, time_jax(ours_fn(spec, scale, cfg), q, cache, qsl, sl, bt))
      except Exception as e:  # noqa: BLE001 - report and keep going
        print(f"[bench] {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
  # Serving-like mixes (NHD, default config).
  spec = kvjax.KVCacheSpec(num_kv_heads=h, head_size=d, block_size=n, dtype=jnp.bfloat16)
  for name, ql, cl in (("chunked prefill 4 x 2048 new on 2048 cached", [2048] * 4, [2048] * 4),
                       ("1 x 4096 prefill + 64 decodes at ctx 4096",
                        [4096] + [1] * 64, [0] + [4096] * 64)):
    q, cache, qsl, sl, bt = ragged_batch(rng, spec, ql, cl, hq, fill="random")
    fl = 4 * hq * d * visible_pairs(ql, cl)
    add(f"ours Triton NHD {name}", time_jax(ours_fn(spec, scale), q, cache, qsl, sl, bt), fl)

  # Dense baselines.
  qd = torch.randn(s_, hq, l_, d, device="cuda", dtype=torch.bfloat16)
  kd = torch.randn(s_, h, l_, d, device="cuda", dtype=torch.bfloat16)
  vd = torch.randn(s_, h, l_, d, device="cuda", dtype=torch.bfloat16)
  ke, ve = kd.repeat_interleave(hq // h, 1), vd.repeat_interleave(hq // h, 1)
  from torch.nn.attention import SDPBackend, sdpa_kernel
  with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    add("torch SDPA FlashAttention (dense KV, heads expanded)",
        time_torch(lambda: tf.scaled_dot_product_attention(qd, ke, ve, is_causal=True)))
  try:
    add("torch SDPA enable_gqa (dense KV)", time_torch(
        lambda: tf.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)))
  except Exception as e:  # noqa: BLE001
    print(f"[bench] torch SDPA enable_gqa: FAILED {e}", flush=True)
  key = jax.random.PRNGKey(0)
  qj = jax.random.normal(key, (s_, l_, hq, d), jnp.bfloat16)
  kj = jax.random.normal(key, (s_, l_, hq, d), jnp.bfloat16)
  vj = jax.random.normal(key, (s_, l_, hq, d), jnp.bfloat16)
  try:
    from jax.experimental.pallas.ops.gpu.attention import mha
    f = jax.jit(functools.partial(mha, segment_ids=None, sm_scale=scale, causal=True))
    add("JAX Pallas ops.gpu.attention.mha (dense KV, heads expanded)",
        time_jax(f, qj, kj, vj))
  except Exception as e:  # noqa: BLE001
    print(f"[bench] JAX mha: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
  try:
    kg = jax.random.normal(key, (s_, l_, h, d), jnp.bfloat16)
    f = jax.jit(lambda a, b, c: jax.nn.dot_product_attention(a, b, c, scale=scale,
                                                             is_causal=True,
                                                             implementation="cudnn"))
    add("JAX dot_product_attention cuDNN (dense KV, GQA)", time_jax(f, qj, kg, kg))
  except Exception as e:  # noqa: BLE001
    print(f"[bench] JAX cuDNN: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
  return rows


def smoke():
  rows = []
  spec = kvjax.KVCacheSpec(num_kv_heads=2, head_size=64, block_size=16, dtype=jnp.bfloat16)
  rng = np.random.default_rng(1)
  q, cache, qsl, sl, bt = ragged_batch(rng, spec, [64, 64], [0, 0], 4, fill="random")
  sec = time_jax(ours_fn(spec, 0.125, interpret=True), q, cache, qsl, sl, bt, reps=1, inner=1)
  fl = 4 * 2 * 64 ** 2 / 2 * 4 * 64
  rows.append(dict(name="ours interpret (CPU) 2 x 64", ms=sec * 1e3, tflops=fl / sec / 1e12,
                   note="interpret mode: not a speed"))
  print(f"[bench] smoke: {sec * 1e3:.1f} ms", flush=True)
  return rows


def versions():
  v = dict(python=platform.python_version(), jax=jax.__version__,
           device=str(jax.devices()[0].device_kind))
  try:
    import torch
    v["torch"] = torch.__version__
  except ImportError:
    pass
  try:
    import triton
    v["triton"] = triton.__version__
  except ImportError:
    pass
  return v


def write_md(path, argv, ver, chk, rows):
  lines = [
      "# Prefill benchmark: ragged paged attention (raw output of bench_prefill.py)", "",
      f"- command: `{' '.join(argv)}`",
      f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
      f"- versions/device: {json.dumps(ver)}",
      "- FLOPs: causal 4 x 4096 counted as 4 * S * L^2 / 2 * Hq * D = "
      f"{4 * 4 * 4096 ** 2 / 2 * 32 * 128 / 1e9:.1f} GFLOP; mixes 4 * Hq * D * visible pairs", "",
      "## Correctness (compiled, vs kvjax.reference)", "",
      "| mix | rel err (L2) | padding rows zero | ok |", "|---|---|---|---|"]
  lines += [f"| {c['name']} | {c['rel_err']:.2e} | {c['padding_zero']} | {c['ok']} |"
            for c in chk]
  lines += ["", "## Speed", "", "| implementation | ms | TFLOP/s | note |", "|---|---|---|---|"]
  lines += [f"| {r['name']} | {r['ms']:.3f} | {r['tflops']:.1f} | {r['note']} |" for r in rows]
  with open(path, "w") as fh:
    fh.write("\n".join(lines) + "\n")
  print(f"wrote {path}")


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--smoke", action="store_true", help="tiny CPU interpret run")
  ap.add_argument("--md", default=None, help="markdown output (default: $OUT/prefill_raw.md "
                  "on the device, else none)")
  ap.add_argument("--no-sweep", action="store_true")
  ap.add_argument("--sweep", default="128,64,4,3;256,64,8,3;256,32,8,3;128,32,4,2;64,32,4,3",
                  help="extra NHD tile configs 'rows,block_kv,warps,stages;...'")
  args = ap.parse_args()
  ver = versions()
  print("versions:", ver, flush=True)
  if args.smoke:
    chk, rows = checks(interpret=True), smoke()
  else:
    sweep = [] if args.no_sweep else [TileConfig(*map(int, c.split(",")))
                                      for c in args.sweep.split(";") if c]
    chk = checks(interpret=False)
    rows = bench_gpu(sweep)
  print("\n| implementation | ms | TFLOP/s |\n|---|---|---|")
  for r in rows:
    print(f"| {r['name']} | {r['ms']:.3f} | {r['tflops']:.1f} |")
  print("checks:", "all OK" if all(c["ok"] for c in chk) else "FAILURES", flush=True)
  md = args.md or (os.path.join(os.environ["OUT"], "prefill_raw.md") if "OUT" in os.environ
                   else None)
  if md:
    write_md(md, sys.argv, ver, chk, rows)
    with open(os.path.splitext(md)[0] + ".json", "w") as fh:
      json.dump(dict(versions=ver, checks=chk, rows=rows), fh, indent=1)


if __name__ == "__main__":
  main()
