"""Sweep of the Mosaic GPU decode kernel's geometry (K/V slots, splits) on the H200.

GPU:  PYTHONUNBUFFERED=1 python3 benchmarks/sweep_mosaic_decode.py
          [--shapes 64x4096,16x16384] [--formats bfloat16,fp8] [--layouts NHD,HND]
          [--stages 2,3,4] [--split-factors 1,2] [--once]
CPU:  python3 benchmarks/sweep_mosaic_decode.py --smoke   (interpret mode, jax >= 0.11)

Per (shape, format, layout): the default geometry (``decode_geometry.choose_geometry``) and
split count (``num_splits_for``), then each K/V slot count and each multiple of the default
split count: µs per decode step and TB/s of the format's own bytes (Hq 32, H 8, D 128,
block 16, pages shuffled; ``common.time_jax_chained``, 3 chained steps per call).
``--once`` runs each configuration once (no timing), for a profiler to wrap (ncu).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import kvjax  # noqa: E402
from benchmarks import bench_side_by_side as SBS  # noqa: E402
from benchmarks import common  # noqa: E402
from pallas_kernels.common import cdiv  # noqa: E402
from pallas_kernels.mosaic_gpu import decode_geometry as DG  # noqa: E402
from pallas_kernels.mosaic_gpu.decode import paged_decode_attention  # noqa: E402
from pallas_kernels.mosaic_gpu.formats import hooks_class  # noqa: E402

HQ, H, D, N = 32, 8, 128, 16


def configs(spec, batch, ctx, stages, split_factors):
  """(label, geometry, splits): the default first."""
  ops = hooks_class(spec.codec).of(spec, jnp.bfloat16)
  geo = DG.choose_geometry(ops, HQ // H, spec.block_size, spec.head_size)
  splits = DG.num_splits_for(batch, spec.num_kv_heads, cdiv(ctx, geo.block_kv))
  out = [(f"default (stages={geo.stages}, splits={splits}, smem={geo.smem_bytes(ops)})", geo,
          splits)]
  for st in stages:
    g = dataclasses.replace(geo, stages=st)
    if st != geo.stages and g.smem_bytes(ops) <= DG.SMEM_BUDGET:
      out.append((f"stages={st} (smem={g.smem_bytes(ops)})", g, splits))
  for f in split_factors:
    if f != 1:
      out.append((f"splits={splits * f}", geo, splits * f))
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--shapes", default="64x4096,16x16384")
  ap.add_argument("--formats", default="bfloat16,fp8")
  ap.add_argument("--layouts", default="NHD")
  ap.add_argument("--stages", default="2,3,4")
  ap.add_argument("--split-factors", default="1,2")
  ap.add_argument("--once", action="store_true", help="run each configuration once, no timing")
  ap.add_argument("--smoke", action="store_true", help="tiny problem in interpret mode")
  args = ap.parse_args()
  shapes = [tuple(int(x) for x in sh.split("x")) for sh in args.shapes.split(",")]
  if args.smoke:
    shapes = [(2, 128)]
  stages = [int(x) for x in args.stages.split(",") if x]
  factors = [int(x) for x in args.split_factors.split(",") if x]
  print(f"device: {common.device_name()}, versions: {common.versions()}", flush=True)
  for batch, ctx in shapes:
    for cd in args.formats.split(","):
      for layout in args.layouts.split(","):
        spec = kvjax.KVCacheSpec(H, D, N, cd, layout=layout)
        q, cache, _, sl, bt = SBS.paged_problem(spec, [1] * batch, [ctx - 1] * batch)
        ks = SBS._tensor_scale(cd)
        nbytes = batch * ctx * spec.page_bytes / spec.block_size
        for label, geo, splits in configs(spec, batch, ctx, stages, factors):
          fn = jax.jit(lambda q, c, sl, bt, geo=geo, splits=splits: paged_decode_attention(
              q, c, spec, seq_lens=sl, block_table=bt, scale=D ** -0.5, k_scale=ks, v_scale=ks,
              geometry=geo, num_splits=splits, interpret=args.smoke))
          head = f"{batch:4d}x{ctx:<6d} {cd:9s} {layout} {label}"
          try:
            if args.once:
              jax.block_until_ready(fn(q, cache, sl, bt))
              print(f"{head}: ran", flush=True)
              continue
            step = lambda q, c, sl, bt, fn=fn: fn(q, c, sl, bt)
            ms = common.time_jax_chained(step, q, cache, sl, bt, chain=3, reps=5, inner=4)
            print(f"{head}: {ms * 1e3:8.1f} us {nbytes / (ms * 1e-3) / 1e12:6.3f} TB/s",
                  flush=True)
          except Exception as e:  # noqa: BLE001 - report and go on
            print(f"{head}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
        del cache


if __name__ == "__main__":
  main()
