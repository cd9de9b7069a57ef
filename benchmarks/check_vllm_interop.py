"""Caches written by vLLM 0.28 read by kvjax, and the other way round (CUDA + vLLM's kernels).

    PYTHONUNBUFFERED=1 python benchmarks/check_vllm_interop.py

For each per-token-head format (and plain bf16) and both layouts, the same K/V tokens are
written twice into caches of random bytes: by kvjax (``kvjax.write_kv``, the Pallas kernel)
and by vLLM's Triton writer (through ``benchmarks/vllm_peer.py`` on the same kind of buffer).
Reported: the share of written bytes that agree, and four attention results over a ragged batch
(kvjax or vLLM reading the cache written by kvjax or by vLLM), each as relative error against
float64 attention over the original, unquantized K/V. A cache format is interoperable when the
cross errors are of the size of the same-writer errors (quantization noise).
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import kvjax  # noqa: E402
from benchmarks import vllm_peer  # noqa: E402

FORMATS = ("bfloat16", "int8_per_token_head", "fp8_per_token_head", "int4_per_token_head")
HQ, H, D, N = 8, 2, 128, 16
Q_LENS, CTX = (24, 1, 1, 1), (40, 100, 17, 63)      # a prefill on a prefix and three decodes


def dense_reference(q, k, v, q_lens, ctx, scale):
  """float64 causal attention over the original K/V; q [T, Hq, D], k/v per sequence [L, H, D]."""
  out, t0, g = [], 0, HQ // H
  for s, (ql, c) in enumerate(zip(q_lens, ctx)):
    ks, vs = np.repeat(k[s], g, 1), np.repeat(v[s], g, 1)          # [L, Hq, D]
    for i in range(ql):
      pos = c + i
      logits = np.einsum("hd,lhd->hl", q[t0 + i], ks[:pos + 1]) * scale
      p = np.exp(logits - logits.max(-1, keepdims=True))
      out.append(np.einsum("hl,lhd->hd", p / p.sum(-1, keepdims=True), vs[:pos + 1]))
    t0 += ql
  return np.stack(out)


def main():
  import torch
  import torch_bridge as tb
  if not vllm_peer.available():
    print("vLLM kernels or CUDA not available: nothing to check")
    return
  rng = np.random.default_rng(0)
  results = []
  seq_lens = [q + c for q, c in zip(Q_LENS, CTX)]
  m = max(-(-s // N) for s in seq_lens)
  num_blocks = len(seq_lens) * m + 4
  perm = rng.permutation(num_blocks)[: len(seq_lens) * m].reshape(len(seq_lens), m)
  slots = np.concatenate([perm[s, np.arange(L) // N] * N + np.arange(L) % N
                          for s, L in enumerate(seq_lens)]).astype(np.int64)
  kv = [rng.standard_normal((2, L, H, D)).astype(np.float32)
        * np.exp(rng.uniform(-1, 1, (2, L, H, 1))).astype(np.float32) for L in seq_lens]
  k_all = np.concatenate([x[0] for x in kv]).astype(jnp.bfloat16)
  v_all = np.concatenate([x[1] for x in kv]).astype(jnp.bfloat16)
  q = rng.standard_normal((sum(Q_LENS), HQ, D)).astype(jnp.bfloat16)
  scale = D ** -0.5
  want = dense_reference(q.astype(np.float64),
                         [x[0].astype(jnp.bfloat16).astype(np.float64) for x in kv],
                         [x[1].astype(jnp.bfloat16).astype(np.float64) for x in kv],
                         Q_LENS, CTX, scale)
  qsl = np.concatenate([[0], np.cumsum(Q_LENS)]).astype(np.int32)
  meta = dict(query_start_loc=jnp.asarray(qsl), seq_lens=jnp.asarray(seq_lens, jnp.int32),
              block_table=jnp.asarray(perm, jnp.int32))
  tmeta = dict(cu_seqlens_q=torch.from_dlpack(meta["query_start_loc"]),
               seqused_k=torch.from_dlpack(meta["seq_lens"]),
               block_table=torch.from_dlpack(meta["block_table"]))
  for cd in FORMATS:
    for layout in ("NHD", "HND"):
      spec = kvjax.KVCacheSpec(num_kv_heads=H, head_size=D, block_size=N, cache_dtype=cd,
                               layout=layout)
      r = {"cache_dtype": cd, "layout": layout}
      try:
        shape = spec.physical_shape(num_blocks)
        raw = rng.integers(0, 256, int(np.prod(shape)) * spec.itemsize, dtype=np.uint8)
        raw = raw.view(spec.storage_dtype).reshape(shape)
        if spec.storage_dtype.kind == "f" or spec.itemsize == 2:
          raw = np.where(np.isfinite(raw.astype(np.float32)), raw, 0).astype(spec.storage_dtype)
        ours = kvjax.write_kv(jnp.asarray(raw), jnp.asarray(k_all), jnp.asarray(v_all),
                              jnp.asarray(slots.astype(np.int32)), spec, impl="pallas")
        theirs = jnp.asarray(raw)
        theirs_t = tb.to_torch(theirs, spec)
        vllm_peer.write(spec, theirs_t, torch.from_dlpack(jnp.asarray(k_all)),
                        torch.from_dlpack(jnp.asarray(v_all)),
                        torch.from_dlpack(jnp.asarray(slots)))
        torch.cuda.synchronize()
        a = np.asarray(ours).view(np.uint8)
        b = np.asarray(theirs).view(np.uint8)
        written = a != raw.view(np.uint8)
        written |= b != raw.view(np.uint8)
        r["bytes_equal_pct"] = round(100.0 * float(np.mean(a[written] == b[written])), 3)
        errs = {}
        for writer, cache in (("kvjax", ours), ("vllm", theirs)):
          o = kvjax.unified_attention(jnp.asarray(q), cache, spec, scale=scale, impl="pallas",
                                      **meta)
          errs[f"kvjax_reads_{writer}"] = o
          run = vllm_peer.attention(spec, tb.to_torch(cache, spec), torch.from_dlpack(
              jnp.asarray(q)), max_seqlen_q=max(Q_LENS), max_seqlen_k=max(seq_lens),
              scale=scale, **tmeta)
          errs[f"vllm_reads_{writer}"] = jnp.asarray(run().float().cpu().numpy())
        for name, o in errs.items():
          o = np.asarray(jnp.asarray(o, jnp.float32), np.float64)
          r[name] = float(np.linalg.norm(o - want) / np.linalg.norm(want))
      except Exception as e:  # noqa: BLE001 - report and go on
        r["error"] = f"{type(e).__name__}: {str(e)[:400]}"
      print(json.dumps(r), flush=True)
      results.append(r)
  print("\n| format | layout | written bytes equal | kvjax reads kvjax | kvjax reads vLLM | "
        "vLLM reads kvjax | vLLM reads vLLM |")
  print("|---|---|---|---|---|---|---|")
  for r in results:
    cells = [f"{r[k]:.2e}" if k in r else "-" for k in
             ("kvjax_reads_kvjax", "kvjax_reads_vllm", "vllm_reads_kvjax", "vllm_reads_vllm")]
    print(f"| {r['cache_dtype']} | {r['layout']} | {r.get('bytes_equal_pct', r.get('error'))} | "
          + " | ".join(cells) + " |")
  out = os.environ.get("OUT")
  if out:
    with open(os.path.join(out, "vllm_interop.json"), "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
