"""TensorRT service: hosts `tensorrt_plan` models (needs the [tensorrt] extra and a GPU)."""
