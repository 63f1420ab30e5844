"""The model families the engine serves, loaded offline (vLLM: vllm/model_executor/models/)."""
