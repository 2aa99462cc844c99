"""gRPC channel options shared by the clients of peers that restart (workers, expert nodes,
pipeline stages, draft workers)."""

# Reconnect quickly once the peer is back: gRPC's default backoff grows to 120 s, and until its
# next attempt every call fails at once with the last connect error ("Connection refused"),
# so a stage that restarted in seconds would stay unreachable for up to two minutes.
RECONNECT = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
             ("grpc.max_reconnect_backoff_ms", 1000)]

# Room for a gateway session's large messages (a whole step's updates, logprobs included).
LARGE_MESSAGES = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
