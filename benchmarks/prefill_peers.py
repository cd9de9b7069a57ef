"""Shared pieces of the prefill benchmarks (``bench_prefill.py``, ``bench_side_by_side.py``).

Problems (ragged batches over a paged cache with shuffled pages), their FLOP count, jitted
kvjax calls, the name of what ``impl="auto"`` picks, and the dense peers (JAX's
``attention_mgpu``, cuDNN through ``jax.nn.dot_product_attention``, torch SDPA with
``enable_gqa``), each a thunk returning milliseconds or raising :class:`Skipped`.

FLOPs of attention = 4 * Hq * D * (visible query-key pairs): QK^T and PV, 2 FLOPs a
multiply-add; a causal S x L prefill has S * L * (L + 1) / 2 visible pairs.
"""
from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from benchmarks.common import first_lines, time_jax, time_torch

#: The benchmark shape: bf16, Hq query heads, H KV heads (GQA 4), head size D, block size N.
HQ, H, D, N = 32, 8, 128, 16
#: (name, q_lens, ctx_lens): causal prefills, a serving mix (one 4096-token prefill in the
#: batch of 64 decodes of 4096-token histories) and the mix's two parts, each alone (what the
#: mix would take run as two kernels one after the other).
PROBLEMS = (
    ("4x4096", [4096] * 4, [0] * 4),
    ("16x1024", [1024] * 16, [0] * 16),
    ("1x16384", [16384], [0]),
    ("1x4096 + 64 dec@4096", [4096] + [1] * 64, [0] + [4096] * 64),
    ("1x4096", [4096], [0]),
    ("64 dec@4096", [1] * 64, [4096] * 64),
)
#: The serving mix and the problems of its parts.
MIX_PARTS = ("1x4096 + 64 dec@4096", ("1x4096", "64 dec@4096"))
#: Tiny problems of the same kinds (CPU interpret smoke runs).
SMOKE_PROBLEMS = (
    ("2x64", [64] * 2, [0] * 2),
    ("1x32 + 3 dec@48", [32, 1, 1, 1], [0, 48, 48, 48]),
)
#: Every cache format of kvjax (nvfp4 is HND only), for the per-format prefill.
FORMATS = ("bfloat16", "fp8", "int8_per_token_head", "fp8_per_token_head",
           "int4_per_token_head", "nvfp4")
#: Timing of one measurement (``common.time_jax`` arguments); SMOKE_TIMING: one call.
TIMING = dict(reps=5, inner=10, warmup=2)
SMOKE_TIMING = dict(reps=1, inner=1, warmup=1)


class Skipped(Exception):
  """A measurement that does not apply here (the message says why); not a failure."""


def measure(thunk) -> dict:
  """Run ``thunk() -> ms``: ``{"ms"}``, ``{"skipped": reason}`` or ``{"error": lines}``."""
  try:
    return dict(ms=float(thunk()))
  except Skipped as e:
    return dict(skipped=str(e))
  except Exception as e:  # noqa: BLE001 - a failing implementation is reported, not fatal
    return dict(error=first_lines(e))


# -- problems ---------------------------------------------------------------------------------
def visible_pairs(q_lens, ctx_lens) -> int:
  """Causal (query, key) pairs: query i of a sequence (0-based) sees ctx + i + 1 keys."""
  return sum(int(q) * int(c) + int(q) * (int(q) + 1) // 2 for q, c in zip(q_lens, ctx_lens))


def attention_flops(q_lens, ctx_lens, hq: int = HQ, d: int = D) -> int:
  """4 * Hq * D * causal visible pairs (QK^T and PV)."""
  return 4 * hq * d * visible_pairs(q_lens, ctx_lens)


def tflops(flops: int, ms: float) -> float:
  return flops / (ms * 1e-3) / 1e12


def format_spec(cache_dtype: str, h: int = H, d: int = D, n: int = N) -> kvjax.KVCacheSpec:
  """bf16-model spec of ``cache_dtype``, NHD (nvfp4: HND, its only layout)."""
  return kvjax.KVCacheSpec(h, d, n, cache_dtype=cache_dtype,
                           layout="HND" if cache_dtype == "nvfp4" else "NHD",
                           dtype=jnp.bfloat16)


def tensor_scale(cache_dtype: str):
  """The global K/V scale a format takes (fp8 per tensor, nvfp4: 1.0), else None."""
  return 1.0 if cache_dtype in ("fp8", "nvfp4") else None


def random_cache(key, spec, num_blocks: int):
  """A cache of random finite bytes: normal values for plain and fp8 per-tensor storage,
  small codes (so every row scale stored in the bytes is finite) for the other formats."""
  shape = spec.physical_shape(num_blocks)
  if spec.codec.is_quantized and spec.cache_dtype != "fp8":
    return jax.random.randint(key, shape, 0, 64, jnp.int32).astype(spec.storage_dtype)
  return (jax.random.normal(key, shape, jnp.float32) * 0.5).astype(spec.storage_dtype)


def nan_cache(spec, num_blocks: int):
  """0xFF in every byte: NaN in 16-bit and 8-bit floats, NaN data and scales when quantized."""
  shape = spec.physical_shape(num_blocks)
  raw = np.full(int(np.prod(shape)) * spec.itemsize, 0xFF, np.uint8)
  return jnp.asarray(raw.view(spec.storage_dtype).reshape(shape))


def paged_batch(rng, spec, q_lens, ctx_lens, hq: int = HQ, pad: int = 0, fill: str = "random",
                scales=None):
  """A ragged batch over a paged cache with shuffled pages.

  Args:
    rng: numpy Generator (pages, data, keys).
    spec: the cache's :class:`kvjax.KVCacheSpec`.
    q_lens, ctx_lens: per sequence, new query tokens and cached prefix (seq_len = sum).
    hq: query heads. pad: padding query tokens after the last sequence.
    fill: "random": the whole cache random (:func:`random_cache`; timing problems);
      "nan": a NaN cache (:func:`nan_cache`), then every token of every sequence written by
      ``kvjax.reference.write_kv`` (checks: a masked key that leaks shows as NaN).
    scales: the global K/V scale given to the writer (fp8 per tensor, nvfp4).
  Returns:
    q ``[T, Hq, D]`` (T = sum(q_lens) + pad, spec.dtype), cache, query_start_loc int32
    ``[S+1]``, seq_lens int32 ``[S]``, block_table int32 ``[S, max_pages]``.
  """
  from kvjax.reference import write_kv
  n = spec.block_size
  q_lens, ctx_lens = np.asarray(q_lens), np.asarray(ctx_lens)
  seq_lens = q_lens + ctx_lens
  pages = np.maximum(-(-seq_lens // n), 1)
  num_blocks = int(pages.sum()) + 2
  perm = rng.permutation(num_blocks)
  bt = np.zeros((len(q_lens), int(pages.max())), np.int32)
  used = 0
  for s, p in enumerate(pages):
    bt[s, :p] = perm[used:used + p]
    bt[s, p:] = perm[-1]
    used += p
  if fill == "random":
    cache = random_cache(jax.random.PRNGKey(int(rng.integers(1 << 30))), spec, num_blocks)
  elif fill == "nan":
    cache = nan_cache(spec, num_blocks)
    slots = np.concatenate([bt[s, np.arange(L) // n] * n + np.arange(L) % n
                            for s, L in enumerate(seq_lens)]).astype(np.int32)
    kv = (len(slots), spec.num_kv_heads, spec.head_size)
    k, v = (jnp.asarray(rng.standard_normal(kv), spec.dtype) for _ in range(2))
    cache = write_kv(cache, k, v, jnp.asarray(slots), spec, k_scale=scales, v_scale=scales)
  else:
    raise ValueError(f"fill={fill!r} must be 'random' or 'nan'")
  q = jnp.asarray(rng.standard_normal((int(q_lens.sum()) + pad, hq, spec.head_size)),
                  spec.dtype)
  qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  return q, cache, jnp.asarray(qsl), jnp.asarray(seq_lens, jnp.int32), jnp.asarray(bt)


#: A check passes when the output is finite, its padding rows are exactly 0 and its largest
#: error on real rows is at most CHECK_TOL times the reference's largest magnitude.
CHECK_TOL = 2e-2


def compare(out, ref, real: int) -> dict:
  """Output ``[T, Hq, D]`` vs reference on the first ``real`` rows (the rest are padding).

  Returns max_err, ref_max, rel_err (L2), padding_zero, finite and ok (CHECK_TOL)."""
  o, r = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  diff = o[:real] - r[:real]
  mag = float(np.max(np.abs(r[:real]))) if real else 0.0
  err = float(np.max(np.abs(diff))) if real else 0.0
  norm = float(np.linalg.norm(r[:real]))
  rel = float(np.linalg.norm(diff) / norm) if norm else err
  pad_zero = bool(np.all(o[real:] == 0))
  finite = bool(np.isfinite(o).all())
  ok = finite and pad_zero and err <= CHECK_TOL * max(mag, 1e-3)
  return dict(max_err=err, ref_max=mag, rel_err=rel, padding_zero=pad_zero, finite=finite,
              ok=bool(ok))


# -- kvjax ------------------------------------------------------------------------------------
def kvjax_fn(spec, impl: str, max_query_len, interpret=None, **kw):
  """Jitted ``f(q, cache, qsl, seq_lens, block_table)``: ``kvjax.unified_attention`` with
  ``impl``, softmax scale D**-0.5 and the format's global scales unless ``kw`` gives them."""
  ks = tensor_scale(spec.cache_dtype)
  kw = dict(dict(scale=spec.head_size ** -0.5, k_scale=ks, v_scale=ks), **kw)

  @jax.jit
  def f(q, cache, qsl, sl, bt):
    return kvjax.unified_attention(q, cache, spec, query_start_loc=qsl, seq_lens=sl,
                                   block_table=bt, max_query_len=max_query_len, impl=impl,
                                   interpret=interpret, **kw)
  return f


@contextlib.contextmanager
def ragged_read(read: str):
  """Within: the Mosaic GPU ragged kernel reads every quantized cache it can the way ``read``
  says ("copy": through a plain copy of the pages; "direct": as stored, where
  ``direct_reason`` allows), whatever its tuning table's default; for jitting under it."""
  from pallas_kernels.mosaic_gpu import ragged_attention as RA   # noqa: PLC0415
  from pallas_kernels.mosaic_gpu import tuning as MT   # noqa: PLC0415
  saved = MT.RAGGED_DIRECT
  MT.RAGGED_DIRECT = frozenset(
      cd for cd in FORMATS if read == "direct"
      and RA.direct_reason(format_spec(cd), jnp.bfloat16) is None)
  try:
    yield
  finally:
    MT.RAGGED_DIRECT = saved


def impl_reason(spec, q_dtype, impl: str):
  """None when ``impl`` runs attention over ``spec`` here, else the registry's reason."""
  try:
    kvjax.explain("attention", spec, q_dtype, impl=impl)
    return None
  except ValueError as e:
    return str(e).split(": ", 1)[-1]


def auto_choice(spec, q, seq_lens, block_table, max_query_len, interpret=None):
  """The :class:`kvjax.registry.Choice` of ``impl="auto"`` for this call (``.name``)."""
  call = kvjax.registry.AttentionCall(num_tokens=q.shape[0], num_q_heads=q.shape[1],
                                      num_seqs=seq_lens.shape[0],
                                      max_blocks=block_table.shape[1],
                                      max_query_len=max_query_len)
  return kvjax.explain("attention", spec, q.dtype, interpret=interpret, call=call)


def kvjax_thunk(spec, impl, args, max_query_len, timing, interpret=None, **kw):
  """``() -> ms`` of ``impl`` on ``args``; :class:`Skipped` where ``impl`` cannot run here."""
  def run():
    if impl != "auto":
      why = impl_reason(spec, args[0].dtype, impl)
      if why is not None:
        raise Skipped(why)
    return time_jax(kvjax_fn(spec, impl, max_query_len, interpret, **kw), *args, **timing)
  return run


# -- dense peers ------------------------------------------------------------------------------
#: Column names of the dense peers, in the order :func:`dense_peers` returns them.
DENSE_PEERS = ("JAX attention_mgpu (dense, f16)", "cuDNN via JAX (dense)",
               "torch SDPA GQA (dense)")


def _need_gpu(what: str):
  if jax.default_backend() != "gpu":
    raise Skipped(f"{what} needs a CUDA GPU (backend: {jax.default_backend()})")


def dense_peers(s: int, L: int, timing, hq: int = HQ, h: int = H, d: int = D):
  """``[(name, thunk -> ms)]`` of the dense peers on a causal s x L prefill, KV [s, L, h, d].

  JAX ``attention_mgpu`` stages q/k/v in float16 shared-memory buffers, so it gets float16
  inputs; cuDNN and torch SDPA (``enable_gqa=True``, no head expansion) take bf16.
  """
  def qkv(dtype=jnp.bfloat16):
    keys = jax.random.split(jax.random.PRNGKey(s * L), 3)
    return (jax.random.normal(keys[0], (s, L, hq, d), dtype),
            jax.random.normal(keys[1], (s, L, h, d), dtype),
            jax.random.normal(keys[2], (s, L, h, d), dtype))

  def mgpu():
    _need_gpu("attention_mgpu")
    from jax.experimental.pallas.ops.gpu import attention_mgpu as am
    cfg = am.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
    return time_jax(jax.jit(functools.partial(am.attention, config=cfg)), *qkv(jnp.float16),
                    **timing)

  def cudnn():
    _need_gpu("cuDNN")
    f = jax.jit(lambda a, b, c: jax.nn.dot_product_attention(
        a, b, c, scale=d ** -0.5, is_causal=True, implementation="cudnn"))
    return time_jax(f, *qkv(), **timing)

  def sdpa():
    try:
      import torch
      import torch.nn.functional as tf
    except ImportError as e:
      raise Skipped(f"torch not importable ({e})") from None
    if not torch.cuda.is_available():
      raise Skipped("torch has no CUDA device")
    qt = torch.randn(s, hq, L, d, device="cuda", dtype=torch.bfloat16)
    kt = torch.randn(s, h, L, d, device="cuda", dtype=torch.bfloat16)
    vt = torch.randn(s, h, L, d, device="cuda", dtype=torch.bfloat16)
    return time_torch(lambda: tf.scaled_dot_product_attention(qt, kt, vt, is_causal=True,
                                                              enable_gqa=True))
  return list(zip(DENSE_PEERS, (mgpu, cudnn, sdpa)))
