"""The docstrings of the public API: every ``>>>`` example runs as written (doctest), and
``help(kvjax.KVCacheSpec)`` documents every public attribute."""
import dataclasses
import doctest
import importlib
import inspect
import pydoc

import pytest

import kvjax

# module: how many examples it must hold at least (so a lost docstring shows)
DOCTESTED = {"kvjax.attention": 8, "kvjax.cache_ops": 12, "kvjax.spec": 8, "kvjax.paging": 10,
             "kvjax.registry": 3, "kvjax.rotation": 2}


@pytest.mark.parametrize("name", sorted(DOCTESTED))
def test_docstring_examples_run(name):
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  assert result.failed == 0, f"{result.failed} of {result.attempted} examples of {name} failed"
  assert result.attempted >= DOCTESTED[name]


@pytest.mark.parametrize("cls", [kvjax.KVCacheSpec, kvjax.MLACacheSpec])
def test_help_documents_every_public_attribute(cls):
  text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
  assert "# --" not in text                     # pydoc shows the comment above an undocumented def
  fields = {f.name for f in dataclasses.fields(cls)}
  for name in fields:
    assert f"    {name}: " in cls.__doc__, f"{cls.__name__}.{name} is not in the class docstring"
  for name, member in vars(cls).items():
    if name.startswith("_") or name in fields:
      continue
    doc = inspect.getdoc(member.fget if isinstance(member, property) else member)
    assert doc, f"{cls.__name__}.{name} has no docstring"
