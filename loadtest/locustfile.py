"""Load test for any OpenAI-compatible endpoint (a Tessera gateway or another server):

    locust -f loadtest/locustfile.py --headless --host http://127.0.0.1:8000 -u 4 -r 4 -t 30s

Each user is a chat client that streams: mixed prompt lengths (short questions, medium and
long documents), a third of them behind one shared system prompt (so prefix caching and
prefix-affinity routing have something to find). Besides locust's own request statistics it
reports two custom metrics per request type: "TTFT" (time to the first content token) and
"ITL" (mean time between content chunks), in milliseconds, as request type "metric".
Environment: TESSERA_MODEL (default: the first model of /v1/models), TESSERA_MAX_TOKENS (32),
TESSERA_API_KEY (sent as a Bearer token when set).
"""
from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, between, events, task

SHARED_SYSTEM = ("You are a concise assistant for a logistics company. Answer in one or two sentences, "
                 "name the unit of every number, and never invent shipment ids. ") * 4
QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "Why is the sky blue?",
             "Give me a haiku about autumn.", "How many legs does a spider have?"]
WORDS = ("pallet container route harbour customs invoice freight carrier depot schedule delay "
         "manifest tonnage warehouse crane berth vessel truck rail ledger").split()
MAX_TOKENS = int(os.environ.get("TESSERA_MAX_TOKENS", "32"))


def document(n_words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def report(name: str, value_ms: float) -> None:
    events.request.fire(request_type="metric", name=name, response_time=value_ms, response_length=0,
                        exception=None, context={})


class ChatUser(HttpUser):
    wait_time = between(0.1, 0.5)

    def on_start(self) -> None:
        self.rng = random.Random()
        key = os.environ.get("TESSERA_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.model = os.environ.get("TESSERA_MODEL") or \
            self.client.get("/v1/models", headers=self.headers).json()["data"][0]["id"]

    def messages(self) -> tuple[str, list[dict]]:
        kind = self.rng.choice(["short", "medium", "long", "shared"])
        if kind == "short":
            return kind, [{"role": "user", "content": self.rng.choice(QUESTIONS)}]
        if kind == "shared":
            return kind, [{"role": "system", "content": SHARED_SYSTEM},
                          {"role": "user", "content": self.rng.choice(QUESTIONS)}]
        n = 60 if kind == "medium" else 250
        return kind, [{"role": "user", "content": "Summarise: " + document(n, self.rng)}]

    @task
    def chat_stream(self) -> None:
        kind, messages = self.messages()
        body = {"model": self.model, "messages": messages, "max_tokens": MAX_TOKENS, "stream": True,
                "temperature": 0.7, "stream_options": {"include_usage": True}}
        name = f"chat stream ({kind})"
        start = time.perf_counter()
        first = last = None
        gaps = []
        with self.client.post("/v1/chat/completions", json=body, headers=self.headers, stream=True,
                              name=name, catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:200]}")
                return
            done = False
            for line in r.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                data = json.loads(line[6:])
                if "error" in data:
                    r.failure(f"error event: {data['error'].get('message')}")
                    return
                if any(c.get("delta", {}).get("content") for c in data.get("choices", [])):
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
            if not done:
                r.failure("stream ended without [DONE]")
                return
            r.success()
        if first is not None:
            report(f"TTFT ({kind})", (first - start) * 1000)
        if gaps:
            report(f"ITL ({kind})", sum(gaps) / len(gaps) * 1000)
