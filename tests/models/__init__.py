"""Generators of the real ONNX models the tests serve."""
