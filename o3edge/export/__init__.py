"""Export of an engine's model to other runtimes (ONNX, and from it TensorRT where it is installed)."""
