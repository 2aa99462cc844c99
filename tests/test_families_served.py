"""Every model family through what a user runs: `tessera serve --model DIR` on the checkpoint as
users download it (config.json, sharded safetensors with model.safetensors.index.json,
tokenizer.json, generation_config.json, the chat template in tokenizer_config.json or, for one
family, in chat_template.jinja), asked with the official openai client for what transformers
generates greedily. All the servers start at once: the file costs about one start-up."""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import test_families
from servers import free_port
from test_families import NEW_TOKENS, PROMPT, build_hf_checkpoint, hf_greedy

pytestmark = pytest.mark.e2e

FAMILIES = test_families.ON_EVERY_PATH      # linear and YaRN RoPE serve as llama3's does
# Its chat template, one of our own, stays in chat_template.jinja; every other family carries
# SmolLM2's inline in tokenizer_config.json, as checkpoints saved before transformers 4.50 do.
JINJA_FAMILY = "qwen3"
JINJA_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} (chat_template.jinja)\n{{ m['content'] }}"
                  "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Beside its HF shards Mistral's repositories ship consolidated.safetensors in Mistral's own names.
CONSOLIDATED_FAMILY = "mistral"
# The chat completion of an inline template is asked of this family.
INLINE_FAMILY = "mistral"
# The embedding and the head are 12 MB each: every checkpoint is at least two shards.
SHARD_SIZE = "8MB"
QUESTION = "Name three prime numbers."
START_TIMEOUT_S = 300


def save_as_users_have_it(family: str, root: Path) -> tuple[str, torch.nn.Module]:
    """The family's checkpoint re-saved sharded, its template placed as described above; returns
    (directory, transformers' model of it)."""
    saved = Path(build_hf_checkpoint(family, root / "saved" / family))
    ref = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32, attn_implementation="eager").eval()
    out = root / family
    ref.save_pretrained(out, max_shard_size=SHARD_SIZE)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(saved / name, out / name)
    if family == JINJA_FAMILY:
        (out / "chat_template.jinja").write_text(JINJA_TEMPLATE)
    else:
        config = json.loads((out / "tokenizer_config.json").read_text())
        config["chat_template"] = (saved / "chat_template.jinja").read_text()
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    if family == CONSOLIDATED_FAMILY:
        from safetensors.torch import save_file
        sd = ref.state_dict()
        save_file({"tok_embeddings.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"],
                   "output.weight": sd["lm_head.weight"]}, str(out / "consolidated.safetensors"))
    return str(out), ref


def start_serve(path: str, port: int, worker_port: int) -> tuple[str, subprocess.Popen]:
    """`tessera serve` as a user starts it, not waited for."""
    proc = subprocess.Popen([sys.executable, "-m", "tessera.cli", "serve", "--port", str(port),
                             "--worker-port", str(worker_port), "--model", path, "--dtype", "float32",
                             # a GiB of cache each by default, a dozen at once; the step
                             # graphs recorded at their first step, not in a warm-up each
                             "--threads", "1", "--kv-cache-gib", "0.02", "--graph-warmup-s", "0"],
                            env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    return f"http://127.0.0.1:{port}", proc


def _new_free_port(taken: set[int]) -> int:
    """A port free now and not handed out before (free_port alone may return one twice); asked
    for just before its server starts, since building the checkpoints takes minutes."""
    while (port := free_port()) in taken:
        pass
    taken.add(port)
    return port


def _stop(procs: list[subprocess.Popen]) -> None:
    """Every server asked to drain at once, then each waited for (killed after 30 s)."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + 30
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _wait_ready(servers: dict[str, tuple[str, subprocess.Popen]]) -> dict[str, str]:
    """family -> why its server never became ready (it exited, or the time ran out)."""
    pending, failed = dict(servers), {}
    deadline = time.monotonic() + START_TIMEOUT_S
    while pending and time.monotonic() < deadline:
        for family, (url, proc) in list(pending.items()):
            if proc.poll() is not None:
                failed[family] = f"tessera serve exited with {proc.returncode}"
            elif not _healthy(url):
                continue
            del pending[family]
        time.sleep(0.5)
    return failed | {f: f"not ready within {START_TIMEOUT_S} s" for f in pending}


def reference(ref, tokenizer, prompt: list[int]) -> list[int]:
    """transformers' greedy tokens, up to the first end-of-sequence token (the server stops there)."""
    stop = {ref.config.eos_token_id, tokenizer.eos_token_id} - {None}
    out = hf_greedy(ref, prompt)
    return next((out[:i] for i, t in enumerate(out) if t in stop), out)


def chat_prompt(family: str, tokenizer) -> list[int]:
    """The question rendered by the family's chat template: JINJA_TEMPLATE written out by hand,
    else transformers' rendering of SmolLM2's (the tokenizer was loaded from INLINE_FAMILY,
    whose template is the one in its tokenizer_config.json)."""
    if family == JINJA_FAMILY:
        text = f"<|im_start|>user (chat_template.jinja)\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
        return tokenizer.encode(text, add_special_tokens=False)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """family -> its server's URL (or why it never became ready), its directory and the
    expected tokens. Each server starts as soon as its checkpoint is written; transformers'
    references run while they load."""
    root = tmp_path_factory.mktemp("served")
    ports: set[int] = set()
    servers, refs, procs = {}, {}, []
    # every family's tokenizer is the same SmolLM2 one: built from the GGUF once, not per family
    patch = pytest.MonkeyPatch()
    patch.setattr(test_families, "default_tokenizer", functools.cache(test_families.default_tokenizer))
    try:
        for family in FAMILIES:
            path, refs[family] = save_as_users_have_it(family, root)
            servers[family] = start_serve(path, _new_free_port(ports), _new_free_port(ports))
            procs.append(servers[family][1])
        patch.undo()
        tok = AutoTokenizer.from_pretrained(str(root / INLINE_FAMILY))
        out = {f: dict(path=root / f, completion=reference(refs[f], tok, PROMPT)) for f in FAMILIES}
        for family in (JINJA_FAMILY, INLINE_FAMILY):
            chat = chat_prompt(family, tok)
            out[family]["chat"] = chat, reference(refs[family], tok, chat)
        failed = _wait_ready(servers)
        for family in FAMILIES:
            out[family].update(url=servers[family][0], failed=failed.get(family), tokenizer=tok)
        yield out
    finally:
        patch.undo()
        _stop(procs)


def _client(server):
    import openai
    assert server["failed"] is None, server["failed"]
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)


def _finish(expected: list[int]) -> str:
    return "length" if len(expected) == NEW_TOKENS else "stop"


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_is_what_users_download(served, family):
    path = served[family]["path"]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    assert (path / "generation_config.json").exists() and (path / "tokenizer.json").exists()
    inline = "chat_template" in json.loads((path / "tokenizer_config.json").read_text())
    assert inline != (path / "chat_template.jinja").exists() and inline == (family != JINJA_FAMILY)
    assert (path / "consolidated.safetensors").exists() == (family == CONSOLIDATED_FAMILY)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_completion_equals_transformers(served, family):
    """A prompt of 100 token ids, past every family's context tricks (see test_families)."""
    server = served[family]
    expected = server["completion"]
    r = _client(server).completions.create(model=family, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0)
    assert r.choices[0].text == server["tokenizer"].decode(expected, skip_special_tokens=True)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (len(expected), _finish(expected))


@pytest.mark.parametrize("family", [JINJA_FAMILY, INLINE_FAMILY])
def test_chat_completion_uses_the_checkpoints_template(served, family):
    """The prompt the server counts and continues is the template's rendering: for JINJA_FAMILY
    the one in chat_template.jinja, whose role line no other template writes."""
    server = served[family]
    prompt, expected = server["chat"]
    r = _client(server).chat.completions.create(model=family, messages=[{"role": "user", "content": QUESTION}],
                                                 max_tokens=NEW_TOKENS, temperature=0)
    assert r.usage.prompt_tokens == len(prompt)
    assert r.choices[0].message.content == server["tokenizer"].decode(expected, skip_special_tokens=True)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (len(expected), _finish(expected))
