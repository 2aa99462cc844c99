"""gRPC plumbing: convert.py (the only protobuf <-> dataclass mapping) and client.py."""
