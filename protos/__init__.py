"""Generated gRPC stubs of the specdec.v1 protocol (see specdec.proto; regenerate with protos.codegen)."""
