"""Shared fixtures: tiny random checkpoints (built once per session) and the default model."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every 4th replayed step re-checked against eager execution, in this process and the workers it starts.
os.environ.setdefault("TESSERA_REPLAY_CHECK_EVERY", "4")
os.environ.setdefault("TESSERA_REPLAY_CHECK_STRICT", "1")    # and a re-check that differs fails the step
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    from tessera.models.random_init import write_random_model
    root = tmp_path_factory.mktemp("models")
    models = {arch: str(write_random_model(arch, root / arch, seed=0))
              for arch in ("llama", "mixtral", "qwen2_moe", "qwen3_moe")}
    models["llama_sharded"] = str(write_random_model("llama", root / "llama_sharded", seed=1, shards=3))
    return models


@pytest.fixture(scope="session")
def smollm2_engine():
    """The default model in float32 (the exactness tests compare with transformers in fp32)."""
    from tessera.config import EngineConfig
    from tessera.engine import Engine
    return Engine(EngineConfig(model="smollm2", dtype="float32"))


@pytest.fixture(autouse=True, scope="module")
def _give_memory_back():
    """After each test file: collect what its engines left in cycles and hand freed heap back to
    the system, so the suite's one process does not grow file after file (24 GiB machines)."""
    yield
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
