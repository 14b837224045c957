"""PyTorch service: hosts `pytorch_libtorch` (TorchScript) and torch.export models."""
