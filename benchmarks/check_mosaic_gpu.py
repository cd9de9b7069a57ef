"""H200 check of the Mosaic GPU ragged attention: compiled correctness, then speed.

GPU:  PYTHONUNBUFFERED=1 python3 benchmarks/check_mosaic_gpu.py         (< 6 minutes)
      [--only checks|bench|rule] [--quant-only] [--persistent-only] [--json FILE]; writes
      $OUT/mosaic_gpu.json when $OUT is set. Two trees in one job (benchmarks/ab.py):
      python3 benchmarks/ab.py run -- benchmarks/check_mosaic_gpu.py --only bench
CPU:  python3 benchmarks/check_mosaic_gpu.py --smoke   (plumbing only: every GPU item fails)

The one prefill table (kvjax Triton / Mosaic GPU / auto vs the dense peers, every cache
format) is ``benchmarks/bench_prefill.py``; this script is the Mosaic GPU kernel's own check
(every P.V variant, the schedules and stagings, the auto rule; tile geometries:
``benchmarks/sweep_mosaic_prefill.py``). Problems, FLOPs, jitted kvjax calls and
the dense peers come from ``benchmarks/prefill_peers.py``.

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
3. The auto rule (Triton vs Mosaic GPU from pure decode to long prefill, bf16 NHD) and every
   cache format on a 4x4096 causal prefill: Triton through a plain copy where it pays, Triton
   dequantizing in its inner loop, Mosaic GPU through the copy (``--quant-only``: formats only).

Each part runs in a child process with a time limit, so a hang (a barrier deadlock) or a
crash costs that part only; the parent prints what the child reported before it stopped.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import first_lines  # noqa: E402

PARTS = {"checks": 240, "bench": 150, "rule": 150}    # seconds each part may take
PREFIX = "@@"                             # result lines the parent collects


def emit(kind, **row):
  """Print a human line and a machine line (collected by the parent)."""
  print(PREFIX + json.dumps(dict(kind=kind, **row)), flush=True)


# -- problems (benchmarks/prefill_peers.py: paged_batch, kvjax_fn, dense_peers, FLOPs) ---------
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


def run_checks(only_pv=None, quick: bool = False):
  """Every case of CHECKS in every P V variant (``only_pv``: those), the default one also on 3
  persistent blocks and with the other stagings (``quick``: not the other stagings)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import kvjax
  from benchmarks import prefill_peers as P
  from pallas_kernels.mosaic_gpu.ragged_attention import supports_attention
  from pallas_kernels.mosaic_gpu import tiles as TL
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
    variants = tuple(v for v in variants if only_pv is None or v in only_pv)
    try:
      spec = kvjax.KVCacheSpec(h, d, n, cache_dtype, layout=layout, dtype=dtype)
      args = P.paged_batch(rng, spec, ql, cl, h * g, pad=pad, fill="nan", scales=scales)
      if kw.pop("sinks", False):
        kw["sinks"] = jnp.asarray(rng.standard_normal(h * g) * 2, jnp.float32)
      ref = P.kvjax_fn(spec, "reference", mql, **kw)(*args)
    except Exception as e:  # noqa: BLE001 - report and go on with the next case
      for pv in variants:
        emit("check", name=name, pv=pv, ok=False, error="setup: " + first_lines(e))
      continue
    # the default variant also on 3 persistent blocks, fewer than the case's work items: each
    # block walks several items (on the device's SM count these small cases have one each)
    runs = [(pv, {}) for pv in variants]
    if DEFAULT_PV in variants:
      runs.append((f"{DEFAULT_PV}, 3 blocks", dict(pv=DEFAULT_PV, num_programs=3)))
      for staging in () if quick else (TL.STAGING_SWIZZLED, TL.STAGING_PLAIN):
        runs.append((f"{DEFAULT_PV}, 3 blocks, {staging} staging",
                     dict(pv=DEFAULT_PV, num_programs=3, staging=staging)))
    for label, extra in runs:
      t0 = time.time()
      try:
        f = ours_fn(spec, d ** -0.5, mql, **(extra or dict(pv=label)), **kw)
        out = jax.block_until_ready(f(*args))
        emit("check", name=name, pv=label, **P.compare(out, ref, sum(ql)),
             seconds=round(time.time() - t0, 1))
      except Exception as e:  # noqa: BLE001 - report and go on
        emit("check", name=name, pv=label, ok=False, error=first_lines(e),
             seconds=round(time.time() - t0, 1))


# -- part 2: speed -----------------------------------------------------------------------------
def run_bench(smoke: bool = False, persistent_only: bool = False, ours_only: bool = False):
  """Time every implementation; ``smoke``: tiny problems (plumbing check on CPU);
  ``persistent_only``: of our kernel's variants only the schedules (persistent blocks or one
  block per work item), not the P V variants or the ping-pong switch; ``ours_only``: only our
  kernel as ``auto`` configures it, both layouts (the A/B of a kernel change, ab.py)."""
  import jax.numpy as jnp
  import numpy as np
  import kvjax
  from benchmarks import prefill_peers as P
  from benchmarks.common import time_jax
  from pallas_kernels.mosaic_gpu import tiles as TL
  from pallas_kernels.mosaic_gpu.tiles import DEFAULT_PV, PV_VARIANTS
  rng = np.random.default_rng(1)
  scale = P.D ** -0.5
  timing = P.SMOKE_TIMING if smoke else P.TIMING

  def timed(impl, problem, fn, flops):
    row = P.measure(fn)
    if "ms" in row:
      row.update(tflops=P.tflops(flops, row["ms"]), us=1e3 * row["ms"])   # us: for ab.py
    emit("bench", impl=impl, problem=problem, **row)

  def same_outputs(name, f, g, args):    # the same math per work item: the same bits
    try:
      a, b = (np.asarray(fn(*args), np.float32) for fn in (f, g))
      diff = float(np.max(np.abs(a - b)))
      emit("check", name=name, pv=DEFAULT_PV, ok=diff == 0.0, max_err=diff,
           ref_max=float(np.max(np.abs(b))), padding_zero=True, seconds=0.0)
    except Exception as e:  # noqa: BLE001 - report and go on
      emit("check", name=name, pv=DEFAULT_PV, ok=False, error=first_lines(e), seconds=0.0)

  problems = P.SMOKE_PROBLEMS if smoke else P.PROBLEMS
  for k, (problem, ql, cl) in enumerate(problems):
    flops, mql = P.attention_flops(ql, cl), max(ql)
    for layout in ("NHD", "HND"):
      spec = kvjax.KVCacheSpec(P.H, P.D, P.N, layout=layout, dtype=jnp.bfloat16)
      args = P.paged_batch(rng, spec, ql, cl)
      if layout == "NHD" and not ours_only:
        f = P.kvjax_fn(spec, "pallas", mql)
        timed("Pallas-Triton (kvjax) NHD", problem, lambda: time_jax(f, *args, **timing), flops)
      f = ours_fn(spec, scale, mql)
      timed(f"Mosaic GPU (ours, {DEFAULT_PV}) {layout}", problem,
            lambda: time_jax(f, *args, **timing), flops)
      if layout == "NHD" and not ours_only:  # the schedule before: one block per item; stagings
        g = ours_fn(spec, scale, mql, num_programs=0)
        timed(f"Mosaic GPU (ours, {DEFAULT_PV}, one block per work item) NHD", problem,
              lambda: time_jax(g, *args, **timing), flops)
        same_outputs(f"{problem}: persistent blocks == one block per item (bitwise)", f, g,
                     args)
        for staging in (TL.STAGING_SWIZZLED, TL.STAGING_PLAIN):
          g = ours_fn(spec, scale, mql, staging=staging)
          timed(f"Mosaic GPU (ours, {DEFAULT_PV}, {staging} staging) NHD", problem,
                lambda: time_jax(g, *args, **timing), flops)
          same_outputs(f"{problem}: default == {staging} staging (bitwise)", f, g, args)
      if (layout == "NHD" and k in (0, len(problems) - 1) and not persistent_only
          and not ours_only):
        for pv in PV_VARIANTS:                                    # the other variants
          if pv != DEFAULT_PV:
            f = ours_fn(spec, scale, mql, pv=pv)
            timed(f"Mosaic GPU (ours, {pv}) NHD", problem,
                  lambda: time_jax(f, *args, **timing), flops)
        f = ours_fn(spec, scale, mql, ping_pong=False)   # the schedule's own gain
        timed(f"Mosaic GPU (ours, {DEFAULT_PV}, no ping-pong) NHD", problem,
              lambda: time_jax(f, *args, **timing), flops)
      args = None     # the next layout's batch replaces this one's device buffers
    if len(set(ql)) == 1 and not any(cl) and not ours_only:   # dense peers: equal prefills
      for impl, thunk in P.dense_peers(len(ql), ql[0], timing):
        timed(impl, problem, thunk, flops)


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


def run_rule(smoke: bool = False, quant_only: bool = False):
  """Triton vs Mosaic GPU across query lengths (the auto rule), and every cache format on a
  4 x 4096 causal prefill: the Triton ragged kernel reading the quantized pages in its inner
  loop (``plain_copy=False``), through a plain copy of them (``kvjax.plain_copy``), and the
  Mosaic GPU kernel (through the copy)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import kvjax
  from benchmarks import prefill_peers as P
  from benchmarks.common import time_jax
  from pallas_kernels.triton.ragged import ragged_paged_attention
  rng = np.random.default_rng(2)
  scale = P.D ** -0.5
  timing = P.SMOKE_TIMING if smoke else P.TIMING
  batches = [("2 decodes", [1, 1], [30, 60]), ("1 x 40 prefill", [40], [0])] if smoke \
      else RULE_BATCHES
  if quant_only:
    batches = []

  def timed(impl, problem, fn, args, flops, **extra):
    row = P.measure(lambda: time_jax(fn, *args, **timing))
    if "ms" in row:
      row["tflops"] = P.tflops(flops, row["ms"])
    emit("bench", impl=impl, problem=problem, **row, **extra)

  for problem, ql, cl in batches:
    flops = P.attention_flops(ql, cl)
    spec = kvjax.KVCacheSpec(P.H, P.D, P.N, layout="NHD", dtype=jnp.bfloat16)
    args = P.paged_batch(rng, spec, ql, cl)
    timed("Pallas-Triton", problem, P.kvjax_fn(spec, "pallas", max(ql)), args, flops,
          part="rule", max_query_len=max(ql))
    timed("Mosaic GPU", problem, ours_fn(spec, scale, max(ql)), args, flops, part="rule",
          max_query_len=max(ql))
    del args
  s, L = (1, 64) if smoke else (4, 4096)
  ql, cl = [L] * s, [0] * s
  flops = P.attention_flops(ql, cl)
  problem = f"{s}x{L} causal prefill, per format"
  for cd in P.FORMATS:
    spec = P.format_spec(cd)
    ks = P.tensor_scale(cd)
    args = P.paged_batch(rng, spec, ql, cl)
    timed(f"Pallas-Triton {cd}", problem, P.kvjax_fn(spec, "pallas", L), args, flops,
          part="quant_prefill")
    if cd != "bfloat16":
      timed(f"Pallas-Triton in-loop dequant {cd}", problem, jax.jit(
          lambda q, c, qsl, sl, bt, spec=spec, ks=ks: ragged_paged_attention(
              q, c, spec, query_start_loc=qsl, seq_lens=sl, block_table=bt, scale=scale,
              k_scale=ks, v_scale=ks, max_query_len=L, plain_copy=False)), args, flops,
          part="quant_prefill")
    timed(f"Mosaic GPU {cd}", problem, ours_fn(spec, scale, L, k_scale=ks, v_scale=ks), args,
          flops, part="quant_prefill")
    del args


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
    if "skipped" in row:
      return f"[bench] {row['problem']} | {row['impl']}: skipped ({row['skipped']})"
    return (f"[bench] {row['problem']} | {row['impl']}: {row['ms']:.3f} ms,"
            f" {row['tflops']:.1f} TFLOP/s")
  return f"[info] {row}"


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--part", choices=sorted(PARTS), help="run one part here (child mode)")
  ap.add_argument("--only", choices=sorted(PARTS), help="run only this part (parent mode)")
  ap.add_argument("--quant-only", action="store_true",
                  help="rule part: only the per-format prefill")
  ap.add_argument("--pv", default=None,
                  help="checks part: comma-separated P.V variants to check (default: all)")
  ap.add_argument("--json", default=None,
                  help="also write the result (rows of every part) here (benchmarks/ab.py "
                       "compares two trees' bench rows by impl and problem)")
  ap.add_argument("--persistent-only", action="store_true",
                  help="bench part: of our kernel's variants only the two schedules")
  ap.add_argument("--quick", action="store_true",
                  help="checks part: the default staging only (default and 3-block runs)")
  ap.add_argument("--ours-only", action="store_true",
                  help="bench part: only our kernel as auto configures it, both layouts, no "
                       "peers or variants (the A/B of a kernel change with benchmarks/ab.py)")
  ap.add_argument("--smoke", action="store_true",
                  help="tiny timing problems (CPU: checks the plumbing, every GPU item fails)")
  args = ap.parse_args()
  if args.part == "checks":
    run_checks(args.pv.split(",") if args.pv else None, args.quick)
    return
  if args.part == "bench":
    run_bench(args.smoke, args.persistent_only, args.ours_only)
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
    extra = ((["--smoke"] if args.smoke else []) + (["--quant-only"] if args.quant_only else [])
             + (["--persistent-only"] if args.persistent_only else [])
             + (["--ours-only"] if args.ours_only else [])
             + (["--quick"] if args.quick else [])
             + (["--pv", args.pv] if args.pv else []))
    rows, status = run_part(part, limit, extra)
    result["parts"][part] = status
    result["rows"] += rows
  checks = [r for r in result["rows"] if r["kind"] == "check"]
  bench = [r for r in result["rows"] if r["kind"] == "bench" and "ms" in r]
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
  paths = [args.json] if args.json else []
  if os.environ.get("OUT"):
    paths.append(os.path.join(os.environ["OUT"], "mosaic_gpu.json"))
  for path in paths:
    with open(path, "w") as fh:
      json.dump(result, fh, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
