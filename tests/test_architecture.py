"""The shape of the source tree: no import cycle inside ``kvjax/``; codecs name no backend;
format kinds are decided in one place.

Only the codecs (``kvjax/codecs/``), the table of cache dtypes (``kvjax/formats.py``), the
backends' adapter tables (``pallas_kernels/*/adapters.py``) and the vLLM adapter's mapping of
vLLM's names (``torch_bridge/vllm_adapter.py``) may branch on a format's kind or cache-dtype
name; everything else asks the codec's facts.
"""
import ast
import pathlib

import pytest

import kvjax

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = ("kvjax", "pallas_kernels", "torch_bridge")
MAY_BRANCH_ON_KINDS = ("kvjax/codecs/", "kvjax/formats.py", "torch_bridge/vllm_adapter.py")
KIND_NAMES = {"PLAIN", "FP8_PER_TENSOR", "PER_TOKEN_HEAD", "NVFP4"}
CODEC_CLASSES = {"PlainCodec", "Fp8PerTensorCodec", "PerTokenHeadCodec",
                 "Int4PerTokenHeadCodec", "Nvfp4Codec"}


def _modules(package: str):
  """{module name: path} of a package's source files."""
  out = {}
  for path in sorted((ROOT / package).rglob("*.py")):
    parts = path.relative_to(ROOT).with_suffix("").parts
    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return out


def _imports(path: pathlib.Path, modules) -> set:
  """The modules of ``modules`` that a file imports, at any depth (lazy imports count); a
  package's own ``__init__`` that every submodule import runs does not."""
  name = ".".join(path.relative_to(ROOT).with_suffix("").parts)

  def known(dotted):
    while dotted and dotted not in modules:
      dotted = dotted.rpartition(".")[0]
    return dotted or None

  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found.update(filter(None, (known(a.name) for a in node.names)))
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      subs = [f"{node.module}.{a.name}" for a in node.names
              if f"{node.module}.{a.name}" in modules]
      found.update(subs)
      if len(subs) < len(node.names) and known(node.module):
        found.add(known(node.module))
  return {m for m in found if not name.startswith(m + ".") and m != name.removesuffix(".__init__")}


def _cycles(package: str):
  """Strongly connected components of more than one module (Tarjan)."""
  modules = _modules(package)
  graph = {m: _imports(p, modules) for m, p in modules.items()}
  index, low, stack, on, comps = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        comps.append(sorted(comp))

  for v in graph:
    if v not in index:
      visit(v)
  return comps


@pytest.mark.parametrize("package", LIBRARY)
def test_no_import_cycle(package):
  assert _cycles(package) == []


def test_codecs_name_no_backend():
  for path in (ROOT / "kvjax" / "codecs").rglob("*.py"):
    text = path.read_text()
    for word in ("pallas_kernels", "kvjax.registry", "triton", "mosaic"):
      assert word not in text, f"{path.relative_to(ROOT)} names {word!r}"


def _kind_branches(path: pathlib.Path):
  """``(line, what)`` of each place a file decides by a format's kind or cache-dtype name:
  a comparison or membership test with a kind constant (``F.NVFP4``, ``Nvfp4Codec.kind``) or
  a cache-dtype / kind string, and ``isinstance`` against a concrete codec class. (A bare
  ``x.kind ==`` is not one: numpy dtypes have kinds too.)"""
  names = set(kvjax.CACHE_FORMATS) - {"auto"}
  kinds = {f.kind for f in kvjax.CACHE_FORMATS.values()}

  def is_kind(node):
    if isinstance(node, ast.Attribute) and (node.attr in KIND_NAMES or (
        node.attr == "kind" and isinstance(node.value, ast.Name)
        and node.value.id in CODEC_CLASSES)):
      return True
    if isinstance(node, ast.Name) and node.id in KIND_NAMES:
      return True
    if isinstance(node, ast.Constant) and node.value in names | kinds:
      return True
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
      return any(is_kind(e) for e in node.elts)
    return False

  found = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Compare) and any(map(is_kind, [node.left, *node.comparators])):
      found.append((node.lineno, ast.unparse(node)))
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
          and node.func.id == "isinstance" and len(node.args) == 2
          and any(n in ast.unparse(node.args[1]) for n in CODEC_CLASSES)):
      found.append((node.lineno, ast.unparse(node)))
  return found


def test_format_kinds_are_decided_by_codecs_and_adapter_tables_only():
  offenders = []
  for package in LIBRARY:
    for path in sorted((ROOT / package).rglob("*.py")):
      rel = path.relative_to(ROOT).as_posix()
      if rel.startswith(MAY_BRANCH_ON_KINDS) or rel.endswith("/adapters.py"):
        continue
      offenders += [f"{rel}:{line}: {what}" for line, what in _kind_branches(path)]
  assert offenders == []


def test_the_branch_finder_finds_branches(tmp_path):
  """The check above can fail: each form it looks for is found."""
  src = tmp_path / "m.py"
  src.write_text("if spec.format.kind == F.NVFP4: pass\n"
                 "ok = spec.cache_dtype in ('fp8', 'nvfp4')\n"
                 "ok = isinstance(spec.codec, Nvfp4Codec)\n"
                 "ok = fmt.kind != Nvfp4Codec.kind\n"
                 "ok = codec.has_row_scales and dt.kind == 'i'\n")
  assert [line for line, _ in _kind_branches(src)] == [1, 2, 3, 4]


@pytest.mark.parametrize("package", LIBRARY)
def test_no_library_file_over_450_lines(package):
  long = [f"{p.relative_to(ROOT)}: {n}" for p in (ROOT / package).rglob("*.py")
          if (n := len(p.read_text().splitlines())) > 450]
  assert long == []


_IMPORT_UNDER_TRACE = """
import importlib, sys, jax
failed = []
def body(x):
  for name in sys.argv[1:]:
    try:
      importlib.import_module(name)
    except ImportError:          # a backend this machine lacks (torch, Mosaic GPU)
      pass
    except Exception as e:       # noqa: BLE001
      failed.append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
  return x
jax.jit(body)(1.0)
print("\\n".join(failed))
"""


def test_every_module_imports_first_under_a_jit_trace():
  """The registry imports a backend when a call first needs it, often while a jitted step is
  traced: module-level values made with jnp must be computed eagerly
  (``jax.ensure_compile_time_eval``), not traced. A fresh process imports every library
  module for the first time inside ``jax.jit``."""
  import subprocess
  import sys
  names = [n for p in LIBRARY for n in _modules(p)]
  done = subprocess.run([sys.executable, "-c", _IMPORT_UNDER_TRACE, *names], cwd=ROOT,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.strip() == "", done.stdout
