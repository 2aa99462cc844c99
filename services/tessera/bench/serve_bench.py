"""`tessera bench serve`: a load generator for any OpenAI-compatible server (Tessera, vLLM,
llama.cpp). Prompts are random token ids of exactly --input-len tokens sent to /v1/completions
(or their decoded text to /v1/chat/completions); each asks for --output-len tokens with
ignore_eos. Requests go out all at once, at a Poisson rate, and/or under a concurrency cap.
With --shared-prefix-len N every prompt starts with the same N tokens (a common system
prompt); cached_prompt_tokens sums the server's usage.prompt_tokens_details.cached_tokens.

TTFT: send -> first streamed token; TPOT: (E2E - TTFT) / (tokens - 1) per request; ITL: gaps
between streamed chunks; E2E: send -> last chunk; output tokens/s: all output tokens / wall time.
server_ms: the server's own mean queue / prefill / decode times over the run, from its /metrics
(Tessera's and vLLM's, both from the tokenized request on; bench/server_side.py);
ttft_outside_engine_ms: the mean TTFT minus the mean queue + prefill (HTTP, the gateway or API
server, tokenization, gRPC or IPC; None unless the server counted every completed request); machine:
this machine's busy / idle / steal CPU time and huge pages split over the run.

The streams are read by a plain HTTP/1.1 client on asyncio's streams (one connection per
request), not httpx: the client shares the machine's CPU with the server it measures, and
httpx's pure-Python parsing costs about twice the CPU, taken from whichever server runs.

--out FILE also writes the run as a `served` result file (tessera.bench.rows), with every
request's TTFT and TPOT; --server, --server-dtype and --server-quantization label it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
import urllib.parse
from typing import AsyncIterator

import httpx

from tessera.bench import server_side


def _percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"mean": None, "p50": None, "p99": None}
    s = sorted(xs)
    pick = lambda q: s[min(len(s) - 1, int(round(q * (len(s) - 1))))]  # noqa: E731
    return {"mean": round(statistics.fmean(s) * 1000, 2), "p50": round(pick(0.5) * 1000, 2),
            "p99": round(pick(0.99) * 1000, 2)}


REQUEST_TIMEOUT_S = 3600.0


# --structured json_schema: at least 64 records, more tokens than any --output-len benchmarked
RECORDS = {"type": "object", "properties": {"records": {"type": "array", "minItems": 64, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0},
                                     "name": {"type": "string", "maxLength": 16},
                                     "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                              "maxItems": 3}},
    "required": ["id", "name", "tags"], "additionalProperties": False}}},
    "required": ["records"], "additionalProperties": False}


async def _one(a, model: str, prompt: list[int], text: str) -> dict:
    """One streamed request; a refusal, a broken stream or a timeout is a failed result."""
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            return await _stream_one(a, model, prompt, text)
    except (OSError, ValueError, IndexError, asyncio.IncompleteReadError, TimeoutError) as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}


async def _stream_one(a, model: str, prompt: list[int], text: str) -> dict:
    body = {"model": model, "max_tokens": a.output_len, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    if not a.no_ignore_eos:
        body["ignore_eos"] = True
    if a.endpoint == "chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
    else:
        path, body["prompt"] = "/v1/completions", prompt
    if a.structured and a.endpoint == "chat":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "records", "schema": RECORDS}}
    elif a.structured:
        body["structured_outputs"] = {"json": RECORDS}
    start = time.perf_counter()
    times: list[float] = []
    tokens = cached = 0
    status, lines = await _post_stream(a.base_url + path, body)
    if status != 200:
        return {"ok": False, "error": f"{status} {b''.join([x async for x in lines])[:200]!r}"}
    async for line in lines:
        if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
            cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        for c in chunk.get("choices") or []:
            piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
            if piece:
                times.append(time.perf_counter() - start)
    if not times:
        return {"ok": False, "error": "no tokens streamed"}
    tokens = tokens or len(times)
    e2e = times[-1]
    return {"ok": True, "ttft": times[0], "e2e": e2e, "tokens": tokens, "cached": cached,
            "tpot": (e2e - times[0]) / (tokens - 1) if tokens > 1 else None,
            "itl": [b - a for a, b in zip(times, times[1:])]}


async def _post_stream(url: str, body: dict) -> tuple[int, AsyncIterator[bytes]]:
    """POST body as JSON over a fresh HTTP/1.1 connection: the status and the response body's
    lines (chunked, Content-Length or until close), read as they arrive. Plain http only (the
    bench's targets)."""
    u = urllib.parse.urlsplit(url)
    if u.scheme != "http":
        raise ValueError(f"bench serve reads plain http only, not {u.scheme}")
    reader, writer = await asyncio.open_connection(u.hostname, u.port or 80)
    try:
        target = u.path + (f"?{u.query}" if u.query else "")
        data = json.dumps(body).encode()
        writer.write(f"POST {target} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
                     f"Accept: text/event-stream\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
                     + data)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip().lower()
    except BaseException:
        writer.close()
        raise
    return status, _body_lines(reader, writer, headers)


async def _body_lines(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, headers: dict
                      ) -> AsyncIterator[bytes]:
    try:
        chunked = headers.get("transfer-encoding") == "chunked"
        left = int(headers["content-length"]) if "content-length" in headers and not chunked else None
        pending = b""
        while left != 0:
            if chunked:
                size = int((await reader.readline()).split(b";")[0], 16)   # ValueError if cut short
                piece = await reader.readexactly(size + 2)                  # the chunk and its CRLF
                if size == 0:
                    break
                piece = piece[:-2]
            else:
                piece = await reader.read(65536 if left is None else min(left, 65536))
                if not piece:
                    break
                left = None if left is None else left - len(piece)
            *done, pending = (pending + piece).split(b"\n")
            for line in done:
                yield line.rstrip(b"\r")
        if pending:
            yield pending
    finally:
        writer.close()


async def run(a: argparse.Namespace) -> dict:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:
        listed = (await client.get(a.base_url + "/v1/models")).json()["data"]
        model = a.model or listed[0]["id"]
        owned_by = next((m.get("owned_by") for m in listed if m["id"] == model), None)
        prompts, texts = _make_prompts(a)
        sem = asyncio.Semaphore(a.concurrency or len(prompts))
        rng = random.Random(a.seed)

        async def limited(p, t):
            async with sem:
                return await _one(a, model, p, t)

        metrics_before, machine_before = await server_side.scrape(client, a.base_url), server_side.machine_counters()
        start = time.perf_counter()
        tasks = []
        for p, t in zip(prompts, texts):
            tasks.append(asyncio.create_task(limited(p, t)))
            if a.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(a.request_rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
        machine = server_side.machine_delta(machine_before, server_side.machine_counters())
        ok = [r for r in results if r["ok"]]
        server = await server_side.phase_means_after(client, a.base_url, metrics_before, len(ok))
    ttft = _percentiles([r["ttft"] for r in ok])
    out_tokens = sum(r["tokens"] for r in ok)
    return {
        "base_url": a.base_url, "model": model, "endpoint": a.endpoint, "structured": a.structured, "num_prompts": len(prompts),
        "input_len": a.input_len, "range_ratio": a.range_ratio, "shared_prefix_len": a.shared_prefix_len,
        "output_len": a.output_len,
        "concurrency": a.concurrency,
        "request_rate": None if a.request_rate == float("inf") else a.request_rate,
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if not r["ok"]})[:5],
        "duration_s": round(wall, 2), "output_tokens": out_tokens, "output_tok_s": round(out_tokens / wall, 1),
        "request_per_s": round(len(ok) / wall, 3), "cached_prompt_tokens": sum(r["cached"] for r in ok),
        "ttft_ms": ttft,
        "tpot_ms": _percentiles([r["tpot"] for r in ok if r["tpot"] is not None]),
        "itl_ms": _percentiles([x for r in ok for x in r["itl"]]),
        "e2e_ms": _percentiles([r["e2e"] for r in ok]),
        "server_ms": server,
        "ttft_outside_engine_ms": (round(ttft["mean"] - server["queue"] - server["prefill"], 2)
                                   if server and server["requests"] == len(ok) and ttft["mean"] is not None
                                   and "prefill" in server and "queue" in server else None),
        "machine": machine,
        "samples": {"ttft_ms": [round(r["ttft"] * 1000, 2) for r in ok],
                    "tpot_ms": [round(r["tpot"] * 1000, 3) for r in ok if r["tpot"] is not None]},
        "owned_by": owned_by,
    }


def _make_prompts(a: argparse.Namespace) -> tuple[list[list[int]], list[str]]:
    """Random token ids, input_len of them (or drawn from input_len's range with --range-ratio),
    the first shared_prefix_len the same in all (and their text, for the chat endpoint)."""
    from tessera.tokenizer import load_tokenizer
    tok = load_tokenizer(a.tokenizer)
    rng = random.Random(a.seed)
    special = set(tok.all_special_ids)
    vocab = [i for i in range(len(tok)) if i not in special]
    shared = [rng.choice(vocab) for _ in range(min(a.shared_prefix_len, a.input_len))]
    low, high = round(a.input_len * (1 - a.range_ratio)), round(a.input_len * (1 + a.range_ratio))
    lengths = [rng.randint(max(low, len(shared), 1), max(high, len(shared), 1)) if a.range_ratio else a.input_len
               for _ in range(a.num_prompts)]
    prompts = [shared + [rng.choice(vocab) for _ in range(n - len(shared))] for n in lengths]
    return prompts, [tok.decode(p) for p in prompts]


def main(a: argparse.Namespace) -> int:
    result = asyncio.run(run(a))
    if a.out:
        from tessera.bench import results, rows as schema
        results.write(a.out, schema.served(a, result))
    result.pop("samples")
    result.pop("owned_by")
    if a.json:
        print(json.dumps(result, indent=2))
    else:
        for k, v in result.items():
            print(f"{k:>14}: {v}")
    return 0 if result["failed"] == 0 else 1
