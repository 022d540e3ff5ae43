"""Generation backends: the segment protocol the engine asks of a backend (segments.py) and its
implementations -- Hugging Face KV-cache decoding with the engine's own sampler (hf_segments.py over
generator.py's `HFGenerator`, sampling.py, prefix_cache.py) and vLLM (vllm_backend.py; its settings,
importable without vLLM, in vllm_options.py)."""
