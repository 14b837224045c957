"""Model-serving services: one process per backend kind (onnx, torchscript, tensorrt, sequence)."""
