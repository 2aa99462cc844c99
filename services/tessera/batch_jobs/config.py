"""BatchConfig: the gateway's Batch API settings (flags generated from these fields)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from tessera.config import ConfigError


@dataclass(frozen=True)
class BatchConfig:
    jobs_redis: str | None = field(default=None, metadata={
        "help": "Redis URL holding Batch API job state (default: --registry; neither: this gateway's "
                "memory, lost when it restarts)"})
    files_dir: str | None = field(default=None, metadata={
        "help": "directory of /v1/files uploads and batch outputs; gateways sharing jobs share it "
                "(default: $TESSERA_CACHE/files or ~/.cache/tessera/files)"})
    max_file_bytes: int = field(default=200 << 20, metadata={
        "help": "largest /v1/files upload (413 beyond); separate from --max-body-bytes"})
    batch_concurrency: int = field(default=8, metadata={
        "help": "batch lines in flight per gateway, all jobs together (interactive requests keep the "
                "rest of --max-inflight)"})
    batch_jobs: int = field(default=2, metadata={"help": "batch jobs one gateway runs at once"})
    batch_lease_s: float = field(default=10.0, metadata={
        "help": "a job's lease: another gateway resumes it this long after its runner dies"})

    def __post_init__(self) -> None:
        if self.max_file_bytes <= 0:
            raise ConfigError("max_file_bytes must be > 0")
        if self.batch_concurrency < 1 or self.batch_jobs < 1:
            raise ConfigError("batch_concurrency and batch_jobs must be >= 1")
        if self.batch_lease_s <= 0:
            raise ConfigError("batch_lease_s must be > 0")

    def directory(self) -> str:
        if self.files_dir:
            return os.path.expanduser(self.files_dir)
        return os.path.join(os.path.expanduser(os.environ.get("TESSERA_CACHE", "~/.cache/tessera")), "files")
