"""Machine code of the Pallas-Triton kernels for the H200 (sm_90), built on a machine without a GPU.

Registers per thread, spills, shared memory and the SASS instruction mix of a kernel tell
whether a change to it helps before it is timed on a GPU. This tool builds one of the kernels
for static shapes, takes the Triton IR that JAX's Pallas lowering hands to XLA for CUDA,
compiles it with a stand-alone Triton for ``sm_90a`` (no GPU, no CUDA driver) and reads the
result with ``ptxas -v`` and ``nvdisasm``::

    python benchmarks/triton_sass.py --kernel decode --cache-dtype fp8 --layout NHD
    python benchmarks/triton_sass.py --kernel decode --cache-dtype nvfp4 --layout HND \\
        --config tokens_per_step=128,num_stages=2 --by-line --save /tmp/sass_nvfp4
    python benchmarks/triton_sass.py --kernel ragged --query-len 64 --num-seqs 4
    python benchmarks/triton_sass.py --kernel write --cache-dtype int4_per_token_head
    python benchmarks/triton_sass.py --table          # the decode sweep (Markdown table)

Requirements. The project never imports Triton; this tool runs it in a child process from a
separate directory: ``pip install --no-deps --target DIR triton==3.6.0``, then pass
``--triton-path DIR`` (or have ``triton`` importable). The wheel carries ``ptxas``,
``cuobjdump`` and ``nvdisasm`` (``triton/backends/nvidia/bin``); ``--ptxas`` / ``--nvdisasm``
pick others (default: ``ptxas`` on PATH when there is one, since the GPU build assembles with
the CUDA toolkit's ptxas, else Triton's).

Pipeline.

1. Build the kernel call with abstract arguments (``jax.ShapeDtypeStruct``) and lower it with
   ``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``: Pallas' Triton lowering runs
   on CPU. The Triton module (``tt`` dialect) is read two ways, which agree: from the
   ``__gpu$xla.gpu.triton`` custom call's backend config (jaxlib <= 0.10.2 puts the module there
   as MLIR bytecode in the ``ir`` string, next to ``num_warps`` / ``num_stages`` / grid; it is
   loaded with jaxlib's MLIR bindings and the Triton dialect and printed as text), and from a
   hook on ``jax._src.pallas.triton.lowering.lower_jaxpr_to_triton_module`` (any jax version;
   warps and stages are then read from the lowering rule's locals). Neither needs Triton.
2. Compile (child process, Triton only): parse the text with Triton's MLIR, run Triton's
   CUDA stages ttir -> ttgir -> llir -> ptx for ``GPUTarget("cuda", 90, 32)`` with the
   kernel's num_warps / num_stages. ``triton.compile`` itself is not used: it would skip the
   ttir passes for an IR input (jaxlib's pipeline runs them) and asks a driver for the target
   when none is given. jaxlib's bytecode (an MLIR newer than Triton 3.6's) does not load in
   Triton 3.6; the text form does (tried in that order: text with source locations, text
   without, bytecode; the report names the form used).
3. ``ptxas -lineinfo -v --gpu-name=sm_90a`` (registers, spill bytes, stack, barriers),
   ``nvdisasm -c -g`` (SASS). Loops are the backward branches of the SASS; the *main loop* is
   the one with the most MMA instructions (then the largest). Histograms group opcodes (global
   loads by width, cp.async ``LDGSTS``, conversions, MMA, fp32, integer / address, byte
   shuffles, MUFU, shuffles, barriers, ...) for the whole kernel and for one main-loop
   iteration. ``--by-line`` attributes main-loop instructions to Python source lines: every
   source location of the IR is renumbered as a line of one pseudo file before compiling (the
   LLVM debug info Triton emits keeps one file per kernel), so the SASS line table maps back.

Caveat: on the GPU the IR is compiled by jaxlib's own Triton (XLA's copy, close to upstream
Triton but not 3.6), assembled by the CUDA toolkit's ptxas. Counts here are a close model of
that build, not the build itself; ``--jaxlib`` (GPU machine only: it needs jaxlib's CUDA
Triton compile handler) compiles the same IR with jaxlib's Triton and reads its PTX the same
way, to calibrate. One known difference: Triton 3.6's alignment analysis over-claims through
the ``select`` of a Python-style ``x % n``, so rows addressed through one may show wider copies
here than the GPU build can use (benchmarks/results/decode_sass.md).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRITON_CALL = "__gpu$xla.gpu.triton"
LINE_FILE = "kernel_lines"          # pseudo file of the renumbered source locations (--by-line)


# -- 1. the Triton IR of a kernel call (jax only) ------------------------------------------------
@dataclasses.dataclass
class TritonKernelIR:
  """One Triton kernel of a lowered JAX function.

  Attributes:
    name: kernel (``tt.func``) name.
    text: the ``tt`` module as MLIR text, with source locations.
    text_plain: the same without locations.
    bytecode: the MLIR bytecode XLA receives (None when the lowering did not expose it).
    num_warps, num_stages: launch parameters of the Pallas compiler params (after Pallas'
      defaults).
    grid: (x, y, z) program grid, or None when unknown.
    source: how the module was read ("backend_config bytecode" or "lowering hook").
  """
  name: str
  text: str
  text_plain: str
  bytecode: bytes | None
  num_warps: int
  num_stages: int
  grid: tuple | None
  source: str


def _walk_ops(op):
  for region in op.regions:
    for block in region:
      for inner in block:
        yield inner
        yield from _walk_ops(inner)


def _module_texts(bytecode: bytes):
  """(text with locations, text without) of a ``tt`` module given as MLIR bytecode."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.triton import dialect as tt_dialect
  with ir.Context() as ctx:
    tt_dialect.register_dialect(ctx)
    ctx.allow_unregistered_dialects = True
    module = ir.Module.parse(bytecode)
    return (module.operation.get_asm(enable_debug_info=True),
            module.operation.get_asm(enable_debug_info=False))


def _kernel_name(text: str) -> str:
  m = re.search(r"tt\.func\s+(?:public\s+)?@([\w$.]+)", text)
  return m.group(1) if m else "kernel"


def triton_kernels(fn, *args) -> list[TritonKernelIR]:
  """The Triton kernels of ``fn(*args)`` lowered for CUDA (runs on CPU; no Triton needed).

  Args:
    fn: a JAX function; args: its arguments (``jax.ShapeDtypeStruct`` or arrays).
  Returns:
    one :class:`TritonKernelIR` per Pallas-Triton call, in program order.
  """
  import jax
  from jax._src.pallas.triton import lowering as tt_lowering

  hooked = []
  original = tt_lowering.lower_jaxpr_to_triton_module

  def hook(*a, **kw):
    result = original(*a, **kw)
    caller = sys._getframe(1).f_locals
    op = result.module.operation
    hooked.append(dict(text=op.get_asm(enable_debug_info=True),
                       text_plain=op.get_asm(enable_debug_info=False),
                       num_warps=caller.get("num_warps"), num_stages=caller.get("num_stages"),
                       grid=getattr(result, "grid", None)))
    return result

  jax.clear_caches()          # a cached lowering would not run the hook
  tt_lowering.lower_jaxpr_to_triton_module = hook
  # Choices the kernels make from the CUDA device they see are made for the target: sm_90.
  from pallas_kernels.triton import pairs
  device_capability, pairs.cuda_capability = pairs.cuda_capability, lambda: (9, 0)
  try:
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  except Exception:
    if not hooked:            # newer jaxlib may compile at lowering; the hook already has the IR
      raise
    lowered = None
  finally:
    tt_lowering.lower_jaxpr_to_triton_module = original
    pairs.cuda_capability = device_capability

  from_config = []
  if lowered is not None:
    from jax._src.lib.mlir import ir
    for op in _walk_ops(lowered.compiler_ir("stablehlo").operation):
      attrs = op.attributes
      if op.name != "stablehlo.custom_call" or "call_target_name" not in attrs:
        continue
      if ir.StringAttr(attrs["call_target_name"]).value != TRITON_CALL:
        continue
      cfg = attrs["mhlo.backend_config"]
      bytecode = ir.StringAttr(cfg["ir"]).value_bytes
      text, plain = _module_texts(bytecode)
      geti = lambda k: ir.IntegerAttr(cfg[k]).value
      from_config.append(TritonKernelIR(
          _kernel_name(text), text, plain, bytecode, geti("num_warps"), geti("num_stages"),
          (geti("grid_x"), geti("grid_y"), geti("grid_z")), "backend_config bytecode"))
  if from_config:
    if len(hooked) == len(from_config):
      for k, h in zip(from_config, hooked):
        if h["text_plain"] != k.text_plain:
          raise RuntimeError(f"kernel {k.name}: the hooked module differs from the bytecode")
    return from_config
  kernels = []
  for h in hooked:
    if h["num_warps"] is None or h["num_stages"] is None:
      raise RuntimeError("could not read num_warps / num_stages of the Pallas lowering")
    grid = h["grid"]
    kernels.append(TritonKernelIR(
        _kernel_name(h["text"]), h["text"], h["text_plain"], None, int(h["num_warps"]),
        int(h["num_stages"]), tuple(grid) if grid is not None else None, "lowering hook"))
  return kernels


# -- kernel builders ------------------------------------------------------------------------------
def _parse_overrides(text: str | None) -> dict:
  """``"a=1,b=true,c=none"`` -> {"a": 1, "b": True, "c": None}."""
  out = {}
  for item in filter(None, (s.strip() for s in (text or "").split(","))):
    key, sep, raw = item.partition("=")
    if not sep:
      raise ValueError(f"--config item {item!r}: expected key=value")
    low = raw.strip().lower()
    if low in ("true", "false"):
      val = low == "true"
    elif low == "none":
      val = None
    else:
      try:
        val = int(raw)
      except ValueError:
        val = float(raw)
    out[key.strip()] = val
  return out


def _replace_config(config, overrides: dict):
  fields = {f.name for f in dataclasses.fields(config)}
  unknown = set(overrides) - fields
  if unknown:
    raise ValueError(f"--config keys {sorted(unknown)} are not fields of "
                     f"{type(config).__name__} (fields: {sorted(fields)})")
  return dataclasses.replace(config, **overrides)


@dataclasses.dataclass
class KernelCall:
  """A kernel call to lower: fn(*args), what it is, and its tuning config."""
  fn: object
  args: tuple
  label: str
  config: object
  tokens_per_iter: int | None   # KV tokens one main-loop iteration covers (None: unknown)


def build_call(a) -> KernelCall:
  """The kernel call that the command-line arguments ``a`` describe (abstract arguments)."""
  import jax
  import jax.numpy as jnp
  from kvjax import KVCacheSpec

  spec = KVCacheSpec(a.hkv, a.head_size, a.block_size, a.cache_dtype, a.layout)
  max_blocks = -(-a.context // a.block_size)
  num_blocks = a.num_blocks or a.num_seqs * max_blocks
  cache = jax.ShapeDtypeStruct(spec.physical_shape(num_blocks), spec.storage_dtype)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  q_dtype = jnp.dtype(a.q_dtype)
  ks = 0.5 if spec.format.has_tensor_scales else None
  overrides = _parse_overrides(a.config)
  opts = dict(scale=1.0 / a.head_size ** 0.5,
              sliding_window=a.window, soft_cap=a.soft_cap,
              sinks=jnp.zeros(a.hq, jnp.float32) if a.sinks else None, k_scale=ks, v_scale=ks)
  shape = f"{a.num_seqs}x{a.context} Hq={a.hq} H={a.hkv} D={a.head_size} N={a.block_size}"
  if a.kernel == "decode":
    from pallas_kernels.triton.decode import paged_decode_attention
    from pallas_kernels.triton.decode_config import choose_num_splits, default_config
    config = _replace_config(default_config(spec), overrides)
    splits = choose_num_splits(config, a.num_seqs, a.hkv, max_blocks, a.block_size)
    q = jax.ShapeDtypeStruct((a.num_seqs, a.hq, a.head_size), q_dtype)
    fn = lambda q, c, sl, bt: paged_decode_attention(
        q, c, spec, seq_lens=sl, block_table=bt, config=config, **opts)
    return KernelCall(fn, (q, cache, i32(a.num_seqs), i32(a.num_seqs, max_blocks)),
                      f"decode {a.cache_dtype} {a.layout} {shape} splits={splits}", config,
                      config.step_tokens(a.block_size))
  if a.kernel == "ragged":
    from pallas_kernels.common import next_pow2
    from pallas_kernels.triton.formats import TileFormat
    from pallas_kernels.triton.ragged import default_tile_config, ragged_paged_attention
    tokens = a.tokens or a.num_seqs * a.query_len
    mql = min(next_pow2(a.query_len), next_pow2(tokens))
    itemsize = TileFormat.of(spec, q_dtype).compute_dtype.itemsize
    config = _replace_config(
        default_tile_config(spec, a.hq // a.hkv, mql, False, itemsize), overrides)
    q = jax.ShapeDtypeStruct((tokens, a.hq, a.head_size), q_dtype)
    fn = lambda q, c, qsl, sl, bt: ragged_paged_attention(
        q, c, spec, query_start_loc=qsl, seq_lens=sl, block_table=bt, causal=True,
        max_query_len=a.query_len, tile_config=config, **opts)
    return KernelCall(fn, (q, cache, i32(a.num_seqs + 1), i32(a.num_seqs),
                           i32(a.num_seqs, max_blocks)),
                      f"ragged {a.cache_dtype} {a.layout} {shape} T={tokens} "
                      f"max_query_len={a.query_len}", config, config.block_kv)
  if a.kernel == "write":
    from pallas_kernels.triton.write import default_config, write_kv
    config = _replace_config(default_config(spec), overrides)
    tokens = a.tokens or a.num_seqs
    kv = jax.ShapeDtypeStruct((tokens, a.hkv, a.head_size), spec.dtype)
    fn = lambda c, k, v, slots: write_kv(c, k, v, slots, spec, k_scale=ks, v_scale=ks,
                                         config=config)
    return KernelCall(fn, (cache, kv, kv, i32(tokens)),
                      f"write {a.cache_dtype} {a.layout} T={tokens} H={a.hkv} "
                      f"D={a.head_size} N={a.block_size} B={num_blocks}", config, None)
  raise ValueError(f"--kernel={a.kernel!r}: expected decode, ragged or write")


# -- 2. compile with a stand-alone Triton (child process) -----------------------------------------
def _split_top(body: str, sep: str):
  """Split ``body`` at ``sep`` outside parentheses, brackets and quotes."""
  parts, depth, quoted, cur, i = [], 0, False, [], 0
  while i < len(body):
    ch = body[i]
    if ch == '"' and (i == 0 or body[i - 1] != "\\"):
      quoted = not quoted
    elif not quoted and ch in "([<":
      depth += 1
    elif not quoted and ch in ")]>":
      depth -= 1
    if not quoted and depth == 0 and body.startswith(sep, i):
      parts.append("".join(cur))
      cur, i = [], i + len(sep)
      continue
    cur.append(ch)
    i += 1
  parts.append("".join(cur))
  return parts


def _frames(body: str, aliases: dict, memo: dict) -> tuple:
  """Source frames ((file, line), ... innermost first) of an MLIR location body."""
  body = body.strip()
  if body.startswith("#loc"):
    if body not in memo:
      memo[body] = ()                                   # cycles cannot happen; be safe
      memo[body] = _frames(aliases.get(body, "unknown"), aliases, memo)
    return memo[body]
  if body.startswith("callsite(") and body.endswith(")"):
    parts = _split_top(body[len("callsite("):-1], " at ")
    return _frames(parts[0], aliases, memo) + (
        _frames(parts[1], aliases, memo) if len(parts) > 1 else ())
  if body.startswith("fused"):
    inner = body[body.index("[") + 1:body.rindex("]")]
    for part in _split_top(inner, ","):
      if (got := _frames(part, aliases, memo)):
        return got
    return ()
  if (m := re.match(r'"((?:[^"\\]|\\.)*)"(.*)$', body, re.S)):
    rest = m.group(2).strip()
    if (f := re.match(r":(\d+):\d+", rest)):
      return ((m.group(1), int(f.group(1))),)
    if rest.startswith("(") and rest.endswith(")"):
      return _frames(rest[1:-1], aliases, memo)
  return ()


def renumber_locations(text: str):
  """Source locations -> lines of one pseudo file, so that SASS line info maps back.

  Every location alias (``#locN = loc(...)``: file / name / call-site / fused locations) is
  resolved to its Python call chain and replaced by ``loc("kernel_lines":ID:0)``, one ID per
  distinct chain (Triton's LLVM debug info keeps one file per kernel and one frame per
  instruction). Returns (text, table) with ``table[ID]`` = the chain ((file, line), ...),
  innermost frame first; ID 0 = no location.
  """
  lines = text.splitlines()
  alias_re = re.compile(r"^(#loc\d*) = loc\((.*)\)\s*$")
  aliases = {m.group(1): m.group(2) for ln in lines if (m := alias_re.match(ln))}
  memo, table, ids = {}, {0: ()}, {(): 0}

  def id_of(frames):
    if frames not in ids:
      ids[frames] = len(ids)
      table[ids[frames]] = frames
    return ids[frames]

  out = []
  for ln in lines:
    if (m := alias_re.match(ln)):
      ln = f'{m.group(1)} = loc("{LINE_FILE}":{id_of(_frames(m.group(1), aliases, memo))}:0)'
    out.append(ln)
  text = "\n".join(out) + "\n"
  # Locations written inline (not as aliases): plain file locations only.
  text = re.sub(r'loc\("([^"]*)":(\d+):\d+(?: to \d*:\d+)?\)',
                lambda m: f'loc("{LINE_FILE}":{id_of(((m.group(1), int(m.group(2))),))}:0)'
                if m.group(1) != LINE_FILE else m.group(0), text)
  return text.replace("loc(unknown)", f'loc("{LINE_FILE}":0:0)'), table


_WORKER = r'''
import json, sys
req = json.load(open(sys.argv[1]))
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import Language, make_backend
import triton, os
target = GPUTarget("cuda", req["arch"], 32)
backend = make_backend(target)
options = backend.parse_options({"num_warps": req["num_warps"], "num_stages": req["num_stages"]})
ctx = ir.context()
ir.load_dialects(ctx)
backend.load_dialects(ctx)
forms, module, used = {}, None, None
for form, path in req["inputs"]:
  try:
    m = ir.parse_mlir_module(path, ctx)
    forms[form] = "ok"
    if module is None:
      module, used = m, form
  except Exception as e:
    forms[form] = "failed: " + str(e).strip().splitlines()[-1]
if module is None:
  json.dump({"error": "no form of the IR parses in Triton " + triton.__version__,
             "forms": forms}, open(req["result"], "w"))
  sys.exit(0)
module.context = ctx
stages = {}
backend.add_stages(stages, options, Language.TRITON)
metadata = {"target": target, **options.__dict__}
out = {}
for ext in ("ttir", "ttgir", "llir", "ptx"):
  module = stages[ext](module, metadata)
  out[ext] = module if isinstance(module, str) else str(module)
  open(os.path.join(req["out"], "kernel." + ext), "w").write(out[ext])
bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
json.dump({"forms": forms, "used": used, "shared": metadata.get("shared"),
           "name": metadata.get("name"), "triton": triton.__version__, "bin": bindir,
           "num_warps": options.num_warps, "num_stages": options.num_stages},
          open(req["result"], "w"))
'''


@dataclasses.dataclass
class Compiled:
  """PTX and what the compiler said about it."""
  ptx: str
  shared_bytes: int | None       # dynamic shared memory Triton allocates at launch
  files: dict                    # stage -> path (ttir, ttgir, llir, ptx)
  info: dict                     # worker facts: IR forms tried, Triton version, bin dir


def compile_triton36(k: TritonKernelIR, work: str, triton_path: str | None, arch: int = 90,
                     line_ids: bool = True):
  """PTX of ``k`` from Triton's CUDA stages, in a child process (Triton never joins this one).

  Returns (Compiled, location table of :func:`renumber_locations` or None)."""
  table = None
  inputs = []
  if line_ids:
    text, table = renumber_locations(k.text)
    inputs.append(("text with source locations", text, "ttir"))
  inputs.append(("text", k.text_plain, "ttir"))
  if k.bytecode is not None:
    inputs.append(("bytecode", k.bytecode, "mlirbc"))
  paths = []
  for i, (form, data, ext) in enumerate(inputs):
    path = os.path.join(work, f"input{i}.{ext}")
    with open(path, "wb" if isinstance(data, bytes) else "w") as f:
      f.write(data)
    paths.append((form, path))
  req = dict(arch=arch, num_warps=k.num_warps, num_stages=k.num_stages, inputs=paths,
             out=work, result=os.path.join(work, "result.json"))
  with open(os.path.join(work, "request.json"), "w") as f:
    json.dump(req, f)
  env = dict(os.environ)
  if triton_path:
    env["PYTHONPATH"] = triton_path + os.pathsep + env.get("PYTHONPATH", "")
  proc = subprocess.run([sys.executable, "-c", _WORKER, os.path.join(work, "request.json")],
                        env=env, capture_output=True, text=True, cwd=work)
  if proc.returncode != 0 or not os.path.exists(req["result"]):
    raise RuntimeError(f"Triton compile of {k.name} failed:\n{proc.stderr[-4000:]}")
  with open(req["result"]) as f:
    info = json.load(f)
  if "error" in info:
    raise RuntimeError(f"{info['error']}: {info['forms']}")
  if info["used"] != "text with source locations":
    table = None
  files = {ext: os.path.join(work, f"kernel.{ext}") for ext in ("ttir", "ttgir", "llir", "ptx")}
  with open(files["ptx"]) as f:
    ptx = f.read()
  return Compiled(ptx, info.get("shared"), files, info), table


def _bytecode(text: str) -> bytes:
  """MLIR bytecode of a ``tt`` module text (jaxlib's MLIR, as the Pallas lowering writes it)."""
  import io
  from jax._src.lib.mlir import ir
  from jax._src.lib.triton import dialect as tt_dialect
  with ir.Context() as ctx:
    tt_dialect.register_dialect(ctx)
    buf = io.BytesIO()
    ir.Module.parse(text).operation.write_bytecode(buf)
    return buf.getvalue()


def compile_jaxlib(k: TritonKernelIR, work: str, arch: int = 90):
  """PTX of ``k`` from jaxlib's own Triton (needs jaxlib's CUDA compile handler: GPU jaxlib)."""
  import jax
  from jax._src.lib import triton as jaxlib_triton
  try:
    jax.devices("gpu")          # the CUDA plugin registers its Triton compile handler
  except RuntimeError:
    pass
  if not jaxlib_triton.has_compilation_handler("cuda"):
    raise RuntimeError("--jaxlib: this jaxlib has no CUDA Triton compile handler "
                       "(install jax[cuda] on a machine with an NVIDIA driver)")
  bytecode = k.bytecode if k.bytecode is not None else _bytecode(k.text)
  res = jaxlib_triton.compile("cuda", bytecode, f"{arch // 10}.{arch % 10}",
                              num_warps=k.num_warps, num_ctas=1, num_stages=k.num_stages)
  path = os.path.join(work, "kernel.ptx")
  with open(path, "w") as f:
    f.write(res.asm)
  return Compiled(res.asm, res.smem_bytes, {"ptx": path}, {"used": "jaxlib bytecode"}), None


# -- 3. ptxas and the SASS ---------------------------------------------------------------------
def _triton_bin(triton_path: str | None):
  """Triton's bundled CUDA tools folder, found without importing Triton (None if absent)."""
  import importlib.util
  roots = [triton_path] if triton_path else []
  spec = None if triton_path else importlib.util.find_spec("triton")
  if spec is not None and spec.origin:
    roots.append(os.path.dirname(os.path.dirname(spec.origin)))
  for root in roots:
    path = os.path.join(root, "triton", "backends", "nvidia", "bin")
    if os.path.isdir(path):
      return path
  return None


def find_tool(name: str, explicit: str | None, triton_bin: str | None, prefer_path: bool):
  """Path of a CUDA tool: explicit, else PATH (when preferred) or Triton's bundled copy."""
  if explicit:
    return explicit
  bundled = os.path.join(triton_bin, name) if triton_bin else None
  on_path = shutil.which(name)
  order = (on_path, bundled) if prefer_path else (bundled, on_path)
  for cand in order:
    if cand and os.path.exists(cand):
      return cand
  raise RuntimeError(f"{name} not found (pass --{name})")


@dataclasses.dataclass
class PtxasReport:
  """What ``ptxas -v`` says about the kernel."""
  registers: int
  spill_stores: int          # bytes
  spill_loads: int           # bytes
  stack: int                 # bytes
  static_smem: int           # bytes (Triton's shared memory is dynamic: see Compiled)
  barriers: int
  version: str
  log: str


def run_ptxas(ptxas: str, ptx_path: str, cubin_path: str, arch: int = 90) -> PtxasReport:
  cmd = [ptxas, "-lineinfo", "-v", f"--gpu-name=sm_{arch}a", ptx_path, "-o", cubin_path]
  proc = subprocess.run(cmd, capture_output=True, text=True)
  if proc.returncode != 0:
    raise RuntimeError(f"ptxas failed: {' '.join(cmd)}\n{proc.stderr[-4000:]}")
  log = proc.stderr + proc.stdout
  num = lambda pat: int(m.group(1)) if (m := re.search(pat, log)) else 0
  ver = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
  ver = (re.search(r"release ([\d.]+)", ver) or re.search(r"(.+)", ver or "?")).group(1)
  return PtxasReport(num(r"Used (\d+) registers"), num(r"(\d+) bytes spill stores"),
                     num(r"(\d+) bytes spill loads"), num(r"(\d+) bytes stack frame"),
                     num(r"(\d+) bytes smem"), num(r"used (\d+) barriers"), ver, log)


def occupancy(registers: int, shared_bytes: int, num_warps: int):
  """(CTAs per SM, what limits it) on sm_90 (H100 / H200): 64K registers allocated per warp
  in 256-register units, 228 KB shared memory with 1 KB reserved per CTA, 64 warps, 32 CTAs."""
  per_warp = -(-max(registers, 1) * 32 // 256) * 256
  limits = {"registers": (65536 // per_warp) // num_warps,
            "shared memory": (228 * 1024) // (shared_bytes + 1024),
            "warps": 64 // num_warps, "CTAs": 32}
  limiter = min(limits, key=limits.get)
  return limits[limiter], limiter


_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:(@!?U?P[T\d]+)\s+)?([A-Z][A-Z0-9_.]*)"
                    r"\s*([^;]*);")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_LINE = re.compile(r'//## File "([^"]*)", line (\d+)')
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")
_FUNCTION = re.compile(r"^(\$\S+):$")      # a called function's entry (e.g. a division's slow path)


@dataclasses.dataclass
class Instr:
  addr: int
  opcode: str        # with modifiers, e.g. LDG.E.128
  operands: str
  line: int | None   # source line id (pseudo file of renumber_locations), None if unknown
  called: bool = False   # in a function the kernel calls (placed after its body), not the body


def parse_sass(sass: str):
  """(instructions, label -> address) of one kernel's ``nvdisasm -c -g`` text."""
  instrs, labels, pending, line, called = [], {}, [], None, False
  for raw in sass.splitlines():
    if (m := _LINE.search(raw)):
      line = int(m.group(2)) if m.group(1) == LINE_FILE else None
      continue
    if _FUNCTION.match(raw.strip()):
      called = True
      continue
    if (m := _LABEL.match(raw.strip())):
      pending.append(m.group(1))
      continue
    if (m := _INSTR.match(raw)):
      ins = Instr(int(m.group(1), 16), m.group(3), m.group(4).strip(), line, called)
      for lab in pending:
        labels[lab] = ins.addr
      pending = []
      instrs.append(ins)
  return instrs, labels


def find_loops(instrs, labels):
  """Backward branches: [(start address, end address)], outermost first."""
  loops = []
  for ins in instrs:
    if ins.opcode.split(".")[0] in ("BRA", "JMP") and (m := _TARGET.search(ins.operands)):
      start = labels.get(m.group(1))
      if start is not None and start < ins.addr:       # (a branch to itself ends the code)
        loops.append((start, ins.addr))
  return sorted(set(loops), key=lambda r: (r[0], -r[1]))


#: SASS opcode (without modifiers) -> group.
GROUPS = {
    "global load": "LDG",
    "cp.async (LDGSTS)": "LDGSTS LDGDEPBAR",
    "TMA / bulk copy": "UTMALDG UTMASTG UBLKCP UTMAPF UTMACCTL",
    "global store / atomic": "STG RED ATOM ATOMG",
    "shared load": "LDS LDSM",
    "shared store": "STS STSM",
    "local (spill)": "LDL STL",
    "constant load": "LDC ULDC",
    "MMA": "HMMA HGMMA IMMA IGMMA QGMMA DMMA BMMA",
    "conversion": "F2F F2FP I2F I2FP F2I F2IP I2I I2IP FRND",
    "byte/bit shuffle": "PRMT LOP3 LOP SHF SGXT BMSK FLO POPC BREV",
    "fp32": "FFMA FADD FMUL FMNMX FSEL FSETP FSET FCHK FSWZADD",
    "fp16x2": "HFMA2 HADD2 HMUL2 HMNMX2 HSETP2 HSET2",
    "MUFU": "MUFU",
    "integer / address": "IMAD IADD3 IADD VIADD LEA ISETP IMNMX VIMNMX VIADDMNMX SEL IABS IMUL "
                         "IDP IMADSP",
    "move / special reg": "MOV MOV32I CS2R S2R S2UR R2UR UR2R",
    "warp shuffle / vote": "SHFL VOTE VOTEU MATCH REDUX",
    "barrier / sync": "BAR DEPBAR MEMBAR SYNCS WARPSYNC BSSY BSYNC ARRIVES WARPGROUP FENCE "
                      "ERRBAR CCTL ELECT",
    "control / predicate": "BRA BRX JMP EXIT RET CALL NOP YIELD BPT PLOP3 P2R R2P",
}
_GROUP_OF = {op: g for g, ops in GROUPS.items() for op in ops.split()}


def group_of(opcode: str) -> str:
  base = opcode.split(".")[0]
  if base in _GROUP_OF:
    return _GROUP_OF[base]
  if base.startswith("U") and base[1:] in _GROUP_OF:      # uniform datapath twin (UIADD3, ...)
    return "uniform " + _GROUP_OF[base[1:]]
  return "other"


def access_bits(opcode: str) -> int | None:
  """Bits one memory instruction moves per thread (LDG.E.128 -> 128; LDG.E.U8 -> 8)."""
  mods = set(opcode.split(".")[1:])
  for tok, bits in (("128", 128), ("64", 64), ("U16", 16), ("S16", 16), ("U8", 8), ("S8", 8)):
    if tok in mods:
      return bits
  return 32


@dataclasses.dataclass
class Mix:
  """Instruction mix of a range of SASS."""
  total: int
  by_opcode: collections.Counter
  by_group: collections.Counter

  @staticmethod
  def of(instrs) -> "Mix":
    ops = collections.Counter(i.opcode for i in instrs)
    groups = collections.Counter()
    for op, n in ops.items():
      groups[group_of(op)] += n
    return Mix(len(instrs), ops, groups)

  def loads_by_width(self, base: str = "LDG") -> dict:
    out = collections.Counter()
    for op, n in self.by_opcode.items():
      if op.split(".")[0] == base:
        out[access_bits(op)] += n
    return dict(sorted(out.items(), reverse=True))

  def count(self, *bases) -> int:
    return sum(n for op, n in self.by_opcode.items() if op.split(".")[0] in bases)


@dataclasses.dataclass
class Analysis:
  """Everything the tool reports about one kernel."""
  kernel: TritonKernelIR
  compiled: Compiled
  ptxas: PtxasReport
  sass: str
  mix: Mix
  loops: list                # [(start, end, Mix)]
  main_loop: int | None      # index into loops
  by_line: list              # [(call chain, count, Mix)] of the main loop, most first
  called: int                # instructions in functions the kernel calls (not its body)


def analyze(k: TritonKernelIR, work: str, a) -> Analysis:
  """Compile ``k`` and read its machine code (work: a folder for the stage files)."""
  if a.jaxlib:
    compiled, table = compile_jaxlib(k, work)
    triton_bin = _triton_bin(a.triton_path)
  else:
    compiled, table = compile_triton36(k, work, a.triton_path, line_ids=not a.plain_ir)
    triton_bin = compiled.info.get("bin")
  ptxas = find_tool("ptxas", a.ptxas, triton_bin, prefer_path=True)
  nvdisasm = find_tool("nvdisasm", a.nvdisasm, triton_bin, prefer_path=False)
  cubin = os.path.join(work, "kernel.cubin")
  rep = run_ptxas(ptxas, compiled.files["ptx"], cubin)
  proc = subprocess.run([nvdisasm, "-c", "-g", cubin], capture_output=True, text=True)
  if proc.returncode != 0:
    raise RuntimeError(f"nvdisasm failed: {proc.stderr[-2000:]}")
  sass = proc.stdout
  instrs, labels = parse_sass(sass)
  loops = []
  for start, end in find_loops(instrs, labels):
    loops.append((start, end, Mix.of([i for i in instrs if start <= i.addr <= end])))
  main = None
  if a.loop is not None:
    if not 0 <= a.loop < len(loops):
      raise ValueError(f"--loop={a.loop}: the kernel has {len(loops)} loops")
    main = a.loop
  elif loops:
    main = max(range(len(loops)),
               key=lambda j: (loops[j][2].by_group["MMA"], loops[j][2].total))
  by_line = []
  if table is not None:   # the main loop's lines; a kernel without loops: all of its body
    start, end = (loops[main][:2] if main is not None else
                  (min(i.addr for i in instrs), max(i.addr for i in instrs)))
    per = collections.defaultdict(list)
    for i in instrs:
      if start <= i.addr <= end and not i.called:
        per[i.line if i.line is not None else 0].append(i)
    for lid, ins in per.items():
      by_line.append((table.get(lid, ()), len(ins), Mix.of(ins)))
    by_line.sort(key=lambda r: -r[1])
  return Analysis(k, compiled, rep, sass, Mix.of(instrs), loops, main, by_line,
                  sum(i.called for i in instrs))


# -- report ------------------------------------------------------------------------------------
def _fmt_widths(w: dict) -> str:
  return " ".join(f"{n}x{bits}b" for bits, n in w.items()) or "0"


def _short_groups(mix: Mix, limit: int = 12) -> str:
  return ", ".join(f"{g} {n}" for g, n in mix.by_group.most_common(limit))


def _source_line(file: str, line: int) -> str:
  try:
    with open(file) as f:
      return f.read().splitlines()[line - 1].strip()[:70]
  except (OSError, IndexError):
    return ""


def print_report(call: KernelCall, an: Analysis, top: int, by_line: bool):
  k, p = an.kernel, an.ptxas
  print(f"== {call.label}")
  print(f"   kernel {k.name}: num_warps={k.num_warps} num_stages={k.num_stages} grid={k.grid} "
        f"config={call.config}")
  print(f"   IR read from the {k.source}; compiled from the "
        f"{an.compiled.info.get('used')} (Triton {an.compiled.info.get('triton', 'jaxlib')}), "
        f"forms: {an.compiled.info.get('forms', {})}; ptxas {p.version}")
  smem = an.compiled.shared_bytes
  print(f"   registers/thread {p.registers}  spill stores {p.spill_stores} B  spill loads "
        f"{p.spill_loads} B  stack {p.stack} B  shared {smem} B dynamic + {p.static_smem} B "
        f"static  barriers {p.barriers}")
  ctas, limiter = occupancy(p.registers, (smem or 0) + p.static_smem, k.num_warps)
  print(f"   occupancy estimate: {ctas} CTAs ({ctas * k.num_warps} warps) per SM, limited by "
        f"{limiter}")
  m = an.mix
  if an.called:
    print(f"   {an.called} of the instructions below are in functions the kernel calls (e.g. a "
          f"division's slow path), not counted by line")
  print(f"   whole kernel: {m.total} instructions; LDG {_fmt_widths(m.loads_by_width())}; "
        f"LDGSTS {_fmt_widths(m.loads_by_width('LDGSTS'))}; STG "
        f"{_fmt_widths(m.loads_by_width('STG'))}")
  print(f"     {_short_groups(m, 20)}")
  for j, (start, end, lm) in enumerate(an.loops):
    mark = "  <- main loop" if j == an.main_loop else ""
    print(f"   loop {j} [{start:#06x}, {end:#06x}]: {lm.total} instructions, "
          f"MMA {lm.by_group['MMA']}{mark}")
  if an.main_loop is None:
    _print_by_line(an, top, by_line)
    return
  lm = an.loops[an.main_loop][2]
  per_tok = ""
  if call.tokens_per_iter:
    per_tok = (f" = {lm.total * k.num_warps / call.tokens_per_iter:.1f} warp-instructions per "
               f"KV token ({call.tokens_per_iter} tokens/iteration, {k.num_warps} warps)")
  print(f"   main loop, one iteration: {lm.total} instructions{per_tok}")
  print(f"     LDG {_fmt_widths(lm.loads_by_width())}; LDGSTS "
        f"{_fmt_widths(lm.loads_by_width('LDGSTS'))}; LDS {_fmt_widths(lm.loads_by_width('LDS'))}"
        f"; LDSM {lm.count('LDSM')}")
  print(f"     {_short_groups(lm, 20)}")
  print(f"     top opcodes: " + ", ".join(f"{op} {n}" for op, n in lm.by_opcode.most_common(top)))
  _print_by_line(an, top, by_line)


def _print_by_line(an: Analysis, top: int, by_line: bool):
  if by_line and an.by_line:
    print(f"   {'main loop' if an.main_loop is not None else 'kernel'} by source line "
          "(instructions, top groups):")
    for chain, n, mix in an.by_line[:top]:
      where = " < ".join(f"{os.path.relpath(f, REPO)}:{ln}" for f, ln in chain[:3])
      print(f"     {n:5d}  {where or '(no location)'}")
      for f, ln in chain[:2]:
        print(f"            {_source_line(f, ln)}")
      print(f"            {_short_groups(mix, 6)}")


def save(an: Analysis, folder: str):
  """Write the ttir / ttgir / llir / ptx / cubin / sass / ptxas log and a summary JSON."""
  os.makedirs(folder, exist_ok=True)
  name = an.kernel.name
  with open(os.path.join(folder, f"{name}.jax.ttir"), "w") as f:
    f.write(an.kernel.text)
  for ext, path in an.compiled.files.items():
    shutil.copy(path, os.path.join(folder, f"{name}.{ext}"))
  cubin = os.path.join(os.path.dirname(an.compiled.files["ptx"]), "kernel.cubin")
  shutil.copy(cubin, os.path.join(folder, f"{name}.cubin"))
  with open(os.path.join(folder, f"{name}.sass"), "w") as f:
    f.write(an.sass)
  with open(os.path.join(folder, f"{name}.ptxas.log"), "w") as f:
    f.write(an.ptxas.log)
  with open(os.path.join(folder, f"{name}.summary.json"), "w") as f:
    json.dump(summary(an), f, indent=1)


def summary(an: Analysis) -> dict:
  loop = an.loops[an.main_loop][2] if an.main_loop is not None else None
  mixd = lambda m: None if m is None else dict(
      total=m.total, groups=dict(m.by_group), opcodes=dict(m.by_opcode),
      ldg=m.loads_by_width(), ldgsts=m.loads_by_width("LDGSTS"))
  by_line = [dict(chain=[f"{os.path.relpath(f, REPO)}:{ln}" for f, ln in chain], count=n,
                  opcodes=dict(mix.by_opcode)) for chain, n, mix in an.by_line]
  return dict(name=an.kernel.name, num_warps=an.kernel.num_warps,
              num_stages=an.kernel.num_stages, grid=an.kernel.grid,
              registers=an.ptxas.registers, spill_stores=an.ptxas.spill_stores,
              spill_loads=an.ptxas.spill_loads, stack=an.ptxas.stack,
              shared_dynamic=an.compiled.shared_bytes, shared_static=an.ptxas.static_smem,
              ctas_per_sm=occupancy(an.ptxas.registers,
                                    (an.compiled.shared_bytes or 0) + an.ptxas.static_smem,
                                    an.kernel.num_warps)[0],
              kernel=mixd(an.mix), main_loop=mixd(loop), main_loop_by_line=by_line)


# -- the decode table ------------------------------------------------------------------------------
TABLE_FORMATS = [(cd, lay) for cd in ("auto", "fp8", "int8_per_token_head", "fp8_per_token_head",
                                      "int4_per_token_head") for lay in ("NHD", "HND")]
TABLE_FORMATS += [("nvfp4", "HND")]


def table(a):
  """Markdown table of the decode kernel at the command line's shapes, per cache format."""
  rows = []
  for cd, lay in TABLE_FORMATS:
    b = argparse.Namespace(**{**vars(a), "cache_dtype": cd, "layout": lay, "kernel": "decode"})
    call = build_call(b)
    (k,) = triton_kernels(call.fn, *call.args)
    with tempfile.TemporaryDirectory() as work:
      an = analyze(k, work, b)
      if a.save:
        save(an, os.path.join(a.save, f"decode_{cd}_{lay}"))
    lm = an.loops[an.main_loop][2]
    c = call.config
    splits = re.search(r"splits=(\d+)", call.label).group(1)
    rows.append([
        f"{cd} {lay}", f"{c.num_warps}/{c.num_stages}/{splits}/{c.tokens_per_step}",
        an.ptxas.registers, f"{an.ptxas.spill_stores}/{an.ptxas.spill_loads}",
        an.compiled.shared_bytes,
        occupancy(an.ptxas.registers, (an.compiled.shared_bytes or 0) + an.ptxas.static_smem,
                  k.num_warps)[0], lm.total,
        f"{lm.total * k.num_warps / call.tokens_per_iter:.1f}",
        _fmt_widths(lm.loads_by_width()), _fmt_widths(lm.loads_by_width("LDGSTS")),
        lm.by_group["conversion"], lm.by_group["MMA"], lm.by_group["integer / address"],
        lm.by_group["byte/bit shuffle"], lm.by_group["fp32"], lm.by_group["shared load"],
        lm.by_group["shared store"], an.mix.total])
    print(f"done {cd} {lay}", file=sys.stderr, flush=True)
  head = ["format", "warps/stages/splits/T", "regs", "spill st/ld B", "smem B", "CTAs/SM",
          "loop instr", "warp-instr/token", "loop LDG", "loop LDGSTS", "loop cvt", "loop MMA",
          "loop int/addr", "loop byte/bit", "loop fp32", "loop LDS+LDSM", "loop STS",
          "kernel instr"]
  print("| " + " | ".join(head) + " |")
  print("|" + "---|" * len(head))
  for r in rows:
    print("| " + " | ".join(str(x) for x in r) + " |")


# -- command line -------------------------------------------------------------------------------
def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--kernel", default="decode", choices=("decode", "ragged", "write"))
  p.add_argument("--cache-dtype", default="auto")
  p.add_argument("--layout", default="NHD", choices=("NHD", "HND"))
  p.add_argument("--num-seqs", type=int, default=64)
  p.add_argument("--context", type=int, default=4096, help="max context (block table width)")
  p.add_argument("--num-blocks", type=int, default=0, help="cache blocks (0: seqs x context)")
  p.add_argument("--hq", type=int, default=32)
  p.add_argument("--hkv", type=int, default=8)
  p.add_argument("--head-size", type=int, default=128)
  p.add_argument("--block-size", type=int, default=16)
  p.add_argument("--q-dtype", default="bfloat16")
  p.add_argument("--query-len", type=int, default=1, help="ragged: max_query_len")
  p.add_argument("--tokens", type=int, default=0,
                 help="ragged: query tokens (0: seqs x query-len); write: tokens (0: seqs)")
  p.add_argument("--window", type=int, default=None)
  p.add_argument("--soft-cap", type=float, default=None)
  p.add_argument("--sinks", action="store_true")
  p.add_argument("--config", default=None,
                 help="overrides of the kernel's default config, e.g. tokens_per_step=128,"
                      "num_warps=8,num_stages=3,num_splits=2 (DecodeConfig), rows=64,block_kv=32"
                      " (ragged TileConfig), tokens_per_program=4,pair_split=false (WriteConfig)")
  p.add_argument("--triton-path", default=os.environ.get("TRITON_SASS_PATH"),
                 help="folder holding the triton package (pip install --target)")
  p.add_argument("--ptxas", default=None)
  p.add_argument("--nvdisasm", default=None)
  p.add_argument("--jaxlib", action="store_true",
                 help="compile with jaxlib's own Triton (GPU machine) instead of Triton 3.6")
  p.add_argument("--save", default=None, help="folder for the ttir/ttgir/llir/ptx/cubin/sass")
  p.add_argument("--sass", action="store_true", help="print the main loop's SASS")
  p.add_argument("--by-line", action="store_true",
                 help="main-loop instructions per Python source line")
  p.add_argument("--plain-ir", action="store_true",
                 help="compile the IR without source locations (no --by-line)")
  p.add_argument("--loop", type=int, default=None,
                 help="loop (index in the loop list) to detail (default: the most MMA, then "
                      "the largest)")
  p.add_argument("--top", type=int, default=15, help="rows of the opcode / line lists")
  p.add_argument("--table", action="store_true",
                 help="decode sweep over cache formats and layouts (Markdown table)")
  return p.parse_args(argv)


def main(argv=None):
  a = parse_args(argv)
  sys.path.insert(0, REPO)
  if a.table:
    table(a)
    return
  call = build_call(a)
  kernels = triton_kernels(call.fn, *call.args)
  if not kernels:
    raise SystemExit("the call lowered to no Triton kernel")
  for k in kernels:
    with tempfile.TemporaryDirectory() as work:
      an = analyze(k, work, a)
      print_report(call, an, a.top, a.by_line)
      if a.sass and an.main_loop is not None:
        start, end, _ = an.loops[an.main_loop]
        for raw in an.sass.splitlines():
          if (m := _INSTR.match(raw)) and start <= int(m.group(1), 16) <= end:
            print(raw.rstrip())
      if a.save:
        save(an, a.save)
        print(f"   saved to {a.save}")


if __name__ == "__main__":
  main()
