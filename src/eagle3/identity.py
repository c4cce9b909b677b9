"""Which target model a file was made from: a fingerprint of every weight file of the target dir.

`target_fingerprint(target)` is
    {"format": FORMAT, "algorithm": "sha256", "sha256": <one hash of them all>,
     "files": {name: sha256}, "num_files": n, "num_bytes": b}
over the weight files at the top of the directory (WEIGHT_PATTERNS: safetensors files and their
index, PyTorch .bin/.pt/.pth, GGUF), None for a dir without any (a config-only target). `sha256`
hashes each file's name, size and content sha256, so a decoder layer fine-tuned in place, another
checkpoint of the same family or a requantized file all change it; config.json is compared on its
own (the records' `target_config_sha256`: `config_sha256`, its content without the keys that only
name the writer's library version, so the same target saved by another transformers version still
matches).

Regenerate, capture, train and export record it; every stage that reads another's output compares it
(eagle3.integrity words the messages, eagle3.artifacts reads records written before it existed).

Cost: a file's sha256 is cached by its resolved path, size, mtime_ns and inode, in one JSON file per
target dir under the user's cache dir ($EAGLE3_CACHE_DIR, else $XDG_CACHE_HOME/eagle3, else
~/.cache/eagle3; `fingerprints/`), so a target is read once and every later stage pays a stat() per
file. A cache dir that cannot be written costs the caching only (said once; every run hashes again).
Uncached files are hashed in parallel threads (eagle3.io.sha256_file: 16 MiB reads). sha256
ran at 0.99 GB/s per thread, blake2b at 0.48 GB/s (2026-12-03, AMD EPYC with SHA extensions, a 1 GiB
file in the page cache), hence sha256: a 1 TB target costs ~17 min of one core once (less with more
cores, until the disk is the limit), then milliseconds.

This module imports only eagle3.io (the file hasher): every stage may use it.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from eagle3.io import sha256_file

FORMAT = "eagle3-target-fingerprint/1"
#: the weight files fingerprinted (top level of the target dir, symlinks followed: HF hub snapshots)
WEIGHT_PATTERNS = (
    "*.safetensors",
    "*.safetensors.index.json",
    "*.bin",
    "*.bin.index.json",
    "*.pt",
    "*.pth",
    "*.gguf",
)
#: threads hashing uncached files side by side
MAX_HASH_THREADS = 8
#: hashing this many uncached bytes or more is announced on stderr (it takes a while)
ANNOUNCE_BYTES = 1 << 30
_CACHE_FORMAT = "eagle3-weight-hashes/1"
_said_unwritable: set[str] = set()


def cache_dir() -> Path:
    """Where the per-target hash caches live: $EAGLE3_CACHE_DIR, else $XDG_CACHE_HOME/eagle3, else
    ~/.cache/eagle3 (the root of eagle3.targets.default_cache_dir), subdir fingerprints/."""
    root = os.environ.get("EAGLE3_CACHE_DIR")
    if not root:
        root = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "eagle3")
    return Path(root) / "fingerprints"


def weight_files(target: str | Path) -> list[Path]:
    """The weight files of a target dir that the fingerprint covers, sorted by name."""
    root = Path(target)
    if not root.is_dir():
        return []
    return sorted(
        p
        for p in root.iterdir()
        if p.is_file() and any(fnmatch.fnmatch(p.name, pat) for pat in WEIGHT_PATTERNS)
    )


#: config.json keys that say which library version wrote the file, not what the model is
#: (2026-12-03: transformers 5.17 and 5.19 write the same SmolLM2 config but for this key)
VERSION_ONLY_CONFIG_KEYS = ("transformers_version",)


def config_sha256(path: str | Path) -> str:
    """sha256 of a config.json's content without VERSION_ONLY_CONFIG_KEYS, keys sorted: what the
    model is, not how the file was formatted or which version wrote it. A file that is not a JSON
    object is hashed as bytes."""
    raw = Path(path).read_bytes()
    try:
        cfg = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return hashlib.sha256(raw).hexdigest()
    if not isinstance(cfg, dict):
        return hashlib.sha256(raw).hexdigest()
    kept = {k: v for k, v in cfg.items() if k not in VERSION_ONLY_CONFIG_KEYS}
    text = json.dumps(kept, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def _stamp(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}


def _cache_file(root: Path) -> Path:
    return cache_dir() / f"{hashlib.sha256(str(root).encode()).hexdigest()[:24]}.json"


def _read_cache(path: Path, root: Path) -> dict[str, Any]:
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if got.get("format") != _CACHE_FORMAT or got.get("target") != str(root):
        return {}
    return got.get("files") or {}


def _write_cache(path: Path, root: Path, files: dict[str, Any]) -> None:
    """Atomically (temp file + rename); a cache dir that cannot be written is said once, then
    skipped."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(
                    {"format": _CACHE_FORMAT, "target": str(root), "files": files}, f, indent=1
                )
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:
        if str(path.parent) not in _said_unwritable:
            _said_unwritable.add(str(path.parent))
            print(
                f"eagle3: note: cannot write the target fingerprint cache {path} "
                f"({e.strerror or e}); the target's weight files will be hashed again next time "
                "(set EAGLE3_CACHE_DIR to a writable dir to keep them)",
                file=sys.stderr,
                flush=True,
            )


def file_hashes(target: str | Path, _attempt: int = 0) -> dict[str, str]:
    """{file name: sha256} of the target's weight files; cached ones (same resolved path, size,
    mtime_ns and inode) are not read again. A file that changes while it is read is read again
    (twice at most)."""
    root = Path(target).resolve()
    files = weight_files(root)
    cache_path = _cache_file(root)
    cached = _read_cache(cache_path, root)
    stamps = {p.name: _stamp(p.resolve()) for p in files}
    out: dict[str, str] = {}
    todo: list[Path] = []
    for p in files:
        hit = cached.get(p.name)
        if hit and all(hit.get(k) == v for k, v in stamps[p.name].items()) and hit.get("sha256"):
            out[p.name] = hit["sha256"]
        else:
            todo.append(p)
    if todo:
        num_bytes = sum(stamps[p.name]["size"] for p in todo)
        loud = num_bytes >= ANNOUNCE_BYTES
        t0 = time.perf_counter()
        if loud:
            print(
                f"eagle3: fingerprinting {len(todo)} weight file(s) of {root} "
                f"({num_bytes / 1e9:.1f} GB; once, cached in {cache_path.parent})",
                file=sys.stderr,
                flush=True,
            )
        threads = max(1, min(MAX_HASH_THREADS, os.cpu_count() or 1, len(todo)))
        with ThreadPoolExecutor(max_workers=threads) as pool:
            for p, digest in zip(todo, pool.map(sha256_file, todo), strict=True):
                out[p.name] = digest
        if loud:
            dt = time.perf_counter() - t0
            print(
                f"eagle3: fingerprinted {num_bytes / 1e9:.1f} GB in {dt:.1f} s "
                f"({num_bytes / 1e6 / dt:.0f} MB/s)",
                file=sys.stderr,
                flush=True,
            )
        moved = [p.name for p in todo if _stamp(p.resolve()) != stamps[p.name]]
        if moved:
            if _attempt >= 2:
                raise RuntimeError(
                    f"target={target}: {', '.join(moved[:3])} kept changing while "
                    "it was fingerprinted; wait until whatever writes the target's "
                    "weights is done"
                )
            return file_hashes(target, _attempt + 1)
        _write_cache(
            cache_path, root, {name: {**stamps[name], "sha256": out[name]} for name in sorted(out)}
        )
    return {p.name: out[p.name] for p in files}


def target_fingerprint(target: str | Path) -> dict[str, Any] | None:
    """The fingerprint of every weight file of `target` (module docstring); None when it holds
    none."""
    hashes = file_hashes(target)
    if not hashes:
        return None
    sizes = {p.name: p.stat().st_size for p in weight_files(target)}
    combined = hashlib.sha256()
    for name in sorted(hashes):
        combined.update(f"{name}\0{sizes[name]}\0{hashes[name]}\n".encode())
    return {
        "format": FORMAT,
        "algorithm": "sha256",
        "sha256": combined.hexdigest(),
        "files": dict(sorted(hashes.items())),
        "num_files": len(hashes),
        "num_bytes": sum(sizes.values()),
    }


def describe_difference(
    known: dict[str, Any], actual: dict[str, Any], max_names: int = 3
) -> str | None:
    """None when two fingerprints agree; else what differs, naming up to `max_names` files, e.g.
    "weights sha256 1a2b3c4d5e6f... (recorded) != 7a8b9c0d1e2f... (target):
    model-00002.safetensors differs"."""
    if known.get("sha256") == actual.get("sha256"):
        return None
    rf, af = known.get("files") or {}, actual.get("files") or {}
    parts = [f"{n} differs" for n in sorted(set(rf) & set(af)) if rf[n] != af[n]]
    parts += [f"{n} missing from the target" for n in sorted(set(rf) - set(af))]
    parts += [f"{n} not in the record" for n in sorted(set(af) - set(rf))]
    more = f" (+{len(parts) - max_names} more)" if len(parts) > max_names else ""
    what = f": {', '.join(parts[:max_names])}{more}" if parts else ""
    return (
        f"weights sha256 {str(known.get('sha256'))[:12]}... (recorded) != "
        f"{str(actual.get('sha256'))[:12]}... (target){what}"
    )


__all__ = [
    "FORMAT",
    "WEIGHT_PATTERNS",
    "cache_dir",
    "describe_difference",
    "file_hashes",
    "target_fingerprint",
    "weight_files",
]
