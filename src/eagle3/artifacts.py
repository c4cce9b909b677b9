"""The records the stages hand each other, typed: one model per file, its format, and the one
migration of files written by older versions. Every writer and every reader of these files goes
through here; no stage reads another stage's JSON by key.

    prepare         PreparedMeta      <prepared>/manifest.json
    capture         CaptureManifest   <captured>/manifest.json, its shards as ShardEntry
                                      (several capture dirs as one: CaptureManifest.load_combined)
                    RoutingStats      <captured>/routing.json (MoE targets: distinct experts per
                                      window of tokens; the raw ids in routing_ids.npz)
    stream-capture  SpoolHeader       <spool>/stream.json (streaming mode's capture manifest)
    vocab           DraftVocab        <vocab>/vocab.safetensors (d2t, t2d)
    train, export   DraftMetadata     <draft dir>/eagle3_draft.json
                                      (best/, final/, checkpoints/step-N/, export's out)
    evaluate        EvalResults       <evaluate>/results.json

Old key names (before the aux layer ids were called `aux_layer_ids` everywhere) load as aliases:
`migrate_record` renames them, for every record read, in files and in memory. Only the exported
config.json keeps vLLM's own key `eagle_aux_hidden_state_layer_ids`; a user config with an old key
is an error naming the new key (eagle3.config), not a silent alias. Keys a record does not declare
(older or newer writers) are kept as they are and written back; a missing required field is an
ArtifactError naming the file, the field and the fix.

Target identity (2026-12-03). Capture manifests, progress files, spool headers and draft metadata
record `target_fingerprint` (eagle3.identity: every weight file). Older ones identify the target by
the embedding, final norm and lm_head only (`target_weights_sha256`): `recorded_target_fingerprint`
warns once per record and the readers compare those instead. Checkpoints record their `inputs`
(capture, vocab, ... identities) since the same date; for older ones `recorded_resume_inputs` warns
once and resume compares the config and draft shape only.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Self

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError
from safetensors.numpy import load_file, save_file

from eagle3.config import RENAMED_CONFIG_KEYS, ConfigError
from eagle3.config.train_options import nest_train_record
from eagle3.errors import UserError
from eagle3.io import atomic_path, read_json, write_json

#: old key -> new key, in capture manifests, spool headers and draft metadata
RENAMED_RECORD_KEYS: dict[str, str] = {
    "layers": "aux_layer_ids",
    "captured_layers": "captured_aux_layer_ids",
}


class ArtifactError(ValueError):
    """A record file (or a record given in memory) lacks a required field or holds a bad value."""


_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Print `message` as an eagle3 warning the first time `key` is seen in this process."""
    if key not in _warned:
        _warned.add(key)
        print(f"eagle3: warning: {message}", file=sys.stderr, flush=True)


def migrate_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a capture manifest, spool header or draft metadata with the old key names
    renamed (a record that holds both names keeps the new one); its nested `train_config` is
    migrated the same way, and the flat one of earlier versions put into groups
    (eagle3.config.train_options.nest_train_record); a `draft_config` of before the draft families
    gets its family (eagle3.1 where its EAGLE-3.1 switches are on, else eagle3)."""
    out = dict(record)
    for old, new in RENAMED_RECORD_KEYS.items():
        if old in out:
            value = out.pop(old)
            out.setdefault(new, value)
    if isinstance(out.get("train_config"), dict):
        tc = dict(out["train_config"])
        for old, new in RENAMED_CONFIG_KEYS.items():
            if old in tc:
                tc.setdefault(new, tc.pop(old))
        out["train_config"] = nest_train_record(tc)
    draft = out.get("draft_config")
    if isinstance(draft, dict) and "family" not in draft:
        switched = bool(draft.get("fc_norm") or draft.get("norm_output"))
        out["draft_config"] = {**draft, "family": "eagle3.1" if switched else "eagle3"}
    return out


class Record(BaseModel):
    """A JSON record: extra keys kept (round-trip), frozen once read. `origin` names where it
    came from."""

    model_config = ConfigDict(extra="allow", frozen=True)

    #: its file name in the stage's output dir
    FILE: ClassVar[str] = ""
    #: what to do when a file cannot be read as this record
    FIX: ClassVar[str] = ""

    _source: str = PrivateAttr(default="")

    @classmethod
    def from_dict(cls, data: Any, source: str) -> Self:
        """The record in `data` (old key names migrated); ArtifactError naming `source`, the
        field and the fix."""
        if isinstance(data, cls):
            return data
        if not isinstance(data, Mapping):
            raise ArtifactError(
                f"{source}: expected a JSON object ({cls.__name__}), got {type(data).__name__}; "
                f"{cls.FIX}"
            )
        try:
            record = cls.model_validate(migrate_record(data))
        except ValidationError as e:
            problems = []
            for err in e.errors():
                field = ".".join(str(p) for p in err["loc"])
                if err["type"] == "missing":
                    problems.append(f"required field `{field}` is missing")
                else:
                    problems.append(f"field `{field}` = {err.get('input')!r}: {err['msg']}")
            raise ArtifactError(
                f"{source} ({cls.__name__}): {'; '.join(problems)}; {cls.FIX}"
            ) from None
        record._source = source
        return record

    @classmethod
    def read(cls, path: str | Path) -> Self:
        """The record in the JSON file `path` (FileNotFoundError / ValueError naming it when
        absent / not JSON)."""
        return cls.from_dict(read_json(path), str(path))

    @property
    def origin(self) -> str:
        """The file (or the caller) this record was read from; "" for a record built in this
        process."""
        return self._source

    def to_dict(self) -> dict[str, Any]:
        """The record as written: the fields it was given (or read) and the extra keys it
        carries."""
        return self.model_dump(mode="json", exclude_unset=True, fallback=str)

    def write(self, path: str | Path) -> Path:
        """Write the record to `path` atomically."""
        write_json(path, self.to_dict())
        return Path(path)

    def save(self, out_dir: str | Path) -> Path:
        """Write the record as `out_dir`/FILE atomically."""
        return self.write(Path(out_dir) / self.FILE)

    def require(self, *fields: str) -> None:
        """ArtifactError naming the file, the first of `fields` that is unset and the fix."""
        for name in fields:
            if getattr(self, name, None) is None:
                raise ArtifactError(
                    f"{self.origin or type(self).__name__}: required field `{name}` is missing; "
                    f"{self.FIX}"
                )


@dataclass(frozen=True)
class RecordedTarget:
    """What a capture or a draft recorded about the target it was made from (eagle3.integrity
    compares it with the target given now); None where the record lacks it (older files: not
    compared)."""

    target: str | None
    config_sha256: str | None
    num_hidden_layers: int | None
    weights_sha256: dict[str, str] | None
    #: eagle3.identity.target_fingerprint (every weight file); None in records before 2026-12-03
    fingerprint: dict[str, Any] | None = None

    @classmethod
    def of_progress(cls, progress: Mapping[str, Any], target: str | None) -> RecordedTarget:
        """What an interrupted capture's progress.json (eagle3.shards.read_progress) recorded
        about the target it was started with (`target`: the target given now, for messages)."""
        return cls(
            target,
            None,
            None,
            progress.get("target_weights_sha256"),
            progress.get("target_fingerprint"),
        )


def recorded_target_fingerprint(recorded: RecordedTarget, what: str) -> dict[str, Any] | None:
    """The `target_fingerprint` a record (`what`: its file, for the message) holds; None, with a
    warning once per record, for one written before 2026-12-03, whose readers then compare its
    `target_weights_sha256` (embedding, final norm, lm_head) instead."""
    if recorded.fingerprint:
        return recorded.fingerprint
    old = (
        "the embedding, final norm and lm_head sha256" if recorded.weights_sha256 else "no weights"
    )
    warn_once(
        f"fingerprint:{what}",
        f"{what} was written before 2026-12-03 and records no "
        f"fingerprint of the target's weight files; only {old} can be compared (decoder "
        "layers changed in place go unnoticed). Produce it again with this version to have "
        "every weight checked",
    )
    return None


# ------------------------------------------------------------------------------------------ prepare


class PreparedMeta(Record):
    """manifest.json of a prepared dataset (`eagle3 prepare`): where the rows came from and how
    many there are. Capture records the hashes of the tokenizer and chat template, vocab reads
    the vocabulary size."""

    FILE: ClassVar[str] = "manifest.json"
    FIX: ClassVar[str] = "run `eagle3 prepare` again into this dir"

    stage: str | None = None
    source: Any = None
    source_sha256: str | None = None
    target: str | None = None
    tokenizer_sha256: str | None = None
    chat_template_sha256: str | None = None
    #: the run's chat_template_kwargs (the thinking switch), and rows' own by count
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template_kwargs_by_row: dict[str, int] | None = None
    #: the reasoning markers the chat template writes ([open, close], any number of tokens each)
    think_markers: list[str] | None = None
    mask_method: str | None = None
    tokenizer_vocab_size: int | None = None
    target_vocab_size: int | None = None
    num_rows: int | None = None
    num_samples: int | None = None
    num_tokens: int | None = None
    num_supervised_tokens: int | None = None
    num_truncated: int | None = None
    num_duplicate_ids_renamed: int | None = None
    max_sample_len: int | None = None
    skipped: dict[str, int] | None = None
    #: assistant turns: from_generated / from_text (where their ids came from), with_reasoning,
    #: reasoning_tokens / answer_tokens (supervised), hit_max_new_tokens, misaligned_dropped, ...
    turns: dict[str, int] | None = None
    #: what the input's assistant turns carried (eagle3.chat_formats.ReadResult.turns)
    input_turns: dict[str, int] | None = None
    config: dict[str, Any] | None = None
    #: refine's rollouts (a prepared dataset it writes): their content key and generation figures
    key: str | None = None
    stats: dict[str, Any] | None = None

    @classmethod
    def load(cls, path: str | Path) -> Self:
        """The manifest of the prepared dataset in `path`."""
        return cls.read(Path(path) / cls.FILE)

    @property
    def vocab_size(self) -> int:
        """The target's vocabulary size (the tokenizer's when the target's config gave none)."""
        if self.target_vocab_size:
            return int(self.target_vocab_size)
        self.require("tokenizer_vocab_size")
        return int(self.tokenizer_vocab_size)


# ------------------------------------------------------------------------------------------ capture


def capture_dirs(captured: str | Path) -> list[Path]:
    """One capture dir, or several separated by commas (captures made in parallel on several GPUs
    or hosts, or of data added later), in the order given."""
    parts = [p.strip() for p in str(captured).split(",")]
    if not all(parts):
        raise ConfigError(
            f"captured={str(captured)!r} has an empty entry; give capture dirs separated by "
            "commas, e.g. runs/cap-0,runs/cap-1"
        )
    seen: dict[str, str] = {}
    for p in parts:
        key = str(Path(p).resolve())
        if key in seen:
            raise ConfigError(
                f"captured={str(captured)!r} names {key} twice ({seen[key]!r} and {p!r}): its "
                "samples would be read twice (and could land in both the training and the "
                "validation split); list each capture dir once"
            )
        seen[key] = p
    return [Path(p) for p in parts]


class ShardEntry(Record):
    """One shard of a capture (manifest `shards`, progress.json), with the sha256 it was written
    with."""

    FIX: ClassVar[str] = "run `eagle3 capture` again with the same --out"

    file: str
    sha256: str
    bytes: int | None = None
    first_index: int | None = None
    next_index: int | None = None
    num_samples: int | None = None
    num_tokens: int | None = None
    skipped: dict[str, int] = {}


class CaptureManifest(Record):
    """manifest.json of a finished capture (`eagle3 capture`, written last: its presence means
    the capture is complete): the target and data it came from, the aux layer ids, the storage
    dtype, the shards."""

    FILE: ClassVar[str] = "manifest.json"
    FORMAT: ClassVar[str] = "eagle3-capture/1"
    #: the record of an interrupted capture (eagle3.shards)
    PROGRESS_FILE: ClassVar[str] = "progress.json"
    FIX: ClassVar[str] = (
        "the capture was not written whole by `eagle3 capture`: run it again with this --out"
    )
    #: what captures trained as one dataset must share (the storage dtype may differ: every reader
    #: gives bfloat16 or better)
    MUST_AGREE: ClassVar[tuple[str, ...]] = (
        "aux_layer_ids",
        "hidden_size",
        "num_hidden_layers",
        "target_config_sha256",
        "tokenizer_sha256",
        "chat_template_sha256",
    )

    format: str | None = None
    stage: str | None = None
    config_hash: str | None = None
    target: str | None = None
    target_config_sha256: str | None = None
    data: str | None = None
    prepared_manifest_sha256: str | None = None
    tokenizer_sha256: str | None = None
    chat_template_sha256: str | None = None
    #: the prepared data's chat_template_kwargs (the thinking switch); None before 2026-12-05
    chat_template_kwargs: dict[str, Any] | None = None
    aux_layer_ids: list[int]
    layer_semantics: str | None = None
    last_semantics: str | None = None
    num_hidden_layers: int | None = None
    target_weights_sha256: dict[str, str] | None = None
    target_fingerprint: dict[str, Any] | None = None
    hidden_size: int
    dtype: str | None = None
    storage: dict[str, Any] | None = None
    compute_dtype: str | None = None
    backend: str | None = None
    bytes_per_token: int | None = None
    num_samples: int | None = None
    num_tokens: int | None = None
    num_input_samples: int | None = None
    num_skipped: dict[str, int] = {}
    shards: list[ShardEntry] = []
    versions: dict[str, str | None] | None = None
    capture_config: dict[str, Any] | None = None
    #: several capture dirs read as one (load_combined): the dirs, in order
    parts: list[str] | None = None
    #: MoE targets: {"file": "routing.json", "sha256", "ids_file", "num_rows"} (RoutingStats);
    #: None when not measured (a dense target, capture.routing_sample_rows 0, before 2026-12-07)
    routing: dict[str, Any] | None = None

    @classmethod
    def load(cls, path: str | Path, check: bool = True) -> Self:
        """The manifest of the finished capture in `path` (layer ids, hidden size, dtype,
        num_samples, shards, ...). `check`: refuse one whose shards do not cover its samples
        (`coverage_problem`, raised as eagle3.errors.UserError)."""
        path = Path(path)
        m = path / cls.FILE
        if not m.is_file():
            hint = (
                " (an interrupted capture: rerun `eagle3 capture` with the same --out to finish it)"
                if (path / cls.PROGRESS_FILE).is_file()
                else " (run `eagle3 capture` first)"
            )
            raise FileNotFoundError(
                f"{m} does not exist: {path} is not a finished capture directory{hint}"
            )
        data = read_json(m)
        if not isinstance(data, dict) or data.get("format") != cls.FORMAT:
            got = data.get("format") if isinstance(data, dict) else None
            raise ValueError(f"{m}: format is {got!r}, expected {cls.FORMAT!r}")
        if "shards" not in data:
            raise ArtifactError(
                f"{m} (CaptureManifest): required field `shards` is missing; {cls.FIX}"
            )
        manifest = cls.from_dict(data, str(m))
        problem = manifest.coverage_problem(path) if check else None
        if problem:
            raise UserError(problem)
        return manifest

    def coverage_problem(self, path: str | Path) -> str | None:
        """What is wrong when the shard list of the finished capture in `path` no longer covers
        its samples (an entry lost or edited away: the reader would train on fewer samples without
        a word), else None. Checks the shards' sample counts against `num_samples` and their row
        ranges (first_index..next_index) for gaps."""
        path = Path(path)
        shards = self.shards
        listed = sum(int(e.num_samples or 0) for e in shards)
        total = self.num_samples
        gaps, expect = [], 0
        if shards and all(e.first_index is not None and e.next_index is not None for e in shards):
            for e in shards:
                if int(e.first_index) > expect:
                    gaps.append((expect, int(e.first_index) - 1))
                expect = max(expect, int(e.next_index))
            end = self.num_input_samples
            if end is not None and expect < int(end):
                gaps.append((expect, int(end) - 1))
        if (total is None or listed == int(total)) and not gaps:
            return None
        names = {e.file for e in shards}
        unlisted = sorted(f.name for f in path.glob("shard-*.safetensors") if f.name not in names)
        what = (
            f"shards holding {listed} of the {total} samples it records"
            if total is not None
            else f"shards holding {listed} samples"
        )
        spans = ", ".join(f"{a}..{b}" for a, b in gaps)
        where = f": rows {spans} of the prepared dataset are in no listed shard" if gaps else ""
        files = f" ({', '.join(unlisted[:5])} on disk but not listed)" if unlisted else ""
        return (
            f"capture {path}: {path / self.FILE} lists {what}{where}{files}; the manifest was "
            "edited or damaged, and training on it would silently drop those samples. Run "
            f"`eagle3 capture` again with the same settings and --out {path}: it rebuilds the "
            "manifest, keeping the shards before the first gap and capturing the rest"
        )

    def recorded_target(self) -> RecordedTarget:
        return RecordedTarget(
            self.target,
            self.target_config_sha256,
            self.num_hidden_layers,
            self.target_weights_sha256,
            self.target_fingerprint,
        )

    @classmethod
    def load_combined(cls, captured: str | Path) -> Self:
        """The manifest of one capture dir, or of several comma-separated ones read as one
        dataset: the first one's fields with `num_samples`/`num_tokens` summed and `parts`
        listing the dirs. Refuses captures that disagree on a MUST_AGREE field (another target,
        tokenizer, chat template or aux layer set)."""
        dirs = capture_dirs(captured)
        manifests = [cls.load(d) for d in dirs]
        first = manifests[0]
        for d, m in zip(dirs[1:], manifests[1:], strict=True):
            for key in cls.MUST_AGREE:
                if getattr(m, key) != getattr(first, key):
                    raise ConfigError(
                        f"captured={captured}: {d / cls.FILE} has {key}={getattr(m, key)!r} but "
                        f"{dirs[0] / cls.FILE} has {getattr(first, key)!r}; captures trained "
                        "together must come from the same target, tokenizer, chat template and aux "
                        "layers: capture the odd one again with the others' settings"
                    )
            pairs = (  # older captures: the second only; compared only when both have it
                (
                    "target_fingerprint",
                    (m.target_fingerprint or {}).get("sha256"),
                    (first.target_fingerprint or {}).get("sha256"),
                ),
                ("target_weights_sha256", m.target_weights_sha256, first.target_weights_sha256),
            )
            for key, mw, fw in pairs:
                if mw and fw and mw != fw:
                    raise ConfigError(
                        f"captured={captured}: {d / cls.FILE} and {dirs[0] / cls.FILE} record "
                        f"different target weights ({key} {mw} != {fw}); captures trained "
                        "together must come from the same target: capture the odd one again"
                    )
        if len(dirs) == 1:
            return first
        counts = {
            k: sum(getattr(m, k) for m in manifests)
            for k in ("num_samples", "num_tokens")
            if all(getattr(m, k) is not None for m in manifests)
        }
        combined = first.model_copy(update={**counts, "parts": [str(d) for d in dirs]})
        combined._source = str(captured)
        return combined


class RoutingStats(Record):
    """routing.json of a capture of an MoE target (eagle3.capture.routing): the distinct routed
    experts per MoE layer that windows of t consecutive tokens of one sequence wake, across b
    sequences, measured on the target's own routing of a bounded sample of captured rows.

    `distinct_experts`: {"t": [1..8], "b": [1, 4, 16, 64], "mean": [t][b] (mean over layers and
    draws; None where the sample has too few rows, the reason in `null_reasons`),
    "per_layer_mean": {"<layer id>": [t][b]}}. The raw ids, [num_tokens, layers, top_k] with the
    rows' offsets, are in IDS_FILE beside it. `RoutingStats.load(capture_dir)`: None when the
    capture measured no routing."""

    FILE: ClassVar[str] = "routing.json"
    IDS_FILE: ClassVar[str] = "routing_ids.npz"
    SCHEMA: ClassVar[str] = "eagle3.routing/1"
    FIX: ClassVar[str] = (
        "delete it and run `eagle3 capture` again with the same --out (capture.routing_sample_rows "
        "> 0) to measure the routing again"
    )

    schema_: str = Field(alias="schema")
    num_experts: int
    top_k: int
    moe_layer_ids: list[int]
    num_rows: int
    num_tokens: int
    distinct_experts: dict[str, Any]
    backend: Literal["vllm", "hf"]
    routing: Literal["grouped_topk_bias", "softmax_topk"]
    #: cells that are None, and why ("t=8,b=64" -> reason)
    null_reasons: dict[str, str] = {}
    #: the expectation under uniform routing, [t][b], for comparison
    uniform_mean: list[list[float]] | None = None

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_unset=True, fallback=str, by_alias=True)

    @classmethod
    def load(cls, path: str | Path) -> Self | None:
        """The routing measured by the capture in the directory `path` (or the routing.json file
        `path`); None when there is no routing.json. ArtifactError naming the file for another
        schema."""
        p = Path(path)
        p = p if p.name == cls.FILE else p / cls.FILE
        if not p.is_file():
            return None
        data = read_json(p)
        got = data.get("schema") if isinstance(data, dict) else None
        if got != cls.SCHEMA:
            raise ArtifactError(f"{p}: schema is {got!r}, expected {cls.SCHEMA!r}; {cls.FIX}")
        return cls.from_dict(data, str(p))

    def cell(self, t: int, b: int) -> float | None:
        """The mean distinct experts per MoE layer of b sequences' windows of t tokens (None where
        not measured)."""
        d = self.distinct_experts
        if t not in d["t"] or b not in d["b"]:
            return None
        return d["mean"][d["t"].index(t)][d["b"].index(b)]


class SpoolHeader(Record):
    """stream.json of a streaming spool (`eagle3 stream-capture`, written once): streaming mode's
    capture manifest (what the states are) plus the fixed plan both sides follow (rows, epochs,
    seed, shard size bounds)."""

    FILE: ClassVar[str] = "stream.json"
    FORMAT: ClassVar[str] = "eagle3-spool/1"
    FIX: ClassVar[str] = "delete the spool and run `eagle3 stream-capture` again"

    format: str
    capture_format: str | None = None
    config_hash: str | None = None
    stage: str | None = None
    target: str | None = None
    target_config_sha256: str | None = None
    data: str | None = None
    target_weights_sha256: dict[str, str] | None = None
    target_fingerprint: dict[str, Any] | None = None
    aux_layer_ids: list[int]
    num_hidden_layers: int | None = None
    hidden_size: int
    dtype: str | None = None
    storage: dict[str, Any] | None = None
    compute_dtype: str | None = None
    backend: str | None = None
    bytes_per_token: int | None = None
    shard_tokens: int
    max_shard_bytes: int
    val_bytes_estimate: int
    cap_bytes: int | None = None
    epochs: int
    seed: int
    num_input_samples: int | None = None
    val_rows: list[int]
    train_rows: list[int]
    #: token count of every prepared row, 0 for rows the capture skips (empty, too long for vLLM)
    row_tokens: list[int]

    def recorded_target(self) -> RecordedTarget:
        return RecordedTarget(
            self.target,
            self.target_config_sha256,
            self.num_hidden_layers,
            self.target_weights_sha256,
            self.target_fingerprint,
        )

    @classmethod
    def load(cls, spool: str | Path) -> Self | None:
        """The header of the spool `spool`, or None while it is not written yet."""
        p = Path(spool) / cls.FILE
        try:
            return cls.read(p)
        except FileNotFoundError:
            return None


# -------------------------------------------------------------------------------------------- vocab


@dataclass(frozen=True)
class DraftVocab:
    """The draft vocabulary (`eagle3 vocab`): vocab.safetensors with vLLM's two EAGLE-3 maps d2t:
    int64 (N,), target_id = draft_id + d2t[draft_id];  t2d: bool (V,), True where a target id is
    a draft id."""

    FILE: ClassVar[str] = "vocab.safetensors"
    FORMAT: ClassVar[str] = "eagle3-draft-vocab"

    d2t: np.ndarray  # (N,) int64
    t2d: np.ndarray  # (V,) bool
    draft_ids: np.ndarray  # (N,) int64 target ids in draft order

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.shape[0])

    @property
    def target_vocab_size(self) -> int:
        return int(self.t2d.shape[0])

    def save(self, out_dir: str | Path) -> Path:
        """Write `out_dir`/vocab.safetensors atomically; its path."""
        path = Path(out_dir) / self.FILE
        with atomic_path(path) as tmp:
            save_file(
                {
                    "d2t": np.ascontiguousarray(self.d2t, dtype=np.int64),
                    "t2d": np.ascontiguousarray(self.t2d, dtype=bool),
                },
                str(tmp),
                metadata={"format": self.FORMAT, "draft_vocab_size": str(self.draft_vocab_size)},
            )
        return path

    @classmethod
    def load(cls, vocab_dir: str | Path) -> DraftVocab:
        """d2t/t2d from a vocab dir (or the vocab.safetensors file itself), checked to agree."""
        p = Path(vocab_dir)
        path = p if p.is_file() else p / cls.FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: run `eagle3 vocab` first")
        t = load_file(str(path))
        d2t, t2d = t["d2t"].astype(np.int64), t["t2d"].astype(bool)
        draft_ids = np.arange(d2t.shape[0], dtype=np.int64) + d2t
        if int(t2d.sum()) != d2t.shape[0] or not t2d[draft_ids].all():
            raise ValueError(
                f"{path}: d2t and t2d disagree (corrupt vocab file): run `eagle3 vocab` again"
            )
        return cls(d2t=d2t, t2d=t2d, draft_ids=draft_ids)

    def torch_maps(self) -> tuple[Any, Any]:
        """(d2t (N,) int64, t2d (V,) bool) as torch tensors, as the draft holds them."""
        import torch  # heavy: the records above load without it

        return torch.from_numpy(self.d2t.copy()).long(), torch.from_numpy(self.t2d.copy()).bool()


# ---------------------------------------------------------------------------------------- the draft


class DraftMetadata(Record):
    """eagle3_draft.json beside a draft's weights (training's best/, final/, checkpoints/step-N/;
    export's out): the draft's shape, the aux layer ids it reads, the target, capture and vocab
    it was trained from, every flag of its training run."""

    FILE: ClassVar[str] = "eagle3_draft.json"
    FORMAT: ClassVar[str] = "eagle3-draft/1"
    FIX: ClassVar[str] = (
        "pass a directory written by `eagle3 train` or `eagle3 export` (or train again)"
    )

    format: str | None = None
    draft_config: dict[str, Any]
    aux_layer_ids: list[int]
    captured_aux_layer_ids: list[int] | None = None
    target: str | None = None
    target_hidden_size: int | None = None
    target_vocab_size: int | None = None
    target_num_layers: int | None = None
    target_config_sha256: str | None = None
    target_weights_sha256: dict[str, str] | None = None
    #: eagle3.identity.target_fingerprint (every weight file), since 2026-12-03
    target_fingerprint: dict[str, Any] | None = None
    target_max_position_embeddings: int | None = None
    #: the chat_template_kwargs of the data it was trained on (the thinking switch; evaluate
    #: compares them); None when not recorded (before 2026-12-05, or a streaming capture)
    chat_template_kwargs: dict[str, Any] | None = None
    draft_vocab_size: int | None = None
    vocab: str | None = None
    captured: str | None = None
    step: int | None = None
    ttt_steps: int | None = None
    #: TrainConfig.model_dump of the run (every flag it was trained with)
    train_config: dict[str, Any] | None = None
    #: identities of the capture, vocab, validation capture and target it was trained from
    #: (eagle3.train.resume_inputs), since 2026-12-03
    inputs: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None
    #: set by export: the format of the directory this file sits in
    export_format: str | None = None

    @classmethod
    def load(cls, draft_dir: str | Path) -> Self:
        """The metadata in `draft_dir`."""
        return cls.read(Path(draft_dir) / cls.FILE)

    def recorded_target(self) -> RecordedTarget:
        return RecordedTarget(
            self.target,
            self.target_config_sha256,
            self.target_num_layers,
            self.target_weights_sha256,
            self.target_fingerprint,
        )

    def recorded_resume_inputs(self, what: str) -> dict[str, Any] | None:
        """The `inputs` (capture, vocab, target identities) a checkpoint's metadata records; None,
        with a warning once, for a checkpoint written before 2026-12-03 (resume then compares its
        config and draft shape only)."""
        if isinstance(self.inputs, dict):
            return self.inputs
        warn_once(
            f"inputs:{what}",
            f"{what} was written before 2026-12-03 and records no "
            "identity of the capture and vocab it was trained on; resume compares its "
            "training config and draft shape only",
        )
        return None

    @property
    def trained_num_speculative_tokens(self) -> int | None:
        """The k the draft was trained for (its train_config's num_speculative_tokens), None when
        not recorded."""
        return (self.train_config or {}).get("num_speculative_tokens")


def list_checkpoints(out: Path) -> list[Path]:
    """checkpoints/step-N dirs of a training out dir (those with a trainer_state.json), newest
    first."""
    steps = []
    for p in (Path(out) / "checkpoints").glob("step-*"):
        m = re.fullmatch(r"step-(\d+)", p.name)
        if m and (p / "trainer_state.json").is_file():
            steps.append((int(m.group(1)), p))
    return [p for _, p in sorted(steps, reverse=True)]


def latest_checkpoint(out: Path) -> Path | None:
    found = list_checkpoints(out)
    return found[0] if found else None


# ----------------------------------------------------------------------------------------- evaluate


class EvalRow(Record):
    """τ and speed of one method at one (category, temperature): a row of results.json's `rows`,
    `comparisons` or `span_rows`, as the evaluate stage builds it (eagle3.evaluate.rows, where it
    is also named CategoryResult) and as its readers load it. Every field is optional so that
    results.json files written before a field existed still load; the stage sets them all."""

    method: str | None = None
    #: "all": every prompt of this temperature
    category: str | None = None
    temperature: float | None = None
    num_prompts: int | None = None
    #: None when the proposer made no drafts (ngram on prompts without repeats)
    tau: float | None = None
    num_drafts: int | None = None
    num_accepted_tokens: int | None = None
    accepted_per_position: list[int] | None = None
    generated_tokens: int | None = None
    tokens_per_s: float | None = None
    baseline_tokens_per_s: float | None = None
    measured_speedup: float | None = None
    #: generated tokens per target forward pass (eagle3.evaluate.tokens_per_target_step)
    tokens_per_step: float | None = None
    #: greedy only: fraction of prompts whose output is identical with and without speculation
    outputs_match_baseline: float | None = None
    draft_cost_ratio: float | None = None
    #: "all" (every generated token), or a span of a thinking target's turns: "reasoning" (the
    #: think block, `</think>` included) or "answer" (after it) (EvalResults.span_rows)
    span: str | None = None


class EvalResults(Record):
    """results.json of `eagle3 evaluate` (also the stage's result in memory): τ and speed of the
    evaluated method over every prompt at the first temperature (headline fields), one row per
    (category, temperature) in `rows`, the rows of the methods measured beside it in
    `comparisons`, and how it was run (engine, config, versions)."""

    FILE: ClassVar[str] = "results.json"
    FIX: ClassVar[str] = "run `eagle3 evaluate` again into this dir"

    num_prompts: int | None = None
    num_speculative_tokens: int | None = None
    acceptance_length: float | None = None
    num_drafts: int | None = None
    num_draft_tokens: int | None = None
    num_accepted_tokens: int | None = None
    accepted_per_position: list[int] | None = None
    acceptance_rate_per_position: list[float] | None = None
    spec_tokens_per_s: float | None = None
    baseline_tokens_per_s: float | None = None
    speedup: float | None = None
    outputs_match_baseline: float | None = None
    prompts_skipped: dict[str, int] | None = None
    method: str = "eagle3"
    rows: list[EvalRow] = []
    draft_cost: dict[str, Any] | None = None
    #: method -> its predicted speed-up per k and concurrency (eagle3.speedup.SpeedupPrediction,
    #: as_dict: rows, recommended_k, summary, table_markdown)
    predicted_speedup: dict[str, Any] | None = None
    comparisons: list[EvalRow] = []
    #: a thinking target's rows per span (reasoning, answer) for every method measured
    span_rows: list[EvalRow] = []
    #: how the prompts were rendered: chat_template_kwargs, the draft's, and whether they differ
    chat: dict[str, Any] | None = None

    @classmethod
    def load(cls, path: str | Path) -> Self:
        """The results of the evaluate dir (or the results.json file) `path`."""
        p = Path(path)
        return cls.read(p / cls.FILE if p.is_dir() else p)

    def all_row(self) -> EvalRow | None:
        """The row over every prompt at the first temperature (None when the result has no rows)."""
        return next((x for x in self.rows if x.category == "all"), None)
