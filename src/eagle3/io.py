"""Small file helpers shared by the stages: atomic writes, content hashes, JSON manifests."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import shutil
import tempfile
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from eagle3.errors import UserError, disk_full_error, is_disk_full


@contextlib.contextmanager
def atomic_path(path: str | Path, needed_bytes: int | None = None) -> Iterator[Path]:
    """Yield a temp path next to `path`; rename it onto `path` only if the block succeeds.

    A killed or failing writer never leaves a half-written file under the final name. A write that
    the full disk stops (ENOSPC, or torch's writer failing there) is raised as
    eagle3.errors.DiskFullError naming `path`, the free space and `needed_bytes` (the size of what
    is written, where the caller knows it).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    umask = os.umask(0)
    os.umask(umask)
    tmp_path.chmod(0o666 & ~umask)  # mkstemp makes it 0600
    try:
        yield tmp_path
        # again: a writer may replace the file (safetensors' save_file writes its own 0600 temp file
        # and renames it over ours), and a draft vLLM serves as another user must be readable (0644
        # under umask 022)
        tmp_path.chmod(0o666 & ~umask)
        os.replace(tmp_path, path)
    except (OSError, RuntimeError) as e:
        _name_failed_write(e, path, path, needed_bytes)
        raise
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def _name_failed_write(
    e: OSError | RuntimeError, written: Path, path: Path, needed_bytes: int | None
) -> None:
    """Make a failed write of `path` (through `written`) say what failed: DiskFullError naming
    `path` and the bytes it needed when the disk is full; else `path` as the error's file where it
    names none (the caller re-raises it)."""
    if is_disk_full(e, written):
        raise disk_full_error(path, needed_bytes) from e
    if isinstance(e, OSError) and e.filename is None:
        e.filename = str(path)


@contextlib.contextmanager
def atomic_dir(path: str | Path, needed_bytes: int | None = None) -> Iterator[Path]:
    """Like atomic_path for a directory: build it under a temp name, then swap it in (a full disk:
    DiskFullError naming the directory and `needed_bytes`, its whole size where the caller knows
    it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it 0700; the final dir should look like any other
    try:
        try:
            yield tmp
        except (OSError, RuntimeError) as e:
            # named as the directory being written (the temp names inside it vanish)
            _name_failed_write(e, tmp, path, needed_bytes)
            raise
        _normal_modes(tmp, umask)
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _normal_modes(root: Path, umask: int) -> None:
    """Files under `root` get the modes of ordinary files (0644 under umask 022, exec bits kept):
    writers such as safetensors' save_file leave a 0600 file, which a vLLM server running as another
    user cannot read."""
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            mode = p.stat().st_mode
            p.chmod((0o666 & ~umask) | (mode & 0o111 & ~umask))


def write_text(path: str | Path, text: str) -> None:
    """Write `text` to `path` atomically (see atomic_path)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: str | Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def write_jsonl(path: str | Path, rows: Iterable[Any]) -> None:
    """Write `rows` to `path` atomically, one JSON line each (UTF-8, not ASCII-escaped)."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def read_json(path: str | Path) -> Any:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p} does not exist")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p} is not valid JSON: {e}") from None


#: bytes read at a time into one reused buffer when hashing a file
READ_BYTES = 1 << 24
_sha256_memo: dict[tuple[str, int, int], str] = {}
_sha256_memo_lock = threading.Lock()


def sha256_file(path: str | Path, *, memo: bool = False) -> str:
    """sha256 of a file's bytes (hex), read READ_BYTES at a time into one reused buffer (hashlib
    releases the GIL: threads hash files side by side). `memo`: remembered per process by
    (resolved path, size, mtime_ns), for files hashed again and again in one process (cache keys,
    stage stamps, the code version); never for a check that must catch a file altered in place
    with its size and mtime kept."""
    if memo:
        st = os.stat(path)
        key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
        with _sha256_memo_lock:
            if key in _sha256_memo:
                return _sha256_memo[key]
    h = hashlib.sha256()
    buf = bytearray(READ_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    digest = h.hexdigest()
    if memo:
        with _sha256_memo_lock:
            _sha256_memo[key] = digest
    return digest


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def sha256_json(obj: Any) -> str:
    return sha256_text(json.dumps(obj, sort_keys=True, default=str))


def tensor_nbytes(obj: Any) -> int:
    """Bytes of the tensors in `obj` (a tensor, or dicts / lists / tuples of them, e.g. a state dict
    or an optimizer's state_dict): about what torch.save or safetensors writes for it."""
    if hasattr(obj, "element_size") and hasattr(obj, "numel"):
        return int(obj.element_size() * obj.numel())
    if isinstance(obj, dict):
        return sum(tensor_nbytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_nbytes(v) for v in obj)
    return 0


class CorruptFileError(UserError, ValueError):
    """A file exists but cannot be read as what it should be (truncated, overwritten, foreign)."""


@contextlib.contextmanager
def corrupt_file_errors(path: str | Path, what: str = "file", fix: str = "") -> Iterator[None]:
    """Turn a reader's low-level failure on `path` (safetensors' SafetensorError, a torch zip/pickle
    error, a truncated read) into a CorruptFileError naming the file, what it is and `fix`."""
    try:
        yield
    except (
        SafetensorError,
        EOFError,
        pickle.UnpicklingError,
        RuntimeError,
        json.JSONDecodeError,
    ) as e:
        if (
            isinstance(e, RuntimeError)
            and not isinstance(e, SafetensorError)
            and not _looks_like_read_error(e)
        ):
            raise
        size = Path(path).stat().st_size if Path(path).is_file() else None
        raise CorruptFileError(
            f"{what} {path} is truncated or corrupt ({type(e).__name__}: {str(e)[:200]}; {size} "
            "bytes on disk)" + (f": {fix}" if fix else "")
        ) from e


def _looks_like_read_error(e: BaseException) -> bool:
    text = str(e).lower()
    return any(
        m in text
        for m in (
            "pytorchstreamreader",
            "zip archive",
            "unexpected eof",
            "invalid header",
            "file_size",
            "incomplete",
        )
    )


def read_safetensors(path: str | Path, what: str = "weights file", fix: str = "") -> dict[str, Any]:
    """safetensors.torch.load_file, with a truncated or corrupt file reported as CorruptFileError
    naming it."""
    from safetensors.torch import load_file

    with corrupt_file_errors(path, what, fix):
        return load_file(str(path))
