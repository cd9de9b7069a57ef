"""kvjax quick start: a packed paged KV cache, ragged attention, and torch on the same bytes.

Run:  python examples/quickstart.py [--layout NHD|HND] [--cache-dtype auto|fp8|nvfp4|...]

What it does (a serving step in miniature):
  1. describes the cache with a KVCacheSpec and allocates it (the *physical* array is the value),
  2. writes the history of four sequences, then one step's new tokens, by slot mapping,
  3. runs kvjax.unified_attention over a ragged batch (one prefill with a cached
     prefix + three decodes) and checks it against kvjax.reference and against plain
     attention over the original, un-paged K/V,
  4. hands the cache to PyTorch zero-copy (torch_bridge.to_torch) when torch is installed,
  5. prints a short report: every error next to the tolerance it is judged by and its
     verdict, then OK (exit 0) or MISMATCH (exit 1).
On CPU it finishes in seconds (impl="auto" runs the compiled XLA implementation there;
``--impl pallas`` runs the Pallas kernels in interpret mode). On a GPU, impl="auto" runs the
Pallas kernels. The report names what ran (``kvjax.explain``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

try:
  import kvjax  # noqa: F401  (installed: pip install -e .)
except ImportError:  # run from a plain checkout
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

import kvjax

# The ragged batch: (cached prefix tokens, new query tokens) per sequence.
PREFILL = (40, 24)          # a prefill whose first 40 tokens are already cached
DECODES = ((16, 1), (49, 1), (32, 1))
PAD_TOKENS = 5              # step padding (slot -1, query rows past query_start_loc[-1])

# Largest max |output - plain attention over the original, un-paged K/V| accepted per cache
# dtype: bf16 rounding for plain caches, quantization error for the others (the default data
# stays under half of each over seeds 0-5).
DENSE_TOLERANCE = {"auto": 2e-2, "bfloat16": 2e-2, "float16": 2e-2, "float32": 2e-2,
                   "int8_per_token_head": 5e-2, "fp8_per_token_head": 0.15, "fp8": 0.25,
                   "fp8_e4m3": 0.25, "fp8_e5m2": 0.5, "int4_per_token_head": 0.6, "nvfp4": 0.6}
# The Pallas kernels against the reference on the same cache: both read the same codes, so only
# bf16 rounding of the output differs (relative to the output's size when it exceeds 1).
KERNEL_TOLERANCE = 2e-2


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--layout", default=None, choices=kvjax.LAYOUTS,
                 help="default NHD, and HND for nvfp4 (the only layout nvfp4 has)")
  p.add_argument("--cache-dtype", default="auto", choices=sorted(kvjax.CACHE_FORMATS))
  p.add_argument("--impl", default="auto", choices=("auto", "pallas", "reference"),
                 help="write/attention implementation (auto: the registry's choice, "
                      "kvjax.explain: Pallas kernels on a GPU, XLA on CPU)")
  p.add_argument("--num-kv-heads", type=int, default=2)
  p.add_argument("--num-q-heads", type=int, default=8)
  p.add_argument("--head-size", type=int, default=64)
  p.add_argument("--block-size", type=int, default=16)
  p.add_argument("--num-blocks", type=int, default=32)
  p.add_argument("--repeats", type=int, default=5, help="timed runs after the first")
  p.add_argument("--seed", type=int, default=0)
  return p.parse_args(argv)


def verdict(ok: bool) -> str:
  return "ok" if ok else "TOO LARGE"


def step(i, total, msg):
  print(f"[{i}/{total}] {msg}", flush=True)


def timed(fn, repeats):
  """(first call ms incl. compile, median ms of ``repeats`` more calls, last result)."""
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn())
  first = (time.perf_counter() - t0) * 1e3
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    times.append((time.perf_counter() - t0) * 1e3)
  return first, statistics.median(times) if times else float("nan"), out


def build_batch(spec: kvjax.KVCacheSpec, num_blocks: int, rng):
  """Sequences, a shuffled block table, and slot mappings for the history and the step.

  Returns a dict of numpy arrays: block_table int32 [S, M], seq_lens int32 [S],
  query_start_loc int32 [S+1], history_slots int32 [Th], step_slots int32 [T + pad],
  plus per-sequence (prefix, new) lengths.
  """
  seqs = (PREFILL,) + DECODES
  n = spec.block_size
  lens = [p + q for p, q in seqs]
  max_blocks = max(-(-l // n) for l in lens)
  need = sum(-(-l // n) for l in lens)
  if need > num_blocks:
    raise ValueError(f"--num-blocks {num_blocks} is too small: the batch needs {need} blocks")
  free = rng.permutation(num_blocks)          # pages are handed out in any order
  block_table = np.zeros((len(seqs), max_blocks), np.int32)
  used = 0
  for s, l in enumerate(lens):
    k = -(-l // n)
    block_table[s, :k] = free[used:used + k]
    used += k

  def slots(s, positions):
    positions = np.asarray(positions)
    return block_table[s, positions // n] * n + positions % n

  history = np.concatenate([slots(s, np.arange(p)) for s, (p, _) in enumerate(seqs)])
  new = np.concatenate([slots(s, np.arange(p, p + q)) for s, (p, q) in enumerate(seqs)])
  step_slots = np.concatenate([new, -np.ones(PAD_TOKENS, np.int64)])
  q_lens = [q for _, q in seqs]
  return dict(seqs=seqs, block_table=block_table, seq_lens=np.asarray(lens, np.int32),
              query_start_loc=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
              history_slots=history.astype(np.int32), step_slots=step_slots.astype(np.int32))


def dense_attention(q, k_hist, v_hist, k_new, v_new, batch, scale, num_kv_heads):
  """Plain causal attention over the original (un-paged, unquantized) K/V, float64 numpy.

  q: [T, Hq, D]; k_hist/v_hist: [Th, H, D] in history order; k_new/v_new: [T, H, D].
  """
  q = np.asarray(q, np.float64)
  out = np.zeros_like(q)
  g = q.shape[1] // num_kv_heads
  h0 = n0 = 0
  for s, (p, qn) in enumerate(batch["seqs"]):
    k = np.concatenate([k_hist[h0:h0 + p], k_new[n0:n0 + qn]]).astype(np.float64)
    v = np.concatenate([v_hist[h0:h0 + p], v_new[n0:n0 + qn]]).astype(np.float64)
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)       # GQA: [L, Hq, D]
    for i in range(qn):
      pos = p + i
      sc = np.einsum("hd,lhd->hl", q[n0 + i], k[:pos + 1]) * scale
      w = np.exp(sc - sc.max(-1, keepdims=True))
      w /= w.sum(-1, keepdims=True)
      out[n0 + i] = np.einsum("hl,lhd->hd", w, v[:pos + 1])
    h0, n0 = h0 + p, n0 + qn
  return out


def torch_step(cache, spec):
  """Hand the cache to torch zero-copy; returns a dict for the report, or None if skipped."""
  try:
    import torch
    from torch_bridge import to_torch
  except ImportError as e:
    print(f"      torch step skipped: {e}", flush=True)
    return None
  t = to_torch(cache, spec)          # vLLM's logical (B, H, N, C) view over JAX's buffer
  same = t.data_ptr() == cache.unsafe_buffer_pointer()
  t_phys = t.permute(*spec.stride_order())   # physical order: contiguous, the same bytes
  t_bytes = t_phys.contiguous().view(torch.uint8).cpu().numpy().ravel()
  j_bytes = np.asarray(cache).view(np.uint8).ravel()
  return dict(shape=tuple(t.shape), stride=tuple(t.stride()), dtype=str(t.dtype),
              device=str(t.device), same_pointer=same, contiguous=t_phys.is_contiguous(),
              bytes_equal=bool(np.array_equal(t_bytes, j_bytes)))


def main(argv=None):
  args = parse_args(argv)
  if args.layout is None:
    args.layout = "HND" if args.cache_dtype == "nvfp4" else "NHD"
  total = 5
  rng = np.random.default_rng(args.seed)
  backend = jax.default_backend()
  device = jax.devices()[0]

  step(1, total, "spec and allocation")
  spec = kvjax.KVCacheSpec(num_kv_heads=args.num_kv_heads, head_size=args.head_size,
                           block_size=args.block_size, cache_dtype=args.cache_dtype,
                           layout=args.layout, dtype=jnp.bfloat16)
  cache = spec.allocate(args.num_blocks)
  print(f"      {spec}", flush=True)
  print(f"      physical {spec.physical_shape(args.num_blocks)} {spec.storage_dtype}, logical "
        f"{spec.logical_shape(args.num_blocks)}, stride order {spec.stride_order()}", flush=True)

  step(2, total, "write history and this step's K/V by slot mapping")
  batch = build_batch(spec, args.num_blocks, rng)
  h, d = spec.num_kv_heads, spec.head_size
  # Random bf16 K/V [T, H, D]: the history (prefixes) and this step's new tokens + padding.
  mk = lambda t: jnp.asarray(rng.standard_normal((t, h, d)).astype(np.float32)).astype(jnp.bfloat16)
  k_hist, v_hist = mk(len(batch["history_slots"])), mk(len(batch["history_slots"]))
  k_new, v_new = mk(len(batch["step_slots"])), mk(len(batch["step_slots"]))   # tail = padding
  scales = {}
  if spec.format.has_tensor_scales:   # global scales of fp8 per-tensor and nvfp4 caches
    gs = jnp.float32(1 / 64 if spec.cache_dtype == "nvfp4" else 0.05)
    scales = dict(k_scale=gs, v_scale=gs)
  # Scales travel as jit arguments (traced values), the spec as a closed-over static.
  write = jax.jit(lambda c, k, v, s, sc: kvjax.write_kv(c, k, v, s, spec, impl=args.impl, **sc),
                  donate_argnums=0)
  cache = write(cache, k_hist, v_hist, jnp.asarray(batch["history_slots"]), scales)
  state = {"cache": cache}

  def write_step():
    state["cache"] = write(state["cache"], k_new, v_new, jnp.asarray(batch["step_slots"]), scales)
    return state["cache"]
  w_first, w_ms, cache = timed(write_step, args.repeats)   # rewriting the same slots is idempotent

  step(3, total, "unified attention, ragged batch (1 prefill with cached prefix + 3 decodes)")
  num_q = int(batch["query_start_loc"][-1])
  q = jnp.asarray(rng.standard_normal((num_q + PAD_TOKENS, args.num_q_heads, d))
                  .astype(np.float32)).astype(jnp.bfloat16)
  meta = dict(query_start_loc=jnp.asarray(batch["query_start_loc"]),
              seq_lens=jnp.asarray(batch["seq_lens"]),
              block_table=jnp.asarray(batch["block_table"]))
  sm_scale = d ** -0.5
  max_q = max(qn for _, qn in batch["seqs"])
  attend = jax.jit(lambda q, c, m, sc: kvjax.unified_attention(
      q, c, spec, scale=sm_scale, max_query_len=max_q, impl=args.impl, **m, **sc))
  a_first, a_ms, out = timed(lambda: attend(q, cache, meta, scales), args.repeats)
  ref = kvjax.unified_attention(q, cache, spec, scale=sm_scale, impl="reference", **meta,
                              **scales)
  out32 = np.asarray(out.astype(jnp.float32))
  call = kvjax.registry.AttentionCall(num_tokens=q.shape[0], num_q_heads=q.shape[1],
                                     num_seqs=len(batch["seqs"]),
                                     max_blocks=meta["block_table"].shape[1], max_query_len=max_q)
  ran = {"write": kvjax.explain("write", spec, impl=args.impl),
         "attention": kvjax.explain("attention", spec, q.dtype, impl=args.impl, call=call)}
  checked, checked_impl = out32, ran["attention"]
  if checked_impl.name == "reference":
    # The reference compared with itself says nothing: check the Pallas kernels instead
    # (interpret mode on CPU).
    checked_impl = kvjax.explain("attention", spec, q.dtype, impl="pallas", call=call)
    checked = np.asarray(kvjax.unified_attention(
        q, cache, spec, scale=sm_scale, max_query_len=max_q, impl="pallas", **meta,
        **scales).astype(jnp.float32))
  err_ref = float(np.max(np.abs(checked - np.asarray(ref.astype(jnp.float32)))))
  dense = dense_attention(np.asarray(q[:num_q].astype(jnp.float32)),
                          np.asarray(k_hist.astype(jnp.float32)),
                          np.asarray(v_hist.astype(jnp.float32)),
                          np.asarray(k_new.astype(jnp.float32)),
                          np.asarray(v_new.astype(jnp.float32)), batch, sm_scale, h)
  err_dense = float(np.max(np.abs(out32[:num_q] - dense)))
  pad_zero = bool(np.all(out32[num_q:] == 0))
  tol_ref = KERNEL_TOLERANCE * max(1.0, float(np.max(np.abs(out32))))
  tol_dense = DENSE_TOLERANCE.get(spec.cache_dtype, 0.6)
  ok_ref, ok_dense = err_ref <= tol_ref, err_dense <= tol_dense

  step(4, total, "hand the cache to PyTorch (zero-copy)")
  tinfo = torch_step(cache, spec)

  step(5, total, "report")
  mode = lambda c: f"{c.name} ({c.mode})"
  rows = [
      ("backend / device", f"{backend} / {device.device_kind}"),
      ("impl", f"write: {mode(ran['write'])}; attention: {mode(ran['attention'])} "
               f"(requested {args.impl})"),
      ("cache", f"{spec.cache_dtype}, layout {spec.layout}, H={h} D={d} N={spec.block_size}"),
      ("physical shape", f"{tuple(cache.shape)} {cache.dtype}"),
      ("page bytes", f"{spec.page_bytes:,}"),
      ("batch", f"{len(batch['seqs'])} seqs, seq_lens {batch['seq_lens'].tolist()}, "
                f"{num_q} query tokens + {PAD_TOKENS} padding"),
      ("output", f"{tuple(out.shape)} {out.dtype}"),
      ("attention vs reference",
       f"{err_ref:.3e} max abs error of {mode(checked_impl)}, tolerance {tol_ref:.2g}: "
       f"{verdict(ok_ref)}"),
      ("max error vs dense attention",
       f"{err_dense:.3e} vs plain attention over the original K/V, tolerance {tol_dense:.2g} "
       f"({'quantization error' if spec.format.is_quantized else 'bf16 rounding'}): "
       f"{verdict(ok_dense)}"),
      ("padding rows zero", "yes" if pad_zero else "NO"),
      ("write_kv ms", f"first {w_first:.1f} (compile), then {w_ms:.3f}"),
      ("attention ms", f"first {a_first:.1f} (compile), then {a_ms:.3f}"),
  ]
  if tinfo is None:
    rows.append(("torch", "skipped (torch or torch_bridge not importable)"))
  else:
    rows += [("torch tensor", f"{tinfo['shape']} {tinfo['dtype']} stride {tinfo['stride']} "
                              f"on {tinfo['device']} (logical view; physical order contiguous: "
                              f"{'yes' if tinfo['contiguous'] else 'NO'})"),
             ("pointer shared", "yes" if tinfo["same_pointer"] else "no (copied)"),
             ("torch bytes equal", "yes" if tinfo["bytes_equal"] else "NO")]
  width = max(len(k) for k, _ in rows)
  print("kvjax quickstart report")
  for k, v in rows:
    print(f"  {k:<{width}} : {v}")
  ok = pad_zero and ok_ref and ok_dense and (tinfo is None or tinfo["bytes_equal"])
  print("OK" if ok else "MISMATCH")
  return 0 if ok else 1


if __name__ == "__main__":
  raise SystemExit(main())
