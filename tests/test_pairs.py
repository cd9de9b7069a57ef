"""Pairs of one-byte codes as float16 (pallas_kernels.triton.pairs), outside any kernel: every
uint16 word against numpy's own decoding of its two bytes."""
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.triton import pairs

WORDS = np.arange(1 << 16, dtype=np.uint16)


@pytest.mark.parametrize("code", [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int8])
def test_every_word_splits_into_its_even_and_odd_values(code):
  even, odd = pairs.pair_to_f16(jnp.asarray(WORDS), code, ptx=False)
  assert even.dtype == odd.dtype == jnp.float16
  low = (WORDS & 0xFF).astype(np.uint8).view(np.dtype(code))
  high = (WORDS >> 8).astype(np.uint8).view(np.dtype(code))
  for got, want in ((even, low), (odd, high)):
    want = want.astype(np.float32)
    got = np.asarray(got, np.float32)
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    assert same.all(), f"{np.count_nonzero(~same)} of 65536 words differ"


def test_which_codes_have_pairs_and_where_ptx_runs(monkeypatch):
  assert pairs.has_pairs(jnp.float8_e4m3fn) and pairs.has_pairs(jnp.int8)
  assert not pairs.has_pairs("int4") and not pairs.has_pairs("e2m1")
  assert not pairs.has_pairs(jnp.bfloat16)
  monkeypatch.setattr(pairs, "cuda_capability", lambda: (8, 0))      # A100: no fp8 cvt
  assert not pairs.pairs_in_ptx(jnp.float8_e4m3fn) and pairs.pairs_in_ptx(jnp.int8)
  monkeypatch.setattr(pairs, "cuda_capability", lambda: (9, 0))
  assert pairs.pairs_in_ptx(jnp.float8_e5m2)
  monkeypatch.setattr(pairs, "cuda_capability", lambda: None)        # CPU, ROCm
  assert not pairs.pairs_in_ptx(jnp.int8)
