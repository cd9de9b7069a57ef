"""Decode kernel configurations per cache format, side by side in one run (tuning aid).

GPU (H200):  PYTHONUNBUFFERED=1 python3 benchmarks/tools/sweep_decode.py [--shape 64x4096 ...]
             [--formats fp8,nvfp4] [--variants default,stages5] [--json PATH]
CPU smoke:   python benchmarks/tools/sweep_decode.py --smoke
Kernels:     python3 benchmarks/tools/sweep_decode.py --trace --formats fp8 --variants default
Profiler:    ncu -k regex:kvjax_paged_decode --section SourceCounters -o prof \
                 python3 benchmarks/tools/sweep_decode.py --once --formats int8_per_token_head \
                 --layouts NHD --variants default

For every cache format and layout, times the paged decode kernel
(:func:`pallas_kernels.triton.decode.paged_decode_attention`) under each configuration of
:data:`VARIANTS` (a :class:`~pallas_kernels.triton.decode_config.DecodeConfig` built on the
format's default), bf16 queries, Hq=32, H=8, D=128, block 16, pages shuffled, 3 decode steps
chained per jitted call. Reports µs per step, TB/s of the format's own bytes (data and
scales) and tokens/s relative to the bf16 cache of the same layout, and first checks each
variant's compiled output against ``kvjax.reference.unified_attention`` on a small poisoned
problem (a variant that is wrong is reported as such and not timed). The Triton decode
defaults (benchmarks/RESULTS.md, "Tuned defaults") were chosen from runs of this script.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import kvjax  # noqa: E402
from benchmarks import bench_decode as BD  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks import device_trace  # noqa: E402
from pallas_kernels.triton import tuning  # noqa: E402
from pallas_kernels.triton.adapters import tile_format  # noqa: E402

NUM_SMS = tuning.num_sms()

FORMATS = ("bfloat16", "fp8", "int8_per_token_head", "fp8_per_token_head",
           "int4_per_token_head", "nvfp4")

#: name -> overrides of the format's default config. "bf16_ops" is the kernel's arithmetic
#: before float16 operands (bfloat16 dots, element-by-element conversions, row scales
#: assembled from four byte loads).
VARIANTS = {
    "default": {},
    "bytes": {"pair_codes": False, "tokens_per_step": 64, "num_stages": 3},  # before pairs
    "t64_s3": {"tokens_per_step": 64, "num_stages": 3},
    "stages2": {"num_stages": 2},
    "w8": {"num_warps": 8},
    "t128_s2": {"tokens_per_step": 128, "num_stages": 2},
    "s1": {"num_stages": 1},
    "t128_s1": {"tokens_per_step": 128, "num_stages": 1},
    "prefetch": {"prefetch": True},
    "bf16_ops": {"compute_dtype": "bfloat16", "fast_decode": False, "scale_words": False},
    "f16_convert": {"fast_decode": False},
    "byte_scales": {"scale_words": False},
    "t128": {"tokens_per_step": 128},
    "t128_w8": {"tokens_per_step": 128, "num_warps": 8},
    "t256_w8": {"tokens_per_step": 256, "num_warps": 8},
    "stages3": {"num_stages": 3},
    "stages4": {"num_stages": 4},
    # more steps in flight for the packed formats (ncu, 2026-12-04: int4 / nvfp4 at 35 % of
    # DRAM with 4 blocks an SM of 64 keys x 136-144 bytes a step)
    "stages5": {"num_stages": 5},
    "stages6": {"num_stages": 6},
    "one_pass": {"single_pass_programs": 3 * NUM_SMS},
    "t128_one_pass": {"tokens_per_step": 128, "single_pass_programs": 3 * NUM_SMS},
    "t32": {"tokens_per_step": 32},
    "w2": {"num_warps": 2},
    # 2 warps: fewer instructions a key in the sm_90 machine code, fewer warps an SM
    "w2_s2": {"num_warps": 2, "num_stages": 2},
    # more warps an SM for the latency-bound per-token-head formats (ncu, 2026-12-03: 136
    # registers a thread, 3 blocks an SM, 18 % achieved occupancy), more steps in flight
    "t32_s4": {"tokens_per_step": 32, "num_stages": 4},
    "t32_s5": {"tokens_per_step": 32, "num_stages": 5},
    "page_ids": {"page_block_ids": True},
    "merge": {"merge_in_kernel": True},
    "merge_p16": {"merge_in_kernel": True, "target_programs": 16 * NUM_SMS},
    # the split count: programs aimed at (default 8 x 132; 64 x 4096 at 4 / 6 / 8 / 12 / 16 x
    # 132: 2 / 2 / 3 / 4 / 5 splits, 8 x 32768: 9 / 13 / 17 / 25 / 33)
    "p4": {"target_programs": 4 * NUM_SMS},
    "p6": {"target_programs": 6 * NUM_SMS},
    "p12": {"target_programs": 12 * NUM_SMS},
    "p16": {"target_programs": 16 * NUM_SMS},
}


def default_config(spec):
  """The decode config the kernel takes for ``spec`` by default (bf16 queries)."""
  return tuning.decode_config(tile_format(spec, jnp.bfloat16))


def temp_bytes(batch, ctx, cd, layout, cfg):
  """Temporary device bytes of the compiled decode step (a copy of the cache shows here)."""
  step, args = our_step(batch, ctx, cd, layout, cfg)
  mem = jax.jit(step).lower(*args).compile().memory_analysis()
  return None if mem is None else int(mem.temp_size_in_bytes)

def our_problem(batch, ctx, cache_dtype, layout, seed=0, h=BD.H, d=BD.D, n=BD.N):
  """(spec, q, cache, seq_lens, block_table): ``batch`` decodes of ``ctx`` keys, bf16 q with
  Hq / H = 4, random cache bytes, shuffled pages."""
  spec = kvjax.KVCacheSpec(num_kv_heads=h, head_size=d, block_size=n, cache_dtype=cache_dtype,
                           layout=layout)
  m = ctx // n
  b = batch * m + 8
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  cache = jax.random.normal(k1, spec.physical_shape(b), jnp.float32).astype(spec.storage_dtype)
  bt = jnp.asarray(np.random.default_rng(seed).permutation(b)[: batch * m].reshape(batch, m),
                   jnp.int32)
  sl = jnp.full((batch,), ctx, jnp.int32)
  q = jax.random.normal(k2, (batch, BD.HQ * h // BD.H, d), jnp.bfloat16)
  return spec, q, cache, sl, bt


def our_step(batch, ctx, cache_dtype, layout, config, interpret=False, **geo):
  """(one decode step of the Triton kernel as a function, its arguments (q, cache, seq_lens,
  block_table)) on :func:`our_problem`."""
  from pallas_kernels.triton.decode import paged_decode_attention
  spec, q, cache, sl, bt = our_problem(batch, ctx, cache_dtype, layout, **geo)
  ks = 1.0 if cache_dtype.startswith("fp8") else None
  step = lambda q, c, sl, bt: paged_decode_attention(
      q, c, spec, seq_lens=sl, block_table=bt, scale=spec.head_size ** -0.5, k_scale=ks,
      v_scale=ks, interpret=interpret, config=config)
  return step, (q, cache, sl, bt)


def time_ours(batch, ctx, cache_dtype, layout, config, interpret=False, **geo):
  """Milliseconds of one decode step (:func:`our_step`), ``BD.CHAIN`` chained a call."""
  step, args = our_step(batch, ctx, cache_dtype, layout, config, interpret, **geo)
  return common.time_jax_chained(step, *args, chain=1 if interpret else BD.CHAIN,
                                 reps=3 if interpret else 5, inner=1 if interpret else 5)


#: Variants whose numerics differ (operand dtype, decode path): each is checked against the
#: reference before it is timed; the others only reorder the same arithmetic.
CHECKED = ("default", "bytes", "bf16_ops", "f16_convert", "byte_scales", "page_ids", "merge",
           "merge_p16")


def layouts(cd):
  return ("HND",) if cd == "nvfp4" else ("NHD", "HND")


def run_once(batch, ctx, cd, layout, cfg, interpret):
  """One decode step, untimed and unchecked (``--once``: a profiler's launch)."""
  step, args = our_step(batch, ctx, cd, layout, cfg, interpret)
  jax.block_until_ready(jax.jit(step)(*args))


def trace(batch, ctx, cd, layout, cfg, interpret, geo):
  """Print the device kernels of one chained decode call (``--trace``) per step."""
  step, args = our_step(batch, ctx, cd, layout, cfg, interpret, **geo)
  rows, span = device_trace.kernel_breakdown(common.chained(step, BD.CHAIN), *args)
  host = {c: common.time_jax_chained(step, *args, chain=c) * 1e3
          for c in (BD.CHAIN, 4 * BD.CHAIN)}
  print(f"    device span {span / BD.CHAIN:8.1f} us a step; host clock "
        + ", ".join(f"{us:.1f} us a step ({c} chained)" for c, us in host.items())
        + "; kernels a step:", flush=True)
  for name, us, launches in rows:
    print(f"    {us / BD.CHAIN:8.1f} us  x{launches / BD.CHAIN:g}  {name[:90]}", flush=True)


def check(cd, layout, cfg, interpret):
  """Relative error of the compiled kernel vs the reference (poisoned cache), or None."""
  rng = np.random.default_rng(0)
  spec = kvjax.KVCacheSpec(num_kv_heads=2, head_size=128, block_size=16, cache_dtype=cd,
                           layout=layout)
  ks = 0.5 if cd in ("fp8", "nvfp4") else None
  q, clean, poison, sl, bt = BD.check_problem(rng, spec, (1, 37, 300, 0, 64), 4, ks)
  kw = dict(seq_lens=sl, block_table=bt, scale=128 ** -0.5, k_scale=ks, v_scale=ks)
  from pallas_kernels.triton.decode import paged_decode_attention
  ours = jax.jit(lambda q, c: paged_decode_attention(q, c, spec, interpret=interpret,
                                                     config=cfg, **kw))(q, poison)
  ref = BD.ref_attention(q, clean, spec, query_start_loc=jnp.arange(6, dtype=jnp.int32), **kw)
  o, r = (np.asarray(x.astype(jnp.float32)) for x in (ours, ref))
  if not np.isfinite(o).all():
    return float("nan")
  return float(np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-30))


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--smoke", action="store_true", help="tiny CPU run (interpret mode)")
  ap.add_argument("--shape", action="append", default=None, help="BATCHxCONTEXT (repeatable)")
  ap.add_argument("--formats", default=",".join(FORMATS))
  ap.add_argument("--variants", default=",".join(VARIANTS))
  ap.add_argument("--layouts", default="NHD,HND", help="of NHD, HND (nvfp4: HND only)")
  ap.add_argument("--once", action="store_true",
                  help="run each configuration once, untimed and unchecked (for a profiler)")
  ap.add_argument("--trace", action="store_true",
                  help="list each configuration's device kernels a step (profiler), untimed")
  ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new timings "
                  "after this many seconds")
  ap.add_argument("--sweep-bf16", action="store_true",
                  help="run the variants on bf16 caches too (else bf16 runs its default only, "
                  "the baseline of x_bf16)")
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  t0 = time.time()
  if args.smoke:
    common.announce_smoke(jax.default_backend())
  interpret = args.smoke or jax.default_backend() == "cpu"
  shapes = [tuple(int(x) for x in s.split("x")) for s in (args.shape or ["64x4096"])]
  geo = {}
  if args.smoke:
    shapes, geo = [(2, 64)], dict(h=2, d=64, n=16)
  formats = [f for f in args.formats.split(",") if f]
  variants = [v for v in args.variants.split(",") if v]
  info = {"device": common.device_name(), "date": common.now_utc(),
          "versions": common.versions(), "command": common.command_line()}
  print(json.dumps(info), flush=True)
  rows, base = [], {}
  for batch, ctx in shapes:
    for cd in formats:
      item = kvjax.KVCacheSpec(num_kv_heads=8, head_size=128, block_size=16, cache_dtype=cd,
                               layout="HND").page_bytes / (16 * 8 * 2 * 128)
      for layout in (x for x in layouts(cd) if x in args.layouts.split(",")):
        names = variants
        if cd == "bfloat16":      # its default first: the baseline of x_bf16
          names = ["default"] + [v for v in variants if v != "default" and args.sweep_bf16]
        for name in names:
          if time.time() - t0 > args.budget_s:
            print(f"  budget spent: skipping {cd} {layout} {name}", flush=True)
            continue
          spec = kvjax.KVCacheSpec(num_kv_heads=8, head_size=128, block_size=16,
                                   cache_dtype=cd, layout=layout)
          cfg = dataclasses.replace(default_config(spec), **VARIANTS[name])
          if args.trace:
            print(f"  {cd:20s} {layout} {batch:4d}x{ctx:<6d} {name:14s} trace:", flush=True)
            trace(batch, ctx, cd, layout, cfg, interpret, geo)
            continue
          if args.once:
            run_once(batch, ctx, cd, layout, cfg, interpret)
            print(f"  {cd:20s} {layout} {batch:4d}x{ctx:<6d} {name:14s} ran once", flush=True)
            continue
          r = dict(cache_dtype=cd, layout=layout, variant=name, batch=batch, context=ctx,
                   config=BD.cfg_name(cfg))
          try:
            if not args.smoke and (batch, ctx) == shapes[0] and name in CHECKED:
              r["relerr"] = check(cd, layout, cfg, interpret)
              if not r["relerr"] < 2e-2:
                print(f"  {cd:20s} {layout} {name:14s} WRONG relerr {r['relerr']}", flush=True)
                rows.append(r)
                continue
            if name == "default" and not args.smoke:      # a copy of the cache would show
              r["temp_mb"] = round(temp_bytes(batch, ctx, cd, layout, cfg) / 2**20, 1)
            ms = time_ours(batch, ctx, cd, layout, cfg, interpret=interpret, **geo)
          except Exception as e:  # noqa: BLE001 - a variant that fails is reported
            r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"  {cd:20s} {layout} {name:14s} FAILED {r['error'][:200]}", flush=True)
            rows.append(r)
            continue
          nbytes = BD.kv_bytes(batch, ctx, item, geo.get("h", BD.H), geo.get("d", BD.D))
          tps = batch / (ms * 1e-3)
          if cd == "bfloat16" and name == "default":
            base[(batch, ctx, layout)] = tps
          r.update(us=round(ms * 1e3, 1), tb_per_s=round(nbytes / (ms * 1e-3) / 1e12, 3),
                   x_bf16=round(tps / base[(batch, ctx, layout)], 3)
                   if (batch, ctx, layout) in base else None)
          print(f"  {cd:20s} {layout} {batch:4d}x{ctx:<6d} {name:14s} {r['us']:8.1f} us "
                f"{r['tb_per_s']:6.3f} TB/s x_bf16={r['x_bf16']} err={r.get('relerr', '-')}"
                + (f" temp={r['temp_mb']} MB" if "temp_mb" in r else ""), flush=True)
          rows.append(r)
  out = args.json or (os.path.join(os.environ["OUT"], "sweep_decode.json")
                      if os.environ.get("OUT") else None)
  if out and rows:                       # (--trace and --once time nothing)
    with open(out, "w") as f:
      json.dump(dict(info, rows=rows), f, indent=1)
  print("== best variant per format and layout (first shape)", flush=True)
  for cd in formats:
    for layout in layouts(cd):
      timed = [r for r in rows if r["cache_dtype"] == cd and r["layout"] == layout
               and "us" in r and (r["batch"], r["context"]) == shapes[0]]
      if timed:
        b = min(timed, key=lambda r: r["us"])
        print(f"  {cd:20s} {layout} best {b['variant']:14s} {b['us']:8.1f} us "
              f"x_bf16={b['x_bf16']}", flush=True)


if __name__ == "__main__":
  main()
