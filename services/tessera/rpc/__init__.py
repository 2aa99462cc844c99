"""gRPC plumbing: convert.py (the only protobuf <-> dataclass mapping), the clients, and
options.py (their channel options)."""
