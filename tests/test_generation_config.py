"""The model's generation_config.json as default sampling parameters (vLLM's --generation-config):
read by the worker, reported in its Info reply, applied by the gateway to the fields a request
leaves unset; `--generation-config vllm` turns it off. Served through `tessera serve` and the
official openai client."""
from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from servers import free_port, tessera_serve
from tessera.config import ConfigError
from tessera.generation_defaults import GenerationConfigSource, GenerationDefaults, parse, parse_file, read
from tessera.openai_api.params import sampling_params
from tessera.openai_api.protocol import ChatCompletionRequest
from tessera.rpc import convert
from tessera.rpc.v1 import worker_pb2
from tessera.worker_api import WorkerInfo

CHAT = [{"role": "user", "content": "Tell me about the sea."}]
SERVE = ("--dtype", "float32", "--max-model-len", "128", "--threads", "1", "--enforce-eager", "--graph-warmup-s", "0",
         "--served-model-name", "tiny")


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory):
    from tessera.models.random_init import write_random_model
    return write_random_model("llama", tmp_path_factory.mktemp("genconf") / "llama", seed=0)


def with_config(plain_model, tmp_path, config) -> str:
    """A copy of the checkpoint with `config` as its generation_config.json (text or a dict)."""
    path = tmp_path / "model"
    shutil.copytree(plain_model, path)
    (path / "generation_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return str(path)


# -- the reader ---------------------------------------------------------------------------------

def test_sampling_keys_are_read_and_the_rest_ignored():
    hf = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
          "repetition_penalty": 1.1, "max_new_tokens": 256, "eos_token_id": [1, 2], "bos_token_id": 0,
          "transformers_version": "4.51.0", "pad_token_id": None, "num_beams": 1}
    assert parse(hf, "f") == GenerationDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.05,
                                                repetition_penalty=1.1, max_tokens=256)
    assert parse({"top_k": -1, "temperature": None}, "f") == GenerationDefaults(top_k=0)   # -1: off, null: unset
    assert parse({"eos_token_id": 2}, "f") == GenerationDefaults()


@pytest.mark.parametrize("config, says", [
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"top_p": 1.5}, "top_p must be in [0, 1]"),
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"repetition_penalty": True}, "repetition_penalty must be a number"),
    ('{"temperature": NaN}', "temperature must be a finite number"),
    ('{"temperature": 0.7,', "not readable as JSON"),
    ("[0.7]", "expected a JSON object"),
])
def test_bad_values_are_a_config_error_naming_the_file(tmp_path, config, says):
    file = tmp_path / "generation_config.json"
    file.write_text(config if isinstance(config, str) else json.dumps(config))
    with pytest.raises(ConfigError) as e:
        parse_file(file)
    assert str(e.value).startswith(str(file)) and says in str(e.value)


def test_sources(plain_model, tmp_path):
    model = with_config(plain_model, tmp_path, {"temperature": 0.3})
    assert read(GenerationConfigSource(), model) == GenerationDefaults(temperature=0.3)
    assert read(GenerationConfigSource("vllm"), model) == GenerationDefaults()
    assert read(GenerationConfigSource(), str(plain_model)) == GenerationDefaults()   # none beside the weights
    assert read(GenerationConfigSource(model), str(plain_model)) == GenerationDefaults(temperature=0.3)   # a DIR
    with pytest.raises(ConfigError, match="no generation_config.json"):
        read(GenerationConfigSource(str(plain_model)), model)


def test_a_bad_file_stops_the_worker_at_start(plain_model, tmp_path):
    model = with_config(plain_model, tmp_path, {"temperature": -1})
    done = subprocess.run([sys.executable, "-m", "tessera.cli", "worker", "--model", model, "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 78, done.stderr     # a configuration error: never restarted
    assert f"{model}/generation_config.json: temperature must be >= 0" in done.stderr


# -- the gateway's side --------------------------------------------------------------------------

def test_request_values_win_and_unset_fields_take_the_defaults():
    defaults = GenerationDefaults(temperature=0.0, top_p=0.5, top_k=7, min_p=0.1, repetition_penalty=1.2,
                                  max_tokens=5)
    unset = sampling_params(ChatCompletionRequest(model="m", messages=CHAT), None, None, None, defaults=defaults)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.min_p, unset.repetition_penalty,
            unset.max_tokens) == (0.0, 0.5, 7, 0.1, 1.2, 5)
    given = ChatCompletionRequest(model="m", messages=CHAT, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0,
                                  repetition_penalty=1.0)
    explicit = sampling_params(given, 9, None, None, defaults=defaults)
    assert (explicit.temperature, explicit.top_p, explicit.top_k, explicit.min_p, explicit.repetition_penalty,
            explicit.max_tokens) == (1.0, 1.0, 0, 0.0, 1.0, 9)
    plain = sampling_params(ChatCompletionRequest(model="m", messages=CHAT), None, None, None)
    assert (plain.temperature, plain.top_k, plain.max_tokens) == (1.0, 0, None)


def test_info_carries_the_defaults_through_protobuf():
    for defaults in (GenerationDefaults(), GenerationDefaults(temperature=0.0, top_k=0, max_tokens=5),
                     GenerationDefaults(top_p=0.95, min_p=0.05, repetition_penalty=1.1)):
        info = WorkerInfo("m", 128, 8, 16, generation_defaults=defaults)
        wire = worker_pb2.InfoResponse.FromString(convert.info_to_proto(info).SerializeToString())
        assert convert.info_from_proto(wire).generation_defaults == defaults


# -- served ---------------------------------------------------------------------------------------

def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def served(plain_model, tmp_path_factory):
    """{"auto": url, "vllm": url}: `tessera serve` on a checkpoint whose file asks for greedy and
    5 tokens, by default and with --generation-config vllm; both start at once."""
    model = with_config(plain_model, tmp_path_factory.mktemp("served"),
                        {"temperature": 0.0, "max_new_tokens": 5, "do_sample": False})
    servers = {"auto": tessera_serve("--model", model, *SERVE),
               "vllm": tessera_serve("--model", model, "--generation-config", "vllm", *SERVE)}
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(2) as pool:
        started = {name: pool.submit(server.__enter__) for name, server in servers.items()}
        for name, future in started.items():
            if future.exception() is None:
                stack.push(servers[name])
        yield {name: future.result() for name, future in started.items()}


def test_tessera_serve_applies_the_models_defaults(served):
    client = client_for(served["auto"])
    greedy = client.chat.completions.create(model="tiny", messages=CHAT, temperature=0, max_tokens=5)
    assert greedy.usage.completion_tokens == 5 and greedy.choices[0].finish_reason == "length"
    unset = client.chat.completions.create(model="tiny", messages=CHAT, seed=7)
    assert unset.choices[0].message.content == greedy.choices[0].message.content
    assert unset.usage.completion_tokens == 5 and unset.choices[0].finish_reason == "length"
    hot = client.chat.completions.create(model="tiny", messages=CHAT, temperature=1.0, seed=7, max_tokens=5)
    assert hot.choices[0].message.content != greedy.choices[0].message.content   # the request's value wins
    longer = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8)
    assert longer.usage.completion_tokens == 8
    assert longer.choices[0].message.content.startswith(greedy.choices[0].message.content)
    # completions: temperature from the file; max_tokens is OpenAI's 16 unless sent (as vLLM)
    a = client.completions.create(model="tiny", prompt="The sea is", seed=3)
    b = client.completions.create(model="tiny", prompt="The sea is", temperature=0, max_tokens=16)
    assert a.choices[0].text == b.choices[0].text and a.usage.completion_tokens == 16


def test_generation_config_vllm_ignores_the_file(served):
    client = client_for(served["vllm"])
    greedy = client.chat.completions.create(model="tiny", messages=CHAT, temperature=0, max_tokens=5)
    unset = client.chat.completions.create(model="tiny", messages=CHAT, seed=7)
    # temperature 1 and no limit but the context: Tessera's (and OpenAI's) defaults
    assert unset.usage.prompt_tokens + unset.usage.completion_tokens == 128
    assert not unset.choices[0].message.content.startswith(greedy.choices[0].message.content)
