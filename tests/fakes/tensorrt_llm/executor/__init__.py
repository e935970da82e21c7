"""Fake `tensorrt_llm.executor`: only `request.LoRARequest`."""
