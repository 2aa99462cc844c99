"""`tessera bench serve`'s own HTTP/1.1 reader against a scripted server: the framings a
server may answer a stream with, and a stream cut short."""
from __future__ import annotations

import asyncio
import types

from tessera.bench import serve_bench

EVENTS = [b'data: {"choices": [{"text": "a"}]}', b'data: {"choices": [{"text": "b"}]}',
          b'data: {"choices": [], "usage": {"completion_tokens": 2}}', b"data: [DONE]"]
SSE = b"".join(e + b"\n\n" for e in EVENTS)


def _chunked(payload: bytes, cut: int) -> bytes:
    """Two chunks split mid-line, the first with a chunk extension, then the last chunk."""
    a, b = payload[:cut], payload[cut:]
    return b"%x;ext=1\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(a), a, len(b), b)


async def _serve(response: bytes):
    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(response)
        await writer.drain()
        writer.close()
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def _run(response: bytes) -> dict:
    async def go():
        server, url = await _serve(response)
        async with server:
            a = types.SimpleNamespace(base_url=url, output_len=2, no_ignore_eos=False, endpoint="completions",
                                      structured=None)
            return await serve_bench._one(a, "m", [1, 2], "")
    return asyncio.run(go())


def test_every_framing_yields_the_same_tokens():
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    for response in (head + b"transfer-encoding: chunked\r\n\r\n" + _chunked(SSE, 20),
                     head + b"content-length: %d\r\n\r\n" % len(SSE) + SSE,
                     head + b"connection: close\r\n\r\n" + SSE):
        result = _run(response)
        assert result["ok"] and result["tokens"] == 2 and len(result["itl"]) == 1, result


def test_a_stream_cut_short_or_refused_is_a_failed_request():
    cut = _chunked(SSE, 20)[:30]
    result = _run(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + cut)
    assert not result["ok"] and result["error"].startswith(("ValueError", "IncompleteReadError")), result
    result = _run(b"HTTP/1.1 404 Not Found\r\ncontent-length: 9\r\n\r\nnot found")
    assert result == {"ok": False, "error": "404 b'not found'"}


def test_the_servers_own_timings_are_read_from_its_metrics():
    """Tessera's and vLLM's histogram names, summed over label sets: the means are those of
    the requests that finished between two scrapes."""
    import httpx

    from tessera.bench import server_side

    def page(n: int) -> bytes:
        body = "\n".join([
            "# TYPE tessera_request_prefill_time_seconds histogram",
            f'tessera_request_prefill_time_seconds_sum{{model_name="a"}} {0.5 * n}',
            f'tessera_request_prefill_time_seconds_count{{model_name="a"}} {n}',
            f'tessera_request_prefill_time_seconds_sum{{model_name="b"}} {0.1 * n}',
            f'tessera_request_prefill_time_seconds_count{{model_name="b"}} {n}',
            f'vllm:request_queue_time_seconds_sum{{engine="0",model_name="m"}} {0.02 * n}',
            f'vllm:request_queue_time_seconds_count{{engine="0",model_name="m"}} {2 * n}',
            'tessera_request_prefill_time_seconds_created{model_name="a"} 1.7e+09', ""]).encode()
        return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)

    async def go():
        scraped = []
        for n in (2, 6):
            server, url = await _serve(page(n))
            async with server, httpx.AsyncClient() as client:
                scraped.append(await server_side.scrape(client, url))
        return scraped
    before, after = asyncio.run(go())
    assert after == {"prefill": (3.6, 12.0), "queue": (0.12, 12.0)}
    assert server_side.phase_means_ms(before, after) == {"prefill": 300.0, "queue": 10.0, "requests": 8}
    assert server_side.phase_means_ms(after, after) is None
