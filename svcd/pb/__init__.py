"""Generated protobuf and gRPC modules; regenerate with python tools/genproto.py."""
