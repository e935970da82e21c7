"""The types every layer shares: requests, the executor seam, KV events, structured output, the tokenizer.

Imports no executor and no looper; the looper, the service and each executor package import from here.
"""
