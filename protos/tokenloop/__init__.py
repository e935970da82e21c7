"""tokenloop: a gRPC text-generation worker (generated protobuf code lives in tokenloop.v1)."""

__version__ = "0.1.0"
