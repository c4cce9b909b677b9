"""Streaming mode's configs (eagle3.stream): the spool's settings, the pipeline's `stream:`
section, and the two sides, capture writing into the spool and train reading from it."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from eagle3.config.capture import CaptureConfig
from eagle3.config.fields import Count, Number
from eagle3.config.train import TrainConfig


class SpoolSettings(BaseModel):
    """The spool of streaming mode: its cap and how the two sides wait for each other."""

    spool_cap_gb: Number = Field(
        100.0,
        gt=0,
        description="Streaming: most the spool may hold at any moment, temp files and ledgers "
        "included (GB = 1e9 bytes); it must fit the validation shards plus a few capture shards",
    )
    poll_interval_s: Number = Field(
        0.5, gt=0, description="Streaming: how often a waiting side looks at the spool again"
    )
    stall_timeout_s: Number = Field(
        3600.0,
        gt=0,
        description="Streaming: a side waiting this long without the other side making progress "
        "fails",
    )

    @property
    def spool_cap_bytes(self) -> int:
        return int(self.spool_cap_gb * 1e9)


class StreamConfig(SpoolSettings):
    """`stream:` of a pipeline config: bounded-disk mode, capture and train at once through a capped
    spool."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    enabled: bool = Field(
        False,
        description="Capture and train concurrently through a spool of at most spool_cap_gb "
        "instead of capture -> train (for captures larger than the disk); every epoch is captured "
        "again",
    )
    spool: Path | None = Field(
        None, description="Spool directory, seen by both sides (default <work_dir>/spool)"
    )


class StreamCaptureConfig(CaptureConfig, SpoolSettings):
    """The producer side of streaming mode (`eagle3 stream-capture`)."""

    out: Path | None = Field(
        None, description="Spool directory the shards go to (pipeline: stream.spool)"
    )
    epochs: Count = Field(
        1, gt=0, description="Passes over the data, each captured again (pipeline: train.epochs)"
    )
    val_fraction: Number = Field(
        0.05,
        ge=0,
        lt=1,
        description="Samples held out for validation, captured once and kept in the spool "
        "for the whole run (pipeline: train.loader.val_fraction)",
    )
    seed: Count = Field(
        0,
        description="Seed of the validation split and of each epoch's order (pipeline: train.seed)",
    )


class StreamTrainConfig(TrainConfig, SpoolSettings):
    """The consumer side of streaming mode (`eagle3 stream-train`): trains on the spool's shards as
    they come and deletes each once a checkpoint covers it. epochs/val_fraction are the
    producer's."""

    captured: str | None = Field(
        None, description="Spool directory to train from (pipeline: stream.spool)"
    )
