"""A step's write and attention in one call: ``write_and_attend`` (the step's new K/V, then
attention over the cache that holds them), as tpu-inference's ragged paged attention takes
them."""
from __future__ import annotations

from kvjax.attention import unified_attention
from kvjax.cache_ops import write_kv


def write_and_attend(q, key, value, slot_mapping, cache, spec, *, query_start_loc, seq_lens,
                     block_table, scale, causal=True, sliding_window=None, soft_cap=None,
                     sinks=None, k_scale=None, v_scale=None, q_scale=None, max_query_len=None,
                     impl: str = "auto", write_impl: str = "auto", interpret=None, layer=None):
  """Write the step's new tokens' K/V into the cache, then attend: ``(out, new cache)``.

  Equal, bit for bit, to :func:`kvjax.write_kv` followed by :func:`kvjax.unified_attention`
  on its result, which is what it runs (under ``jax.jit`` the two are one program; ``cache``
  is donated when the caller donates it).

  Args:
    q: ``[T, Hq, D]`` the step's queries (as :func:`kvjax.unified_attention`).
    key, value: ``[T', H, D]`` the step's new K and V in ``spec.dtype``; slot_mapping: int
      ``[T]`` where each goes (as :func:`kvjax.write_kv`; usually the same tokens as q).
    cache, spec, query_start_loc, seq_lens, block_table, scale, causal, sliding_window,
      soft_cap, sinks, k_scale, v_scale, q_scale, max_query_len, interpret, layer: as
      :func:`kvjax.unified_attention` (``k_scale`` / ``v_scale`` serve the write too).
    impl: the attention implementation; write_impl: the write's (both "auto" by default).
  Returns:
    (``[T, Hq, D]`` attention output, the new cache).
  """
  cache = write_kv(cache, key, value, slot_mapping, spec, k_scale=k_scale, v_scale=v_scale,
                   impl=write_impl, interpret=interpret, layer=layer)
  out = unified_attention(q, cache, spec, query_start_loc=query_start_loc, seq_lens=seq_lens,
                          block_table=block_table, scale=scale, causal=causal,
                          sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks,
                          k_scale=k_scale, v_scale=v_scale, q_scale=q_scale,
                          max_query_len=max_query_len, impl=impl, interpret=interpret,
                          layer=layer)
  return out, cache


__all__ = ["write_and_attend"]
