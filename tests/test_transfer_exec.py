"""Executed transfers between simulated CPU device groups, byte-exact against caches
written directly on the decode side (docs/layout.md §7)."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
import kvjax.transfer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the _transfer_* helpers
from kvjax.transfer import execute as E
from _transfer_data import (FORMATS, as_bytes, attention, poison_caches, rank_spec, request_kv,
                            write_rank_caches)

H = 4            # total KV heads: TP 8 replicates
NUM_TOKENS = 40  # 3 blocks, the last one partial
SRC_BLOCKS, DST_BLOCKS = [5, 1, 7], [0, 6, 3]


def run_transfer(rng, cache_dtype, head_size, layout, p, d):
  devs = jax.devices()
  seed = int(rng.integers(2**31))
  k, v = request_kv(seed, NUM_TOKENS, H, head_size)
  pspec = rank_spec(cache_dtype, head_size, layout, H, p)
  dspec = rank_spec(cache_dtype, head_size, layout, H, d)
  kw = dict(k_scale=0.05, v_scale=0.03) if cache_dtype == "nvfp4" else {}
  prefill = write_rank_caches(pspec, p, H, k, v, SRC_BLOCKS, 8, devs[:p], **kw)
  poison = poison_caches(dspec, d, 9, seed + 1)
  decode = [jax.device_put(poison[r], devs[(p + r) % 8]) for r in range(d)]
  want = write_rank_caches(dspec, d, H, k, v, DST_BLOCKS, 9, devs[:d], fill=poison, **kw)
  got = kvjax.transfer.transfer_blocks(prefill, decode, dspec, SRC_BLOCKS, DST_BLOCKS,
                                       total_num_kv_heads=H)
  return dspec, got, want


CASES = [  # (format, layout, P, D): P < D, P > D, D > H (replicated decode), P > H, P == D
    ("bf16", "HND", 1, 2), ("bf16", "HND", 2, 1), ("bf16", "HND", 2, 8), ("bf16", "HND", 8, 2),
    ("bf16", "HND", 4, 4), ("bf16", "HND", 8, 1), ("bf16", "HND", 1, 8),
    ("bf16", "NHD", 2, 8), ("bf16", "NHD", 8, 2), ("bf16", "NHD", 4, 4),
    ("fp8_per_token_head", "HND", 2, 8), ("fp8_per_token_head", "HND", 8, 2),
    ("fp8_per_token_head", "NHD", 1, 4),
    ("nvfp4", "HND", 1, 2), ("nvfp4", "HND", 2, 8), ("nvfp4", "HND", 8, 2), ("nvfp4", "HND", 4, 1),
]


@pytest.mark.parametrize("fmt,layout,p,d", CASES)
def test_transfer_byte_exact(rng, fmt, layout, p, d):
  cache_dtype, head_size = FORMATS[fmt]
  dspec, got, want = run_transfer(rng, cache_dtype, head_size, layout, p, d)
  for r, (g, w) in enumerate(zip(got, want)):
    assert g.dtype == dspec.storage_dtype and g.shape == dspec.physical_shape(9)
    assert list(g.devices()) == [jax.devices()[(p + r) % 8]]
    np.testing.assert_array_equal(as_bytes(g), as_bytes(w), err_msg=f"P={p} D={d} rank {r}")


def test_transferred_attention_matches_direct(rng):
  """Per decode rank, attention over the transferred cache = over the directly written one."""
  dspec, got, want = run_transfer(rng, "fp8_per_token_head", 32, "NHD", 4, 2)
  q = jnp.asarray(rng.standard_normal((3, 4, 32)), jnp.bfloat16)  # 2 query heads per KV head
  meta = (jnp.array([0, 3]), jnp.array([NUM_TOKENS]), jnp.array([DST_BLOCKS]), 32 ** -0.5)
  for g, w in zip(got, want):
    out = attention(q, jax.device_put(g, jax.devices()[0]), dspec, *meta)
    ref = attention(q, jax.device_put(w, jax.devices()[0]), dspec, *meta)
    assert float(jnp.max(jnp.abs(out.astype(jnp.float32)))) > 0
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))


def test_naive_nvfp4_slice_is_caught(rng):
  """The vLLM pitfall: slicing nvfp4's 2H slots by contiguous bytes mixes K and V.

  Executed with the wrong plan, the comparison used above must fail.
  """
  cache_dtype, head_size = FORMATS["nvfp4"]
  devs = jax.devices()
  k, v = request_kv(int(rng.integers(2**31)), NUM_TOKENS, H, head_size)
  pspec, dspec = (rank_spec(cache_dtype, head_size, "HND", H, t) for t in (1, 2))
  prefill = write_rank_caches(pspec, 1, H, k, v, SRC_BLOCKS, 8, devs[:1])
  want = write_rank_caches(dspec, 2, H, k, v, DST_BLOCKS, 9, devs[:2])
  src = E.gather_page_bytes(prefill[0], np.asarray(SRC_BLOCKS, np.int32))
  page = dspec.page_bytes
  for r in range(2):
    naive = [kvjax.transfer.Read(0, r * page, page, 0)]   # "rank r takes chunk r of the page"
    good = kvjax.transfer.plan_reads(dspec, tp_rank=r, tp_size=2, remote_tp_size=1,
                                     total_num_kv_heads=H)
    fresh = lambda: jax.device_put(dspec.allocate(9), devs[r])
    bad_cache = E.receive_into(fresh(), dspec, {0: src}, naive, DST_BLOCKS, permute=False)
    good_cache = E.receive_into(fresh(), dspec, {0: src}, good, DST_BLOCKS, permute=False)
    np.testing.assert_array_equal(as_bytes(good_cache), as_bytes(want[r]))
    assert not np.array_equal(as_bytes(bad_cache), as_bytes(want[r]))


def test_mla_transfer(rng):
  mla = kvjax.MLACacheSpec(64, 16)
  devs = jax.devices()
  latent = jnp.asarray(rng.standard_normal((8, 16, 64)), jnp.bfloat16)
  prefill = [jax.device_put(latent, devs[s]) for s in range(4)]   # replicated on every rank
  decode = [jax.device_put(mla.allocate(6, fill=-3.0), devs[4 + r]) for r in range(2)]
  got = kvjax.transfer.transfer_blocks(prefill, decode, mla, [2, 6], [5, 0],
                                       total_num_kv_heads=1)
  want = np.full((6, 16, 64), -3.0, np.float32)
  want[[5, 0]] = np.asarray(latent, np.float32)[[2, 6]]
  for g in got:
    np.testing.assert_array_equal(np.asarray(g, np.float32), want)


def test_transfer_refusals():
  dspec = rank_spec("auto", 32, "HND", H, 2)
  pspec = rank_spec("auto", 32, "HND", H, 4)
  pre = [pspec.allocate(4) for _ in range(4)]
  dec = [dspec.allocate(4) for _ in range(2)]
  with pytest.raises(ValueError, match="distinct"):
    kvjax.transfer.transfer_blocks(pre, dec, dspec, [0, 1], [2, 2], total_num_kv_heads=H)
  with pytest.raises(ValueError, match="differ in length"):
    kvjax.transfer.transfer_blocks(pre, dec, dspec, [0, 1], [2], total_num_kv_heads=H)
  with pytest.raises(ValueError, match="prefill cache of rank 0"):   # 2 heads, P=4 holds 1
    kvjax.transfer.transfer_blocks([dspec.allocate(4)] * 4, dec, dspec, [0], [1],
                                   total_num_kv_heads=H)
  with pytest.raises(ValueError, match="decode cache of rank 0"):
    kvjax.transfer.transfer_blocks(pre, pre[:2], dspec, [0], [1], total_num_kv_heads=H)
  with pytest.raises(ValueError, match=r"\[0, 4\)"):
    kvjax.transfer.transfer_blocks(pre, dec, dspec, [4], [1], total_num_kv_heads=H)
  with pytest.raises(ValueError, match="does not split"):
    kvjax.transfer.transfer_blocks(pre[:3], dec, dspec, [0], [1], total_num_kv_heads=H)
