"""Block types the pipeline flow reads by name (`eagle3_pipeline(..., target_source=, storage=,
hardware=)`).

python -m eagle3_prefect.blocks.register            # registers the three types with the current
                                                    # PREFECT_API_URL
python -m eagle3_prefect.blocks.register --example  # ... and saves example documents named "demo"
"""

from __future__ import annotations

import re
from pathlib import Path

from prefect.blocks.core import Block
from pydantic import Field, SecretStr, model_validator

from eagle3.config import ConfigError, PipelineConfig


class TargetModelSource(Block):
    """Where the target model comes from: a local directory, or a Hugging Face hub id at a pinned
    revision (downloaded once into the run's work dir). The token is a SecretStr: the UI and logs
    show it as ********."""

    _block_type_name = "eagle3 target model source"
    _block_type_slug = "eagle3-target-model-source"
    _description = "Target LLM for an EAGLE-3 draft: local path, or hub id + revision (+ token)"

    path: str | None = Field(None, description="Local model directory (wins over hub_id)")
    hub_id: str | None = Field(
        None, description="Hugging Face repo id, e.g. meta-llama/Llama-3.1-8B-Instruct"
    )
    revision: str = Field(
        "main", description="Hub revision: pin a commit sha for reproducible runs"
    )
    token: SecretStr | None = Field(None, description="Hub token for gated models (never logged)")

    @model_validator(mode="after")
    def _one_source(self) -> TargetModelSource:
        if not self.path and not self.hub_id:
            raise ValueError(
                "TargetModelSource needs `path` (a local model dir) or `hub_id` (a hub repo id)"
            )
        return self

    def resolve(self, cache_dir: str | Path) -> str:
        """A local directory holding the model: `path`, or a snapshot of hub_id@revision in
        cache_dir."""
        if self.path:
            if not (Path(self.path) / "config.json").is_file():
                raise ConfigError(
                    f"TargetModelSource.path = {self.path!r} has no config.json; point it at a "
                    "model directory"
                )
            return self.path
        from huggingface_hub import snapshot_download

        local = Path(cache_dir) / re.sub(
            r"[^A-Za-z0-9._-]+", "--", f"{self.hub_id}@{self.revision}"
        )
        token = self.token.get_secret_value() if self.token else None
        return snapshot_download(
            repo_id=self.hub_id, revision=self.revision, token=token, local_dir=str(local)
        )


class StorageLocation(Block):
    """Where a pipeline writes: one base directory (shared by every pool's workers), optionally with
    captures, checkpoints and results on other volumes."""

    _block_type_name = "eagle3 storage location"
    _block_type_slug = "eagle3-storage-location"
    _description = "Base directory for eagle3 runs, with optional capture/checkpoint/result volumes"

    base_path: str = Field(..., description="Runs go to <base_path>/<config.name>")
    captures_path: str | None = Field(
        None, description="Hidden-state captures (large): <captures_path>/<name>"
    )
    checkpoints_path: str | None = Field(
        None, description="Training checkpoints: <checkpoints_path>/<name>"
    )
    results_path: str | None = Field(None, description="Evaluation results: <results_path>/<name>")

    def work_dir_for(self, name: str) -> Path:
        return Path(self.base_path) / name

    def apply(self, cfg: PipelineConfig) -> PipelineConfig:
        """A copy of cfg writing under this location (explicit stage paths in cfg are kept)."""
        c = cfg.model_copy(deep=True)
        c.work_dir = self.work_dir_for(c.name)
        if self.captures_path and c.capture.out is None:
            c.capture.out = Path(self.captures_path) / c.name
        if self.checkpoints_path and c.train.out is None:
            c.train.out = Path(self.checkpoints_path) / c.name
        if self.results_path and c.evaluate.out is None:
            c.evaluate.out = Path(self.results_path) / c.name
        return c


class HardwareProfile(Block):
    """The hardware GPU stages run on: the work pool (its deployments are
    eagle3-<stage>/<work_pool>), GPUs per host, vLLM tensor-parallel size, and the global
    concurrency limit guarding each host."""

    _block_type_name = "eagle3 hardware profile"
    _block_type_slug = "eagle3-hardware-profile"
    _description = "Work pool, GPUs and tensor-parallel size for eagle3 GPU stages"

    work_pool: str = Field(
        "gpu-1x", description="Pool of the GPU stage deployments: cpu, gpu-1x, gpu-8x"
    )
    num_gpus: int = Field(1, ge=0, description="GPUs per host in that pool")
    tensor_parallel_size: int = Field(
        1, gt=0, description="vLLM tensor-parallel size of every stage that runs the target"
    )
    gpu_concurrency_limit: str = Field(
        "gpu-host-{host}", description="Global concurrency limit per host ({host} = hostname)"
    )

    @model_validator(mode="after")
    def _tp_fits(self) -> HardwareProfile:
        if self.num_gpus and self.tensor_parallel_size > self.num_gpus:
            raise ValueError(
                f"tensor_parallel_size = {self.tensor_parallel_size} exceeds num_gpus = "
                f"{self.num_gpus}; lower tensor_parallel_size or use a bigger pool"
            )
        return self


BLOCK_TYPES = (TargetModelSource, StorageLocation, HardwareProfile)
