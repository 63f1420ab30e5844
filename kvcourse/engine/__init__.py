"""The engine loop around the learner's scheduler, cache and runner (vLLM: vllm/v1/engine/)."""
