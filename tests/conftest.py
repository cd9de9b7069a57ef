"""Test setup: 8 simulated CPU devices (for sharding and transfer tests)."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def rng():
  """A fresh numpy Generator per test; its seed is printed (shown when the test fails).

  Set KVJAX_TEST_SEED to replay a failure.
  """
  seed = int(os.environ.get("KVJAX_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
  print(f"rng seed = {seed} (replay with KVJAX_TEST_SEED={seed})")
  return np.random.default_rng(seed)
