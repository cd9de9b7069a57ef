"""Public paged attention: ``unified_attention`` (ragged prefill + decode, docs/layout.md §6)."""
from __future__ import annotations

import numpy as np

from kvjax import registry
from kvjax import validation as V
from kvjax.spec import KVCacheSpec


def check_attention_args(q, cache, spec: KVCacheSpec, query_start_loc, seq_lens, block_table,
                         sliding_window, soft_cap, sinks, max_query_len=None):
  sl, bt = V.check_attention_inputs(q, cache, spec, seq_lens, block_table, sliding_window,
                                    soft_cap, sinks)
  qsl = V.check_int_array("query_start_loc", query_start_loc, 1)
  if qsl.shape[0] != sl.shape[0] + 1:
    raise ValueError(f"query_start_loc [S+1] and seq_lens [S] disagree on S: {qsl.shape}, "
                     f"{sl.shape}")
  if max_query_len is not None:
    if not isinstance(max_query_len, int) or max_query_len < 1:
      raise ValueError(f"max_query_len must be a positive Python int or None, got "
                       f"{max_query_len!r}")
    if V.is_concrete(qsl) and qsl.size > 1:
      longest = int(np.max(np.diff(np.asarray(qsl))))
      if longest > max_query_len:
        raise ValueError(f"a sequence has {longest} query tokens > max_query_len={max_query_len}")
  if V.is_concrete(sl) and V.is_concrete(bt) and sl.size:
    cap = bt.shape[1] * spec.block_size
    if int(np.max(np.asarray(sl))) > cap:
      raise ValueError(f"a seq_len exceeds block_table capacity {bt.shape[1]} blocks x "
                       f"{spec.block_size} = {cap}")


def unified_attention(q, cache, spec: KVCacheSpec, *, query_start_loc, seq_lens, block_table,
                      scale, causal=True, sliding_window=None, soft_cap=None, sinks=None,
                      k_scale=None, v_scale=None, max_query_len=None, impl: str = "auto",
                      interpret=None):
  """Ragged paged attention over the packed cache (decodes and prefills in one batch).

  Arguments as :func:`kvjax.reference.unified_attention`, plus:
    max_query_len: optional static upper bound on any sequence's query length
      (Python int); kernels bucket it to a power of two so serving steps reuse
      compiled programs. None = T (always correct).
    impl: "auto" or a name in ``kvjax.registry.ATTENTION`` ("pallas" = the Triton kernels,
      decode or ragged; "reference"); interpret: Pallas interpret mode (None: where the
      kernel is not native). "auto" takes the Triton kernels on GPU and the reference on CPU;
      ``kvjax.explain("attention", spec)`` says which implementation runs and why.
  Returns ``[T, Hq, D]`` in q's dtype.
  """
  check_attention_args(q, cache, spec, query_start_loc, seq_lens, block_table, sliding_window,
                       soft_cap, sinks, max_query_len)
  V.check_scales(spec, k_scale, v_scale)
  k_scale, v_scale = V.normalize_scale(k_scale), V.normalize_scale(v_scale)
  run = registry.ATTENTION.choose(impl, interpret, spec, q.dtype)
  return run(q, cache, spec, query_start_loc=query_start_loc, seq_lens=seq_lens,
             block_table=block_table, scale=scale, causal=causal, sliding_window=sliding_window,
             soft_cap=soft_cap, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
             max_query_len=max_query_len)
