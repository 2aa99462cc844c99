"""gRPC channel options shared by the clients of peers that restart (workers, expert nodes,
pipeline stages, draft workers), and what a worker's server accepts of them."""

# Reconnect quickly once the peer is back: gRPC's default backoff grows to 120 s, and until its
# next attempt every call fails at once with the last connect error ("Connection refused"),
# so a stage that restarted in seconds would stay unreachable for up to two minutes.
RECONNECT = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
             ("grpc.max_reconnect_backoff_ms", 1000)]

# Room for a gateway session's large messages (a whole step's updates, logprobs included).
LARGE_MESSAGES = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]

# HTTP/2 pings on the gateway's connection to a worker, whose Session stream may sit idle for
# minutes between requests: they keep NAT tables and load balancers from dropping it unseen, and
# tell a worker that is gone without closing the connection (a host lost, a process stopped) from
# a quiet one within time + timeout. gRPC's defaults send none, and stop after two on a stream
# that carries no data.
KEEPALIVE_TIME_MS = 20_000
KEEPALIVE_TIMEOUT_MS = 10_000


def keepalive() -> list[tuple[str, int]]:
    return [("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS), ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]


# A worker's server takes those pings: by default gRPC answers a client that pings more often
# than every 5 minutes with GOAWAY ("too_many_pings") after two strikes, closing every stream.
ACCEPT_KEEPALIVE = [("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_ping_strikes", 0)]
