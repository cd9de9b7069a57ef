"""benchmarks/decode_tables.py's per-format summary on hand-made rows of two kernels."""
from benchmarks import decode_tables as B


def _rows():
  """Two kernels, bf16 and fp8, both layouts, two shapes; mosaic_gpu's time is triton's
  times a factor per (format, layout, shape)."""
  factor = {("fp8", "NHD", 64): 0.8, ("fp8", "NHD", 8): 0.9, ("fp8", "HND", 64): 1.25,
            ("fp8", "HND", 8): 1.5}
  rows = []
  for cd, item in (("bfloat16", 1.0), ("fp8", 0.5)):
    for layout in ("NHD", "HND"):
      for batch in (64, 8):
        base = 300.0 if cd == "bfloat16" else 200.0
        for kernel, us in (("triton", base),
                           ("mosaic_gpu", base * factor.get((cd, layout, batch), 1.0))):
          rows.append(dict(kernel=kernel, cache_dtype=cd, layout=layout, batch=batch,
                           context=32768 // batch, bytes_vs_bf16=item, us=us,
                           x_bf16=1.0 if cd == "bfloat16" else 300.0 / us))
  return rows


def test_summary_gives_each_further_kernels_time_over_the_first():
  table = B.summary(_rows(), [], ("triton", "mosaic_gpu")).splitlines()
  head = [c.strip() for c in table[0].strip("|").split("|")]
  assert head[-1] == "mosaic_gpu time / triton's"
  cells = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
           for line in table[2:]}
  assert cells["fp8"][-1] == "0.80–0.90 / 1.25–1.50"
  assert cells["bfloat16"][-1] == "1.00 / 1.00"
  assert cells["fp8"][3] == "1.50 / 1.50"                     # triton's tokens/s vs bf16
  assert len(cells["bf16 vs torch SDPA (dense)"]) == len(head)
