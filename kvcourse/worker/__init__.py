"""What runs the model: the paged cache's hooks into transformers, the model runner's given parts, the sampler (vLLM: vllm/v1/worker/, vllm/v1/sample/)."""
