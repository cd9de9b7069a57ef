"""Public paged attention: ``unified_attention`` (ragged prefill + decode, docs/layout.md §6)."""
from __future__ import annotations

from kvjax import registry
from kvjax import validation as V
from kvjax.layers import Stack, attention_condition
from kvjax.spec import KVCacheSpec


def check_attention_args(q, cache, spec: KVCacheSpec, query_start_loc, seq_lens, block_table,
                         sliding_window, soft_cap, sinks, max_query_len=None, layer=None):
  """Every check of :func:`unified_attention`'s arguments but the scales; the metadata
  values too when concrete. Returns (query_start_loc, seq_lens, block_table) as arrays."""
  sl, bt = V.check_attention_inputs(q, cache, spec, seq_lens, block_table, sliding_window,
                                    soft_cap, sinks, layer)
  qsl = V.check_int_array("query_start_loc", query_start_loc, 1)
  if qsl.shape[0] != sl.shape[0] + 1:
    raise ValueError(f"query_start_loc [S+1] and seq_lens [S] disagree on S: {qsl.shape}, "
                     f"{sl.shape}")
  if max_query_len is not None and (isinstance(max_query_len, bool) or
                                    not isinstance(max_query_len, int) or max_query_len < 1):
    raise ValueError(f"max_query_len must be a positive Python int or None, got "
                     f"{max_query_len!r}")
  values = [V.host_values(x) for x in (qsl, sl, bt)]
  if all(v is not None for v in values):
    V.check_attention_metadata(*values, num_tokens=q.shape[0], num_blocks=cache.shape[0],
                               block_size=spec.block_size, max_query_len=max_query_len)
  return tuple(V.as_jax_int32(x) for x in (qsl, sl, bt))


def unified_attention(q, cache, spec: KVCacheSpec, *, query_start_loc, seq_lens, block_table,
                      scale, causal=True, sliding_window=None, soft_cap=None, sinks=None,
                      k_scale=None, v_scale=None, q_scale=None, max_query_len=None,
                      impl: str = "auto", interpret=None, layer=None):
  """Ragged paged attention over the packed cache: prefills and decodes in one batch.

  Each of S sequences brings its new query tokens (a prefill chunk, or one token for a decode)
  and attends to its whole history in the cache -- the cached prefix and the new tokens, which
  must already have been written (:func:`kvjax.write_kv`). The queries of all sequences are
  flattened into one ``[T, Hq, D]`` array.

  Args:
    q: ``[T, Hq, D]`` query tokens of the step, sequence after sequence (rows past
      ``query_start_loc[-1]`` are padding and output 0); bfloat16, float16 or float32 (it
      need not be the cache's model dtype), or fp8 (float8_e4m3fn / float8_e5m2) with
      ``q_scale``. ``D = spec.head_size``; ``Hq`` a multiple of
      ``spec.num_kv_heads`` (GQA: query head ``i`` reads KV head ``i // (Hq // H)``).
    cache: the spec's physical cache array (``spec.physical_shape(B)``,
      ``spec.storage_dtype``), e.g. from ``spec.allocate(B)``.
    spec: the :class:`kvjax.KVCacheSpec` of ``cache``.
    query_start_loc: int ``[S+1]``, non-decreasing from 0: sequence ``s``'s query tokens are
      rows ``query_start_loc[s]:query_start_loc[s+1]`` of ``q``, ``q_len[s]`` of them (vLLM's
      ``query_start_loc``). This and the other metadata may be jax or numpy int arrays or
      lists of ints.
    seq_lens: int ``[S]``: each sequence's length *after* this step, i.e. cached prefix + new
      query tokens (so ``seq_lens[s] >= q_len[s]``); a decode of a 100-token history has
      ``seq_lens = 101`` and one query token. The query tokens are the last ``q_len[s]``
      positions ``seq_lens[s] - q_len[s] .. seq_lens[s] - 1``.
    block_table: int ``[S, max_blocks]``: sequence ``s``'s token ``p`` lives in page
      ``block_table[s, p // block_size]`` at offset ``p % block_size``. Only the first
      ``ceil(seq_lens[s] / block_size)`` entries of a row are read; the rest may hold anything
      (padding, -1).
    scale: the softmax scale, usually ``head_size ** -0.5``; a Python float or a float32
      scalar, traced under ``jit`` too (every implementation takes either).
    causal: True (default): query position ``p`` sees keys at positions ``<= p``; False: every
      key of its sequence (``< seq_lens[s]``).
    sliding_window: None, or W >= 1: query position ``p`` also sees only keys ``> p - W``
      (W keys, itself included, when causal).
    soft_cap: None, or c > 0: logits become ``c * tanh(logit / c)`` (Gemma-2 style).
    sinks: None, or float32 ``[Hq]``: a per-query-head sink logit, added to the softmax
      denominator (``exp(sink - max)``) with no value (attention sinks, as gpt-oss uses).
    k_scale, v_scale: the global dequantization scales of fp8 per-tensor caches (a scalar, or
      ``[H]`` per KV head) and of nvfp4 (a scalar), float32; ``None`` = 1.0. Formats without
      global scales (plain, per-token-head) ignore them.
    q_scale: an fp8 q's dequantization scale (q's value is ``q * q_scale``): a positive
      float32 scalar, traced under jit too; None for a floating-point q. Every implementation
      takes it: q is widened to bfloat16 exactly and ``q_scale`` folded into ``scale``.
    max_query_len: optional static upper bound (Python int) on every sequence's query length.
      ``1`` with one query token per sequence takes the decode kernel; kernels round it up to
      a power of two, so steps of one bucket share a compiled program. None = T (always
      correct, the slowest tiling). Checked when the metadata is concrete.
    impl: "auto" or a name in ``kvjax.registry.ATTENTION``: "pallas" (the Triton kernels,
      decode or ragged), "mosaic_gpu", "mosaic_tpu", "xla" (plain ``jnp``, blocked over the
      batch's pages), "reference" (pure ``jnp``, the oracle). "auto" takes the Triton kernels
      on GPU, Mosaic TPU on TPU and "xla" on CPU;
      ``kvjax.explain("attention", spec)`` says which implementation runs and why.
    interpret: run a Pallas kernel in interpret mode (on CPU); None: exactly where the kernel
      is not native to the platform.
    layer: with a layered cache (``spec.physical_shape(B, L)``), the layer attended over: a
      Python int or an int32 scalar (traced under jit: one program for every layer). Block ids
      are the layer's own. Read in place (:mod:`kvjax.layers`); attention kernels need an NHD
      layered cache (``auto`` takes an XLA implementation for HND: ``explain(..., layered=True)``).

  Returns:
    ``[T, Hq, D]`` in q's dtype (bfloat16 for an fp8 q); padding rows and rows with no visible
    key are 0.

  Types and shapes are always checked; metadata values whenever they are concrete (also
  when closed over inside ``jax.jit``); traced metadata outside the contract is clamped by
  the rules of :mod:`kvjax.ragged_batch`. Works under ``jax.jit`` with every argument
  traced but ``spec``, the options and ``max_query_len``, with no host synchronization.
  A format that stores rotated rows (int4 per token-head: ``spec.codec.rotation``) gets the
  softmax scale adjusted, and q rotated before the implementation runs and its output
  un-rotated after, unless the implementation does both itself (registered with
  ``model_frame``: the Mosaic GPU kernels).

  Two sequences: four new tokens on a 12-token prefix (page 1) and a decode of a 3-token
  history (page 2); equal logits, so each query averages the V of the positions it sees:

  >>> import jax.numpy as jnp, numpy as np, kvjax
  >>> spec = kvjax.KVCacheSpec(num_kv_heads=1, head_size=8, block_size=16, dtype=jnp.float32)
  >>> pos = np.r_[np.arange(16), np.arange(4)]                # positions of the 20 tokens
  >>> slots = np.r_[16 + np.arange(16), 32 + np.arange(4)]    # pages 1 and 2
  >>> v = jnp.asarray(np.broadcast_to(pos[:, None, None], (20, 1, 8)), jnp.float32)
  >>> cache = kvjax.write_kv(spec.allocate(4), jnp.zeros((20, 1, 8)), v, slots, spec)
  >>> q = jnp.ones((5, 2, 8))                                  # 4 + 1 query tokens, GQA 2
  >>> out = kvjax.unified_attention(q, cache, spec, query_start_loc=[0, 4, 5], seq_lens=[16, 4],
  ...                               block_table=[[1, 0], [2, 0]], scale=8 ** -0.5)
  >>> out.shape, out.dtype
  ((5, 2, 8), dtype('float32'))
  >>> np.round(np.asarray(out[:, 0, 0]), 4).tolist()   # causal: position p averages 0 .. p
  [6.0, 6.5, 7.0, 7.5, 1.5]
  """
  query_start_loc, seq_lens, block_table = check_attention_args(
      q, cache, spec, query_start_loc, seq_lens, block_table, sliding_window, soft_cap, sinks,
      max_query_len, layer)
  V.check_softmax_scale(scale)
  q, scale = V.query_input(q, q_scale, scale)
  V.check_scales(spec, k_scale, v_scale)
  k_scale, v_scale = V.normalize_scale(k_scale), V.normalize_scale(v_scale)
  stack = Stack.of(spec, cache, V.layer_index(layer))
  also = None if stack is None else attention_condition(spec)
  call = registry.AttentionCall(num_tokens=q.shape[0], num_q_heads=q.shape[1],
                                num_seqs=seq_lens.shape[0],
                                max_blocks=block_table.shape[1], max_query_len=max_query_len)
  routes = registry.ATTENTION.routes(impl, interpret, spec, q.dtype, call=call, also=also,
                                     array=cache)
  rot = spec.codec.rotation

  def attend(run):
    pages, table = cache, block_table
    if stack is not None:
      pages, table = stack.attention_operands(cache, spec, block_table, run.impl.xla)
    inside = run.impl.model_frame            # the implementation applies the rotation
    out = run(q if inside else rot.rotate_q(q), pages, spec, query_start_loc=query_start_loc,
              seq_lens=seq_lens, block_table=table,
              scale=rot.softmax_scale(scale, spec.head_size), causal=causal,
              sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks,
              k_scale=k_scale, v_scale=v_scale, max_query_len=max_query_len)
    return out if inside else rot.unrotate_out(out)
  return routes.run(attend)
