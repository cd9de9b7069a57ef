"""The Llama forward in JAX, every cache write and attention through kvjax on a paged cache.

One serving step runs the new tokens of a ragged batch (prefill chunks and decodes, packed
``[T]``) through all layers: embed, then per layer RMSNorm, Q/K/V projections, RoPE at each
token's absolute position, ``kvjax.write_kv`` of K/V into the layer's paged cache,
``kvjax.unified_attention`` of Q over the cache (the new tokens and each sequence's cached
history), the output projection, RMSNorm and the SwiGLU MLP; then the final RMSNorm and the
LM head (the tied embedding) at each sequence's last new token, and a greedy argmax.

The layers run under ``jax.lax.scan`` (one traced layer: compiling costs the same for 30
layers as for one) over weights stacked ``[L, ...]`` and every layer's cache in one stack:
layer ``i`` takes its cache out of the stack, writes and attends to it, and puts it back
(an in-place update of the donated stack). The stack holds the caches' bytes (uint8), each
layer viewed in the cache's storage dtype by a bitcast (free): XLA:CPU updates a stacked
float8 or bfloat16 array inside a loop through a slow path (an fp8 step of this model took
~7x longer than a float32 one), bytes take the fast one on every backend.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

import kvjax

_HI = jax.lax.Precision.HIGHEST


def to_device(weights, dtype) -> dict:
  """The checkpoint's numpy weights as jax arrays of ``dtype`` (float32 or bfloat16)."""
  return jax.tree.map(lambda w: jnp.asarray(w, dtype), weights)


def allocate_caches(spec: kvjax.KVCacheSpec, num_layers: int, num_blocks: int):
  """Zeroed caches of every layer, stacked as bytes: uint8 ``[L, *physical[:-1], C * s]``
  for ``physical = spec.physical_shape(B)`` of ``spec.storage_dtype`` (s bytes an item).
  Page ``b`` of every layer belongs to the same sequence."""
  shape = spec.physical_shape(num_blocks)
  return jnp.zeros((num_layers,) + shape[:-1] + (shape[-1] * spec.itemsize,), jnp.uint8)


def layer_cache(stack, i, spec: kvjax.KVCacheSpec):
  """Layer ``i`` (an int32 scalar, traced) of the byte stack as the spec's physical array."""
  raw = jax.lax.dynamic_index_in_dim(stack, i, keepdims=False)
  if spec.itemsize == 1:
    return jax.lax.bitcast_convert_type(raw, spec.storage_dtype)
  raw = raw.reshape(raw.shape[:-1] + (-1, spec.itemsize))
  return jax.lax.bitcast_convert_type(raw, spec.storage_dtype)


def put_layer_cache(stack, cache, i):
  """The byte stack with layer ``i`` replaced by ``cache`` (the spec's physical array)."""
  raw = jax.lax.bitcast_convert_type(cache, jnp.uint8)
  if raw.ndim > cache.ndim:
    raw = raw.reshape(raw.shape[:-2] + (-1,))
  return jax.lax.dynamic_update_index_in_dim(stack, raw, i, 0)


def rms_norm(x, weight, eps):
  """``x [T, d]`` normalized in float32 by its root mean square, times ``weight``; x's dtype."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (weight.astype(jnp.float32) * x32).astype(x.dtype)


def rope(x, positions, theta):
  """Llama's rotary embedding of ``x [T, heads, D]`` at int32 ``positions [T]``.

  Rotate-half form: dim ``i`` pairs with dim ``i + D/2`` at frequency ``theta^(-2i/D)``;
  angles and products in float32, the result in x's dtype.
  """
  half = x.shape[-1] // 2
  inv_freq = 1.0 / theta ** (jnp.arange(0, 2 * half, 2, dtype=jnp.float32) / (2 * half))
  angle = positions.astype(jnp.float32)[:, None, None] * inv_freq        # [T, 1, D/2]
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def mm(x, w):
  """``x @ w`` at full float32 precision (no TF32 / bf16 passes on GPU for float32)."""
  return jnp.matmul(x, w, precision=_HI)


def decoder_layer(cfg, x, positions, p, attend):
  """One Llama block on ``x [T, d_model]``; ``p``: this layer's weights (unstacked).

  ``attend(q [T, Hq, D], k [T, H, D], v [T, H, D]) -> [T, Hq, D]`` is the attention (which
  also stores K/V). Returns the new ``x``.
  """
  t, hq, h, d = x.shape[0], cfg.num_q_heads, cfg.num_kv_heads, cfg.head_size
  a = rms_norm(x, p["attn_norm"], cfg.rms_eps)
  q = rope(mm(a, p["wq"]).reshape(t, hq, d), positions, cfg.rope_theta)
  k = rope(mm(a, p["wk"]).reshape(t, h, d), positions, cfg.rope_theta)
  v = mm(a, p["wv"]).reshape(t, h, d)
  x = x + mm(attend(q, k, v).reshape(t, hq * d), p["wo"])
  m = rms_norm(x, p["mlp_norm"], cfg.rms_eps)
  return x + mm(jax.nn.silu(mm(m, p["w_gate"])) * mm(m, p["w_up"]), p["w_down"])


def logits_of(params, hidden):
  """float32 logits ``[S, V]`` of final hidden states ``[S, d_model]`` (tied LM head)."""
  if "lm_head" in params:
    return mm(hidden, params["lm_head"]).astype(jnp.float32)
  return jnp.einsum("sd,vd->sv", hidden, params["embed"], precision=_HI).astype(jnp.float32)


def make_step(cfg, spec: kvjax.KVCacheSpec, *, impl="auto", interpret=None):
  """The jitted serving step and the list of shapes it was traced for.

  ``step(params, caches, tokens, scales, md, max_query_len=...)``:

  - ``params``: :func:`to_device` weights; ``caches``: :func:`allocate_caches`' stack
    (donated: written in place);
  - ``tokens``: int32 ``[T]``, the step's new tokens, sequence after sequence, padded;
  - ``scales``: ``{}`` or ``dict(k_scale=, v_scale=)`` float32 scalars (fp8 per-tensor, nvfp4);
  - ``md``: ``kvjax.paging.StepMetadata.arrays()`` (query_start_loc ``[S+1]``, seq_lens
    ``[S]``, block_table ``[S, max_blocks]``, slot_mapping / positions ``[T]``);
  - ``max_query_len``: static, the step's longest query rounded to a bucket.

  Returns ``(next_tokens int32 [S], logits float32 [S, V], caches)``: the greedy token and
  the logits at each sequence's last new token (padded sequences: row 0's). T, S, the
  block-table width and ``max_query_len`` are the compile key.
  """
  traced = []     # appended at trace time only: one entry per compiled shape
  scale = cfg.head_size ** -0.5

  def step(params, caches, tokens, scales, md, *, max_query_len):
    traced.append((tokens.shape[0], max_query_len))
    x = params["embed"][tokens]

    def layer(carry, inputs):
      x, caches = carry
      i, p = inputs
      cache = layer_cache(caches, i, spec)

      def attend(q, k, v):
        nonlocal cache
        cache = kvjax.write_kv(cache, k, v, md["slot_mapping"], spec, impl=impl,
                               interpret=interpret, **scales)
        return kvjax.unified_attention(
            q, cache, spec, query_start_loc=md["query_start_loc"], seq_lens=md["seq_lens"],
            block_table=md["block_table"], scale=scale, max_query_len=max_query_len,
            impl=impl, interpret=interpret, **scales)

      x = decoder_layer(cfg, x, md["positions"], p, attend)
      return (x, put_layer_cache(caches, cache, i)), None

    layer_ids = jnp.arange(cfg.layers, dtype=jnp.int32)
    (x, caches), _ = jax.lax.scan(layer, (x, caches), (layer_ids, params["layers"]))
    last = jnp.maximum(md["query_start_loc"][1:] - 1, 0)          # padded sequences: row 0
    logits = logits_of(params, rms_norm(x[last], params["final_norm"], cfg.rms_eps))
    return jnp.argmax(logits, -1).astype(jnp.int32), logits, caches

  return jax.jit(step, static_argnames="max_query_len", donate_argnums=1), traced
