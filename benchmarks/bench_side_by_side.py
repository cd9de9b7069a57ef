"""Side-by-side decode and prefill through kvjax's public ops, vLLM 0.28's kernels and dense peers.

GPU (H200):  PYTHONUNBUFFERED=1 python benchmarks/bench_side_by_side.py [--part decode|prefill|all]
             [--impl pallas] [--label NAME] [--json PATH]
CPU smoke:   python benchmarks/bench_side_by_side.py --smoke

Only public API is used (``kvjax.KVCacheSpec``, ``kvjax.unified_attention(..., impl=...)``), so
the same script measures an older checkout of kvjax (put it first on PYTHONPATH, give ``--label``)
against the current one in one session.

Decode: bf16 queries, Hq=32, H=8, D=128, block 16, pages shuffled, one query token per
sequence, at the five batch x context shapes; every cache format and layout. For each:
µs per step (3 steps chained in one jitted call), tokens/s relative to bf16 of the same layout,
TB/s of the format's own bytes (``batch * ctx * page_bytes / block_size``: data and scales), and
vLLM's Triton kernel on the very same cache buffer (best of its 2-D and split-KV 3-D paths)
where vLLM has that format.
Prefill: causal prefill 4x4096, 16x1024, 1x16384 and the serving mix (one 4096-token prefill
and 64 decodes at 4096) through the paged cache, TFLOP/s = 4·Hq·D·(visible query-key pairs);
rows keyed by ``problem``, times also in ``us`` (so ``tools/ab.py`` pairs them); peers: vLLM's
kernel on the same cache, torch SDPA with ``enable_gqa`` and cuDNN on dense KV.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(_HERE) not in sys.path:
  sys.path.append(os.path.dirname(_HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import kvjax  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks import prefill_peers  # noqa: E402
from benchmarks import vllm_peer  # noqa: E402

HQ, H, D, N = 32, 8, 128, 16
DECODE_SHAPES = ((64, 4096), (128, 2048), (16, 16384), (8, 32768), (256, 1024))
FORMATS = ("bfloat16", "fp8", "int8_per_token_head", "fp8_per_token_head",
           "int4_per_token_head", "nvfp4")
PREFILLS = (("4x4096", [4096] * 4, [0] * 4), ("16x1024", [1024] * 16, [0] * 16),
            ("1x16384", [16384], [0]),
            ("mix 1x4096 + 64 dec@4096", [4096] + [1] * 64, [0] + [4095] * 64))
CHAIN = 3


def _layouts(cd):
  return ("HND",) if cd == "nvfp4" else ("NHD", "HND")


def paged_problem(spec, q_lens, ctx_lens, seed=0):
  """Random cache bytes (finite), shuffled pages; returns q, cache, qsl, seq_lens, block_table."""
  rng = np.random.default_rng(seed)
  q_lens, ctx_lens = np.asarray(q_lens), np.asarray(ctx_lens)
  seq_lens = q_lens + ctx_lens
  pages = -(-seq_lens // spec.block_size)
  b = int(pages.sum()) + 8
  m = int(pages.max())
  perm = rng.permutation(b)
  bt = np.zeros((len(q_lens), m), np.int32)
  used = 0
  for s, p in enumerate(pages):
    bt[s, :p] = perm[used:used + p]
    used += p
  shape = spec.physical_shape(b)
  key = jax.random.PRNGKey(seed)
  if spec.storage_dtype.itemsize >= 2 or spec.storage_dtype.kind == "f":
    cache = (jax.random.normal(key, shape, jnp.float32) * 0.5).astype(spec.storage_dtype)
  else:   # byte formats: random small codes, scales ~1e-2 are not needed for timing
    cache = jax.random.randint(key, shape, 0, 64, jnp.int32).astype(spec.storage_dtype)
  t = int(q_lens.sum())
  q = jax.random.normal(jax.random.PRNGKey(seed + 1), (t, HQ * spec.num_kv_heads // H,
                                                     spec.head_size), jnp.bfloat16)
  qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  return q, cache, jnp.asarray(qsl), jnp.asarray(seq_lens, jnp.int32), jnp.asarray(bt)


def _tensor_scale(cd):
  return 1.0 if cd.startswith("fp8") and not cd.endswith("per_token_head") or cd == "nvfp4" \
      else None


def kvjax_step(spec, impl, max_query_len, interpret):
  ks = _tensor_scale(spec.cache_dtype)

  def step(q, cache, qsl, sl, bt):
    return kvjax.unified_attention(q, cache, spec, query_start_loc=qsl, seq_lens=sl,
                                   block_table=bt, scale=spec.head_size ** -0.5, k_scale=ks,
                                   v_scale=ks, max_query_len=max_query_len, impl=impl,
                                   interpret=interpret)
  return step


def time_kvjax_decode(spec, batch, ctx, impl, interpret, chain):
  q, cache, qsl, sl, bt = paged_problem(spec, [1] * batch, [ctx - 1] * batch)
  step = kvjax_step(spec, impl, 1, interpret)
  ms = common.time_jax_chained(lambda x, *r: step(x, *r), q, cache, qsl, sl, bt, chain=chain,
                               reps=3 if interpret else 5, inner=1 if interpret else 5)
  return ms, (q, cache, qsl, sl, bt)


def time_vllm(spec, problem, max_q, max_k):
  import torch
  import torch_bridge as tb
  q, cache, qsl, sl, bt = problem
  qt = torch.from_dlpack(q)
  cache_t = tb.to_torch(cache, spec)
  meta = dict(cu_seqlens_q=torch.from_dlpack(qsl), seqused_k=torch.from_dlpack(sl),
              block_table=torch.from_dlpack(bt))
  ks = _tensor_scale(spec.cache_dtype)
  best = None
  for use_3d in ((False, True) if max_q == 1 else (False,)):
    fn = vllm_peer.attention(spec, cache_t, qt, max_seqlen_q=max_q, max_seqlen_k=max_k,
                             scale=spec.head_size ** -0.5, k_scale=ks, v_scale=ks,
                             use_3d=use_3d, **meta)
    ms = common.time_torch(fn)
    best = ms if best is None else min(best, ms)
  return best


def record_decode(r, spec, batch, ctx, ms, problem, base, use_vllm):
  """Fill a decode row ``r``: µs, TB/s of the format's own bytes, tokens/s (relative to the
  bf16 row of the same layout, kept in ``base``), and vLLM's kernel on the same ``problem``
  where it has the format."""
  nbytes = batch * ctx * spec.page_bytes / spec.block_size
  r.update(us=round(ms * 1e3, 1), tb_per_s=round(nbytes / (ms * 1e-3) / 1e12, 3),
           tokens_per_s=round(batch / (ms * 1e-3)))
  if spec.cache_dtype == "bfloat16":
    base[spec.layout] = r["tokens_per_s"]
  if spec.layout in base:
    r["x_bf16"] = round(r["tokens_per_s"] / base[spec.layout], 3)
  if use_vllm and vllm_peer.supports(spec):
    try:
      r["vllm_us"] = round(time_vllm(spec, problem, 1, ctx) * 1e3, 1)
    except Exception as e:  # noqa: BLE001 - reported in the row
      r["vllm_error"] = f"{type(e).__name__}: {str(e)[:200]}"
  return r


def _only(formats, wanted):
  """``formats`` in order, only those in ``wanted`` (None: all)."""
  return tuple(f for f in formats if wanted is None or f in wanted)


def decode_part(args, interpret):
  shapes = ((4, 64),) if args.smoke else args.decode_shapes or DECODE_SHAPES
  geo = dict(num_kv_heads=2, head_size=64, block_size=16) if args.smoke else dict(
      num_kv_heads=H, head_size=D, block_size=N)
  formats = ("bfloat16", "int8_per_token_head") if args.smoke else _only(FORMATS, args.formats)
  rows = []
  use_vllm = vllm_peer.available() and not args.no_vllm
  for batch, ctx in shapes:
    base = {}
    for cd in formats:
      for layout in _layouts(cd):
        spec = kvjax.KVCacheSpec(cache_dtype=cd, layout=layout, **geo)
        r = {"part": "decode", "label": args.label, "cache_dtype": cd, "layout": layout,
             "batch": batch, "context": ctx}
        try:
          ms, problem = time_kvjax_decode(spec, batch, ctx, args.impl, interpret,
                                          1 if interpret else CHAIN)
        except Exception as e:  # noqa: BLE001 - report and go on
          print(f"  {cd} {layout} {batch}x{ctx}: FAILED {type(e).__name__}: {str(e)[:400]}",
                flush=True)
          continue
        record_decode(r, spec, batch, ctx, ms, problem, base, use_vllm)
        del problem
        print(f"  decode {cd:20s} {layout} {batch:4d}x{ctx:<6d} {r['us']:9.1f} us "
              f"{r['tb_per_s']:6.3f} TB/s x_bf16={r.get('x_bf16', '-')} "
              f"vllm={r.get('vllm_us', r.get('vllm_error', '-'))}", flush=True)
        rows.append(r)
  return rows


#: Keys of the dense peers' times in a prefill row (``prefill_peers.DENSE_PEERS`` names).
_PEER_KEYS = {"cuDNN via JAX (dense)": "cudnn", "torch SDPA GQA (dense)": "sdpa"}


def time_dense_peers(q_lens, ctx_lens, interpret):
  """torch SDPA (enable_gqa) and cuDNN via JAX on dense KV (``prefill_peers.dense_peers``) for
  equal-length causal prefills: ``{"sdpa_ms", "cudnn_ms"}`` or ``*_error``; empty elsewhere."""
  out = {}
  if interpret or len(set(q_lens)) != 1 or any(ctx_lens):
    return out
  for name, thunk in prefill_peers.dense_peers(len(q_lens), q_lens[0],
                                               dict(reps=5, inner=5, warmup=2)):
    if name in _PEER_KEYS:
      row = prefill_peers.measure(thunk)
      key = _PEER_KEYS[name]
      if "ms" in row:
        out[f"{key}_ms"] = row["ms"]
      else:
        out[f"{key}_error"] = row.get("error") or row["skipped"]
  return out


def prefill_part(args, interpret):
  cases = (("2x64", [64, 64], [0, 0]), ("mix", [32, 1, 1], [0, 40, 70])) if args.smoke \
      else [c for c in PREFILLS if not args.prefill_cases or c[0] in args.prefill_cases]
  geo = dict(num_kv_heads=2, head_size=64, block_size=16) if args.smoke else dict(
      num_kv_heads=H, head_size=D, block_size=N)
  formats = ("bfloat16",) if args.smoke else _only(
      ("bfloat16", "fp8", "int8_per_token_head", "fp8_per_token_head"), args.formats)
  rows = []
  use_vllm = vllm_peer.available() and not args.no_vllm
  for name, q_lens, ctx_lens in cases:
    flops = prefill_peers.attention_flops(q_lens, ctx_lens, hq=HQ * geo["num_kv_heads"] // H,
                                          d=geo["head_size"])
    peers = time_dense_peers(q_lens, ctx_lens, interpret)
    for cd in formats:
      for layout in ("NHD", "HND") if cd == "bfloat16" else ("NHD",):
        spec = kvjax.KVCacheSpec(cache_dtype=cd, layout=layout, **geo)
        problem = paged_problem(spec, q_lens, ctx_lens)
        mql = max(q_lens)
        f = jax.jit(kvjax_step(spec, args.impl, mql, interpret))
        r = {"part": "prefill", "label": args.label, "problem": name, "cache_dtype": cd,
             "layout": layout, "gflop": round(flops / 1e9, 2)}
        try:
          ms = common.time_jax(f, *problem, reps=3 if interpret else 5,
                               inner=1 if interpret else 5)
          r.update(ms=round(ms, 4), us=round(ms * 1e3, 1),
                   tflops=round(flops / (ms * 1e-3) / 1e12, 1))
        except Exception as e:  # noqa: BLE001
          r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if use_vllm and vllm_peer.supports(spec):
          try:
            vms = time_vllm(spec, problem, mql, max(q + c for q, c in zip(q_lens, ctx_lens)))
            r["vllm_tflops"] = round(flops / (vms * 1e-3) / 1e12, 1)
          except Exception as e:  # noqa: BLE001
            r["vllm_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        if cd == "bfloat16" and layout == "NHD":
          for k in ("sdpa_ms", "cudnn_ms"):
            if k in peers:
              r[k.replace("_ms", "_tflops")] = round(flops / (peers[k] * 1e-3) / 1e12, 1)
        del problem
        print(f"  prefill {name:26s} {cd:20s} {layout} {r.get('tflops', r.get('error'))} "
              f"TFLOP/s vllm={r.get('vllm_tflops', r.get('vllm_error', '-'))} "
              f"sdpa={r.get('sdpa_tflops', '-')} cudnn={r.get('cudnn_tflops', '-')}", flush=True)
        rows.append(r)
  return rows


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--smoke", action="store_true", help="tiny CPU run (Pallas interpret mode)")
  ap.add_argument("--part", choices=("decode", "prefill", "all"), default="all")
  ap.add_argument("--impl", default="pallas", help="kvjax implementation to time")
  ap.add_argument("--label", default="current", help="name of this kvjax checkout in the JSON")
  ap.add_argument("--no-vllm", action="store_true")
  ap.add_argument("--json", default=None, help="write the rows here (default "
                  "$OUT/side_by_side_<label>_<part>.json when $OUT is set)")
  ap.add_argument("--formats", type=lambda s: s.split(","), default=None,
                  help="comma list of cache dtypes (default: every one of the part)")
  ap.add_argument("--decode-shapes", default=None,
                  type=lambda s: tuple(tuple(int(x) for x in bc.split("x")) for bc in s.split(",")),
                  help="BxC,... (default: the five decode shapes)")
  ap.add_argument("--prefill-cases", type=lambda s: s.split(","), default=None,
                  help=f"comma list among {[c[0] for c in PREFILLS]} (default: all)")
  args = ap.parse_args()
  if args.smoke:
    common.announce_smoke(jax.default_backend())
  interpret = args.smoke or jax.default_backend() == "cpu"
  info = {"device": common.device_name(), "date": common.now_utc(),
          "versions": common.versions(), "command": common.command_line(),
          "kvjax": os.path.dirname(os.path.abspath(kvjax.__file__)), "label": args.label,
          "vllm": vllm_peer.available()}
  print(json.dumps(info), flush=True)
  rows = []
  if args.part in ("decode", "all"):
    rows += decode_part(args, interpret)
  if args.part in ("prefill", "all"):
    rows += prefill_part(args, interpret)
  out = common.output_path(args.json, f"side_by_side_{args.label}_{args.part}.json")
  if out:
    with open(out, "w") as f:
      json.dump(dict(info, rows=rows), f, indent=1)
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
  common.exit_after(main)
