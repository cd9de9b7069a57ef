"""benchmarks/triton_sass.py: the Triton IR of a kernel lowered for CUDA on CPU, the SASS reader,
and (where a stand-alone ``triton`` is importable, or ``TRITON_SASS_PATH`` names a folder holding
it) the sm_90 compile. CI has no Triton: the compile test skips there."""
import importlib.util
import os

import jax
import jax.numpy as jnp
import pytest

from benchmarks import triton_sass as TS
from kvjax import KVCacheSpec
from pallas_kernels.triton.decode import paged_decode_attention
from pallas_kernels.triton.decode_config import DecodeConfig


S, H, G, D, N, M = 4, 2, 4, 64, 16, 4
CONFIG = DecodeConfig(tokens_per_step=32, num_splits=2, num_warps=2, num_stages=3)


def _tiny_decode():
  spec = KVCacheSpec(H, D, N, "fp8", "NHD")
  cache = jax.ShapeDtypeStruct(spec.physical_shape(S * M), spec.storage_dtype)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  q = jax.ShapeDtypeStruct((S, H * G, D), jnp.bfloat16)
  fn = lambda q, c, sl, bt: paged_decode_attention(
      q, c, spec, seq_lens=sl, block_table=bt, scale=0.125, k_scale=0.5, v_scale=0.5,
      config=CONFIG)
  return fn, (q, cache, i32(S), i32(S, M))


def test_decode_ir_extraction():
  """One tt module with the config's launch parameters, its grid, and locations that map
  back to the kernel's source lines; no Triton needed."""
  fn, args = _tiny_decode()
  (k,) = TS.triton_kernels(fn, *args)
  assert k.name == "kvjax_paged_decode"
  assert (k.num_warps, k.num_stages) == (2, 3)
  assert k.grid is None or k.grid == (S, H, 2)       # 0.11 (lowering hook) may not say
  for text in (k.text, k.text_plain):
    assert "tt.func public @kvjax_paged_decode" in text and "tt.dot" in text
  assert "loc(" in k.text and "loc(" not in k.text_plain
  text, table = TS.renumber_locations(k.text)
  assert f'loc("{TS.LINE_FILE}":' in text and "decode_kernel.py" not in text
  files = {os.path.basename(f) for chain in table.values() for f, _ in chain}
  assert {"decode_kernel.py", "formats.py"} <= files


SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/              @!P1 LDG.E.U8 R4, desc[UR4][R2.64] ;
.L_x_0:
	//## File "kernel_lines", line 3
        /*0020*/                   LDG.E.128 R8, desc[UR4][R2.64] ;
        /*0030*/                   HMMA.16816.F32.BF16 R12, R8, R4, R12 ;
	//## File "kernel_lines", line 5
        /*0040*/                   F2FP.BF16.F32.PACK_AB R5, R6, R7 ;
        /*0050*/                   IMAD.WIDE R2, R5, 0x2, R2 ;
        /*0060*/               @P0 BRA `(.L_x_0) ;
        /*0070*/                   EXIT ;
.L_x_1:
        /*0080*/                   BRA `(.L_x_1);
"""


def test_sass_loops_and_mix():
  instrs, labels = TS.parse_sass(SASS)
  assert len(instrs) == 9 and labels == {".L_x_0": 0x20, ".L_x_1": 0x80}
  assert TS.find_loops(instrs, labels) == [(0x20, 0x60)]     # the self-branch is no loop
  loop = TS.Mix.of([i for i in instrs if 0x20 <= i.addr <= 0x60])
  assert loop.total == 5 and loop.loads_by_width() == {128: 1}
  assert (loop.by_group["MMA"], loop.by_group["conversion"]) == (1, 1)
  assert loop.by_group["integer / address"] == 1
  assert [i.line for i in instrs if i.addr in (0x20, 0x40)] == [3, 5]
  assert TS.Mix.of(instrs).loads_by_width() == {128: 1, 8: 1}


def test_called_functions_are_told_apart_from_the_body():
  """A function the kernel calls (here a division's slow path) comes after the body's EXIT
  under a ``$name:`` label: its instructions are marked, the body's are not."""
  sass = SASS.replace("        /*0070*/                   EXIT ;\n", """\
        /*0070*/                   EXIT ;
        .type           $__internal_0_$__cuda_sm3x_div_rn_noftz_f32_slowpath,@function
$__internal_0_$__cuda_sm3x_div_rn_noftz_f32_slowpath:
        /*0074*/                   SHF.R.U32.HI R27, RZ, 0x17, R3 ;
        /*0078*/                   RET.REL.NODEC R28 `(write_kv) ;
""")
  instrs, _ = TS.parse_sass(sass)
  assert [i.addr for i in instrs if i.called] == [0x74, 0x78, 0x80]
  assert not any(i.called for i in instrs if i.addr <= 0x70)


def test_occupancy_estimate():
  assert TS.occupancy(167, 22784, 4) == (3, "registers")       # 168 x 32 -> 5376 a warp
  assert TS.occupancy(64, 100000, 4) == (2, "shared memory")
  assert TS.occupancy(16, 0, 16) == (4, "warps")


def _triton_path():
  path = os.environ.get("TRITON_SASS_PATH")
  if path and os.path.isdir(os.path.join(path, "triton")):
    return path
  if importlib.util.find_spec("triton") is not None:
    return None
  pytest.skip("no stand-alone triton (set TRITON_SASS_PATH to a pip --target folder)")


def test_decode_compiles_for_sm90():
  """Triton 3.6's CUDA stages + ptxas + nvdisasm on the tiny kernel: mma.sync tiles on fp8
  codes converted in registers, loads in the loop, no spills."""
  path = _triton_path()
  fn, args = _tiny_decode()
  (k,) = TS.triton_kernels(fn, *args)
  opts = TS.parse_args([] if path is None else ["--triton-path", path])
  import tempfile
  with tempfile.TemporaryDirectory() as work:
    an = TS.analyze(k, work, opts)
  assert an.compiled.info["used"] == "text with source locations"
  assert 0 < an.ptxas.registers <= 255 and an.ptxas.spill_stores == 0
  assert an.main_loop is not None
  loop = an.loops[an.main_loop][2]
  assert loop.count("HMMA") > 0 and loop.by_group["conversion"] > 0
  assert loop.count("LDG", "LDGSTS") > 0
  assert any(os.path.basename(f) == "formats.py" for chain, _, _ in an.by_line for f, _ in chain)
