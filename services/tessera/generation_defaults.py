"""The model's recommended sampling defaults, from its generation_config.json, as vLLM applies
them: the worker reads them at start-up (--generation-config auto|vllm|DIR) and reports them in
its Info reply; the gateway fills in the fields a request leaves unset (openai_api/params.py).
No torch, no rpc: both sides import it."""
from __future__ import annotations

import json
import logging
import pathlib
from dataclasses import dataclass, field, fields

from tessera.config import ConfigError, SamplingParams

log = logging.getLogger("tessera.generation_defaults")
FILE = "generation_config.json"
# generation_config.json key -> GenerationDefaults field: the keys vLLM's
# ModelConfig.get_diff_sampling_param takes (Hugging Face's max_new_tokens is max_tokens).
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
_INTS = ("top_k", "max_tokens")


@dataclass(frozen=True)
class GenerationConfigSource:
    generation_config: str = field(default="auto", metadata={
        "help": "default sampling parameters for fields a request leaves unset: 'auto' reads the model's "
                "generation_config.json, 'vllm' uses none (Tessera's and OpenAI's defaults), or a "
                "directory holding a generation_config.json"})

    def __post_init__(self) -> None:
        if not self.generation_config:
            raise ConfigError("--generation-config must be auto, vllm or a directory", "generation_config")


@dataclass(frozen=True)
class GenerationDefaults:
    """None: the field has no default here (the request's value, else SamplingParams' default).
    top_k 0 disables it (a file's -1, vLLM's "off", is read as 0)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        """Ranges are SamplingParams': a default that no request could carry is refused."""
        SamplingParams(**self.given())

    def given(self) -> dict[str, float | int]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def read(source: GenerationConfigSource, model: str) -> GenerationDefaults:
    """The defaults --generation-config names for `model` (a path, or what
    tessera.models.loader.resolve_model_path takes). 'auto' with no generation_config.json beside
    the weights (a GGUF file has none): no defaults. ConfigError names the file at fault."""
    if source.generation_config == "vllm":
        return GenerationDefaults()
    if source.generation_config == "auto":
        from tessera.models.loader import resolve_model_path
        path = resolve_model_path(model)
        if not (path / FILE).is_file():
            return GenerationDefaults()
    else:
        path = pathlib.Path(source.generation_config).expanduser()
        if not (path / FILE).is_file():
            raise ConfigError(f"--generation-config {path}: no {FILE} in that directory", "generation_config")
    defaults = parse_file(path / FILE)
    if defaults.given():
        log.info("default sampling parameters from %s: %s (--generation-config vllm ignores them)", path / FILE,
                 ", ".join(f"{k}={v}" for k, v in defaults.given().items()))
    return defaults


def parse_file(file: pathlib.Path) -> GenerationDefaults:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{file}: not readable as JSON ({e})", "generation_config") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: expected a JSON object", "generation_config")
    return parse(data, str(file))


def parse(data: dict, where: str) -> GenerationDefaults:
    """The sampling fields of a generation_config.json object; other keys (do_sample, eos_token_id,
    transformers_version...) are not sampling defaults and are ignored, as vLLM ignores them;
    a null value is unset."""
    values: dict[str, float | int] = {}
    for key, name in KEYS.items():
        value = data.get(key)
        if value is None:
            continue
        # bool is an int to Python, and a float like 20.0 is no token count
        if isinstance(value, bool) or not isinstance(value, int if name in _INTS else (int, float)):
            kind = "an integer" if name in _INTS else "a number"
            raise ConfigError(f"{where}: {key} must be {kind}, got {json.dumps(value)[:40]}", "generation_config")
        values[name] = 0 if name == "top_k" and value == -1 else value
    try:
        return GenerationDefaults(**values)
    except ConfigError as e:
        key = next((k for k, n in KEYS.items() if n == e.param), e.param)
        raise ConfigError(f"{where}: {key} {str(e).removeprefix(f'{e.param} ')}", "generation_config") from None
