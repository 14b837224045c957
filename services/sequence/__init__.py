"""The sequence service: stateful models (``sequence_batching``) on the ONNX / TorchScript runtimes."""
