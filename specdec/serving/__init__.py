"""What the draft and target gRPC servers share: pb <-> engine conversion, error mapping, bootstrap."""
