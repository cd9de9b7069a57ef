"""Shared helpers of the torch tests: the ``device`` parameter, random tensors, cache bytes.

``device`` runs a test on CPU, and again on CUDA when both torch and JAX see a GPU
(on a GPU machine: ``JAX_PLATFORMS=cuda,cpu python -m pytest tests/test_torch_*.py``;
tests/conftest.py defaults JAX to the CPU otherwise). References are computed by
kvjax's reference on JAX's CPU device, the oracle on every machine.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from torch_bridge import layout as L

CPU = jax.devices("cpu")[0]


def _cuda_ready() -> bool:
  if not torch.cuda.is_available():
    return False
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


requires_cuda = pytest.mark.skipif(
    not _cuda_ready(), reason="needs a CUDA GPU seen by torch and JAX (JAX_PLATFORMS=cuda,cpu)")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=requires_cuda)])
def device(request):
  return torch.device(request.param)


def sync(device):
  if torch.device(device).type == "cuda":
    torch.cuda.synchronize(device)


def rand_bf16(rng, shape, device="cpu", scale=1.0):
  return torch.from_numpy((rng.standard_normal(shape) * scale).astype(np.float32)).to(
      device, torch.bfloat16)


def to_jnp(t: torch.Tensor):
  """A torch tensor's values as a bf16 JAX array on the CPU."""
  return jax.device_put(jnp.asarray(t.detach().float().cpu().numpy()).astype(jnp.bfloat16), CPU)


def on_cpu(x):
  return jax.device_put(jnp.asarray(x), CPU)


def cache_bytes(t: torch.Tensor, spec) -> np.ndarray:
  """The cache's physical bytes (uint8, flat) on the host, after torch's queued work."""
  sync(t.device)
  return L.physical_tensor(t, spec).contiguous().reshape(-1).view(torch.uint8).cpu().numpy()


def cache_array(t: torch.Tensor, spec):
  """The cache's bytes as the spec's physical JAX array on the CPU (a copy)."""
  raw = cache_bytes(t, spec).view(spec.storage_dtype)
  return on_cpu(raw.reshape(L.physical_tensor(t, spec).shape))


def jax_bytes(a) -> np.ndarray:
  """Bytes of a JAX array read now. ``jnp.copy`` first: on a GPU ``np.asarray`` keeps a host
  copy of the array, which would hide later writes through torch."""
  return np.asarray(jnp.copy(a)).reshape(-1).view(np.uint8)


def poison(rng, t: torch.Tensor, spec):
  """Fill the cache tensor's physical buffer with random bytes, in place."""
  flat = L.physical_tensor(t, spec).reshape(-1).view(torch.uint8)
  flat.copy_(torch.from_numpy(rng.integers(0, 256, flat.numel(), dtype=np.uint8)).to(t.device))
  sync(t.device)
