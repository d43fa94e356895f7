"""Generated protobuf/gRPC code (committed); regenerate with hack/gen-protos.sh."""
