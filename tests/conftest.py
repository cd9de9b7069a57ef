"""Test setup: 8 simulated CPU devices (for sharding and transfer tests), x64 off."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def rng(request):
  """A fresh numpy Generator per test, seeded from the test's name (reproducible, varied)."""
  import zlib
  return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
