"""benchmarks/sweep_mosaic_prefill.py's configuration strings (the sweep itself needs a Hopper
GPU): parsed into tile-geometry changes and a staging, bad keys named."""
import pytest

from benchmarks import sweep_mosaic_prefill as S
from pallas_kernels.mosaic_gpu import tiles as TL


def test_configurations_become_kernel_keywords():
  geo = TL.choose_geometry(4, 128, 16, 4096)
  assert S.kernel_kwargs(S.parse_config("default"), geo) == {}
  kw = S.kernel_kwargs(S.parse_config("bk=64:stages=5:staging=swizzled"), geo)
  assert kw["staging"] == TL.STAGING_SWIZZLED
  assert (kw["geometry"].block_kv, kw["geometry"].stages) == (64, 5)
  assert (kw["geometry"].bq, kw["geometry"].num_wgs) == (geo.bq, geo.num_wgs)
  assert S.kernel_kwargs(S.parse_config("staging=plain"), geo) == {"staging": "plain"}
  assert S.kernel_kwargs(S.parse_config("causal=0:pingpong=1"), geo) == {
      "causal": False, "ping_pong": True}
  kw = S.kernel_kwargs(S.parse_config("bq=16:causal=1"), geo)
  assert kw["causal"] is True and kw["geometry"].bq == 16
  assert S.kernel_kwargs(S.parse_config("regs=240/24"), geo) == {"registers": (240, 24)}


def test_every_default_configuration_fits_shared_memory():
  geo = TL.choose_geometry(4, 128, 16, 4096)
  for text in S.DEFAULT_CONFIGS.split(","):
    kw = S.kernel_kwargs(S.parse_config(text), geo)
    g = kw.get("geometry", geo)
    staging = kw.get("staging", TL.choose_staging(g, 128))
    assert g.smem_bytes(128, 2, staging=staging) <= TL.SMEM_BUDGET, text


@pytest.mark.parametrize("text,needle", [("bk64", "'bk64' is not key=value"),
                                         ("blocks=3", "unknown key 'blocks'"),
                                         ("bk=", "is not key=value"),
                                         ("causal=yes", "causal must be 0 or 1"),
                                         ("regs=240", "regs must be CONSUMER/PRODUCER")])
def test_bad_configurations_are_named(text, needle):
  with pytest.raises(ValueError, match=needle):
    S.parse_config(text)
