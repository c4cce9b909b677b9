"""Content identity of stage runs: cache keys, output manifests and the stamp that proves an output
is intact.

A stage's cache key is the sha256 of
  - the stage name and its code version (eagle3.code_version: the library modules its function
    can run, found from its imports, and the versions of the packages they import; plus
    CACHE_EPOCH),
  - the stage's resolved config (every field; paths absolute and resolved: two checkouts'
    `runs/demo` differ),
  - the content hashes of its upstream stages' outputs (from their manifests),
  - fingerprints of the external inputs it reads directly (target dir, data file, mix's sources,
    eval prompts: the fields the stage declaration reads from outside the pipeline's outputs).
So an unchanged stage keeps its key across runs, a changed config changes its key and (through the
output content hash) the keys of everything downstream, and nothing upstream.

After a stage runs, `<out>/.eagle3-stage.json` (the stamp) records the key and every output file
(size, mtime, sha256). A cache hit is only honoured when the stamp carries the same key and the
files still verify; otherwise the stage runs again (Prefect's own cache would return a path to files
that are gone or altered).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from eagle3.io import sha256_file, sha256_json
from eagle3.stages import external_inputs, get_stage

#: bump to invalidate every cached stage (e.g. after changing what a manifest contains)
CACHE_EPOCH = 1
STAMP = ".eagle3-stage.json"
#: what a stage task returns (the stamp in the output dir holds these plus the file list)
MANIFEST_KEYS = (
    "stage",
    "key",
    "out",
    "content_sha256",
    "num_files",
    "num_bytes",
    "wall_s",
    "slot_wait_s",
    "resumed_from",
    "result",
)

#: config fields that name inputs read from outside the pipeline's own outputs (a path, or a list of
#: sources: mix's), from the stage declaration (eagle3.stage_graph.external_inputs)
EXTERNAL_INPUT_FIELDS = tuple(external_inputs())
#: config fields holding a local path: keyed by the absolute, resolved path (two checkouts that both
#: write `runs/demo` are two different outputs, never one cache entry)
PATH_FIELDS = frozenset(
    {
        "target",
        "data",
        "out",
        "captured",
        "vocab",
        "checkpoint",
        "draft",
        "prompts",
        "spool",
        "work_dir",
        "compile_cache",
        "gguf",
        "cache_dir",
        "path",
    }
)

#: files whose deletion makes a stage redo its work while keeping verified partial outputs
#: (capture resumes from progress.json, re-verifying every shard); other stages are wiped instead
COMPLETION_MARKERS: dict[str, tuple[str, ...]] = {"capture": ("manifest.json",)}

_SMALL_FILE_BYTES = 1 << 20


def iter_files(root: Path) -> Iterable[Path]:
    """Files under root, sorted, skipping anything whose relative path has a dot-component."""
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if any(part.startswith(".") for part in rel.parts):
            continue
        if p.is_file():
            yield p


@functools.cache
def code_version(stage: str) -> str:
    """The stage's code version (eagle3.stages.Stage.code_version) with CACHE_EPOCH and eagle3's
    version. Computed once per process: a flow run keys its stages by the code it started with
    (each deployment run and each `eagle3 run` is a fresh process)."""
    import eagle3

    version = getattr(eagle3, "__version__", "?")
    return f"epoch={CACHE_EPOCH};version={version};{get_stage(stage).code_version()}"


def fingerprint_path(value: str | Path) -> str:
    """Content fingerprint of an external input: sha256 for files; for a directory, the sha256 of
    its small files and (size, mtime) of large ones (model weights), so a multi-GB target is not
    re-read."""
    p = Path(value)
    if p.is_file():
        return sha256_file(p, memo=True)
    if p.is_dir():
        items = []
        for f in iter_files(p):
            st = f.stat()
            rel = str(f.relative_to(p))
            if st.st_size <= _SMALL_FILE_BYTES:
                items.append((rel, sha256_file(f, memo=True)))
            else:
                items.append((rel, st.st_size, st.st_mtime_ns))
        return sha256_json(items)
    return f"missing:{p}"


def config_dict(cfg: BaseModel | dict[str, Any]) -> dict[str, Any]:
    if isinstance(cfg, BaseModel):
        return cfg.model_dump(mode="json")
    return json.loads(json.dumps(cfg, default=str))


def absolute_paths(value: Any, key: str | None = None) -> Any:
    """`value` (a config as JSON) with every relative path in a PATH_FIELDS field made absolute and
    resolved against this process's working directory."""
    if isinstance(value, dict):
        return {k: absolute_paths(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [absolute_paths(v, key) for v in value]
    if key in PATH_FIELDS and isinstance(value, str) and value and "://" not in value:
        return str(Path(value).expanduser().resolve())
    return value


def external_fingerprints(conf: dict[str, Any], upstream_outs: set[str]) -> dict[str, str]:
    """Content fingerprints of the external inputs a stage's config (as JSON) names
    (EXTERNAL_INPUT_FIELDS): a path that is none of its upstream outputs, and every source of a list
    (mix's sources) as "<field>.<i>"."""
    external = {}
    for name in EXTERNAL_INPUT_FIELDS:
        value = conf.get(name)
        if isinstance(value, list):
            for i, src in enumerate(value):
                external[f"{name}.{i}"] = fingerprint_path(src["path"])
        elif value and str(Path(value).resolve()) not in upstream_outs:
            external[name] = fingerprint_path(value)
    return external


def stage_cache_key(
    stage: str, cfg: BaseModel | dict[str, Any], upstream: dict[str, dict[str, Any]]
) -> str:
    """The content key of one stage run (see the module docstring)."""
    conf = absolute_paths(config_dict(cfg))
    upstream_outs = {str(Path(m["out"]).resolve()) for m in upstream.values() if m.get("out")}
    material = {
        "stage": stage,
        "code": code_version(stage),
        "config": conf,
        "upstream": {name: m["content_sha256"] for name, m in sorted(upstream.items())},
        "external": external_fingerprints(conf, upstream_outs),
    }
    return f"eagle3-{stage}-{sha256_json(material)[:32]}"


def list_outputs(out: Path) -> dict[str, list[Any]]:
    """{relative path: [size, mtime_ns, sha256]} for every output file."""
    files = {}
    for f in iter_files(out):
        st = f.stat()
        files[str(f.relative_to(out))] = [st.st_size, st.st_mtime_ns, sha256_file(f, memo=True)]
    return files


def content_sha256(files: dict[str, list[Any]]) -> str:
    return sha256_json(sorted((rel, v[2]) for rel, v in files.items()))


def read_stamp(out: str | Path) -> dict[str, Any] | None:
    p = Path(out) / STAMP
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def write_stamp(out: str | Path, stamp: dict[str, Any]) -> None:
    p = Path(out) / STAMP
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(stamp, indent=1, default=str))
    os.replace(tmp, p)


def verify_outputs(out: str | Path, key: str) -> tuple[bool, str]:
    """(True, "") when `out` holds a finished run of `key` whose files are all present and
    unaltered; otherwise (False, reason). Files whose size and mtime match are trusted; others are
    re-hashed."""
    out = Path(out)
    stamp = read_stamp(out)
    if stamp is None:
        return False, f"no stamp in {out}"
    if stamp.get("key") != key:
        return False, f"{out} holds the output of {stamp.get('key')}, not {key}"
    if stamp.get("status") != "done":
        return False, f"{out} holds an unfinished run ({stamp.get('status')})"
    for rel, (size, mtime_ns, sha) in stamp.get("files", {}).items():
        f = out / rel
        if not f.is_file():
            return False, f"{f} is missing"
        st = f.stat()
        if st.st_size != size:
            return False, f"{f} changed size ({size} -> {st.st_size} bytes)"
        if st.st_mtime_ns != mtime_ns and sha256_file(f, memo=True) != sha:
            return False, f"{f} was altered (sha256 differs)"
    return True, ""


def prepare_out_dir(stage: str, out: str | Path, key: str) -> str:
    """Before a stage runs: make `out` safe to (re)write. Returns what was done, for the log.

    - stamp of another key (config/upstream changed): the old output is removed, so a library that
      resumes from `out` cannot mix runs;
    - stamp of this key but damaged output: for capture only the completion marker goes (the library
      re-verifies its shards and recaptures what is missing); other stages are removed;
    - stamp of this key, unfinished (a crashed attempt being retried): kept, so the library resumes;
    - no stamp: left alone (not ours to delete).
    """
    out = Path(out)
    stamp = read_stamp(out)
    if stamp is None or not out.exists():
        return "fresh"
    if stamp.get("key") != key:
        _wipe(out)
        return "removed output of a different config"
    if stamp.get("status") != "done":
        return "resuming unfinished run"
    markers = COMPLETION_MARKERS.get(stage)
    if markers:
        for name in markers:
            (out / name).unlink(missing_ok=True)
        (out / STAMP).unlink(missing_ok=True)
        return "damaged output: removed completion marker, library resumes"
    _wipe(out)
    return "damaged output: removed"


def describe_resume_point(stage: str, out: str | Path) -> str | None:
    """What a run of `stage` that resumes in `out` starts from, in words (the summary's "from which
    checkpoint"); None for stages that do not resume."""
    out = Path(out)
    if stage in ("train", "stream-train"):
        steps = sorted(
            int(p.name[5:])
            for p in (out / "checkpoints").glob("step-*")
            if p.name[5:].isdigit() and (p / "trainer_state.json").is_file()
        )
        if not steps:
            return "step 0 (no checkpoint was written)"
        return f"checkpoint step {steps[-1]} ({out / 'checkpoints' / f'step-{steps[-1]}'})"
    if stage == "capture":
        try:
            shards = json.loads((out / "progress.json").read_text()).get("shards") or []
        except (OSError, ValueError):
            shards = []
        if not shards:
            return "sample 0 (no shard was finished)"
        return f"{len(shards)} finished shard(s), sample {shards[-1].get('next_index', '?')}"
    return None


def _wipe(out: Path) -> None:
    for child in out.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
