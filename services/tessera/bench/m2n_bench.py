"""`tessera bench m2n`: latency and bandwidth of one AFD round trip between M senders
(attention nodes) and N receivers (expert nodes), each a separate process on this machine.

One iteration = every sender dispatches `bytes` to every receiver, every receiver sends the
same bytes back (combine), and the sender has all N replies. Our backends do it with the M2N
transport; the baseline does the same logical operation as two torch.distributed
all_to_all_single calls over gloo (the CPU analogue of NCCL). Times are taken on the senders;
gbps = 2 * bytes * M * N / p50 (all bytes moved by one iteration, both directions). Backend
"tcp" runs as deployments do, over mutual TLS (senders hold attention-node certificates,
receivers expert-node ones, from a throwaway CA); "tcp-plain" without it, for TLS's cost.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import time

SIZES = [1 << k for k in range(10, 25, 2)]          # 1 KiB .. 16 MiB, x4
SHAPES = [(1, 1), (2, 2), (4, 2)]


def add_args(p) -> None:
    p.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    p.add_argument("--backends", default="auto",
                   help="comma list of tcp (mutual TLS), tcp-plain, nixl, gloo (auto: all available)")
    p.add_argument("--sizes", default=None, help="comma list of message sizes in bytes")
    p.add_argument("--shapes", default=None, help="comma list of MxN, e.g. 1x1,2x2,4x2")
    p.add_argument("--iters", type=int, default=60)
    from tessera.bench.results import add_out_arg
    add_out_arg(p)


def iterations(size: int, iters: int) -> int:
    return max(8, min(iters, int(iters * (1 << 18) / max(size, 1 << 18))))


def _endpoint(backend: str, role: str, index: int, m: int, n: int, sizes: list[int], iters: int, conn,
              port: int, tls_dir: str | None = None) -> None:
    import torch
    torch.set_num_threads(1)
    if backend == "gloo":
        return _gloo_endpoint(role, index, m, n, sizes, iters, conn, port)
    from tessera.mtls import ENV
    if tls_dir and backend == "tcp":
        os.environ[ENV] = os.path.join(tls_dir, "attention-node" if role == "s" else "expert-node")
    backend = "tcp" if backend == "tcp-plain" else backend
    from tessera.transport import make_transport
    from tessera.transport.base import COMBINE, DISPATCH, Tag
    senders, receivers = [f"s{i}" for i in range(m)], [f"r{j}" for j in range(n)]
    me, peers = (senders[index], receivers) if role == "s" else (receivers[index], senders)
    t = make_transport(backend, me, slots=2, capacity_bytes=max(sizes), timeout_s=120)
    conn.send({p: t.metadata_for(p) for p in peers})
    for peer, md in conn.recv().items():
        t.connect(peer, md)
    conn.send("linked")
    conn.recv()                                       # everyone is linked
    step, results = 0, {}
    for size in sizes:
        buf = torch.ones(size, dtype=torch.uint8)
        times = []
        for it in range(iterations(size, iters) + 3):     # 3 warm-up rounds
            # Consecutive iterations are consecutive micro-batches (slot it % 2), as in the
            # ping-pong pipeline: a slot's free then has an iteration to come back.
            out, back = Tag(step, it % 2, 0, DISPATCH), Tag(step, it % 2, 0, COMBINE)
            step += 1
            t0 = time.perf_counter()
            if role == "s":
                for r in peers:
                    t.send(r, out, buf)
                for r in peers:
                    t.recv(r, back)
                    t.release(r, back)
            else:
                got = [t.recv(s, out) for s in peers]
                for s, x in zip(peers, got):
                    t.send(s, back, x)
                    t.release(s, out)
            if it >= 3:
                times.append(time.perf_counter() - t0)
        results[size] = times
    conn.send(results)
    conn.recv()
    t.close()


def _gloo_endpoint(role, index, m, n, sizes, iters, conn, port) -> None:
    import torch
    import torch.distributed as dist
    rank = index if role == "s" else m + index
    world = m + n
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    conn.send({})
    conn.recv()
    conn.send("linked")
    conn.recv()
    results = {}
    for size in sizes:
        to_receivers = [0] * m + [size] * n          # a sender's split toward every rank
        from_senders = [size] * m + [0] * n          # a receiver's split from every rank
        zero = [0] * world
        send1, recv1 = (to_receivers, zero) if role == "s" else (zero, from_senders)
        a = torch.ones(sum(send1), dtype=torch.uint8)
        b = torch.empty(sum(recv1), dtype=torch.uint8)
        times = []
        for it in range(iterations(size, iters) + 3):
            t0 = time.perf_counter()
            dist.all_to_all_single(b, a, recv1, send1)    # dispatch
            dist.all_to_all_single(a, b, send1, recv1)    # combine: the same bytes back
            if it >= 3:
                times.append(time.perf_counter() - t0)
        results[size] = times
    conn.send(results)
    conn.recv()
    dist.destroy_process_group()


def run_shape(backend: str, m: int, n: int, sizes: list[int], iters: int) -> list[dict]:
    import tempfile

    from tessera.bench.m2n_bench import _endpoint  # picklable by name under spawn
    from tessera.mtls.certs import write_role_dirs
    ctx = mp.get_context("spawn")
    from tessera.disagg.measure import free_port
    port = free_port()
    pipes, procs = [], []
    tls = tempfile.TemporaryDirectory(prefix="m2n-tls-")
    write_role_dirs(tls.name, "bench", ("attention-node", "expert-node"))
    for role, count in (("s", m), ("r", n)):
        for i in range(count):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_endpoint, args=(backend, role, i, m, n, sizes, iters, child, port, tls.name))
            proc.start()
            pipes.append((f"{role}{i}", parent))
            procs.append(proc)
    try:
        metadata = {name: conn.recv() for name, conn in pipes}   # what each endpoint offers each peer
        for name, conn in pipes:
            conn.send({peer: offers[name] for peer, offers in metadata.items() if name in offers})
        for _, conn in pipes:
            conn.recv()
        for _, conn in pipes:
            conn.send("go")
        results = [conn.recv() for name, conn in pipes if name.startswith("s")]
        for _, conn in pipes:
            conn.send("done")
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        tls.cleanup()
    rows = []
    for size in sizes:
        times = sorted(t for r in results for t in r[size])
        p50, p99 = statistics.median(times), times[min(len(times) - 1, int(0.99 * len(times)))]
        rows.append({"backend": backend, "bytes": size, "senders": m, "receivers": n,
                     "p50_us": round(p50 * 1e6, 1), "p99_us": round(p99 * 1e6, 1),
                     "gbps": round(2 * size * m * n * 8 / p50 / 1e9, 3)})
    return rows


def main(a) -> int:
    from tessera.transport import nixl
    backends = ["tcp", "tcp-plain", "gloo"] + (["nixl"] if nixl.available() else []) if a.backends == "auto" \
        else a.backends.split(",")
    sizes = [int(s) for s in a.sizes.split(",")] if a.sizes else SIZES
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")] if a.shapes else SHAPES
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rows = []
    for m, n in shapes:
        for backend in backends:
            rows += run_shape(backend, m, n, sizes, a.iters)
            if not a.json:
                for r in rows[-len(sizes):]:
                    print(f"{r['backend']:>9} {m}x{n} {r['bytes']:>9} B  p50 {r['p50_us']:>9.1f} us  "
                          f"p99 {r['p99_us']:>9.1f} us  {r['gbps']:>7.3f} Gb/s", flush=True)
    if a.out:
        from tessera.bench import results, rows as schema
        results.write(a.out, schema.m2n(a, rows))
    if a.json:
        print(json.dumps(rows, indent=1))
    return 0
