"""Diagnose wrong rows of the Mosaic GPU ragged attention on an H200 (< 3 minutes).

GPU:  PYTHONUNBUFFERED=1 python3 benchmarks/debug_mosaic_gpu_causal.py [--part NAME]

Written for the "causal prefill" failures of 2026-12-01, which these probes traced to q tiles
starting at a token that is not a multiple of 8 (a TMA copy into tiled shared memory lost the
rows past the first 8-row boundary; docs/mosaic_gpu.md, "Alignment"): one-hot V showed the
softmax weights right whenever every sequence started at a multiple of 8, and the row map
showed, per failing sequence, tokens 1..7 of each 8-row group wrong and tokens 0 and 8 right.
Kept as the first thing to run when a check of ``check_mosaic_gpu.py`` fails again.

Parts (each in a child process with a time limit, so a hang costs that part only):

* ``probe``: V is one-hot in the key's position (``v[pos, d] = 1`` iff ``d == pos``, D = 128,
  every sequence <= 128 keys), so each output row *is* that row's softmax weights over the
  keys. Per sequence (prefix length C, query length L) it prints which rows are wrong and,
  for the first wrong rows, the keys the kernel weighted vs the keys the reference weighted
  (ranges) and the kernel's weight sum (1 = normalized). Random q and q = 0 (uniform weights).
* ``rows``: failing cases of ``check_mosaic_gpu.py`` with random data; wrong (token, head)
  rows grouped by sequence (prefix, query length), by row of the tile (token % bq), by tile of
  the sequence, by head of the KV group.
* ``variants``: one failing case under changes of the kernel's configuration: every P·V
  variant, causal=False (against the non-causal reference), one consumer warpgroup, fewer /
  more K/V slots, other bq.

A row is wrong when ``|out - ref| > 2e-2 * max|ref|`` anywhere in it.
"""
from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PARTS = {"probe": 60, "rows": 60, "variants": 60}   # seconds each part may take
TOL = 2e-2


def ranges(idx) -> str:
  """'0-5,9,12-13' of a sorted int sequence."""
  idx = [int(i) for i in idx]
  if not idx:
    return "-"
  out, lo, prev = [], idx[0], idx[0]
  for i in idx[1:] + [None]:
    if i is not None and i == prev + 1:
      prev = i
      continue
    out.append(f"{lo}" if lo == prev else f"{lo}-{prev}")
    if i is not None:
      lo = prev = i
  return ",".join(out)


def batch(rng, spec, q_lens, ctx_lens, hq, pad=0, onehot_v=False, zero_q=False):
  """(q, cache, qsl, seq_lens, block_table): NaN cache, shuffled pages, every token of every
  sequence written (K random; V random or one-hot in the key's position)."""
  import jax.numpy as jnp
  import numpy as np
  from kvjax.reference import write_kv
  n, d, h = spec.block_size, spec.head_size, spec.num_kv_heads
  q_lens, ctx_lens = np.asarray(q_lens), np.asarray(ctx_lens)
  seq_lens = q_lens + ctx_lens
  pages = np.maximum(-(-seq_lens // n), 1)
  num_blocks = int(pages.sum()) + 2
  perm = rng.permutation(num_blocks)
  bt = np.zeros((len(q_lens), int(pages.max()) + 1), np.int32)
  used = 0
  for s, p in enumerate(pages):
    bt[s, :p] = perm[used:used + p]
    bt[s, p:] = perm[-1]
    used += p
  cache = jnp.full(spec.physical_shape(num_blocks), jnp.nan, spec.dtype)
  slots = np.concatenate([bt[s, np.arange(L) // n] * n + np.arange(L) % n
                          for s, L in enumerate(seq_lens)]).astype(np.int32)
  k = rng.standard_normal((len(slots), h, d))
  if onehot_v:
    pos = np.concatenate([np.arange(L) for L in seq_lens])
    assert pos.max() < d, "one-hot V needs every sequence <= head_size keys"
    v = np.zeros((len(slots), h, d))
    v[np.arange(len(slots)), :, pos] = 1.0
  else:
    v = rng.standard_normal((len(slots), h, d))
  cache = write_kv(cache, jnp.asarray(k, spec.dtype), jnp.asarray(v, spec.dtype),
                   jnp.asarray(slots), spec)
  t = int(q_lens.sum()) + pad
  q = np.zeros((t, hq, d)) if zero_q else rng.standard_normal((t, hq, d))
  qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  return (jnp.asarray(q, spec.dtype), cache, jnp.asarray(qsl), jnp.asarray(seq_lens, jnp.int32),
          jnp.asarray(bt))


def run_pair(spec, args, mql, geometry=None, pv=None, **kw):
  """(kernel out, reference out) as float32 numpy."""
  import jax
  import numpy as np
  from benchmarks.check_mosaic_gpu import ours_fn
  from kvjax.reference import unified_attention as ref
  scale = spec.head_size ** -0.5
  o = ours_fn(spec, scale, mql, geometry=geometry, pv=pv, **kw)(*args)
  o = np.asarray(jax.block_until_ready(o), np.float32)
  q, cache, qsl, sl, bt = args
  r = np.asarray(jax.jit(functools.partial(ref, spec=spec, scale=scale, **kw))(
      q, cache, query_start_loc=qsl, seq_lens=sl, block_table=bt), np.float32)
  return o, r


def wrong_rows(o, r, real):
  """bool [real, Hq]: rows off by more than TOL of the data's magnitude."""
  import numpy as np
  mag = max(float(np.abs(r[:real]).max()), 1e-3)
  return np.abs(o[:real] - r[:real]).max(axis=-1) > TOL * mag


def seq_of_tokens(qsl):
  """(sequence, token index within it) of every real token."""
  import numpy as np
  qsl = np.asarray(qsl)
  tok = np.arange(int(qsl[-1]))
  seq = np.searchsorted(qsl[1:], tok, side="right")
  return seq, tok - qsl[seq]


# -- part probe --------------------------------------------------------------------------------
def part_probe():
  import jax.numpy as jnp
  import numpy as np
  import kvjax
  from pallas_kernels.mosaic_gpu import tiles as TL
  rng = np.random.default_rng(0)
  q_lens, ctx = [40, 40, 40, 24, 6], [0, 1, 30, 88, 0]
  for g in (1, 4):
    for zero_q in (False, True):
      spec = kvjax.KVCacheSpec(1, 128, 16, dtype=jnp.bfloat16)
      args = batch(rng, spec, q_lens, ctx, g, onehot_v=True, zero_q=zero_q)
      geo = TL.choose_geometry(g, 128, 16, max(q_lens))
      tag = f"G={g} bq={geo.bq} wgs={geo.num_wgs} q={'zero' if zero_q else 'random'}"
      try:
        o, r = run_pair(spec, args, max(q_lens))
      except Exception as e:  # noqa: BLE001
        print(f"[probe] {tag}: ERROR {type(e).__name__}: {str(e)[:300]}")
        continue
      qsl, sl = np.asarray(args[2]), np.asarray(args[3])
      bad = wrong_rows(o, r, int(qsl[-1]))
      print(f"[probe] {tag}: {int(bad.sum())}/{bad.size} rows wrong, max err "
            f"{np.abs(o[:qsl[-1]] - r[:qsl[-1]]).max():.3f}")
      for s in range(len(q_lens)):
        lo, hi = qsl[s], qsl[s + 1]
        b = bad[lo:hi]
        c = int(sl[s]) - (hi - lo)
        if not b.any():
          print(f"   seq {s} (prefix {c}, {hi - lo} queries): all right")
          continue
        toks = np.nonzero(b.any(axis=1))[0]
        heads = np.nonzero(b.any(axis=0))[0]
        print(f"   seq {s} (prefix {c}, {hi - lo} queries): wrong query tokens "
              f"{ranges(toks)} (positions {ranges(toks + c)}), heads {ranges(heads)}")
        shown = 0
        for t in toks:
          for hd in np.nonzero(b[t])[0]:
            if shown >= 3:
              break
            w, wr = o[lo + t, hd, :sl[s]], r[lo + t, hd, :sl[s]]
            print(f"      pos {t + c} head {hd}: kernel keys {ranges(np.nonzero(w > 1e-3)[0])} "
                  f"sum {w.sum():.3f}; reference keys {ranges(np.nonzero(wr > 1e-3)[0])}; "
                  f"max |dw| at key {int(np.abs(w - wr).argmax())}")
            shown += 1


# -- part rows ---------------------------------------------------------------------------------
ROW_CASES = [
    # name, layout, H, G, D, N, q_lens, ctx_lens, pad, kwargs
    ("NHD G=4 D=128 mix", "NHD", 2, 4, 128, 16, [300, 1, 1, 77, 0, 64], [0, 1000, 37, 500, 5, 64],
     13, {}),
    ("NHD G=1 D=128 2 wgs", "NHD", 2, 1, 128, 16, [700, 130, 1], [0, 300, 90], 5, {}),
    ("NHD G=4 D=64 small ragged", "NHD", 2, 4, 64, 16, [6, 1, 9, 0, 1], [0, 30, 11, 5, 0], 2, {}),
    ("NHD G=4 D=128 prefix sweep", "NHD", 1, 4, 128, 16, [64, 64, 64, 64, 64, 64],
     [0, 1, 7, 64, 127, 128], 0, {}),
    ("HND G=4 D=128 starts at every offset mod 8", "HND", 1, 4, 128, 16,
     [9, 10, 11, 12, 13, 14, 15, 17], [0, 5, 0, 20, 3, 0, 40, 7], 3, {}),
]


def part_rows():
  import jax.numpy as jnp
  import numpy as np
  import kvjax
  from pallas_kernels.mosaic_gpu import tiles as TL
  rng = np.random.default_rng(1)
  for name, layout, h, g, d, n, ql, cl, pad, kw in ROW_CASES:
    spec = kvjax.KVCacheSpec(h, d, n, layout=layout, dtype=jnp.bfloat16)
    args = batch(rng, spec, ql, cl, h * g, pad)
    geo = TL.choose_geometry(g, d, n, max(ql))
    try:
      o, r = run_pair(spec, args, max(ql), **kw)
    except Exception as e:  # noqa: BLE001
      print(f"[rows] {name}: ERROR {type(e).__name__}: {str(e)[:300]}")
      continue
    qsl = np.asarray(args[2])
    real = int(qsl[-1])
    bad = wrong_rows(o, r, real)
    pad_ok = bool(np.all(o[real:] == 0))
    print(f"[rows] {name} (bq={geo.bq} wgs={geo.num_wgs} bk={geo.block_kv} "
          f"stages={geo.stages}): {int(bad.sum())}/{bad.size} rows wrong, padding zero {pad_ok}, "
          f"max err {np.abs(o[:real] - r[:real]).max():.3f} of max {np.abs(r).max():.2f}")
    seq, local = seq_of_tokens(qsl)
    for s in range(len(ql)):
      sel = seq == s
      if not sel.any():
        continue
      b = bad[sel]
      toks = np.nonzero(b.any(axis=1))[0]
      print(f"   seq {s} (first token {qsl[s]}, = {qsl[s] % 8} mod 8) prefix {cl[s]} queries "
            f"{ql[s]}: {int(b.sum())}/{b.size} wrong; wrong tokens {ranges(toks)}")
    tok_any = bad.any(axis=1)
    by_row = np.bincount(local[tok_any] % geo.bq, minlength=geo.bq)
    by_tile = np.bincount(local[tok_any] // geo.bq)
    by_head = bad.sum(axis=0).reshape(h, g).sum(axis=0)
    print("   wrong tokens by row of tile (token % bq, row:count): "
          + " ".join(f"{i}:{c}" for i, c in enumerate(by_row) if c))
    print(f"   wrong tokens by tile of sequence: {by_tile.tolist()}")
    print(f"   wrong rows by head of the group: {by_head.tolist()}")


# -- part variants -----------------------------------------------------------------------------
def part_variants():
  import dataclasses
  import jax.numpy as jnp
  import numpy as np
  import kvjax
  from pallas_kernels.mosaic_gpu import tiles as TL
  rng = np.random.default_rng(2)
  ql, cl, g = [100, 60, 1], [0, 20, 50], 4
  spec = kvjax.KVCacheSpec(1, 128, 16, dtype=jnp.bfloat16)
  args = batch(rng, spec, ql, cl, g, pad=3)
  base = TL.choose_geometry(g, 128, 16, max(ql))
  real = sum(ql)
  runs = [("default", {}, None)]
  runs += [(f"pv={pv}", dict(pv=pv), None) for pv in TL.PV_VARIANTS if pv != TL.DEFAULT_PV]
  runs += [("causal=False", dict(causal=False), None),
           ("window=1000 (masks every step)", dict(sliding_window=1000), None),
           ("one consumer wg (bq=16)", {}, TL.TileGeometry(g, 16, 1, 128, 2, 16)),
           ("bq=8 one wg", {}, TL.TileGeometry(g, 8, 1, 128, 2, 16)),
           ("bk=64 stages=4", {}, dataclasses.replace(base, block_kv=64, stages=4)),
           ("stages=3 (bk=64)", {}, dataclasses.replace(base, block_kv=64, stages=3))]
  print(f"[variants] case: prefixes {cl}, queries {ql}, G={g}, D=128, N=16; default {base}")
  for name, kw, geo in runs:
    kw = dict(kw)
    pv = kw.pop("pv", None)
    t0 = time.time()
    try:
      o, r = run_pair(spec, args, max(ql), geometry=geo, pv=pv, **kw)
    except Exception as e:  # noqa: BLE001
      print(f"[variants] {name}: ERROR {type(e).__name__}: {str(e)[:300]}")
      continue
    bad = wrong_rows(o, r, real)
    err = float(np.abs(o[:real] - r[:real]).max())
    seq, local = seq_of_tokens(np.asarray(args[2]))
    per_seq = [int(bad[seq == s].sum()) for s in range(len(ql))]
    print(f"[variants] {name}: max err {err:.3f}, wrong rows per sequence {per_seq} -> "
          f"{'PASS' if not bad.any() else 'FAIL'} [{time.time() - t0:.1f} s]")


# -- parent ------------------------------------------------------------------------------------
def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--part", choices=sorted(PARTS))
  ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  a = ap.parse_args()
  if a.child:
    {"probe": part_probe, "rows": part_rows, "variants": part_variants}[a.part]()
    return
  t0 = time.time()
  for part, limit in PARTS.items():
    if a.part and part != a.part:
      continue
    cmd = [sys.executable, os.path.abspath(__file__), "--part", part, "--child"]
    try:
      p = subprocess.run(cmd, cwd=ROOT, timeout=limit, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
      out, status = p.stdout + p.stderr, f"exit {p.returncode}"
    except subprocess.TimeoutExpired as e:
      out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
      status = f"TIMEOUT after {limit} s"
    noise = ("WARNING", "I0", "W0")
    lines = [ln for ln in out.splitlines() if ln.strip() and not ln.startswith(noise)]
    print("\n".join(lines[-80:]), flush=True)
    print(f"== {part}: {status} ({time.time() - t0:.0f} s total)", flush=True)


if __name__ == "__main__":
  main()
