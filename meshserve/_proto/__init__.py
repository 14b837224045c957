"""Generated protobuf and gRPC modules (see protos/generate.py). Never hand-edited."""
