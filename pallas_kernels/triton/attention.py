"""The Triton implementation of ``kvjax.unified_attention``: the decode or the ragged kernel."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kvjax import ragged_batch as RB
from pallas_kernels.triton.adapters import hooks_reason

_Q_DTYPES = tuple(np.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))


def supports_attention(spec, q_dtype):
  """Registry hook: every format the Triton adapter table adapts; q in bfloat16, float16 or
  float32."""
  if np.dtype(q_dtype) not in _Q_DTYPES:
    return f"q dtype {np.dtype(q_dtype)} is not one of {[str(d) for d in _Q_DTYPES]}"
  return hooks_reason(spec)


def unified_attention(q, cache, spec, *, query_start_loc, seq_lens, block_table, scale,
                      causal=True, sliding_window=None, soft_cap=None, sinks=None, k_scale=None,
                      v_scale=None, max_query_len=None, interpret=False):
  """Triton paged attention. Arguments as :func:`kvjax.unified_attention` (already validated).

  ``max_query_len == 1`` (a pure decode batch, one query token per sequence and
  ``T == S``) takes the decode kernel; anything else the ragged kernel.
  """
  kwargs = dict(seq_lens=seq_lens, block_table=block_table, scale=scale,
                sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks, k_scale=k_scale,
                v_scale=v_scale, interpret=interpret)
  if RB.is_decode_batch(q.shape[0], seq_lens.shape[0], max_query_len):
    from pallas_kernels.triton.decode import paged_decode_attention
    return paged_decode_attention(q, cache, spec, query_start_loc=query_start_loc, **kwargs)
  from pallas_kernels.triton.ragged import ragged_paged_attention
  return ragged_paged_attention(q, cache, spec, query_start_loc=query_start_loc, causal=causal,
                                max_query_len=max_query_len, **kwargs)
