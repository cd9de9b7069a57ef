"""Adapter tables: how a kernel backend finds its per-format code from a codec's facts.

Codecs (:mod:`kvjax.codecs`) describe bytes and numbers only and name no backend. Each
kernel backend owns one :class:`AdapterTable`: rows that match codecs by their facts (row
format or head-group sides, which scales take part, the quantized number format, the
storage dtype) and give the backend's hooks for them. The first matching row wins; a codec
no row matches is a format the backend cannot run, and :meth:`AdapterTable.reason` says so
in the words the registry's ``explain`` prints.

A new cache format whose facts an existing row matches runs on that backend with no
backend code; a new backend writes its hook classes and one table.

>>> import kvjax
>>> table = AdapterTable("toy", (Adapter("plain rows", lambda c: c.is_plain, "PlainHooks"),))
>>> table.hooks(kvjax.KVCacheSpec(2, 64, 16).codec)
'PlainHooks'
>>> print(table.reason(kvjax.KVCacheSpec(2, 64, 16, "fp8")))
cache_dtype='fp8' has no toy adapter (its rows: plain rows)
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Tuple

import jax.numpy as jnp


def packs(codec, number_format: str) -> bool:
  """Whether ``codec`` quantizes to the packed number format named ``number_format``
  ("int4", "e2m1": the sub-byte formats, named by string since numpy has no dtype for them)."""
  return isinstance(codec.quant, str) and codec.quant == number_format


def stores_fp8(codec) -> bool:
  """Whether ``codec`` stores fp8 elements (e4m3 / e5m2 storage)."""
  dt = codec.storage
  return dt is not None and dt.itemsize == 1 and jnp.issubdtype(dt, jnp.floating)


@dataclasses.dataclass(frozen=True)
class Adapter:
  """One row of an adapter table.

  Attributes:
    name: what the row adapts, in words (``explain`` prints it).
    matches: ``matches(codec) -> bool``, from the codec's facts only.
    hooks: the backend's hooks for matching codecs (usually a class).
  """
  name: str
  matches: Callable[[object], bool]
  hooks: object


@dataclasses.dataclass(frozen=True)
class AdapterTable:
  """A backend's adapters, tried in order.

  Attributes:
    backend: the backend's name, for messages.
    rows: its :class:`Adapter` rows.
  """
  backend: str
  rows: Tuple[Adapter, ...]

  def row(self, codec) -> Optional[Adapter]:
    """The first row matching ``codec``, or None."""
    return next((r for r in self.rows if r.matches(codec)), None)

  def hooks(self, codec):
    """The hooks of the first row matching ``codec``, or None."""
    row = self.row(codec)
    return None if row is None else row.hooks

  def reason(self, spec) -> Optional[str]:
    """None when a row matches ``spec``'s codec, else why the backend cannot run it."""
    if self.row(spec.codec) is not None:
      return None
    names = ", ".join(r.name for r in self.rows)
    return f"cache_dtype={spec.cache_dtype!r} has no {self.backend} adapter (its rows: {names})"
