"""torch_bridge.vllm_ops: vLLM's ``reshape_and_cache_flash`` and ``unified_attention`` over a
packed kvjax cache, on CPU and CUDA.

The attention grid is vLLM 0.28's own kernel test's (tests/kernels/attention/
test_triton_unified_attention.py: its sequence lengths, head counts, head sizes, windows,
soft caps and tolerances -- atol 1.5e-2 / rtol 1e-2 for bf16 caches, 1.5e-1 for fp8 ones),
with one change: K and V are the two halves of one packed cache, as the layout has them.
The reference is kvjax's (the oracle) on the cache's bytes. The full grid is the slow tier.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import kvjax
import torch_bridge as tb
from torch_bridge import vllm_ops
from torch_testing import cache_array, device, on_cpu, poison, rand_bf16, to_jnp  # noqa: F401

SEQ_LENS = [[(1, 1328), (5, 18), (129, 463)], [(1, 523), (1, 37), (1, 2011)]]
NUM_HEADS = [(4, 4), (8, 2), (5, 1)]
NUM_BLOCKS = 2048
N = 16


def _grid():
  fast = {(0, (8, 2), 128, None, None), (1, (8, 2), 128, 64, 50.0), (1, (5, 1), 256, None, None)}
  for i in range(len(SEQ_LENS)):
    for heads in NUM_HEADS:
      for d in (128, 256):
        for window in (None, 64, 128, 256):
          for cap in (None, 50.0):
            marks = () if (i, heads, d, window, cap) in fast else (pytest.mark.slow,)
            yield pytest.param(i, heads, d, window, cap, marks=marks)


def _case(rng, device, seq_lens, heads, d, cache_dtype):
  hq, h = heads
  backend = tb.PagedAttentionBackend(hq, h, d, N, cache_dtype)
  cache = backend.allocate_kv_cache(NUM_BLOCKS, device=device)
  poison(rng, cache, backend.spec)
  key_cache, value_cache = tb.kv_views(cache, backend.spec)
  q_lens = [a for a, _ in seq_lens]
  kv_lens = [b for _, b in seq_lens]
  width = -(-max(kv_lens) // N)
  table = rng.integers(0, NUM_BLOCKS, (len(seq_lens), width)).astype(np.int32)
  # every slot a sequence reads written once (the tables may share blocks)
  used = np.unique(np.concatenate([table[s, :-(-ln // N)] for s, ln in enumerate(kv_lens)]))
  slots = (used[:, None] * N + np.arange(N)).reshape(-1)
  key = rand_bf16(rng, (len(slots), h, d), device)
  value = rand_bf16(rng, (len(slots), h, d), device)
  as_t = lambda a: torch.from_numpy(np.asarray(a, np.int32)).to(device)   # noqa: E731
  return backend.spec, cache, key_cache, value_cache, key, value, as_t(slots), dict(
      q=rand_bf16(rng, (sum(q_lens), hq, d), device),
      cu_seqlens_q=as_t(np.concatenate([[0], np.cumsum(q_lens)])), max_seqlen_q=max(q_lens),
      seqused_k=as_t(kv_lens), max_seqlen_k=max(kv_lens), block_table=as_t(table))


def _reference(spec, cache, a, scale, window, cap, ks=None, vs=None):
  meta = dict(query_start_loc=on_cpu(a["cu_seqlens_q"].cpu().numpy()),
              seq_lens=on_cpu(a["seqused_k"].cpu().numpy()),
              block_table=on_cpu(a["block_table"].cpu().numpy()))
  fn = jax.jit(lambda q, c: kvjax.unified_attention(
      q, c, spec, scale=scale, sliding_window=window, soft_cap=cap, k_scale=ks, v_scale=vs,
      impl="reference", **meta))
  return np.asarray(fn(to_jnp(a["q"]), cache_array(cache, spec)).astype(jnp.float32))


@pytest.mark.parametrize("seqs,heads,head_size,window,soft_cap", _grid())
def test_unified_attention_vllm_grid(rng, device, seqs, heads, head_size, window, soft_cap):
  spec, cache, kc, vc, key, value, slots, a = _case(rng, device, SEQ_LENS[seqs], heads,
                                                     head_size, "auto")
  vllm_ops.reshape_and_cache_flash(key, value, kc, vc, slots, "auto", None, None)
  out = torch.full_like(a["q"], float("nan"))
  scale = head_size ** -0.5
  vllm_ops.unified_attention(
      a["q"], kc, vc, out, a["cu_seqlens_q"], a["max_seqlen_q"], a["seqused_k"],
      a["max_seqlen_k"], scale, True, (-1, -1) if window is None else (window - 1, 0),
      a["block_table"], soft_cap or 0, None, None, None)
  want = _reference(spec, cache, a, scale, window, soft_cap)
  torch.testing.assert_close(out.float().cpu(), torch.from_numpy(want.copy()), atol=1.5e-2,
                             rtol=1e-2)


@pytest.mark.parametrize("seqs,heads,head_size", [
    (1, (8, 2), 128), pytest.param(0, (4, 4), 256, marks=pytest.mark.slow),
    pytest.param(1, (5, 1), 256, marks=pytest.mark.slow)])
def test_fp8_cache_writes_as_kvjax_and_reads_within_vllm_tolerance(rng, device, seqs, heads,
                                                                   head_size):
  spec, cache, kc, vc, key, value, slots, a = _case(rng, device, SEQ_LENS[seqs], heads,
                                                     head_size, "fp8")
  before = cache_array(cache, spec)
  k_scale = torch.tensor(0.5, device=device)
  v_scale = torch.tensor(0.25, device=device)
  vllm_ops.reshape_and_cache_flash(key, value, kc, vc, slots, "fp8", k_scale, v_scale)
  want = kvjax.write_kv(before, to_jnp(key), to_jnp(value), on_cpu(slots.cpu().numpy()), spec,
                        k_scale=jnp.float32(0.5), v_scale=jnp.float32(0.25), impl="reference")
  np.testing.assert_array_equal(np.asarray(cache_array(cache, spec)).view(np.uint8),
                                np.asarray(want).view(np.uint8))
  out = torch.full_like(a["q"], float("nan"))
  shape = (len(SEQ_LENS[seqs]), heads[1])              # vLLM's per-sequence descale expand
  vllm_ops.unified_attention(
      a["q"], kc, vc, out, a["cu_seqlens_q"], a["max_seqlen_q"], a["seqused_k"],
      a["max_seqlen_k"], head_size ** -0.5, True, (-1, -1), a["block_table"], 0, None,
      k_scale.expand(shape), v_scale.expand(shape))
  ref = _reference(spec, cache, a, head_size ** -0.5, None, None, jnp.float32(0.5),
                   jnp.float32(0.25))
  torch.testing.assert_close(out.float().cpu(), torch.from_numpy(ref.copy()), atol=1.5e-1,
                             rtol=1.5e-1)


def test_views_of_one_packed_cache_only(rng):
  backend = tb.PagedAttentionBackend(8, 2, 64, N, "auto", "HND")
  cache = backend.allocate_kv_cache(4)
  kc, vc = tb.kv_views(cache, backend.spec)
  phys, layout = vllm_ops.packed_cache(kc, vc)
  assert layout == "HND" and phys.data_ptr() == cache.data_ptr() and phys.is_contiguous()
  with pytest.raises(ValueError, match="halves of one packed cache"):
    vllm_ops.packed_cache(kc, kc)
  separate = torch.zeros(4, N, 2, 64, dtype=torch.bfloat16)
  with pytest.raises(ValueError, match="halves of one packed cache"):
    vllm_ops.packed_cache(separate, torch.zeros_like(separate))
  q = torch.zeros(2, 8, 64, dtype=torch.bfloat16)
  args = (q, kc, vc, torch.empty_like(q), torch.tensor([0, 1, 2], dtype=torch.int32), 1,
          torch.tensor([3, 4], dtype=torch.int32), 4, 0.125, True, (-1, -1),
          torch.zeros(2, 1, dtype=torch.int32), 0)
  with pytest.raises(ValueError, match="q_descale"):
    vllm_ops.unified_attention(*args, torch.tensor(1.0), None, None)
  with pytest.raises(ValueError, match="alibi_slopes"):
    vllm_ops.unified_attention(*args, None, None, None, alibi_slopes=torch.zeros(8))
  with pytest.raises(ValueError, match="window_size"):
    vllm_ops.unified_attention(*args[:10], (3, 2), *args[11:], None, None, None)
