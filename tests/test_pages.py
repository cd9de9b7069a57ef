"""``kvjax.pages.store_pages`` (whole pages into a cache by block id) on every implementation:
the named rows get the incoming bits, every other byte of the poisoned cache keeps its own."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import pages, registry
from op_suite import implementations, run_mode

DTYPES = [jnp.bfloat16, jnp.float8_e4m3fn, jnp.int8, jnp.uint8, jnp.float32]


def _bits(x):
  x = np.asarray(jax.device_get(x))
  return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _random(rng, shape, dtype):
  """Random bits of ``dtype`` (NaN payloads included: they must survive bit for bit)."""
  size = jnp.dtype(dtype).itemsize
  raw = rng.integers(0, 256, size=(*shape, size), dtype=np.uint8)
  return jax.lax.bitcast_convert_type(jnp.asarray(raw), dtype) if size > 1 else \
      jax.lax.bitcast_convert_type(jnp.asarray(raw[..., 0]), dtype)


def _expected(table, rows, ids, column):
  want = _bits(table).copy()
  got_rows = _bits(rows)
  if rows.dtype == jnp.uint8 and table.dtype != jnp.uint8:
    got_rows = got_rows.view(want.dtype)
  want[np.asarray(ids)] = got_rows[:, column:column + want.shape[1]]
  return want


@pytest.mark.parametrize("name", implementations("pages"))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("width,column,extra", [(4096, 0, 0), (96, 0, 0), (24, 48, 24),
                                                 (6, 3, 0)])
@pytest.mark.parametrize("as_bytes", [False, True], ids=["typed", "bytes"])
def test_named_rows_get_the_bits_and_nothing_else_changes(name, dtype, width, column, extra,
                                                          as_bytes):
  isz = jnp.dtype(dtype).itemsize
  interpret = run_mode("pages", name, jnp.dtype(dtype), width)
  rng = np.random.default_rng([width, column, isz, as_bytes])
  table = _random(rng, (11, width), dtype)                  # poison: random bits, NaNs too
  rows = _random(rng, (4, column + width + extra), dtype)
  ids = jnp.asarray(rng.permutation(11)[:4].astype(np.int32))
  if as_bytes:
    rows = jax.lax.bitcast_convert_type(rows, jnp.uint8).reshape(4, -1) if isz > 1 else \
        jax.lax.bitcast_convert_type(rows, jnp.uint8)
  want = _expected(table, rows, ids, column)
  fn = jax.jit(lambda t, r, i: pages.store_pages(t, r, i, column=column, impl=name,
                                                 interpret=interpret), donate_argnums=0)
  out = fn(table, rows, ids)
  assert out.dtype == dtype and out.shape == (11, width)
  np.testing.assert_array_equal(_bits(out), want)


@pytest.mark.parametrize("name", implementations("pages"))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn],
                         ids=lambda d: jnp.dtype(d).name)
def test_negative_ids_skip_their_rows(name, dtype):
  interpret = run_mode("pages", name, jnp.dtype(dtype), 48)
  rng = np.random.default_rng(5)
  table = _random(rng, (9, 48), dtype)
  rows = _random(rng, (6, 48), dtype)
  ids = jnp.asarray([4, -1, 0, -1, 8, -1], jnp.int32)      # padded to 6 rows
  want = _bits(table).copy()
  want[[4, 0, 8]] = _bits(rows)[[0, 2, 4]]
  out = jax.jit(lambda t, r, i: pages.store_pages(t, r, i, impl=name, interpret=interpret),
                donate_argnums=0)(table, rows, ids)
  np.testing.assert_array_equal(_bits(out), want)


@pytest.mark.parametrize("name", implementations("pages"))
def test_no_pages_is_no_change(name):
  interpret = run_mode("pages", name, jnp.dtype(jnp.bfloat16), 64)
  table = jnp.arange(3 * 64, dtype=jnp.float32).reshape(3, 64).astype(jnp.bfloat16)
  out = pages.store_pages(table, jnp.zeros((0, 64), jnp.bfloat16), jnp.zeros((0,), jnp.int32),
                          impl=name, interpret=interpret)
  np.testing.assert_array_equal(_bits(out), _bits(table))


def test_explain_names_the_kernel_on_gpu_and_the_scatter_on_cpu():
  spec = kvjax.KVCacheSpec(num_kv_heads=2, head_size=64, block_size=16)
  assert kvjax.explain("pages", spec, platform="gpu").name == "pallas"
  assert kvjax.explain("pages", spec, platform="cpu").name == "reference"
  assert registry.PAGES.get("pallas").reason(np.dtype(np.float64), 8) is not None
