"""The Hadamard rotation of vLLM's int4 cache: signs, transform, inverse."""
import jax
import numpy as np
import pytest

from kvjax import rotation

# jitted: eagerly each butterfly stage's ops compile on their own for every new shape
hadamard = jax.jit(rotation.hadamard)
rht = jax.jit(rotation.rht, static_argnames="inverse")


def _sylvester(d):
  h = np.ones((1, 1))
  while h.shape[0] < d:
    h = np.block([[h, h], [h, -h]])
  return h


@pytest.mark.parametrize("d", [16, 64, 128, 256])
def test_hadamard_equals_sylvester_matrix(rng, d):
  x = (rng.standard_normal((5, d)) * 10.0 ** rng.uniform(-3, 3, (5, 1))).astype(np.float32)
  got = np.asarray(hadamard(x), np.float64)
  want = x.astype(np.float64) @ _sylvester(d)
  scale = np.abs(x).sum(-1, keepdims=True)          # bound on every partial sum
  bound = np.broadcast_to(4 * np.log2(d) * 2**-24 * scale, got.shape)
  np.testing.assert_array_less(np.abs(got - want), bound)


@pytest.mark.parametrize("d", [32, 128])
def test_inverse_undoes_forward_times_d(rng, d):
  x = rng.standard_normal((3, 4, d)).astype(np.float32)
  back = np.asarray(rht(rht(x), inverse=True)) / d
  np.testing.assert_allclose(back, x, rtol=0, atol=4 * d * 2**-24 * np.abs(x).max())


def test_signs_are_prefixes_and_plus_minus_one():
  for d in (16, 64, 1024):
    s = rotation.rht_signs(d)
    assert s.shape == (d,) and set(np.unique(s).tolist()) <= {-1.0, 1.0}
  np.testing.assert_array_equal(rotation.rht_signs(1024)[:128], rotation.rht_signs(128))


@pytest.mark.parametrize("d", [16, 32, 64, 128, 256, 512, 1024])
def test_signs_match_torch_generator(d):
  torch = pytest.importorskip("torch")
  gen = torch.Generator(device="cpu")
  gen.manual_seed(0x9E3779B9)
  want = 2.0 * torch.bernoulli(torch.full((d,), 0.5), generator=gen) - 1.0
  np.testing.assert_array_equal(rotation.rht_signs(d), want.numpy().astype(np.float32))


@pytest.mark.parametrize("bad", [0, 1, 96, 2048])
def test_bad_head_size_is_refused(bad):
  with pytest.raises(ValueError, match=f"head_size={bad}"):
    rotation.rht_signs(bad)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("d", [16, 128])
def test_attention_forms_equal_the_butterflies(rng, dtype, d):
  """rotate_q / unrotate_out (one matrix product) equal rotate / unrotate (butterflies) up
  to the summation order: within one unit in the last place of the result's dtype plus the
  float32 summation error bound (D * 2**-24 * sum |x| of the row: ``H`` entries are ±1)."""
  import jax.numpy as jnp
  rot = rotation.HADAMARD
  x = jnp.asarray(rng.standard_normal((64, 3, d)) * 10.0 ** rng.uniform(-2, 2, (64, 3, 1)),
                  dtype)
  mant = {"bfloat16": 8, "float16": 11, "float32": 24}[dtype]
  for fast, slow, k in ((rot.rotate_q, rot.rotate, 1.0), (rot.unrotate_out, rot.unrotate, 1 / d)):
    got, want = (np.asarray(f(x)).astype(np.float64) for f in (fast, slow))
    row = k * np.abs(np.asarray(x).astype(np.float64)).sum(-1, keepdims=True)
    tol = np.abs(want) * 2.0 ** (1 - mant) + 2 * d * 2.0 ** -24 * row
    assert (np.abs(got - want) <= tol).all()
    assert np.abs(want).max() > 0
