"""Former dispatch helpers, kept for existing callers: use :mod:`kvjax.registry` instead."""
from __future__ import annotations

from kvjax import registry
from kvjax.registry import platform  # noqa: F401  (re-exported)


def check_impl(impl: str):
  """ValueError unless ``impl`` is "auto" or registered for both writes and attention."""
  registry.WRITE.check(impl)
  registry.ATTENTION.check(impl)
