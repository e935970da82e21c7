"""Fake of the nanobind extension `tensorrt_llm.bindings`."""
