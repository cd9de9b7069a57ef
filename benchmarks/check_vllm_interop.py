"""Caches written by vLLM 0.28 read by kvjax, and the other way round (CUDA + vLLM's kernels).

    PYTHONUNBUFFERED=1 python benchmarks/check_vllm_interop.py

For each per-token-head format (and plain bf16) and both layouts, the same K/V tokens are
written twice into caches of random bytes: by kvjax (``kvjax.write_kv``, the Pallas kernel)
and by vLLM's Triton writer (through ``benchmarks/vllm_peer.py`` on the same kind of buffer).
Reported: the share of written bytes that agree, and four attention results over a ragged batch
(kvjax or vLLM reading the cache written by kvjax or by vLLM), each as relative error against
float64 attention over the original, unquantized K/V. A cache format is interoperable when the
cross errors are of the size of the same-writer errors (quantization noise).

Per-token-head rows also get where their bytes differ (docs/layout.md §5, "Byte agreement"):
data and scale bytes apart, the largest code difference, and for int8 the share of differing
codes that sit on a rounding tie of ``x * 127 / amax``. int4 rows (bf16 and float16 models)
also report how many rotated elements vLLM's GPU Hadamard transform and kvjax's float32
butterfly agree on, the bytes of vLLM's quantizer alone fed kvjax's rotated rows, and
``kvjax.read_kv`` of either cache against the original K/V.
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

#: (cache_dtype, model dtype): every format in bf16, int4 also in float16 (vLLM's GPU
#: Hadamard rounds a float16 row to bfloat16 before rotating it).
CASES = (("bfloat16", jnp.bfloat16), ("int8_per_token_head", jnp.bfloat16),
         ("fp8_per_token_head", jnp.bfloat16), ("int4_per_token_head", jnp.bfloat16),
         ("int4_per_token_head", jnp.float16))
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


def _pct(x) -> float:
  return round(100.0 * float(np.mean(x)), 3) if np.size(x) else 100.0


def _rel(got, want) -> float:
  got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _codes(data, spec):
  """Stored data ``[T, H, data_dim]`` -> integer codes ``[T, H, D]`` (int4: nibbles; int8:
  the signed bytes; other formats: the bytes)."""
  data = np.asarray(data)
  if spec.format.quant == "int4":
    return np.stack([data & 0xF, data >> 4], -1).reshape(data.shape[:-1] + (-1,)).astype(int)
  if spec.format.quant == np.dtype(np.int8):
    return data.view(np.int8).astype(int)
  return data.view(np.uint8).astype(int)


def row_agreement(spec, ours, theirs, slots, key, value):
  """Where two per-token-head caches written from the same ``key``/``value`` ``[T, H, D]`` at
  ``slots`` differ: data and scale bytes, codes, and (int8) how many differing codes sit on a
  rounding tie. Runs on any device (numpy on the host)."""
  n = spec.block_size
  blk, off = np.asarray(slots) // n, np.asarray(slots) % n
  side = {}
  for name, cache in (("ours", ours), ("theirs", theirs)):
    data = [np.asarray(x)[blk, off] for x in kvjax.kv_views(cache, spec)]
    scales = [np.asarray(x)[blk, off].view(np.uint32) for x in kvjax.kv_scale_views(cache, spec)]
    side[name] = (data, scales)
  r = {}
  for i, (label, x) in enumerate((("k", key), ("v", value))):
    d_ours, d_theirs = side["ours"][0][i], side["theirs"][0][i]
    s_ours, s_theirs = side["ours"][1][i], side["theirs"][1][i]
    r[f"{label}_data_bytes_equal_pct"] = _pct(d_ours.view(np.uint8) == d_theirs.view(np.uint8))
    r[f"{label}_scales_equal_pct"] = _pct(s_ours == s_theirs)
    c_ours, c_theirs = _codes(d_ours, spec), _codes(d_theirs, spec)
    diff = c_ours != c_theirs
    r[f"{label}_codes_differing"] = int(diff.sum())
    r[f"{label}_max_code_step"] = int(np.abs(c_ours - c_theirs).max()) if diff.any() else 0
    if spec.format.quant == "int4":
      r[f"{label}_zero_points_equal_pct"] = _pct((s_ours & 0xF) == (s_theirs & 0xF))
    if spec.format.quant == np.dtype(np.int8) and diff.any():
      x64 = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
      y = x64 * 127 / np.abs(x64).max(-1, keepdims=True)
      tie = np.abs(np.abs(y) % 1 - 0.5) < 1e-9
      r[f"{label}_differing_codes_on_ties_pct"] = _pct(tie[diff])
  return r


def rotation_agreement(key_t, key):
  """Share of rotated elements on which vLLM's GPU rotation and kvjax's agree bit for bit."""
  theirs = vllm_peer.int4_rotate(key_t).float().cpu().numpy()
  ours = np.asarray(kvjax.get_format("int4_per_token_head").codec.rotation.rotate(key),
                    np.float32)
  return _pct(theirs.view(np.uint32) == ours.view(np.uint32))


def _written_bytes_equal(ours, theirs, raw):
  a, b = np.asarray(ours).view(np.uint8), np.asarray(theirs).view(np.uint8)
  written = (a != raw.view(np.uint8)) | (b != raw.view(np.uint8))
  return _pct(a[written] == b[written])


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
  q32 = rng.standard_normal((sum(Q_LENS), HQ, D)).astype(np.float32)
  scale = D ** -0.5
  qsl = np.concatenate([[0], np.cumsum(Q_LENS)]).astype(np.int32)
  meta = dict(query_start_loc=jnp.asarray(qsl), seq_lens=jnp.asarray(seq_lens, jnp.int32),
              block_table=jnp.asarray(perm, jnp.int32))
  tmeta = dict(cu_seqlens_q=torch.from_dlpack(meta["query_start_loc"]),
               seqused_k=torch.from_dlpack(meta["seq_lens"]),
               block_table=torch.from_dlpack(meta["block_table"]))
  jslots = jnp.asarray(slots.astype(np.int32))
  for cd, dtype in CASES:
    k_all = jnp.asarray(np.concatenate([x[0] for x in kv])).astype(dtype)
    v_all = jnp.asarray(np.concatenate([x[1] for x in kv])).astype(dtype)
    q = jnp.asarray(q32).astype(dtype)
    want = dense_reference(np.asarray(q, np.float64),
                           [np.asarray(jnp.asarray(x[0]).astype(dtype), np.float64) for x in kv],
                           [np.asarray(jnp.asarray(x[1]).astype(dtype), np.float64) for x in kv],
                           Q_LENS, CTX, scale)
    k_t, v_t = torch.from_dlpack(k_all), torch.from_dlpack(v_all)
    s_t = torch.from_dlpack(jnp.asarray(slots))
    for layout in ("NHD", "HND"):
      spec = kvjax.KVCacheSpec(num_kv_heads=H, head_size=D, block_size=N, cache_dtype=cd,
                               layout=layout, dtype=dtype)
      r = {"cache_dtype": cd, "dtype": np.dtype(dtype).name, "layout": layout}
      try:
        shape = spec.physical_shape(num_blocks)
        raw = rng.integers(0, 256, int(np.prod(shape)) * spec.itemsize, dtype=np.uint8)
        raw = raw.view(spec.storage_dtype).reshape(shape)
        if spec.storage_dtype.kind == "f" or spec.itemsize == 2:
          raw = np.where(np.isfinite(raw.astype(np.float32)), raw, 0).astype(spec.storage_dtype)
        ours = kvjax.write_kv(jnp.asarray(raw), k_all, v_all, jslots, spec, impl="pallas")
        theirs = jnp.asarray(raw)
        vllm_peer.write(spec, tb.to_torch(theirs, spec), k_t, v_t, s_t)
        torch.cuda.synchronize()
        r["bytes_equal_pct"] = _written_bytes_equal(ours, theirs, raw)
        if spec.codec.has_row_scales:
          r.update(row_agreement(spec, ours, theirs, slots, k_all, v_all))
        if spec.format.quant == "int4":
          r["rotation_equal_pct"] = rotation_agreement(k_t, k_all)
          rotated = spec.codec.rotation.rotate
          quantizer_only = jnp.asarray(raw)
          vllm_peer.write_int4_rotated(spec, tb.to_torch(quantizer_only, spec),
                                       torch.from_dlpack(rotated(k_all)),
                                       torch.from_dlpack(rotated(v_all)), s_t)
          torch.cuda.synchronize()
          r["vllm_quantizer_on_kvjax_rotation_bytes_equal_pct"] = _written_bytes_equal(
              ours, quantizer_only, raw)
          r.update({f"quantizer_only_{k}": x for k, x in row_agreement(
              spec, ours, quantizer_only, slots, rotated(k_all), rotated(v_all)).items()
              if "equal" in k})
          for writer, cache in (("kvjax", ours), ("vllm", theirs)):
            k_back, v_back = kvjax.read_kv(cache, spec, jslots)
            r[f"read_kv_of_{writer}_rel_err"] = _rel(
                jnp.concatenate([k_back, v_back]),
                np.asarray(jnp.concatenate([k_all, v_all]), np.float64))
        errs = {}
        for writer, cache in (("kvjax", ours), ("vllm", theirs)):
          o = kvjax.unified_attention(q, cache, spec, scale=scale, impl="pallas", **meta)
          errs[f"kvjax_reads_{writer}"] = o
          run = vllm_peer.attention(spec, tb.to_torch(cache, spec), torch.from_dlpack(q),
                                    max_seqlen_q=max(Q_LENS), max_seqlen_k=max(seq_lens),
                                    scale=scale, **tmeta)
          errs[f"vllm_reads_{writer}"] = jnp.asarray(run().float().cpu().numpy())
        for name, o in errs.items():
          r[name] = _rel(o, want)
      except Exception as e:  # noqa: BLE001 - report and go on
        r["error"] = f"{type(e).__name__}: {str(e)[:400]}"
      print(json.dumps(r), flush=True)
      results.append(r)
  print("\n| format | model | layout | written bytes equal | kvjax reads kvjax | kvjax reads vLLM "
        "| vLLM reads kvjax | vLLM reads vLLM |")
  print("|---|---|---|---|---|---|---|---|")
  for r in results:
    cells = [f"{r[k]:.2e}" if k in r else "-" for k in
             ("kvjax_reads_kvjax", "kvjax_reads_vllm", "vllm_reads_kvjax", "vllm_reads_vllm")]
    print(f"| {r['cache_dtype']} | {r['dtype']} | {r['layout']} | "
          f"{r.get('bytes_equal_pct', r.get('error'))} | " + " | ".join(cells) + " |")
  out = os.environ.get("OUT")
  if out:
    with open(os.path.join(out, "vllm_interop.json"), "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
