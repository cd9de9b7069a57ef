"""Benchmark of the Triton cache-write kernel, every cache format, next to vLLM's writers.

GPU (H200):  PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false \
               python benchmarks/bench_write.py [--parts checks,formats] [--default-config]
               [--formats nvfp4,...] [--no-vllm] [--json PATH] [--md PATH]
CPU smoke:   python benchmarks/bench_write.py --smoke      (tiny sizes, interpret mode)

Parts (``--parts``, default both):
  checks   the kernel's bytes == ``kvjax.reference.cache_update.write_kv`` under jit, on this
           device and on the CPU (poisoned caches, padded slots in random order, several
           cache dtypes and both layouts, strided pair loads, tiny nvfp4 block scales), and
           the dequantize kernel == ``kvjax.views.dequantize_stored``;
  formats  every format's quantize-on-write of 8192 tokens (H=8, D=128, N=16, bf16 K/V,
           random pages of a 2 GB cache): the best of FORMAT_CONFIGS launch configs
           (``--default-config``: the default only), the best config's write kernel alone
           (profiler trace of the same loop, ``device_trace.py``), its writes queued without a
           loop, and vLLM's writer on the same problem where vLLM has one.
Timing: a jitted, cache-donating ``fori_loop`` of writes (4 rotating input sets a step, so
nothing stays in L2), device time per write = loop time / writes, median of trials; "queued":
32 writes unrolled in one jit, called back to back (what a jitted serving step pays).
Rates are bytes read (bf16 K/V) + written (the format's rows) per second, as a % of an XLA
device-to-device copy of 1 GiB timed the same way (its bytes read + written per second).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kvjax import KVCacheSpec  # noqa: E402
from kvjax import views  # noqa: E402
from kvjax.reference import cache_update as ref  # noqa: E402
from pallas_kernels.triton import write as cu  # noqa: E402
from pallas_kernels.triton.adapters import tile_format  # noqa: E402
from pallas_kernels.triton import dequant as dq  # noqa: E402
from benchmarks import common  # noqa: E402

log = functools.partial(print, flush=True)


def as_bytes(x):
  return np.asarray(jax.device_get(x)).view(np.uint8)


# -- inputs -----------------------------------------------------------------------------------
def poisoned(rng, spec, num_blocks):
  """Random finite bytes in the cache's physical shape."""
  shape = spec.physical_shape(num_blocks)
  raw = rng.integers(0, 256, int(np.prod(shape)) * spec.itemsize, dtype=np.uint8)
  raw = raw.view(spec.storage_dtype).copy()
  if spec.storage_dtype.kind in "fV":
    bad = ~np.isfinite(raw.astype(np.float32))
    raw[bad] = 1.0
  return jnp.asarray(raw.reshape(shape))


def random_kv(rng, spec, t):
  def one():
    x = rng.standard_normal((t, spec.num_kv_heads, spec.head_size)).astype(np.float32)
    x *= np.exp(rng.uniform(-1, 1, (t, spec.num_kv_heads, 1))).astype(np.float32)
    return jnp.asarray(x).astype(spec.dtype)
  return one(), one()


def page_slots(rng, spec, num_blocks, t, pad=0):
  """Tokens filling random distinct pages in order (as a prefill would), then ``pad`` -1s."""
  n = spec.block_size
  pages = rng.choice(num_blocks, -(-t // n), replace=False)
  slots = (pages[:, None] * n + np.arange(n)[None, :]).reshape(-1)[:t]
  return jnp.asarray(np.concatenate([slots, -np.ones(pad, np.int64)]).astype(np.int32))


def scales_for(spec, rng):
  if spec.format.kind == "fp8_per_tensor":
    return jnp.float32(rng.uniform(0.05, 0.5)), jnp.asarray(
        rng.uniform(0.05, 0.5, spec.num_kv_heads).astype(np.float32))
  if spec.format.kind == "nvfp4":
    return jnp.float32(rng.uniform(0.05, 0.5)), jnp.float32(rng.uniform(0.05, 0.5))
  return None, None


# -- 1. correctness -------------------------------------------------------------------------
CHECK_CASES = [  # (cache_dtype, layout, H, D, N)
    ("auto", "NHD", 8, 128, 16), ("auto", "HND", 2, 64, 32), ("float32", "NHD", 1, 80, 16),
    ("fp8", "NHD", 8, 128, 16), ("fp8_e5m2", "HND", 2, 64, 16),
    ("int8_per_token_head", "NHD", 8, 128, 16), ("int8_per_token_head", "HND", 2, 80, 32),
    ("fp8_per_token_head", "NHD", 2, 64, 16), ("fp8_per_token_head", "HND", 8, 128, 16),
    ("int4_per_token_head", "NHD", 8, 128, 16), ("int4_per_token_head", "HND", 1, 32, 16),
    ("nvfp4", "HND", 8, 128, 16), ("nvfp4", "HND", 2, 64, 32), ("nvfp4", "HND", 1, 80, 16),
]


def _diff(a, b):
  return int((as_bytes(a) != as_bytes(b)).sum())


def _diff_f32(a, b):
  """float32 elements whose bits differ."""
  return int((as_bytes(a).view(np.uint32) != as_bytes(b).view(np.uint32)).sum())


def check_case(rng, case, interpret, cpu_ref, config=None, scale_boost=1.0):
  """Counts of differing bytes / elements: kernel write vs jitted reference on this device
  and on the CPU; dequant kernel vs ``views.dequantize_stored`` on this device and the CPU."""
  cd, layout, h, d, n = case
  spec = KVCacheSpec(h, d, n, cd, layout)
  nb, t = 24, 100
  cache = poisoned(rng, spec, nb)
  k, v = random_kv(rng, spec, t + 7)
  slots = page_slots(rng, spec, nb, t, pad=5)
  slots = slots[rng.permutation(slots.shape[0])]
  ks, vs = scales_for(spec, rng)
  if ks is not None:
    ks, vs = ks * scale_boost, vs * scale_boost
  ref_fn = jax.jit(lambda c, k, v, s, a, b: ref.write_kv(c, k, v, s, spec, a, b))
  want = ref_fn(cache, k, v, slots, ks, vs)
  kern = jax.jit(lambda c, k, v, s, a, b: cu.write_kv(c, k, v, s, spec, k_scale=a, v_scale=b,
                                                      interpret=interpret, config=config),
                 donate_argnums=0)
  before = as_bytes(cache).copy()
  got = kern(cache, k, v, slots, ks, vs)
  out = {"write_dev": _diff(want, got), "write_cpu": -1, "deq_dev": 0, "deq_cpu": -1,
         "bytes": as_bytes(got).size}
  deq = dq.dequantize_pages(got, spec, ks, vs, interpret=interpret)
  view_fn = jax.jit(lambda p, a, b: views.dequantize_stored(p, spec, a, b))
  out["deq_dev"] = sum(_diff_f32(a, b) for a, b in zip(deq, view_fn(got, ks, vs)))
  if cpu_ref:
    cpu = jax.devices("cpu")[0]
    put = lambda x: None if x is None else jax.device_put(np.asarray(x), cpu)
    want_cpu = ref_fn(put(before.view(spec.storage_dtype).reshape(cache.shape)), put(k), put(v),
                      put(slots), put(ks), put(vs))
    out["write_cpu"] = _diff(want_cpu, got)
    out["deq_cpu"] = sum(_diff_f32(a, b) for a, b in zip(
        deq, view_fn(put(as_bytes(got).view(spec.storage_dtype).reshape(cache.shape)),
                     put(ks), put(vs))))
  return out


# -- 2. timing -----------------------------------------------------------------------------
def one_write(spec, interpret, config):
  """``(cache, k, v, slots) -> cache``: one write of the benchmark (fixed tensor scales)."""
  ks, vs = ((jnp.float32(0.3), jnp.float32(0.2)) if spec.format.has_tensor_scales
            else (None, None))
  return lambda c, k, v, s: cu.write_kv(c, k, v, s, spec, k_scale=ks, v_scale=vs,
                                        interpret=interpret, config=config)


def write_chain(spec, rounds, interpret, config):
  """``(cache, inputs) -> cache``: ``rounds`` x one write per input set, unrolled (no loop)."""
  write = one_write(spec, interpret, config)

  def chain(c, inputs):
    for _ in range(rounds):
      for k, v, s in inputs:
        c = write(c, k, v, s)
    return c
  return chain


def write_loop(spec, iters, interpret, config):
  """``(cache, inputs) -> cache``: ``iters`` steps of one write per input set (a fori_loop)."""
  step = write_chain(spec, 1, interpret, config)
  return lambda c, inputs: jax.lax.fori_loop(0, iters, lambda _, c: step(c, inputs), c)


def _time_per_write(fn, writes_per_call, cache, inputs, calls, trials):
  """Median seconds per write of ``fn(cache, inputs) -> cache`` jitted with the cache donated,
  called ``calls`` times back to back a trial (one sync at the end); returns the cache too."""
  f = jax.jit(fn, donate_argnums=0)
  cache = f(cache, inputs)               # compile + warm up
  cache.block_until_ready()
  times = []
  for _ in range(trials):
    t0 = time.perf_counter()
    for _ in range(calls):
      cache = f(cache, inputs)
    cache.block_until_ready()
    times.append((time.perf_counter() - t0) / (calls * writes_per_call))
  return statistics.median(times), cache


def device_time_per_write(spec, cache, inputs, iters, trials, interpret, config):
  """Median device seconds per write: a donated jitted fori_loop over rotating input sets."""
  return _time_per_write(write_loop(spec, iters, interpret, config), iters * len(inputs),
                         cache, inputs, 1, trials)


def queued_time_per_write(spec, cache, inputs, rounds, calls, trials, interpret, config):
  """Median device seconds per write as a jitted serving step sees it: one jit of ``rounds`` x
  ``len(inputs)`` writes unrolled (no ``fori_loop``: on the H200 its clock has 3-7 µs a write
  between the loop's kernels), called ``calls`` times back to back (donated, one sync at the
  end)."""
  return _time_per_write(write_chain(spec, rounds, interpret, config), rounds * len(inputs),
                         cache, inputs, calls, trials)


def kernel_us_per_write(spec, cache, inputs, iters, config):
  """µs a write of the write kernel alone, from a profiler trace of the write loop (not
  donated: each call also copies the cache, a kernel of its own); None when the backend
  records no device kernels (CPU)."""
  from benchmarks.device_trace import kernel_breakdown
  rows, _ = kernel_breakdown(jax.jit(write_loop(spec, iters, False, config)), cache, inputs,
                             calls=3)
  kernel = [us for name, us, _ in rows if name.startswith("write_kv_")]
  return kernel[0] / (iters * len(inputs)) if kernel else None


def copy_rate(nbytes, iters, trials):
  """Bytes written per second of an XLA device copy of ``nbytes`` (median of trials)."""
  x = jax.random.bits(jax.random.key(0), (nbytes // 4,), jnp.uint32)
  f = jax.jit(lambda x: x.copy())      # a fresh output buffer each call: a real device copy
  f(x).block_until_ready()
  times = []
  for _ in range(trials):
    t0 = time.perf_counter()
    for _ in range(iters):              # queued asynchronously, one sync at the end
      y = f(x)
    y.block_until_ready()
    times.append((time.perf_counter() - t0) / iters)
    del y
  t = statistics.median(times)
  return nbytes / t, t


def make_inputs(rng, spec, num_blocks, t, sets):
  out = []
  for _ in range(sets):
    k, v = random_kv(rng, spec, t)
    out.append((k, v, page_slots(rng, spec, num_blocks, t)))
  return tuple(out)


def fill_cache(spec, num_blocks):
  """A non-zero cache without a host copy: an iota pattern (contents are never read)."""
  shape = spec.physical_shape(num_blocks)
  f = jax.jit(lambda: (jax.lax.broadcasted_iota(jnp.int32, shape, 3) % 251 + 1).astype(
      spec.storage_dtype))
  return f()


# -- per-format table ----------------------------------------------------------------------
#: (cache dtype, layout) rows of the per-format table: every format, both layouts where allowed.
FORMAT_ROWS = [("auto", "NHD"), ("auto", "HND"), ("fp8", "NHD"), ("fp8", "HND"),
               ("int8_per_token_head", "NHD"), ("int8_per_token_head", "HND"),
               ("fp8_per_token_head", "NHD"), ("fp8_per_token_head", "HND"),
               ("int4_per_token_head", "NHD"), ("int4_per_token_head", "HND"),
               ("nvfp4", "HND")]
#: Launch configurations tried per format (the best is reported; the default is marked).
FORMAT_CONFIGS = [cu.WriteConfig(tb, w, pair_split=ps) for tb in (1, 2, 4, 8) for w in (1, 2, 4)
                  for ps in (True, False)]


def moved_bytes(spec, t):
  """(bytes written, bytes read) of writing ``t`` tokens: the format's rows, the bf16 K/V."""
  return (t * spec.page_bytes // spec.block_size,
          2 * t * spec.num_kv_heads * spec.head_size * np.dtype(spec.dtype).itemsize)


def vllm_write_us(spec, t, rng):
  """vLLM's cache writer for the format (microseconds, CUDA events) on the same problem, or
  None where vLLM has no writer for it (nvfp4) or its kernels are absent."""
  from benchmarks import vllm_peer
  if not vllm_peer.available() or not vllm_peer.supports(spec):
    return None
  import torch
  import torch_bridge as tb
  from benchmarks.common import time_torch
  nb = (2 * 2**30) // spec.page_bytes
  cache_t = tb.to_torch(spec.allocate(nb), spec)
  k, v = (torch.from_dlpack(x) for x in random_kv(rng, spec, t))
  slots = torch.from_dlpack(page_slots(rng, spec, nb, t)).long()
  ks = vs = None
  if spec.format.has_tensor_scales:
    ks = vs = 0.25
  if spec.cache_dtype == "int4_per_token_head":   # its quantize-and-store kernel alone
    fn = lambda: vllm_peer.write_int4_rotated(spec, cache_t, k, v, slots)
  else:
    fn = lambda: vllm_peer.write(spec, cache_t, k, v, slots, k_scale=ks, v_scale=vs)
  return time_torch(fn) * 1e3


def format_problem(cache_dtype, layout, t_tok, rng, cache_bytes=2 * 2**30):
  """(spec, cache, inputs) of the per-format problem: H 8, D 128, block 16, a cache of
  ``cache_bytes``, 4 input sets of ``t_tok`` tokens."""
  spec = KVCacheSpec(8, 128, 16, cache_dtype, layout)
  nb = cache_bytes // spec.page_bytes
  return spec, fill_cache(spec, nb), make_inputs(rng, spec, nb, t_tok, 4)


def format_table(rng, crate, t_tok, iters, trials, interpret, smoke, with_vllm, formats=None,
                 default_only=False):
  """Per format: best configuration's device time per write of ``t_tok`` tokens, rates, % of
  the copy's read+written rate, its write kernel alone (profiler trace; None on CPU), its
  writes queued without a loop, and vLLM's writer on the same problem. ``formats``: the cache
  dtypes to time (None: all); ``default_only``: time the default config only."""
  rows = []
  configs = [] if default_only else FORMAT_CONFIGS[:2] if smoke else FORMAT_CONFIGS
  for cd, layout in (FORMAT_ROWS[::4] if smoke else FORMAT_ROWS):
    if formats is not None and cd not in formats:
      continue
    spec, cache, inputs = format_problem(cd, layout, t_tok, rng,
                                         2**22 if smoke else 2 * 2**30)
    wbytes, rbytes = moved_bytes(spec, t_tok)
    default = cu.default_config(spec)
    tried = []
    fmt = tile_format(spec)
    splits = fmt.split and not fmt.write_words   # the formats whose encoders use io.pairs
    for cfg in ([default] + [c for c in configs if c != default and (splits or c.pair_split
                                                                    == default.pair_split)]):
      try:
        sec, cache = device_time_per_write(spec, cache, inputs, max(1, iters // 2),
                                           max(2, trials - 2), interpret, cfg)
      except Exception as e:   # noqa: BLE001
        log(f"  {cd} {layout} {cfg}: ERROR {type(e).__name__}: {str(e)[:200]}")
        continue
      tried.append((sec, cfg))
    if not tried:
      continue
    best_sec, best_cfg = min(tried, key=lambda x: x[0])
    kernel_us = queued_sec = None
    if not interpret:
      try:
        kernel_us = kernel_us_per_write(spec, cache, inputs, 4, best_cfg)
      except Exception as e:   # noqa: BLE001
        log(f"  {cd} {layout} trace: ERROR {type(e).__name__}: {str(e)[:200]}")
    try:
      queued_sec, cache = queued_time_per_write(spec, cache, inputs, 1 if smoke else 8,
                                                1 if smoke else 4, max(2, trials - 2),
                                                interpret, best_cfg)
    except Exception as e:   # noqa: BLE001
      log(f"  {cd} {layout} queued: ERROR {type(e).__name__}: {str(e)[:200]}")
    del cache, inputs
    default_sec = tried[0][0] if tried[0][1] == default else float("nan")
    try:
      vllm_us = None if (smoke or not with_vllm) else vllm_write_us(spec, t_tok, rng)
    except Exception as e:   # noqa: BLE001
      log(f"  vLLM writer {cd} {layout}: ERROR {type(e).__name__}: {str(e)[:200]}")
      vllm_us = None
    rw = (wbytes + rbytes) / best_sec
    row = dict(cache_dtype=cd, layout=layout, us=best_sec * 1e6, default_us=default_sec * 1e6,
               config=f"tb={best_cfg.tokens_per_program},w={best_cfg.num_warps}"
               + (",split" if best_cfg.pair_split else ""),
               written_mb=wbytes / 1e6, read_mb=rbytes / 1e6, rw_tbs=rw / 1e12,
               pct_copy=100 * rw / (2 * crate), vllm_us=vllm_us, kernel_us=kernel_us,
               kernel_pct_copy=(None if kernel_us is None else
                                100 * (wbytes + rbytes) / (kernel_us * 1e-6) / (2 * crate)),
               queued_us=None if queued_sec is None else queued_sec * 1e6,
               queued_pct_copy=(None if queued_sec is None else
                                100 * (wbytes + rbytes) / queued_sec / (2 * crate)))
    rows.append(row)
    log(f"  {cd:22s} {layout}: best {row['us']:6.1f} us ({row['config']}), default "
        f"{row['default_us']:6.1f} us, {row['pct_copy']:5.1f}% of copy; kernel alone "
        f"{_cell(row['kernel_pct_copy'], '.1f', '%')}; queued "
        f"{_cell(row['queued_pct_copy'], '.1f', '%')}; vLLM {_cell(vllm_us, '.1f', ' us')}")
  return rows


def _cell(x, fmt, unit=""):
  return "-" if x is None else f"{x:{fmt}}{unit}"


def format_table_md(rows, t_tok, crate, default_only=False):
  lines = [f"{t_tok} tokens, H=8, D=128, N=16, random pages, 2 GB cache; % = (K/V bf16 read + "
           f"format rows written) / s over the device copy's read+written rate "
           f"({2 * crate / 1e12:.3f} TB/s); "
           + ("the default launch config" if default_only else
              f"best of {len(FORMAT_CONFIGS)} launch configs (default's time next to it)")
           + ", one write of a fori_loop of writes (launch gaps "
           "included); kernel = the best config's write kernel alone, from a profiler trace of "
           "the same loop; queued = the best config's writes unrolled in one jit (32 a call, "
           "calls back to back: no loop); vLLM = its Triton writer on the same problem (int4: "
           "its quantize-and-store kernel on pre-rotated rows).", "",
           "| cache dtype | layout | µs (best) | config | µs (default) | written MB | "
           "r+w TB/s | % of copy | kernel µs | kernel % of copy | queued µs | queued % of copy "
           "| vLLM µs | vs vLLM |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    v = r["vllm_us"]
    vs = "-" if v is None else f"{v / r['us']:.2f}x"
    lines.append(f"| {r['cache_dtype']} | {r['layout']} | {r['us']:.1f} | {r['config']} | "
                 f"{r['default_us']:.1f} | {r['written_mb']:.1f} | {r['rw_tbs']:.3f} | "
                 f"{r['pct_copy']:.1f} | {_cell(r.get('kernel_us'), '.1f')} | "
                 f"{_cell(r.get('kernel_pct_copy'), '.1f')} | {_cell(r.get('queued_us'), '.1f')} | "
                 f"{_cell(r.get('queued_pct_copy'), '.1f')} | {_cell(v, '.1f')} | {vs} |")
  return lines


def run_checks(rng, interpret, smoke):
  """Part "checks": ``[(case, note, counts or None)]``, one line printed per case."""
  base = CHECK_CASES[:4] + CHECK_CASES[-3:-1] if smoke else CHECK_CASES
  strided = cu.WriteConfig(pair_split=False)
  cases = [(c, "", None) for c in base]
  cases += [(c, "strided pairs", strided) for c in base
            if c[0] in ("int4_per_token_head", "nvfp4")][:3]
  cases += [(("nvfp4", "HND", 8, 128, 16), "tiny SF (k_scale x300)", None)]
  rows = []
  for case, note, cfg in cases:
    t0 = time.perf_counter()
    try:
      res = check_case(rng, case, interpret, cpu_ref=not interpret, config=cfg,
                       scale_boost=300.0 if note.startswith("tiny") else 1.0)
      log(f"  {case} {note}: write bytes != ref: device {res['write_dev']}, CPU "
          f"{res['write_cpu']}; dequant elems != views: device {res['deq_dev']}, CPU "
          f"{res['deq_cpu']}  ({res['bytes']} cache bytes, {time.perf_counter() - t0:.1f}s)")
    except Exception as e:   # noqa: BLE001  -- report and go on
      res = None
      log(f"  {case} {note}: ERROR {common.first_lines(e)}")
    rows.append((case, note, res))
  return rows


def checks_md(rows):
  lines = ["## Compiled kernel == reference bytes", "",
           "Poisoned caches (random bytes), 100 tokens + 5 padding slots in random order; the "
           "reference is `kvjax.reference.cache_update.write_kv` under `jax.jit`, run on this "
           "device and on the CPU; dequant = `pallas_kernels.triton.dequant` vs "
           "`kvjax.views.dequantize_stored` over all 24 pages (poisoned ones included).", "",
           "| cache dtype | layout | H | D | N | variant | write bytes != ref (device) | "
           "write bytes != ref (CPU) | dequant elems != views (device) | dequant != views (CPU) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for case, note, res in rows:
    cells = ["error"] * 4 if res is None else [
        str(res["write_dev"]), str(res["write_cpu"]) if res["write_cpu"] >= 0 else "-",
        str(res["deq_dev"]), str(res["deq_cpu"]) if res["deq_cpu"] >= 0 else "-"]
    lines.append("| " + " | ".join(str(c) for c in case) + f" | {note or '-'} | "
                 + " | ".join(cells) + " |")
  return lines


def main():
  warnings.filterwarnings("ignore", category=DeprecationWarning)
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--smoke", action="store_true", help="tiny sizes, interpret mode (CPU)")
  ap.add_argument("--parts", default="checks,formats", help="comma list of: checks, formats")
  ap.add_argument("--formats", default=None,
                  help="comma list of cache dtypes for the per-format table (default: all)")
  ap.add_argument("--default-config", action="store_true",
                  help="per-format table: time each format's default launch config only")
  ap.add_argument("--no-vllm", action="store_true", help="skip vLLM's writers")
  ap.add_argument("--json", default=None, help="write the per-format table here (default "
                  "$OUT/write.json when $OUT is set)")
  ap.add_argument("--md", default=None, help="write the markdown report here (default "
                  "$OUT/write.md when $OUT is set)")
  args = ap.parse_args()
  smoke = args.smoke
  if smoke:
    common.announce_smoke(jax.default_backend())
  parts = set(args.parts.split(","))
  interpret = smoke or jax.default_backend() == "cpu"
  rng = np.random.default_rng(0)
  info = dict(date=common.now_utc(), command=common.command_line(),
              device=common.device_name(), versions=common.versions())
  log(json.dumps(info))
  rows1 = []
  if "checks" in parts:
    log("\n## compiled kernel vs reference bytes (poisoned cache, 100 tokens + 5 pad slots)")
    rows1 = run_checks(rng, interpret, smoke)
  format_rows, crate = [], None
  t_tok = 64 if smoke else 8192
  if "formats" in parts:
    iters, trials = (1, 2) if smoke else (25, 7)
    copy_bytes = 2**20 if smoke else 2**30
    crate, ctime = copy_rate(copy_bytes, 2 if smoke else 50, trials)
    log(f"\n## per-format table\n  device copy of {copy_bytes / 2**20:.0f} MiB: "
        f"{ctime * 1e6:.1f} us, {2 * crate / 1e12:.3f} TB/s read+written")
    format_rows = format_table(rng, crate, t_tok, iters, trials, interpret, smoke,
                               not args.no_vllm,
                               None if args.formats is None else args.formats.split(","),
                               args.default_config)
  json_path = common.output_path(args.json, "write.json")
  if json_path and format_rows:
    with open(json_path, "w") as fh:
      json.dump(dict(info, copy_written_tbs=crate / 1e12, rows=format_rows), fh, indent=1)
    log(f"wrote {json_path}")
  lines = [f"# Cache write kernel, {info['date']}", "", f"- command: `{info['command']}`",
           f"- device: {info['device']}", f"- versions: {json.dumps(info['versions'])}", ""]
  if rows1:
    lines += checks_md(rows1) + [""]
  if format_rows:
    lines += ["## Per format (device time per write, "
              + ("default" if args.default_config else "best") + " launch config)", ""]
    lines += format_table_md(format_rows, t_tok, crate, args.default_config)
  md = "\n".join(lines) + "\n"
  print("\n" + md)
  md_path = common.output_path(args.md, "write.md")
  if md_path:
    with open(md_path, "w") as fh:
      fh.write(md)
    log(f"wrote {md_path}")


if __name__ == "__main__":
  common.exit_after(main)
