"""TEST-ONLY: tiny seeded random HF transformers models, built on a CPU, and HF's greedy ids for them.

Shared by attnhost's engine test kits (``attnhost_sglang_cpu``, ``attnhost_vllm_engine_cpu``), which pass in what
their engine needs (the Llama's shape, the EAGLE head's layout, the variant models' RoPE) and keep the rest:
:mod:`.llama` (tokenizer, Llama target, drafts, EAGLE head, batched greedy ids) and :mod:`.variants` (Gemma 2 and
gpt-oss with windows, soft-cap and sinks that change the ids, per-prompt greedy ids with a feature off).
"""
