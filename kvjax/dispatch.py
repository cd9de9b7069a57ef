"""The one dispatch point: which implementation runs an op, and whether Pallas interprets."""
from __future__ import annotations

import jax

from kvjax.validation import check_impl


def platform() -> str:
  """The default backend's platform: "gpu", "tpu" or "cpu"."""
  return jax.default_backend()


def choose(impl: str, interpret):
  """Resolve ``impl`` ("auto" | "pallas" | "reference") and ``interpret`` (None = auto).

  auto: the compiled Pallas kernel on GPU, the reference on CPU (Pallas runs on
  CPU only in interpret mode, which is for tests). Returns (impl, interpret).
  """
  check_impl(impl)
  on_cpu = platform() == "cpu"
  if impl == "auto":
    impl = "reference" if on_cpu else "pallas"
  if interpret is None:
    interpret = on_cpu
  return impl, bool(interpret)
