"""Decode benchmark of the paged decode kernels, every cache format, side by side with vLLM 0.28.

GPU (H200):  PYTHONUNBUFFERED=1 python benchmarks/bench_decode.py [--json PATH]
             [--shapes 64x4096,...] [--formats bfloat16,fp8,...] [--kernels triton,mosaic_gpu]
             [--no-vllm] [--no-peers] [--no-checks] [--check-kernels triton]
Saved runs:  python benchmarks/bench_decode.py --summarize RUN.json [MORE.json ...]
CPU smoke:   python benchmarks/bench_decode.py --smoke

Kernels (``--kernels``): ``triton`` (``pallas_kernels.triton.decode``, every format) and
``mosaic_gpu`` (``pallas_kernels.mosaic_gpu.decode``: the formats with Mosaic GPU hooks, on
jax >= 0.11 and an sm90+ GPU; skipped with the reason elsewhere).

In one run:
  1. the device copy ceiling (torch, bytes read + written per second);
  2. the per-format table: Hq=32, H=8, D=128, block 16, batch x context in SHAPES, pages
     shuffled; every cache format and layout, every kernel that runs it, default configs:
     µs per step, tokens/s relative to the bf16 cache of the same layout and kernel, TB/s of
     the format's own bytes (data and scales: ``batch * context * page_bytes / block_size``),
     and vLLM 0.28's Triton kernel on the very same cache buffer (best of its 2-D and
     split-KV paths; once per problem) where vLLM has the format and its kernels are found
     (``vllm_peer.py``);
  3. peers on bf16: JAX's built-in Pallas ``paged_attention`` (its own [H, pages, N, D] K and V
     arrays) and torch SDPA on dense KV (GQA through enable_gqa); the JSON is written after
     each shape's rows and peers, so a run cut short keeps what it measured;
  4. the per-format summary (:func:`summary`): each kernel's tokens/s vs its bf16 cache,
     vLLM's, the second kernel's time over the first's, and each bf16 kernel vs torch SDPA,
     ranges over the shapes;
  5. compiled correctness of each kernel vs ``kvjax.reference.unified_attention`` on small
     problems (every cache dtype the kernel takes, both layouts, GQA 1/4/7/8/16, head sizes
     64..256, window, soft cap, sinks, several splits); the kernel reads a poisoned cache
     (unwritten slots random bytes / NaN), the reference a clean copy holding the same tokens.
JAX timings chain CHAIN decode steps in one jitted program (each step's output is the next
step's query) and divide; torch timings use CUDA events (triton.testing.do_bench). The JSON
(``--json``, or ``$OUT/decode.json`` when $OUT is set) is what ``plot_decode.py`` draws.
Kernel configurations are compared by ``tools/sweep_decode.py``.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import kvjax  # noqa: E402
from kvjax.reference import unified_attention as ref_attention  # noqa: E402
from benchmarks import common  # noqa: E402
from pallas_kernels.triton.decode import paged_decode_attention  # noqa: E402
from benchmarks import vllm_peer  # noqa: E402
from benchmarks.decode_tables import markdown, summarize, summary  # noqa: E402
from pallas_kernels.triton.decode_config import DEFAULT_CONFIG, DecodeConfig  # noqa: E402

KERNELS = ("triton", "mosaic_gpu")


def kernel_fn(kernel: str):
  """The decode entry of ``kernel``: ``fn(q, cache, spec, *, seq_lens, block_table, scale,
  ..., interpret, config)`` (the Mosaic GPU kernel takes no Triton config)."""
  if kernel == "triton":
    return paged_decode_attention
  from pallas_kernels.mosaic_gpu.decode import paged_decode_attention as mgpu_decode

  def fn(q, cache, spec, *, config=None, interpret=False, **kw):
    del config
    return mgpu_decode(q, cache, spec, interpret=interpret, **kw)
  return fn


def kernel_reason(kernel: str, spec, group: int):
  """None when ``kernel`` runs ``spec`` here (compiled), else why not."""
  if kernel == "triton":
    return None
  from pallas_kernels.mosaic_gpu.decode import decode_reason
  from pallas_kernels.mosaic_gpu.ragged_attention import supports_attention
  q_dtype = jnp.float16 if spec.cache_dtype == "float16" else jnp.bfloat16
  return decode_reason(spec, q_dtype, group) or supports_attention(spec, q_dtype)

SHAPES = ((64, 4096), (128, 2048), (16, 16384), (8, 32768), (256, 1024))
HQ, H, D, N = 32, 8, 128, 16
#: Decode steps chained inside one jitted program per timing (hides host dispatch).
CHAIN = 3


# -- problems ---------------------------------------------------------------------------------
def check_problem(rng, spec, lens, g, k_scale=None):
  """A decode batch: poisoned cache for the kernel, clean cache (same tokens) for the reference."""
  n = spec.block_size
  s = len(lens)
  m = max(1, max(-(-ln // n) for ln in lens)) + 1
  b = s * m + 3
  clean = spec.allocate(b)
  shape = spec.physical_shape(b)
  if spec.storage_dtype.itemsize >= 2 and spec.format.kind == kvjax.formats.PLAIN:
    poison = jnp.full(shape, jnp.nan, spec.storage_dtype)
  else:
    raw = rng.integers(0, 256, int(np.prod(shape)) * spec.itemsize, dtype=np.uint8)
    raw[: raw.size // 8] = 0xFF                       # plenty of NaN scale bytes
    poison = jnp.asarray(rng.permutation(raw).view(spec.storage_dtype).reshape(shape))
  perm = rng.permutation(b)[: s * m].reshape(s, m)
  for i, ln in enumerate(lens):
    if ln == 0:
      continue
    x = rng.standard_normal((2, ln, spec.num_kv_heads, spec.head_size)).astype(np.float32)
    x *= np.exp(rng.uniform(-1, 1, (2, ln, spec.num_kv_heads, 1)))
    k, v = (jnp.asarray(t).astype(spec.dtype) for t in x)
    slots = jnp.asarray([perm[i, p // n] * n + p % n for p in range(ln)], jnp.int32)
    kw = dict(k_scale=k_scale, v_scale=k_scale, impl="reference")
    clean = kvjax.write_kv(clean, k, v, slots, spec, **kw)
    poison = kvjax.write_kv(poison, k, v, slots, spec, **kw)
  q = jnp.asarray(rng.standard_normal((s, spec.num_kv_heads * g, spec.head_size)),
                  spec.dtype)
  return q, clean, poison, jnp.asarray(lens, jnp.int32), jnp.asarray(perm, jnp.int32)


CHECKS = (
    # cache_dtype, layout, H, G, D, N, window, soft_cap, sinks, k_scale, config
    ("bfloat16", "NHD", 8, 4, 128, 16, None, None, False, None, None),
    ("bfloat16", "HND", 1, 7, 80, 32, 40, 30.0, True, None, None),
    ("float16", "NHD", 2, 1, 96, 64, None, None, True, None, None),
    ("float32", "HND", 2, 4, 64, 16, None, 5.0, False, None, None),
    ("bfloat16", "NHD", 2, 4, 256, 128, 100, None, False, None, DecodeConfig(prefetch=True)),
    ("fp8", "NHD", 4, 4, 128, 16, None, None, False, "perhead", None),
    ("fp8_e5m2", "HND", 2, 7, 128, 32, 50, None, True, 0.5, None),
    ("int8_per_token_head", "NHD", 2, 4, 128, 16, None, None, False, None, None),
    ("fp8_per_token_head", "HND", 2, 4, 128, 16, 33, None, True, None, None),
    ("int4_per_token_head", "NHD", 2, 4, 128, 16, None, None, False, None, None),
    ("int4_per_token_head", "HND", 1, 7, 32, 32, None, 20.0, True, None, None),
    ("nvfp4", "HND", 2, 4, 128, 16, None, None, False, 0.5, None),
    ("nvfp4", "HND", 2, 1, 64, 32, 30, None, True, None, None),
    # one split: normalized (and de-interleaved) in the kernel's epilogue
    ("bfloat16", "NHD", 1, 7, 80, 16, 40, 30.0, True, None, DecodeConfig(num_splits=1)),
    ("fp8", "HND", 2, 4, 128, 16, None, None, True, "perhead", DecodeConfig(num_splits=1)),
    ("int4_per_token_head", "NHD", 2, 4, 128, 16, None, None, True, None,
     DecodeConfig(num_splits=1)),
    ("nvfp4", "HND", 2, 4, 128, 16, 50, None, False, 0.5, DecodeConfig(num_splits=1)),
    # the Mosaic GPU kernel's own cases (its query columns, page pieces, splits); config is
    # the split count there
    ("bfloat16", "NHD", 2, 8, 128, 16, None, None, True, None, 3),
    ("bfloat16", "HND", 2, 16, 64, 48, 70, None, False, None, None),
    ("float16", "HND", 3, 5, 128, 128, None, 10.0, False, None, 2),
    ("fp8", "NHD", 4, 1, 256, 32, 90, None, True, "perhead", 4),
    ("fp8_e5m2", "NHD", 2, 4, 128, 64, None, None, False, 0.5, None),
)


def run_checks(rng, interpret, checks=CHECKS, lens=(1, 37, 300, 0, 64), config=None,
               kernel="triton"):
  results = []
  fn = kernel_fn(kernel)
  for cd, layout, h, g, d, n, win, cap, sinks, ks, cfg in checks:
    if isinstance(cfg, int) if kernel == "triton" else isinstance(cfg, DecodeConfig):
      continue                      # another kernel's own case
    spec = kvjax.KVCacheSpec(num_kv_heads=h, head_size=d, block_size=n, cache_dtype=cd,
                             layout=layout, dtype=jnp.float16 if cd == "float16" else jnp.bfloat16)
    if kernel_reason(kernel, spec, g) is not None:
      continue
    extra = {}
    if kernel == "triton":
      extra["config"] = cfg or config
    elif cfg is not None:
      extra["num_splits"] = cfg
    if ks == "perhead":
      ks = jnp.asarray(rng.uniform(0.25, 2.0, h), jnp.float32)
    q, clean, poison, sl, bt = check_problem(rng, spec, lens, g, ks)
    sk = jnp.asarray(rng.standard_normal(h * g), jnp.float32) if sinks else None
    kw = dict(seq_lens=sl, block_table=bt, scale=d ** -0.5, sliding_window=win, soft_cap=cap,
              sinks=sk, k_scale=ks, v_scale=ks)
    # float32 caches: both sides at full float32 (JAX's GPU default for float32 dots, in the
    # kernels as in XLA, is TF32; the check is of the kernel's reading, not of TF32 rounding)
    precision = "highest" if spec.storage_dtype == np.float32 else None
    try:
      with jax.default_matmul_precision(precision):
        ours = jax.jit(lambda q, c, kw=kw, spec=spec, extra=extra: fn(
            q, c, spec, interpret=interpret, **extra, **kw))(q, poison)
    except Exception as e:  # noqa: BLE001 - report and go on with the other checks
      print(f"check {kernel} {cd} {layout} D={d}: ERROR {type(e).__name__}: {str(e)[:1500]}",
            flush=True)
      results.append({"kernel": kernel, "cache_dtype": cd, "layout": layout, "D": d,
                      "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"})
      continue
    with jax.default_matmul_precision(precision):
      ref = ref_attention(q, clean, spec, query_start_loc=jnp.arange(len(lens) + 1,
                                                                     dtype=jnp.int32), **kw)
    o = np.asarray(ours.astype(jnp.float32))
    r = np.asarray(ref.astype(jnp.float32))
    err = float(np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-30))
    tol = 1e-4 if spec.storage_dtype == np.float32 else 2e-2
    zero = [i for i, ln in enumerate(lens) if ln == 0]
    ok = bool(np.isfinite(o).all()) and err < tol and not np.any(o[zero])  # seq_len 0 -> 0
    how = (cfg_name(extra["config"] or DEFAULT_CONFIG) if kernel == "triton"
           else f"splits={extra.get('num_splits', 'auto')}")
    line = (f"check {kernel:10s} {cd:20s} {layout} H={h} G={g} D={d} N={n} win={win} "
            f"cap={cap} sinks={sinks} {how}: relerr {err:.2e} {'OK' if ok else 'FAIL'}")
    print(line, flush=True)
    results.append({"kernel": kernel, "cache_dtype": cd, "layout": layout, "H": h, "G": g,
                    "D": d, "N": n, "window": win, "soft_cap": cap, "sinks": sinks,
                    "relerr": err, "ok": ok})
  return results


# -- timing problems --------------------------------------------------------------------------
def kv_bytes(batch, ctx, itemsize, h=H, d=D):
  return batch * ctx * h * 2 * d * itemsize


def time_jax_builtin(batch, ctx, interpret=False, h=H, d=D, n=N):
  from jax.experimental.pallas.ops.gpu import paged_attention as pa
  m = ctx // n
  pages = batch * m + 8
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(1), 3)
  k_pages = jax.random.normal(k1, (h, pages, n, d), jnp.float32).astype(jnp.bfloat16)
  v_pages = jax.random.normal(k2, (h, pages, n, d), jnp.float32).astype(jnp.bfloat16)
  bt = jnp.asarray(np.random.default_rng(1).permutation(pages)[: batch * m].reshape(batch, m),
                   jnp.int32)
  lengths = jnp.full((batch,), ctx, jnp.int32)
  q = jax.random.normal(k3, (batch, HQ * h // H, d), jnp.bfloat16)
  k_splits = 16 if m % 16 == 0 else 1
  step = functools.partial(pa.paged_attention, k_splits=k_splits, interpret=interpret,
                           pages_per_compute_block=min(8, m // k_splits))
  ms = common.time_jax_chained(step, q, k_pages, v_pages, bt, lengths,
                               chain=1 if interpret else CHAIN, reps=3 if interpret else 5,
                               inner=1 if interpret else 5)
  del k_pages, v_pages
  return ms


def time_torch_sdpa(batch, ctx, h=H, d=D):
  import torch
  import torch.nn.functional as tf
  dev = "cuda" if torch.cuda.is_available() else "cpu"
  dt = torch.bfloat16
  q = torch.randn(batch, HQ * h // H, 1, d, device=dev, dtype=dt)
  k = torch.randn(batch, h, ctx, d, device=dev, dtype=dt)
  v = torch.randn(batch, h, ctx, d, device=dev, dtype=dt)
  ms = common.time_torch(lambda: tf.scaled_dot_product_attention(q, k, v, enable_gqa=True))
  del q, k, v
  return ms


def peer_rows(batch, ctx, interpret, geo):
  """The bf16 peers at one shape: JAX's built-in Pallas op and torch SDPA on dense KV."""
  out = []
  size = dict(h=geo.get("h", H), d=geo.get("d", D))
  try:
    ms = time_jax_builtin(batch, ctx, interpret=interpret, **geo)
    out.append(row("jax_builtin", "bfloat16", "HPND", batch, ctx, ms, 2, **size))
  except Exception as e:  # noqa: BLE001 - report and go on
    print(f"  jax_builtin failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
  ms = time_torch_sdpa(batch, ctx, **size)
  out.append(row("torch_sdpa", "bfloat16", "dense", batch, ctx, ms, 2, **size))
  return out


def row(kernel, cache_dtype, layout, batch, ctx, ms, itemsize, config=None, h=H, d=D):
  r = {"kernel": kernel, "cache_dtype": cache_dtype, "layout": layout, "batch": batch,
       "context": ctx, "ms": round(ms, 4),
       "tb_per_s": round(kv_bytes(batch, ctx, itemsize, h, d) / (ms * 1e-3) / 1e12, 3),
       "tokens_per_s": round(batch / (ms * 1e-3), 1)}
  if config is not None:
    r["config"] = config
  print(f"  {kernel:11s} {cache_dtype:9s} {layout:5s} {batch:4d} x {ctx:6d}: {ms:8.4f} ms "
        f"{r['tb_per_s']:6.3f} TB/s {r['tokens_per_s']:12.1f} tok/s"
        + (f"  [{config}]" if config else ""), flush=True)
  return r


def cfg_name(cfg: DecodeConfig) -> str:
  d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
       if getattr(cfg, f.name) != getattr(DEFAULT_CONFIG, f.name)}
  return ",".join(f"{k}={v}" for k, v in d.items()) or "default"


def format_table(shapes, formats, interpret, geo, use_vllm, kernels=("triton",)):
  """The per-format table: each kernel (its default config) and vLLM 0.28's kernel on the
  very same cache buffer, at every shape; tokens/s relative to bf16 of the same layout and
  kernel."""
  from benchmarks import bench_side_by_side as SBS
  rows = []
  for batch, ctx in shapes:
    base = {k: {} for k in kernels}
    for cd in formats:
      for layout in SBS._layouts(cd):
        spec = kvjax.KVCacheSpec(num_kv_heads=geo.get("h", H), head_size=geo.get("d", D),
                                 block_size=geo.get("n", N), cache_dtype=cd, layout=layout)
        problem = SBS.paged_problem(spec, [1] * batch, [ctx - 1] * batch)
        q, cache, qsl, sl, bt = problem
        ks = SBS._tensor_scale(cd)
        vllm_pending = use_vllm
        for kernel in kernels:
          why = kernel_reason(kernel, spec, HQ // H)
          if why is not None:
            continue
          fn = kernel_fn(kernel)
          step = lambda q, c, sl, bt, spec=spec, ks=ks, fn=fn: fn(
              q, c, spec, seq_lens=sl, block_table=bt, scale=spec.head_size ** -0.5,
              k_scale=ks, v_scale=ks, interpret=interpret)
          try:
            ms = common.time_jax_chained(step, q, cache, sl, bt,
                                         chain=1 if interpret else CHAIN,
                                         reps=3 if interpret else 5,
                                         inner=1 if interpret else 4)
          except Exception as e:  # noqa: BLE001 - report and go on
            print(f"  {kernel} {cd} {layout} {batch}x{ctx}: FAILED {type(e).__name__}: "
                  f"{str(e)[:300]}", flush=True)
            continue
          r = {"kernel": kernel, "cache_dtype": cd, "layout": layout, "batch": batch,
               "context": ctx,
               "bytes_vs_bf16": round(spec.page_bytes / (2 * spec.block_size *
                                                         spec.num_kv_heads * 2 * spec.head_size),
                                      3)}
          SBS.record_decode(r, spec, batch, ctx, ms, problem, base[kernel], vllm_pending)
          vllm_pending = False          # vLLM's kernel once per problem
          print(f"  {kernel:10s} {cd:20s} {layout} {batch:4d}x{ctx:<6d} {r['us']:8.1f} us "
                f"{r['tb_per_s']:6.3f} TB/s x_bf16={r.get('x_bf16', '-')} "
                f"vllm={r.get('vllm_us', r.get('vllm_error', '-'))}", flush=True)
          rows.append(r)
        del problem, cache
  return rows


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--smoke", action="store_true", help="tiny CPU run (interpret mode)")
  ap.add_argument("--json", default=None,
                  help="write the JSON here (default $OUT/decode.json when $OUT is set)")
  ap.add_argument("--shapes", default=None, help="BxC,BxC,... (default: the five shapes)")
  ap.add_argument("--formats", default=None, help="comma-separated cache dtypes (default: all)")
  ap.add_argument("--no-peers", action="store_true", help="skip JAX's Pallas op and SDPA")
  ap.add_argument("--no-vllm", action="store_true")
  ap.add_argument("--no-checks", action="store_true")
  ap.add_argument("--kernels", default=",".join(KERNELS),
                  help=f"comma-separated decode kernels among {KERNELS} (default: both)")
  ap.add_argument("--check-kernels", default=None,
                  help="kernels whose correctness checks run (default: --kernels)")
  ap.add_argument("--summarize", nargs="+", default=None, metavar="JSON",
                  help="print the tables of saved runs (rows and peers merged) and exit")
  args = ap.parse_args()
  if args.summarize:
    summarize(args.summarize)
    return
  kernels = tuple(k for k in args.kernels.split(",") if k)
  check_kernels = (kernels if args.check_kernels is None
                   else tuple(k for k in args.check_kernels.split(",") if k))
  if any(k not in KERNELS for k in kernels + check_kernels):
    ap.error(f"--kernels / --check-kernels: choose among {KERNELS}")
  from benchmarks import bench_side_by_side as SBS
  smoke = args.smoke
  if smoke:
    common.announce_smoke(jax.default_backend())
  interpret = smoke or jax.default_backend() == "cpu"
  json_path = common.output_path(args.json, "decode_smoke.json" if smoke else "decode.json")
  info = {"device": common.device_name(), "date": common.now_utc(),
          "versions": common.versions(), "command": common.command_line()}
  print(json.dumps(info), flush=True)
  rng = np.random.default_rng(0)

  print("== device copy ceiling", flush=True)
  copy = common.device_copy_tb_s()
  print(f"  copy {copy:.3f} TB/s (read + write)", flush=True)

  geo = dict(h=2, d=64, n=16) if smoke else {}
  shapes = ((2, 64),) if smoke else SHAPES
  if args.shapes:
    shapes = tuple(tuple(int(x) for x in sh.split("x")) for sh in args.shapes.split(","))
  formats = (("bfloat16", "int8_per_token_head") if smoke else SBS.FORMATS)
  if args.formats:
    formats = tuple(args.formats.split(","))
  if not interpret:
    print(f"== timings chain {CHAIN} decode steps per jitted call", flush=True)

  print("== per-format decode table (ours and vLLM on the same cache)", flush=True)
  use_vllm = vllm_peer.available() and not args.no_vllm and not interpret
  if "mosaic_gpu" in kernels + check_kernels:
    why = kernel_reason("mosaic_gpu", kvjax.KVCacheSpec(H, D, N), HQ // H)
    if why is not None:
      print(f"== mosaic_gpu kernel skipped: {why}", flush=True)
      kernels = tuple(k for k in kernels if k != "mosaic_gpu")
      check_kernels = tuple(k for k in check_kernels if k != "mosaic_gpu")
  result = dict(info, copy_tb_s=round(copy, 3), rows=[], peers=[], checks=[], chain=CHAIN,
                bytes_counted="batch * context * page_bytes / block_size (data and scales)")

  def save():   # after every shape too: a time limit keeps what was measured
    if json_path:
      with open(json_path, "w") as f:
        json.dump(result, f, indent=1)

  rows, peers = result["rows"], result["peers"]
  for batch, ctx in shapes:   # the table's rows and the bf16 peers of each shape, then saved
    rows += format_table(((batch, ctx),), formats, interpret, geo, use_vllm, kernels)
    if not args.no_peers:
      print("  peers (bf16): JAX's built-in Pallas paged_attention, torch SDPA on dense KV",
            flush=True)
      peers += peer_rows(batch, ctx, interpret, geo)
    save()
  checks = result["checks"]
  if not args.no_checks:
    print("== compiled correctness vs reference (kernel on a poisoned cache)", flush=True)
    for kernel in check_kernels:
      checks += run_checks(rng, interpret, CHECKS[:2] if smoke else CHECKS,
                           lens=(1, 20, 0) if smoke else (1, 37, 300, 0, 64), kernel=kernel)

  print(markdown(rows), flush=True)
  print("== per-format summary (tokens/s vs bf16 of the same kernel and layout)", flush=True)
  print(summary(rows, peers, kernels), flush=True)
  save()
  if json_path:
    print(f"wrote {json_path}", flush=True)
  if any(not c["ok"] for c in checks):
    print("SOME CHECKS FAILED", flush=True)
    sys.exit(1)


if __name__ == "__main__":
  common.exit_after(main)
