"""Tensor ops of the scoring hot path: pure torch, no protobuf, no I/O."""
