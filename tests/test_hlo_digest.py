"""benchmarks/hlo_digest.py on CPU: the normalization, and the property it is used for: the
public ops' platform branches (kvjax.registry.Routes) leave the compiled program as it is
without them."""
import pytest

from benchmarks import hlo_digest as H
from kvjax import registry


def test_normalized_drops_names_and_metadata_only():
  a = ('HloModule jit_a\n%x.1 = f32[4] parameter(0), metadata={op_name="a"}\n'
       '%y.2 = f32[4] add(%x.1, %x.1)')
  b = ('HloModule jit_b\n%p = f32[4] parameter(0), metadata={op_name="b/c"}\n'
       '%q.7 = f32[4] add(%p, %p)')
  assert H.normalized(a) == H.normalized(b)
  frames = '\nFileNames\n1 "/x.py"\n\nStackFrames\n1 {file_location_id=1 parent_frame_id=1}\n'
  assert H.normalized(a + frames) == H.normalized(a)
  assert H.normalized(a) != H.normalized(a.replace("add", "multiply"))


@pytest.mark.parametrize("case", H.SMOKE_STEPS, ids=lambda c: f"{c[0]}_{c[1]}")
def test_platform_branches_compile_to_the_same_program(monkeypatch, case):
  geo = dict(num_kv_heads=2, head_size=64, block_size=16)
  _, plain = H.digest(*case, "auto", geo)
  monkeypatch.setattr(registry, "host_platforms", lambda: ("cpu", "gpu", "tpu"))
  _, branched = H.digest(*case, "auto", geo)
  assert branched == plain and "conditional(" not in branched
