"""The ground truth: HF transformers' own Llama, eager attention, reading the same GGUF file.

transformers dequantizes the GGUF weights itself (and undoes the Q/K row permutation itself),
so agreement with it checks the weight loading of :mod:`smollm2.checkpoint` as well as the
paged forward. Runs on CPU in float32 by default: the reference every cache dtype is judged by.
"""
from __future__ import annotations

import os

from smollm2 import checkpoint


def load_model(path: str | None = None, dtype: str = "float32"):
  """``LlamaForCausalLM`` of the GGUF file, eager attention, on CPU, in eval mode."""
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  try:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
  except ImportError as e:
    raise checkpoint.MissingModelError(
        f"the HF reference needs torch and transformers: {checkpoint.INSTALL_HINT}") from e
  path = checkpoint.find_gguf(path)
  hf_logging.disable_progress_bar()        # its per-tensor bars would bury the demo's lines
  model = AutoModelForCausalLM.from_pretrained(
      os.path.dirname(path), gguf_file=os.path.basename(path), dtype=getattr(torch, dtype),
      attn_implementation="eager")
  return model.eval()


def greedy(model, prompts_ids, max_new: int, eos_id: int | None):
  """Greedy continuations: one list of generated ids per prompt (``list[int]`` each).

  Each prompt runs alone (no padding) through HF's ``generate`` (its own KV cache, no
  sampling); generation stops after ``max_new`` tokens or at ``eos_id`` (included), as the
  serving loop stops.
  """
  import torch
  outputs = []
  with torch.no_grad():
    for ids in prompts_ids:
      prompt = torch.tensor([ids], device=model.device)
      out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                           max_new_tokens=max_new, eos_token_id=eos_id, pad_token_id=eos_id)
      outputs.append([int(t) for t in out[0, len(ids):]])
  return outputs
