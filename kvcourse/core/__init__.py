"""The engine's core data: requests, the scheduler-cache contract, the step's plan and its records (vLLM: vllm/v1/core/, vllm/v1/request.py)."""
