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
                      k_scale=None, v_scale=None, max_query_len=None, impl: str = "auto",
                      interpret=None, layer=None):
  """Ragged paged attention over the packed cache (decodes and prefills in one batch).

  Arguments as :func:`kvjax.reference.unified_attention`, plus:
    max_query_len: optional static upper bound on any sequence's query length
      (Python int); kernels bucket it to a power of two so serving steps reuse
      compiled programs. None = T (always correct).
    impl: "auto" or a name in ``kvjax.registry.ATTENTION`` ("pallas" = the Triton kernels,
      decode or ragged; "reference"); interpret: Pallas interpret mode (None: where the
      kernel is not native). "auto" takes the Triton kernels on GPU and the reference on CPU;
      ``kvjax.explain("attention", spec)`` says which implementation runs and why.
    layer: with a layered cache (``spec.physical_shape(B, L)``), the layer attended over: a
      Python int or an int32 scalar (traced under jit: one program for every layer). Block ids
      are the layer's own. Read in place (:mod:`kvjax.layers`); attention kernels need an NHD
      layered cache (``auto`` takes the reference for HND: ``explain(..., layered=True)``).
  Returns ``[T, Hq, D]`` in q's dtype.

  A format that stores rotated rows (int4 per token-head: ``spec.codec.rotation``) gets q
  rotated and the softmax scale adjusted before the implementation runs, and its output
  un-rotated after.
  """
  query_start_loc, seq_lens, block_table = check_attention_args(
      q, cache, spec, query_start_loc, seq_lens, block_table, sliding_window, soft_cap, sinks,
      max_query_len, layer)
  V.check_softmax_scale(scale)
  V.check_scales(spec, k_scale, v_scale)
  k_scale, v_scale = V.normalize_scale(k_scale), V.normalize_scale(v_scale)
  stack = Stack.of(spec, cache, V.layer_index(layer))
  also = None if stack is None else attention_condition(spec)
  call = registry.AttentionCall(num_tokens=q.shape[0], num_q_heads=q.shape[1],
                                num_seqs=seq_lens.shape[0],
                                max_blocks=block_table.shape[1], max_query_len=max_query_len)
  run = registry.ATTENTION.choose(impl, interpret, spec, q.dtype, call=call, also=also)
  if stack is not None:
    cache, block_table = stack.attention_operands(cache, spec, block_table, run.impl.xla)
  rot = spec.codec.rotation
  out = run(rot.rotate(q), cache, spec, query_start_loc=query_start_loc, seq_lens=seq_lens,
            block_table=block_table, scale=rot.softmax_scale(scale, spec.head_size),
            causal=causal, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks,
            k_scale=k_scale, v_scale=v_scale, max_query_len=max_query_len)
  return rot.unrotate(out)
