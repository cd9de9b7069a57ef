"""kvjax.viz: the page byte map agrees with the writer, and the pictures are real PNGs."""
import importlib.util
import json
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import KVCacheSpec, viz
from kv_testing import jit_reference_write

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _plot_decode_module():
  path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "plot_decode.py")
  spec = importlib.util.spec_from_file_location("plot_decode", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


plot_decode = _plot_decode_module()

MAP_SPECS = [
    KVCacheSpec(num_kv_heads=2, head_size=32, block_size=16),
    KVCacheSpec(num_kv_heads=3, head_size=32, block_size=16, layout="HND"),
    KVCacheSpec(num_kv_heads=2, head_size=32, block_size=16, cache_dtype="fp8"),
    KVCacheSpec(num_kv_heads=2, head_size=32, block_size=16, cache_dtype="int8_per_token_head"),
    KVCacheSpec(num_kv_heads=2, head_size=32, block_size=16, cache_dtype="fp8_per_token_head",
                layout="HND"),
    KVCacheSpec(num_kv_heads=2, head_size=32, block_size=16, cache_dtype="int4_per_token_head",
                layout="HND"),
    KVCacheSpec(num_kv_heads=2, head_size=32, block_size=16, cache_dtype="nvfp4", layout="HND"),
    KVCacheSpec(num_kv_heads=2, head_size=64, block_size=16, cache_dtype="nvfp4",
                layout="HND"),  # S = 4: V scales swizzled
]


def _ids(specs):
  return [f"{s.cache_dtype}-{s.layout}-H{s.num_kv_heads}-D{s.head_size}" for s in specs]


@pytest.mark.parametrize("spec", MAP_SPECS, ids=_ids(MAP_SPECS))
def test_byte_map_accounts_for_every_byte(spec):
  m = viz.page_byte_map(spec)
  h, n, d = spec.num_kv_heads, spec.block_size, spec.head_size
  counts = np.bincount(m.category, minlength=5)
  assert counts[viz.UNUSED] == 0
  kind = spec.format.kind
  data_bytes = h * n * spec.data_dim * spec.itemsize
  assert counts[viz.K_DATA] == counts[viz.V_DATA] == data_bytes
  scale_bytes = {"per_token_head": h * n * 4, "nvfp4": h * n * d // 16}.get(kind, 0)
  assert counts[viz.K_SCALE] == counts[viz.V_SCALE] == scale_bytes
  assert m.category.size == spec.page_bytes
  assert m.num_rows * m.row_bytes == spec.page_bytes
  # every (head, token) pair owns the same number of bytes of each category
  for c in (viz.K_DATA, viz.V_DATA):
    sel = m.category == c
    pairs = np.bincount(m.head[sel] * n + m.token[sel], minlength=h * n)
    assert np.all(pairs == pairs[0]) and pairs[0] > 0


@pytest.mark.parametrize("spec", MAP_SPECS, ids=_ids(MAP_SPECS))
def test_byte_map_agrees_with_write_kv(spec, rng):
  """Write one token into a page of a zeroed cache: every byte that changes is labelled with it."""
  num_blocks = 2
  token = int(rng.integers(0, spec.block_size))
  block = int(rng.integers(0, num_blocks))
  shape = (1, spec.num_kv_heads, spec.head_size)
  key = jnp.asarray(rng.uniform(0.5, 2.0, shape) * rng.choice([-1, 1], shape), spec.dtype)
  value = jnp.asarray(rng.uniform(0.5, 2.0, shape) * rng.choice([-1, 1], shape), spec.dtype)
  cache = spec.allocate(num_blocks)
  slot = jnp.asarray([block * spec.block_size + token], jnp.int32)
  new = jit_reference_write(cache, key, value, slot, spec)
  page = np.asarray(new).view(np.uint8).reshape(num_blocks, -1)
  changed = np.nonzero(page[block])[0]
  m = viz.page_byte_map(spec)
  assert changed.size > 0
  assert np.all(m.token[changed] == token), np.unique(m.token[changed])
  assert not np.any(page[1 - block])
  # both sides were written and the labels say which bytes belong to which side
  cats = set(np.unique(m.category[changed]).tolist())
  assert {viz.K_DATA, viz.V_DATA} <= cats


def test_byte_map_heads_agree_with_write_kv(rng):
  """A plain cache, only one head non-zero: the changed bytes are that head's, K and V."""
  for layout in ("NHD", "HND"):
    spec = KVCacheSpec(num_kv_heads=4, head_size=32, block_size=16, layout=layout)
    head, token = int(rng.integers(0, 4)), int(rng.integers(0, 16))
    x, y = np.zeros((2, 1, 4, 32), np.float32)   # +0.0 everywhere else (-0.0 has a set bit)
    x[0, head] = rng.uniform(0.5, 2.0, 32)
    y[0, head] = -rng.uniform(0.5, 2.0, 32)
    new = kvjax.write_kv(spec.allocate(1), jnp.asarray(x, spec.dtype),
                         jnp.asarray(y, spec.dtype), jnp.asarray([token], jnp.int32), spec,
                         impl="reference")
    elems = np.nonzero(np.asarray(new).view(np.uint16).ravel())[0]   # bf16: a byte may be 0
    assert elems.size == 2 * 32
    changed = np.concatenate([2 * elems, 2 * elems + 1])
    m = viz.page_byte_map(spec)
    assert np.all(m.head[changed] == head) and np.all(m.token[changed] == token)
    assert np.sum(m.category[changed] == viz.K_DATA) == 32 * spec.itemsize


def _check_png(path):
  import matplotlib.image as mpimg
  with open(path, "rb") as f:
    assert f.read(8) == PNG_SIGNATURE
  img = mpimg.imread(path)
  assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
  flat = img[..., :3].reshape(-1, 3)
  assert flat.std(axis=0).max() > 0.05, "picture is a single uniform colour"
  rgb = (flat * 255).astype(np.int64)
  assert np.unique(rgb[:, 0] << 16 | rgb[:, 1] << 8 | rgb[:, 2]).size > 5
  return img


def test_plot_page_layouts_png(tmp_path):
  path = viz.plot_page_layouts(None, str(tmp_path / "page_layouts.png"))
  img = _check_png(path)
  # the colours of the categories appear in the picture
  flat = (img[::2, ::2, :3].reshape(-1, 3) * 255).round()
  for c in (viz.K_DATA, viz.V_DATA, viz.K_SCALE, viz.V_SCALE):
    target = np.array(viz._BASE_COLORS[c]) * 255
    assert np.any(np.all(np.abs(flat - target) <= 2, axis=1)), viz.CATEGORY_NAMES[c]


def test_plot_page_layout_single_png(tmp_path):
  spec = KVCacheSpec(num_kv_heads=2, head_size=64, block_size=16, cache_dtype="nvfp4",
                     layout="HND")
  path = str(tmp_path / "one.png")
  viz.plot_page_layout(spec, path=path)
  _check_png(path)


def _synthetic_results(rng):
  rows = []
  for kernel, base in (("kvjax", 2.3), ("jax_builtin", 1.5), ("torch_sdpa", 1.0)):
    for layout in ("NHD", "HND"):
      for batch, ctx in ((8, 32768), (64, 4096), (256, 1024), (4, 512)):
        tb = float(base + rng.uniform(-0.3, 0.3))
        ms = batch * ctx * 2 * 8 * 128 * 2 / (tb * 1e12) * 1e3
        rows.append(dict(kernel=kernel, cache_dtype="auto", layout=layout, batch=batch,
                         context=ctx, ms=ms, tb_per_s=tb, tokens_per_s=batch / ms * 1e3))
  return {"device": "synthetic", "date": "2026-11-29",
          "versions": {"jax": "0.11.2", "torch": "2.11.0"}, "command": "pytest synthetic",
          "copy_tb_s": float(rng.uniform(3.5, 4.5)), "rows": rows}


@pytest.mark.parametrize("device", ["NVIDIA H200", "cpu"])
def test_plot_decode_bandwidth_png(tmp_path, rng, device):
  data = _synthetic_results(rng)
  data["device"] = device                   # H200: anchors and the read ceiling are drawn
  data["rows"][0]["config"] = "pages_per_step=8"
  src = tmp_path / "decode.json"
  src.write_text(json.dumps(data))
  path = plot_decode.plot_decode_bandwidth(str(src), str(tmp_path / "bw.png"))
  _check_png(path)


def _format_rows(rng):
  """bench_decode.py-like rows of the Triton kernel: three formats, both layouts, two shapes."""
  rows = []
  for cd, item in (("bfloat16", 1.0), ("fp8", 0.5), ("int4_per_token_head", 0.266)):
    for layout in ("NHD", "HND"):
      for batch, ctx in ((64, 4096), (8, 32768)):
        x = 1.0 if item == 1.0 else float(rng.uniform(1.0, 1.8))
        rows.append(dict(kernel="triton", cache_dtype=cd, layout=layout, batch=batch,
                         context=ctx, bytes_vs_bf16=item, us=280.0 / x, x_bf16=x,
                         tb_per_s=3.8 * x * item, vllm_us=300.0 if cd != "bfloat16" else 290.0))
  return {"device": "synthetic", "date": "2026-12-02", "rows": rows}


def test_plot_decode_speedup_png(tmp_path, rng):
  data = _format_rows(rng)
  _check_png(plot_decode.plot_decode_speedup(data, str(tmp_path / "x.png")))
  _check_png(plot_decode.plot_decode_speedup(data, str(tmp_path / "y.png"),
                                             formats=("bfloat16", "fp8")))
  _check_png(plot_decode.plot_decode_bandwidth(data, str(tmp_path / "z.png"),
                                               formats=("fp8",), kernels=("triton",)))
  with pytest.raises(ValueError, match="no decode results row"):
    plot_decode.plot_decode_bandwidth(data, str(tmp_path / "w.png"), formats=("nvfp4",))
  del data["rows"][0]["x_bf16"]
  with pytest.raises(ValueError, match="x_bf16"):
    plot_decode.plot_decode_speedup(data, str(tmp_path / "v.png"))


def test_decode_results_are_checked(tmp_path, rng):
  with pytest.raises(ValueError, match="rows"):
    plot_decode.plot_decode_bandwidth({"rows": []}, str(tmp_path / "x.png"))
  data = _synthetic_results(rng)
  del data["rows"][3]["tb_per_s"]
  with pytest.raises(ValueError, match="tb_per_s"):
    plot_decode.plot_decode_bandwidth(data, str(tmp_path / "x.png"))


def test_clis_draw_their_pictures(tmp_path, rng):
  out = tmp_path / "img"
  assert viz.main(["--out", str(out)]) == 0
  _check_png(out / "page_layouts.png")
  src = tmp_path / "decode.json"
  src.write_text(json.dumps(_synthetic_results(rng)))
  assert plot_decode.main(["--results", str(src), "--out", str(out / "bw.png")]) == 0
  _check_png(out / "bw.png")
  src.write_text(json.dumps(_format_rows(rng)))
  assert plot_decode.main(["--results", str(src), "--out", str(out / "bw2.png"), "--formats",
                           "fp8", "--speedup-out", str(out / "speed.png")]) == 0
  _check_png(out / "speed.png")


def test_bad_input_and_missing_matplotlib(monkeypatch, tmp_path):
  with pytest.raises(TypeError):
    viz.page_byte_map("auto")
  with pytest.raises(ValueError):
    viz.plot_page_layouts([], str(tmp_path / "x.png"))
  monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
  with pytest.raises(ImportError, match=r"pip install kvjax\[viz\]"):
    viz.plot_page_layouts(None, str(tmp_path / "x.png"))
