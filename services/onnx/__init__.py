"""ONNX Runtime service: hosts `onnxruntime_onnx` models."""
