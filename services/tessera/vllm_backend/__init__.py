"""vLLM as a backend engine behind Tessera's gRPC Worker service (`tessera worker --engine vllm`).

hf_export.py writes the Hugging Face directory vLLM loads (the default GGUF, converted once into
the cache); params.py maps Tessera's SamplingParams onto vLLM's; engine.py is the adapter the
WorkerServicer drives in place of AsyncEngine. Only engine.py imports vllm, so the rest runs in
the main environment too.
"""
