"""H200 check of the Mosaic GPU ragged attention: compiled correctness, then speed.

GPU:  PYTHONUNBUFFERED=1 python3 benchmarks/check_mosaic_gpu.py         (< 6 minutes)
      writes $OUT/mosaic_gpu.json when $OUT is set.

1. Correctness of every ``acc += P V`` variant of the kernel (``tiles.PV_VARIANTS``: P in
   registers / through shared memory, accumulated in place / into a fresh accumulator) vs
   ``kvjax.reference.unified_attention`` on small ragged batches (NHD and HND, GQA 1/4/7/8,
   head sizes 64/128/256, window, soft cap, sinks, padding tokens, zero-length prefixes and
   empty sequences, decode-only, a prefill + decode mix, sequences starting at every token
   offset mod 8), caches poisoned with NaN in every
   slot no token was written to. Per case and variant: max |error| relative to the output's
   magnitude, padding rows exactly 0, PASS/FAIL; an exception prints its type and first
   lines and the next one runs. The summary says which variants pass every case.
2. Speed (bf16, Hq=32, H=8, D=128, block 16, pages shuffled): 4x4096, 16x1024, 1x16384
   causal prefill and a serving mix (1x4096 prefill + 64 decodes at 4096) for this kernel's
   default variant (NHD, HND) and, on 4x4096 and the mix, its other variants (NHD); the
   Pallas-Triton kernel (``kvjax.unified_attention(impl="pallas")``), and on dense KV JAX's
   ``attention_mgpu`` (float16: it stages q/k/v in float16 buffers), cuDNN
   (``jax.nn.dot_product_attention``) and torch SDPA (``enable_gqa=True``).
   FLOPs = 4 * (visible query-key pairs) * Hq * D.

Each part runs in a child process with a time limit, so a hang (a barrier deadlock) or a
crash costs that part only; the parent prints what the child reported before it stopped.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PARTS = {"checks": 240, "bench": 150, "rule": 150}    # seconds each part may take
PREFIX = "@@"                             # result lines the parent collects


def emit(kind, **row):
  """Print a human line and a machine line (collected by the parent)."""
  print(PREFIX + json.dumps(dict(kind=kind, **row)), flush=True)


def first_lines(e: BaseException, n: int = 3) -> str:
  text = f"{type(e).__name__}: {e}".strip().splitlines()
  return " | ".join(text[:n])[:400]


# -- problems ----------------------------------------------------------------------------------
def paged_batch(rng, spec, q_lens, ctx_lens, hq, pad=0, fill="nan", scales=None):
  """(q, cache, qsl, seq_lens, block_table) with shuffled pages.

  fill="nan": NaN cache, then every token of every sequence written (small checks);
  fill="random": the whole cache random normal (big timing problems).
  """
  import jax
  import jax.numpy as jnp
  import numpy as np
  from kvjax.reference import write_kv
  n = spec.block_size
  q_lens, ctx_lens = np.asarray(q_lens), np.asarray(ctx_lens)
  seq_lens = q_lens + ctx_lens
  pages = np.maximum(-(-seq_lens // n), 1)
  num_blocks = int(pages.sum()) + 2
  perm = rng.permutation(num_blocks)
  bt = np.zeros((len(q_lens), int(pages.max())), np.int32)
  used = 0
  for s, p in enumerate(pages):
    bt[s, :p] = perm[used:used + p]
    bt[s, p:] = perm[-1]
    used += p
  shape = spec.physical_shape(num_blocks)
  if fill == "random":
    cache = jax.random.normal(jax.random.PRNGKey(int(rng.integers(1 << 30))), shape,
                              jnp.float32).astype(spec.dtype)
  else:   # 0xFF bytes: NaN in 16-bit floats, NaN data and scales in quantized formats
    raw = np.full(int(np.prod(shape)) * spec.itemsize, 0xFF, np.uint8)
    cache = jnp.asarray(raw.view(spec.storage_dtype).reshape(shape))
    slots = np.concatenate([bt[s, np.arange(L) // n] * n + np.arange(L) % n
                            for s, L in enumerate(seq_lens)]).astype(np.int32)
    kv = (len(slots), spec.num_kv_heads, spec.head_size)
    k, v = (jnp.asarray(rng.standard_normal(kv), spec.dtype) for _ in range(2))
    cache = write_kv(cache, k, v, jnp.asarray(slots), spec, k_scale=scales, v_scale=scales)
  q = jnp.asarray(rng.standard_normal((int(q_lens.sum()) + pad, hq, spec.head_size)),
                  spec.dtype)
  qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  return q, cache, jnp.asarray(qsl), jnp.asarray(seq_lens, jnp.int32), jnp.asarray(bt)


def visible_pairs(q_lens, ctx_lens):
  """Causal (query, key) pairs: query i of a sequence sees ctx + i + 1 keys."""
  return sum(int(q) * int(c) + int(q) * (int(q) + 1) // 2 for q, c in zip(q_lens, ctx_lens))


def ours_fn(spec, scale, max_query_len, geometry=None, pv=None, **kw):
  import jax
  from pallas_kernels.mosaic_gpu.ragged_attention import ragged_paged_attention_tiled

  @jax.jit
  def f(q, cache, qsl, sl, bt):
    return ragged_paged_attention_tiled(q, cache, spec, query_start_loc=qsl, seq_lens=sl,
                                        block_table=bt, scale=scale,
                                        max_query_len=max_query_len, geometry=geometry,
                                        pv=pv, **kw)
  return f


def triton_fn(spec, scale, max_query_len, **kw):
  import jax
  import kvjax

  @jax.jit
  def f(q, cache, qsl, sl, bt):
    return kvjax.unified_attention(q, cache, spec, query_start_loc=qsl, seq_lens=sl,
                                   block_table=bt, scale=scale, max_query_len=max_query_len,
                                   impl="pallas", **kw)
  return f


# -- part 1: correctness -----------------------------------------------------------------------
CHECKS = [
    # name, layout, H, G, D, N, q_lens, ctx_lens, pad, kwargs
    ("NHD G=4 D=128 prefill/prefix/decode mix + pad", "NHD", 2, 4, 128, 16,
     [300, 1, 1, 77, 0, 64], [0, 1000, 37, 500, 5, 64], 13, {}),
    ("HND G=4 D=128 same mix", "HND", 2, 4, 128, 16,
     [300, 1, 1, 77, 0, 64], [0, 1000, 37, 500, 5, 64], 13, {}),
    ("NHD G=1 D=128 two consumer warpgroups", "NHD", 2, 1, 128, 16,
     [700, 130, 1], [0, 300, 90], 5, {}),
    ("HND G=7 D=64 N=32 window+softcap+sinks", "HND", 2, 7, 64, 32,
     [200, 1, 64, 3], [100, 700, 0, 90], 5,
     dict(sliding_window=128, soft_cap=30.0, sinks=True)),
    ("NHD G=4 D=256 one consumer warpgroup", "NHD", 2, 4, 256, 16,
     [129, 1, 40], [0, 333, 7], 3, {}),
    ("NHD G=8 D=128 decode-only (max_query_len=1)", "NHD", 2, 8, 128, 16,
     [1] * 9, [0, 1, 15, 16, 17, 255, 1000, 3, 64], 7, dict(max_query_len=1)),
    ("HND G=4 D=128 zero-length prefixes, empty seqs", "HND", 2, 4, 128, 16,
     [33, 0, 250, 0, 16], [0, 0, 0, 12, 0], 0, {}),
    ("HND G=2 D=128 non-causal + window", "HND", 2, 2, 128, 16,
     [90, 4], [40, 200], 2, dict(causal=False, sliding_window=60)),
    ("NHD G=4 D=128 N=64 window+sinks", "NHD", 2, 4, 128, 64,
     [256, 1, 31], [512, 800, 0], 1, dict(sliding_window=200, sinks=True)),
    ("NHD fp16 G=4 D=64 N=48 softcap", "NHD", 2, 4, 64, 48,
     [100, 1], [50, 300], 4, dict(soft_cap=20.0, dtype="float16")),
    # sequences start at token offsets 0,1,3,6,2,7,5,4 (mod 8): q tiles at every alignment
    ("HND G=4 D=128 q tiles at every token offset mod 8", "HND", 2, 4, 128, 16,
     [9, 10, 11, 12, 13, 14, 15, 17], [0, 5, 0, 20, 3, 0, 40, 7], 3, {}),
    # quantized caches, read through a plain copy of the batch's pages (default variant only)
    ("HND G=4 D=128 int8 per token-head (plain copy)", "HND", 2, 4, 128, 16,
     [300, 1, 77], [0, 1000, 500], 5, dict(cache_dtype="int8_per_token_head")),
    ("NHD G=4 D=128 fp8 per tensor (plain copy)", "NHD", 2, 4, 128, 16,
     [200, 1, 64], [30, 700, 0], 2, dict(cache_dtype="fp8", scales=0.5)),
]


def cuda_info() -> dict:
  """CUDA runtime / driver versions JAX sees (ptxas comes with the runtime's toolkit)."""
  try:
    from jax._src.lib import cuda_versions
    return dict(cuda_runtime=cuda_versions.cuda_runtime_get_version(),
                cuda_driver=cuda_versions.cuda_driver_get_version())
  except Exception as e:  # noqa: BLE001 - informational only
    return dict(cuda_versions=first_lines(e, 1))


def run_checks():
  import jax
  import jax.numpy as jnp
  import numpy as np
  import kvjax
  from kvjax.reference import unified_attention as ref_attention
  from pallas_kernels.mosaic_gpu.ragged_attention import supports_attention
  from pallas_kernels.mosaic_gpu.tiles import DEFAULT_PV, PV_VARIANTS
  spec0 = kvjax.KVCacheSpec(8, 128, 16, dtype=jnp.bfloat16)
  emit("info", supports=supports_attention(spec0, jnp.bfloat16), device=str(jax.devices()[0]),
       default_pv=DEFAULT_PV, **cuda_info())
  rng = np.random.default_rng(0)
  for name, layout, h, g, d, n, ql, cl, pad, kw in CHECKS:
    kw = dict(kw)
    dtype = jnp.dtype(kw.pop("dtype", "bfloat16"))
    mql = kw.pop("max_query_len", max(ql))
    cache_dtype = kw.pop("cache_dtype", "auto")
    scales = kw.pop("scales", None)
    if scales is not None:
      kw.update(k_scale=scales, v_scale=scales)
    variants = PV_VARIANTS if cache_dtype == "auto" else (DEFAULT_PV,)
    try:
      spec = kvjax.KVCacheSpec(h, d, n, cache_dtype, layout=layout, dtype=dtype)
      q, cache, qsl, sl, bt = paged_batch(rng, spec, ql, cl, h * g, pad=pad, scales=scales)
      if kw.pop("sinks", False):
        kw["sinks"] = jnp.asarray(rng.standard_normal(h * g) * 2, jnp.float32)
      scale = d ** -0.5
      r = np.asarray(jax.jit(functools.partial(ref_attention, spec=spec, scale=scale, **kw))(
          q, cache, query_start_loc=qsl, seq_lens=sl, block_table=bt), np.float32)
    except Exception as e:  # noqa: BLE001 - report and go on with the next case
      for pv in variants:
        emit("check", name=name, pv=pv, ok=False, error="setup: " + first_lines(e))
      continue
    real = int(np.sum(ql))
    mag = float(np.max(np.abs(r))) if r.size else 0.0
    for pv in variants:
      t0 = time.time()
      try:
        out = ours_fn(spec, scale, mql, pv=pv, **kw)(q, cache, qsl, sl, bt)
        o = np.asarray(jax.block_until_ready(out), np.float32)
        err = float(np.max(np.abs(o[:real] - r[:real]))) if real else 0.0
        pad_zero = bool(np.all(o[real:] == 0))
        finite = bool(np.isfinite(o).all())
        ok = finite and pad_zero and err <= 2e-2 * max(mag, 1e-3)
        emit("check", name=name, pv=pv, max_err=err, ref_max=mag, padding_zero=pad_zero,
             finite=finite, ok=ok, seconds=round(time.time() - t0, 1))
      except Exception as e:  # noqa: BLE001 - report and go on
        emit("check", name=name, pv=pv, ok=False, error=first_lines(e),
             seconds=round(time.time() - t0, 1))


# -- part 2: speed -----------------------------------------------------------------------------
PREFILLS = [(4, 4096), (16, 1024), (1, 16384)]
MIX = ([4096] + [1] * 64, [0] + [4096] * 64)
HQ, H, D, N = 32, 8, 128, 16


def run_bench(smoke: bool = False):
  """Time every implementation; ``smoke``: tiny problems (plumbing check on CPU)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import kvjax
  from benchmarks.common import time_jax
  from pallas_kernels.mosaic_gpu.tiles import DEFAULT_PV, PV_VARIANTS
  rng = np.random.default_rng(1)
  scale = D ** -0.5

  def timed(impl, problem, fn, flops):
    try:
      ms = fn()
      emit("bench", impl=impl, problem=problem, ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
    except Exception as e:  # noqa: BLE001
      emit("bench", impl=impl, problem=problem, error=first_lines(e))

  prefills, mix = ([(1, 64)], ([32, 1], [0, 64])) if smoke else (PREFILLS, MIX)
  problems = [(f"{s}x{L} causal prefill", [L] * s, [0] * s) for s, L in prefills]
  problems.append((f"1x{mix[0][0]} prefill + {len(mix[0]) - 1} decodes at {mix[1][1]}", *mix))
  timing = dict(reps=1, inner=1, warmup=1) if smoke else {}
  for k, (problem, ql, cl) in enumerate(problems):
    flops = 4 * visible_pairs(ql, cl) * HQ * D
    mql = max(ql)
    for layout in ("NHD", "HND"):
      spec = kvjax.KVCacheSpec(H, D, N, layout=layout, dtype=jnp.bfloat16)
      args = paged_batch(rng, spec, ql, cl, HQ, fill="random")
      if layout == "NHD":
        f = triton_fn(spec, scale, mql)
        timed("Pallas-Triton (kvjax) NHD", problem, lambda: time_jax(f, *args, **timing), flops)
      f = ours_fn(spec, scale, mql)
      timed(f"Mosaic GPU (ours, {DEFAULT_PV}) {layout}", problem,
            lambda: time_jax(f, *args, **timing), flops)
      if layout == "NHD" and k in (0, len(problems) - 1):    # the other variants
        for pv in PV_VARIANTS:
          if pv != DEFAULT_PV:
            f = ours_fn(spec, scale, mql, pv=pv)
            timed(f"Mosaic GPU (ours, {pv}) NHD", problem,
                  lambda: time_jax(f, *args, **timing), flops)
      del args
    if len(set(ql)) == 1:          # dense baselines: equal-length causal prefills
      dense_baselines(timed, problem, len(ql), ql[0], flops)
  # Tile sweep of the default variant on the first problem (NHD): bq, consumer warpgroups,
  # keys per step, K/V slots; the default tile (tiles.choose_geometry) is bq=32 wgs=2 bk=128.
  from pallas_kernels.mosaic_gpu.tiles import TileGeometry
  problem, ql, cl = problems[0]
  flops = 4 * visible_pairs(ql, cl) * HQ * D
  spec = kvjax.KVCacheSpec(H, D, N, dtype=jnp.bfloat16)
  args = paged_batch(rng, spec, ql, cl, HQ, fill="random")
  g = HQ // H
  for bq, wgs, bk, stages in ((32, 2, 64, 4), (16, 1, 128, 2)):
    geo = TileGeometry(g, bq, wgs, bk, stages, N)
    f = ours_fn(spec, scale, max(ql), geometry=geo)
    timed(f"Mosaic GPU (ours, {DEFAULT_PV}) NHD bq={bq} wgs={wgs} bk={bk} stages={stages}",
          problem, lambda: time_jax(f, *args, **timing), flops)


#: (name, q_lens, ctx_lens): batches from pure decode to long prefill, for the rule that says
#: where ``auto`` takes the Mosaic GPU kernel over the Triton one (same bf16 NHD cache).
RULE_BATCHES = [
    ("64 decodes at 4096", [1] * 64, [4095] * 64),
    ("256 decodes at 1024", [1] * 256, [1023] * 256),
    ("64 x 4 tokens at 4096 (speculative)", [4] * 64, [4092] * 64),
    ("32 x 16 tokens at 2048", [16] * 32, [2032] * 32),
    ("8 x 128-token chunks on 2048", [128] * 8, [2048] * 8),
    ("1 x 512 prefill + 32 decodes at 2048", [512] + [1] * 32, [0] + [2047] * 32),
    ("2 x 2048 prefill", [2048] * 2, [0] * 2),
]
#: Cache formats the Triton ragged kernel is timed on for a 4 x 4096 causal prefill.
QUANT_PREFILL_FORMATS = ("bfloat16", "fp8", "int8_per_token_head", "fp8_per_token_head",
                         "int4_per_token_head", "nvfp4")


def run_rule(smoke: bool = False, quant_only: bool = False):
  """Triton vs Mosaic GPU across query lengths (the auto rule), and every cache format on a
  4 x 4096 causal prefill: the Triton ragged kernel reading the quantized pages in its inner
  loop (``plain_copy=False``), through a plain copy of them (``kvjax.plain_copy``), and the
  Mosaic GPU kernel (through the copy)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import kvjax
  from benchmarks.common import time_jax
  rng = np.random.default_rng(2)
  scale = D ** -0.5
  timing = dict(reps=1, inner=1, warmup=1) if smoke else {}
  batches = [("2 decodes", [1, 1], [30, 60]), ("1 x 40 prefill", [40], [0])] if smoke \
      else RULE_BATCHES
  if quant_only:
    batches = []
  for problem, ql, cl in batches:
    flops = 4 * visible_pairs(ql, cl) * HQ * D
    spec = kvjax.KVCacheSpec(H, D, N, layout="NHD", dtype=jnp.bfloat16)
    args = paged_batch(rng, spec, ql, cl, HQ, fill="random")
    for impl, fn in (("Pallas-Triton", triton_fn), ("Mosaic GPU", ours_fn)):
      f = fn(spec, scale, max(ql))
      try:
        ms = time_jax(f, *args, **timing)
        emit("bench", impl=impl, problem=problem, ms=ms, tflops=flops / (ms * 1e-3) / 1e12,
             part="rule", max_query_len=max(ql))
      except Exception as e:  # noqa: BLE001
        emit("bench", impl=impl, problem=problem, error=first_lines(e), part="rule")
    del args
  s, L = (1, 64) if smoke else (4, 4096)
  ql, cl = [L] * s, [0] * s
  flops = 4 * visible_pairs(ql, cl) * HQ * D
  for cd in QUANT_PREFILL_FORMATS:
    spec = kvjax.KVCacheSpec(H, D, N, cache_dtype=cd, layout="HND" if cd == "nvfp4" else "NHD",
                             dtype=jnp.bfloat16)
    ks = 1.0 if cd in ("fp8", "nvfp4") else None
    q = jnp.asarray(rng.standard_normal((s * L, HQ, D)), jnp.bfloat16)
    pages = s * L // N + 8
    shape = spec.physical_shape(pages)
    if spec.storage_dtype.itemsize >= 2 or cd == "fp8":
      cache = jnp.asarray(rng.standard_normal(shape) * 0.5).astype(spec.storage_dtype)
    else:   # small random codes (finite scales)
      cache = jnp.asarray(rng.integers(0, 64, shape), spec.storage_dtype)
    bt = jnp.asarray(rng.permutation(pages)[: s * L // N].reshape(s, L // N), jnp.int32)
    qsl = jnp.asarray(np.arange(s + 1) * L, jnp.int32)
    sl = jnp.full((s,), L, jnp.int32)
    from pallas_kernels.triton.ragged import ragged_paged_attention
    variants = [("Pallas-Triton", triton_fn(spec, scale, L, k_scale=ks, v_scale=ks))]
    if cd != "bfloat16":
      variants.append(("Pallas-Triton in-loop dequant", jax.jit(
          lambda q, c, qsl, sl, bt, spec=spec, ks=ks: ragged_paged_attention(
              q, c, spec, query_start_loc=qsl, seq_lens=sl, block_table=bt, scale=scale,
              k_scale=ks, v_scale=ks, max_query_len=L, plain_copy=False))))
    variants.append(("Mosaic GPU", ours_fn(spec, scale, L, k_scale=ks, v_scale=ks)))
    for impl, f in variants:
      name = f"{impl} {cd}"
      try:
        ms = time_jax(f, q, cache, qsl, sl, bt, **timing)
        emit("bench", impl=name, problem=f"{s}x{L} causal prefill, per format", ms=ms,
             tflops=flops / (ms * 1e-3) / 1e12, part="quant_prefill")
      except Exception as e:  # noqa: BLE001
        emit("bench", impl=name, problem=f"{s}x{L} causal prefill, per format",
             error=first_lines(e), part="quant_prefill")
    del cache


def dense_baselines(timed, problem, s, L, flops):
  import jax
  import jax.numpy as jnp
  from benchmarks.common import time_jax, time_torch
  key = jax.random.PRNGKey(0)
  q = jax.random.normal(key, (s, L, HQ, D), jnp.bfloat16)
  k = jax.random.normal(jax.random.PRNGKey(1), (s, L, H, D), jnp.bfloat16)
  v = jax.random.normal(jax.random.PRNGKey(2), (s, L, H, D), jnp.bfloat16)

  def mgpu():   # its kernel stages q/k/v in float16 shared-memory buffers: float16 inputs
    from jax.experimental.pallas.ops.gpu import attention_mgpu as am
    cfg = am.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
    f = jax.jit(functools.partial(am.attention, config=cfg))
    f16 = [x.astype(jnp.float16) for x in (q, k, v)]
    return time_jax(f, *f16)
  timed("JAX attention_mgpu (dense KV)", problem, mgpu, flops)

  def cudnn():
    f = jax.jit(lambda a, b, c: jax.nn.dot_product_attention(
        a, b, c, scale=D ** -0.5, is_causal=True, implementation="cudnn"))
    return time_jax(f, q, k, v)
  timed("cuDNN via JAX (dense KV)", problem, cudnn, flops)
  del q, k, v

  def sdpa():
    import torch
    import torch.nn.functional as tf
    qt = torch.randn(s, HQ, L, D, device="cuda", dtype=torch.bfloat16)
    kt = torch.randn(s, H, L, D, device="cuda", dtype=torch.bfloat16)
    vt = torch.randn(s, H, L, D, device="cuda", dtype=torch.bfloat16)
    return time_torch(lambda: tf.scaled_dot_product_attention(qt, kt, vt, is_causal=True,
                                                              enable_gqa=True))
  timed("torch SDPA enable_gqa (dense KV)", problem, sdpa, flops)


# -- parent: run the parts, collect, print, save -----------------------------------------------
def run_part(part: str, limit: int, extra: list) -> tuple[list, str]:
  """Run one part in a child process; (result rows, status)."""
  cmd = [sys.executable, os.path.abspath(__file__), "--part", part, *extra]
  rows, status = [], "ok"
  t0 = time.time()
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
  try:
    for line in iter_lines(proc, t0 + limit):
      if line.startswith(PREFIX):
        row = json.loads(line[len(PREFIX):])
        rows.append(row)
        print(describe(row), flush=True)
      elif line.strip() and not line.startswith("WARNING"):
        print(f"    [{part}] {line.rstrip()[:300]}", flush=True)
  except TimeoutError:
    proc.kill()
    status = f"TIMEOUT after {limit} s (hang or slow compile): later items missing"
  proc.wait()
  if status == "ok" and proc.returncode:
    status = f"child exited with {proc.returncode}"
  print(f"== part {part}: {status} ({time.time() - t0:.0f} s)", flush=True)
  return rows, status


def iter_lines(proc, deadline):
  import selectors
  sel = selectors.DefaultSelector()
  sel.register(proc.stdout, selectors.EVENT_READ)
  while True:
    left = deadline - time.time()
    if left <= 0:
      raise TimeoutError
    if not sel.select(timeout=min(left, 5.0)):
      continue
    line = proc.stdout.readline()
    if not line:
      return
    yield line


def describe(row) -> str:
  if row["kind"] == "check":
    head = f"[check] {row['pv']:>12} | {row['name']}"
    if "error" in row:
      return f"{head}: FAIL {row['error']}"
    return (f"{head}: max err {row['max_err']:.2e} (ref max {row['ref_max']:.2f}),"
            f" padding zero {row['padding_zero']} -> {'PASS' if row['ok'] else 'FAIL'}"
            f" [{row['seconds']} s]")
  if row["kind"] == "bench":
    if "error" in row:
      return f"[bench] {row['problem']} | {row['impl']}: FAILED {row['error']}"
    return (f"[bench] {row['problem']} | {row['impl']}: {row['ms']:.3f} ms,"
            f" {row['tflops']:.1f} TFLOP/s")
  return f"[info] {row}"


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--part", choices=sorted(PARTS), help="run one part here (child mode)")
  ap.add_argument("--only", choices=sorted(PARTS), help="run only this part (parent mode)")
  ap.add_argument("--quant-only", action="store_true",
                  help="rule part: only the per-format prefill")
  ap.add_argument("--smoke", action="store_true",
                  help="tiny timing problems (CPU: checks the plumbing, every GPU item fails)")
  args = ap.parse_args()
  if args.part == "checks":
    run_checks()
    return
  if args.part == "bench":
    run_bench(args.smoke)
    return
  if args.part == "rule":
    run_rule(args.smoke, args.quant_only)
    return
  from benchmarks.common import now_utc, versions
  t0 = time.time()
  ver = versions()
  print("versions:", ver, flush=True)
  result = dict(date=now_utc(), versions=ver, parts={}, rows=[])
  for part, limit in PARTS.items():
    if args.only and part != args.only:
      continue
    extra = (["--smoke"] if args.smoke else []) + (["--quant-only"] if args.quant_only else [])
    rows, status = run_part(part, limit, extra)
    result["parts"][part] = status
    result["rows"] += rows
  checks = [r for r in result["rows"] if r["kind"] == "check"]
  bench = [r for r in result["rows"] if r["kind"] == "bench" and "error" not in r]
  variants = list(dict.fromkeys(r["pv"] for r in checks))
  names = list(dict.fromkeys(r["name"] for r in checks))
  print("\nmax err / ref max, per acc += P V variant\n| check | " + " | ".join(variants) + " |")
  print("|---|" + "---|" * len(variants))
  for name in names:
    cells = []
    for pv in variants:
      hit = [r for r in checks if r["name"] == name and r["pv"] == pv]
      if not hit:
        cells.append("missing")
      elif "error" in hit[0]:
        cells.append("FAIL (error)")
      else:
        r = hit[0]
        cells.append(f"{r['max_err']:.2e} / {r['ref_max']:.2f} {'PASS' if r['ok'] else 'FAIL'}")
    print(f"| {name} | " + " | ".join(cells) + " |")
  for pv in variants:
    rows = [r for r in checks if r["pv"] == pv]
    n_pass = sum(r["ok"] for r in rows)
    print(f"variant {pv}: {n_pass}/{len(rows)} checks PASS")
  good = [pv for pv in variants if all(r["ok"] for r in checks if r["pv"] == pv)]
  print(f"VARIANTS PASSING EVERY CHECK: {', '.join(good) if good else 'none'}")
  impls = list(dict.fromkeys(r["impl"] for r in bench))
  problems = list(dict.fromkeys(r["problem"] for r in bench))
  print("\nTFLOP/s (ms)\n| implementation | " + " | ".join(problems) + " |")
  print("|---|" + "---|" * len(problems))
  for impl in impls:
    cells = []
    for p in problems:
      hit = [r for r in bench if r["impl"] == impl and r["problem"] == p]
      cells.append(f"{hit[0]['tflops']:.0f} ({hit[0]['ms']:.2f})" if hit else "-")
    print(f"| {impl} | " + " | ".join(cells) + " |")
  print(f"\ntotal {time.time() - t0:.0f} s", flush=True)
  if os.environ.get("OUT"):
    path = os.path.join(os.environ["OUT"], "mosaic_gpu.json")
    with open(path, "w") as fh:
      json.dump(result, fh, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
