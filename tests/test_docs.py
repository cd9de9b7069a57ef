"""The docstrings of the public API: every ``>>>`` example runs as written (doctest), and
``help(kvjax.KVCacheSpec)`` documents every public attribute."""
import dataclasses
import doctest
import importlib
import inspect
import pathlib
import pydoc
import re
import subprocess
import sys

import pytest

import kvjax

# module: how many examples it must hold at least (so a lost docstring shows)
DOCTESTED = {"kvjax.attention": 8, "kvjax.cache_ops": 16, "kvjax.spec": 8, "kvjax.paging": 10,
             "kvjax.registry": 3, "kvjax.rotation": 2, "kvjax.adapters": 3}


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


# -- the documentation pages -------------------------------------------------------------------
ROOT = pathlib.Path(__file__).resolve().parents[1]
#: Pages whose python blocks run as written on CPU (each in a fresh namespace, one interpreter).
RUNNABLE_PAGES = ["docs/formats.md", "docs/ops.md", "docs/backends.md", "docs/pytorch.md",
                  "docs/serving.md", "docs/performance.md", "docs/testing.md"]
#: Pages whose relative links must resolve (files, and #anchors to their headings).
LINKED_PAGES = ["README.md"] + RUNNABLE_PAGES


def _blocks(page, lang):
  return [code for tag, code in re.findall(r"```(\w+)\n(.*?)```", (ROOT / page).read_text(),
                                           flags=re.S) if tag == lang]


def _slug(heading):
  """GitHub's anchor of a markdown heading."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_doc_pages_python_blocks_run():
  from xla_cpu import subprocess_env
  blocks = [(page, code) for page in RUNNABLE_PAGES for code in _blocks(page, "python")]
  assert len(blocks) >= 4
  driver = ("import sys\n"
            "for name, code in zip(sys.argv[1::2], sys.argv[2::2]):\n"
            "  print('---', name, flush=True)\n"
            "  exec(compile(code, name, 'exec'), {'__name__': '__main__'})\n")
  args = [a for i, (page, code) in enumerate(blocks) for a in (f"<{page} block {i}>", code)]
  proc = subprocess.run([sys.executable, "-c", driver, *args], cwd=ROOT,
                        env=subprocess_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.mark.parametrize("page", LINKED_PAGES)
def test_doc_links_resolve(page):
  text = (ROOT / page).read_text()
  text = re.sub(r"```.*?```", "", text, flags=re.S)
  for target in re.findall(r"\]\(([^)\s]+)\)", text):
    if re.match(r"\w+://", target):
      continue
    path, _, anchor = target.partition("#")
    dest = (ROOT / page).parent / path if path else ROOT / page
    assert dest.exists(), f"{page} links to {target}, which does not exist"
    if anchor and dest.suffix == ".md":
      headings = re.findall(r"^#+ (.+)$", dest.read_text(), flags=re.M)
      assert anchor in {_slug(h) for h in headings}, f"{page}: no heading for #{anchor} in {path}"
  for code in _blocks(page, "bash"):
    for word in re.findall(r"[\w./-]+\.(?:py|ipynb)\b", code):
      assert (ROOT / word).exists(), f"{page} names {word}, which does not exist"
