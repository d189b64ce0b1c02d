"""Generated protobuf and gRPC modules for package tether.v1 (see protos/; do not edit)."""
