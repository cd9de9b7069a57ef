"""The Mosaic GPU implementation of ``kvjax.unified_attention``: the decode or the ragged kernel.

A pure decode batch (static ``max_query_len == 1`` and ``T == S``) of a format with Mosaic GPU
hooks (:mod:`.formats`, :mod:`.row_formats`, :mod:`.group_formats`: plain bf16 / f16, fp8 per
tensor, int8 / fp8 / int4 per token-head, nvfp4) and a GQA group whose queries fit the
kernel's 16 query columns takes the decode kernel (:mod:`.decode`); everything else the ragged
kernel
(:mod:`.ragged_attention`, quantized formats through a plain copy of the pages).
:func:`prefer_attention` is the measured rule that says where ``auto`` takes either.
"""
from __future__ import annotations

from kvjax import ragged_batch as RB
from pallas_kernels.common import triton_lowering_available
from pallas_kernels.mosaic_gpu import ragged_attention as R
from pallas_kernels.mosaic_gpu import tuning as MT
from pallas_kernels.mosaic_gpu.decode import decode_reason, paged_decode_attention

def supports_attention(spec, q_dtype):
  """Registry hook: what the ragged kernel takes (every format it reads directly or through a
  plain copy, 16-bit q, head sizes 64 / 128 / 256, jax >= 0.11 on an sm90+ GPU); the decode
  kernel takes a subset of it."""
  return R.supports_attention(spec, q_dtype)


def _decode_kernel_reason(spec, q_dtype, num_tokens, num_seqs, num_q_heads, max_query_len):
  """None when a call is a decode batch the decode kernel runs, else why not."""
  if not RB.is_decode_batch(num_tokens, num_seqs, max_query_len):
    return "not a decode batch (static max_query_len == 1, one query per sequence)"
  return decode_reason(spec, q_dtype, num_q_heads // spec.num_kv_heads)


def prefer_attention(spec, q_dtype, call):
  """The auto rule (registry ``prefer``): None when ``auto`` should take Mosaic GPU.

  Decode batches the decode kernel runs: the formats and layouts where it is faster than the
  Triton decode kernel on this GPU (:func:`.tuning.auto_decode`). Other batches: the ragged
  kernel's rule (:func:`.ragged_attention.prefer_attention`). Without Pallas' Triton
  lowering (a JAX that has removed it) every call the kernels support: the rules compare
  them with Triton kernels that no longer run, and the next candidate is the XLA
  attention."""
  if not triton_lowering_available():
    return None
  if call is not None and RB.is_decode_batch(call.num_tokens, call.num_seqs,
                                             call.max_query_len):
    why = decode_reason(spec, q_dtype, call.num_q_heads // spec.num_kv_heads)
    if why is not None:
      return f"decode batch: {why}"
    if (spec.cache_dtype, spec.layout) in MT.auto_decode():
      return None
    return (f"decode batch: the Triton decode kernel is faster on {spec.cache_dtype} "
            f"{spec.layout} (measured)")
  return R.prefer_attention(spec, q_dtype, call)


def unified_attention(q, cache, spec, *, query_start_loc, seq_lens, block_table, scale,
                      causal=True, sliding_window=None, soft_cap=None, sinks=None, k_scale=None,
                      v_scale=None, max_query_len=None):
  """Mosaic GPU paged attention. Arguments as :func:`kvjax.unified_attention` (validated),
  q and the output in the model's frame (registered with ``model_frame``): the ragged
  kernel applies a rotated format's rotation itself, the decode kernel's small q and output
  go through the rotation's ops; ``scale`` is the stored frame's."""
  kwargs = dict(seq_lens=seq_lens, block_table=block_table, scale=scale,
                sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks, k_scale=k_scale,
                v_scale=v_scale, query_start_loc=query_start_loc)
  if _decode_kernel_reason(spec, q.dtype, q.shape[0], seq_lens.shape[0], q.shape[1],
                           max_query_len) is None:
    rot = spec.codec.rotation                  # one query at seq_len - 1
    return rot.unrotate_out(paged_decode_attention(rot.rotate_q(q), cache, spec, **kwargs))
  return R.ragged_paged_attention(q, cache, spec, causal=causal, max_query_len=max_query_len,
                                  model_frame=True, **kwargs)
