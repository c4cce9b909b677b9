"""The wheels a GPU host without vLLM needs to run vLLM, packed into parts a device call carries.

Downloads vLLM's wheel and, for the GPU image's Python (3.12, manylinux x86_64), every requirement
it and eagle3's capture (EAGLE3_NEEDS) pull in (breadth first, environment markers evaluated for
that host) that the image does not already hold (IMAGE_HAS: the image's package list,
2026-11-17) and that the capture does not need (SKIPPED: video decoding, compilers and kernel
libraries for paths an eager engine never takes).
vLLM's own wheel is unpacked and pruned of what Hopper does not load (the Ampere-only
FlashAttention-2 library, DeepGEMM builds for other Pythons), and everything is packed into one
tar.gz, split into parts of `--part-mb` MB, one folder each: `.device/vllm_gpu_1`, `_2`, ...
(git-ignored), each with the manifest (parts, sha256 of the whole). benchmarks/vllm_gpu/gpu.sh
joins them there.

    .venv/bin/python benchmarks/vllm_gpu/closure.py --vllm 0.26.0 [--part-mb 58]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
#: the GPU image's Python packages (the device host's package list; torch 2.11.0+cu130 among them)
IMAGE_HAS = set(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
    botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
    coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
    diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
    frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
    hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib
    jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator
    lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py
    mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
    numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
    nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
    nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
    nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
    opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip
    pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo
    pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov
    pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests
    rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
    sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
    statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
    tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
    torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions
    typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
    zipp""".split()
)
#: not carried: video decoding, compilers and kernel libraries an eager capture engine never loads
#: (vLLM imports them lazily, where a feature asks for them)
SKIPPED = {
    "torchcodec",
    "pynvvideocodec",
    "tilelang",
    "nvidia-cutlass-dsl",
    "quack-kernels",
    "humming-kernels",
    "tokenspeed-mla",
    "fastsafetensors",
    "opentelemetry-exporter-otlp",
    "opentelemetry-exporter-otlp-proto-grpc",
    "opentelemetry-exporter-otlp-proto-http",
}
#: what eagle3's capture needs beside vLLM (it runs from the checkout's src/): its requirements that
#: the image lacks come along (datasets reads the prepared rows)
EAGLE3_NEEDS = ("datasets>=4.0", "pydantic>=2.8")
#: what vLLM 0.26.0 imports at engine start but its wheel's requirements leave to the host (seen on
#: the H200 on 2026-12-05: benchmarks/results/vllm_gpu_golden.md)
VLLM_UNDECLARED = ("pycountry",)
#: inside vLLM's wheel, not needed on a Hopper GPU with Python 3.12
PRUNED = (
    re.compile(r"vllm/vllm_flash_attn/_vllm_fa2_C\.abi3\.so$"),
    re.compile(r"vllm/third_party/deep_gemm/_C\.cpython-3(1[013-9])-"),
)
#: the GPU image's Python and platform, for markers and for pip
TARGET_ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "platform_machine": "x86_64",
    "platform_system": "Linux",
    "sys_platform": "linux",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}
PIP_TARGET = [
    "--only-binary=:all:",
    "--python-version",
    "3.12",
    "--implementation",
    "cp",
    # the image is Ubuntu 24.04 (glibc 2.39): any manylinux tag up to 2_39 runs there
    *[f"--platform=manylinux_2_{n}_x86_64" for n in range(39, 16, -1)],
    "--platform=manylinux2014_x86_64",
    "--platform=manylinux1_x86_64",
    "--platform=linux_x86_64",
    "--platform=any",
]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def download(req: str, dest: Path) -> Path:
    """One wheel for the GPU image (no dependencies); the path of the new file."""
    before = set(dest.glob("*.whl"))
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PIP_TARGET, "-d", str(dest)]
        + [req],
        check=True,
    )
    new = set(dest.glob("*.whl")) - before
    if not new:  # already there from an earlier requirement
        name = norm(Requirement(req).name).replace("-", "_")
        return next(p for p in dest.glob("*.whl") if p.name.lower().startswith(name + "-"))
    return new.pop()


def requirements(wheel: Path, extras: set[str]) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode()
    out = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        req = Requirement(line.removeprefix("Requires-Dist: "))
        if req.marker is not None:
            wanted = [x for x in extras or {""}]
            if not any(req.marker.evaluate({**TARGET_ENV, "extra": e}) for e in wanted):
                continue
        out.append(req)
    return out


def resolve(roots: list[str], work: Path) -> dict[str, dict]:
    """pip's own resolver, for the GPU image's Python and platform, without installing: name ->
    the chosen release's metadata (version, requires_dist). Every requirement of every package
    counts, as in a real install (vLLM pins apache-tvm-ffi 0.1.10, so xgrammar comes in the newest
    release that accepts it)."""
    report = work / "resolution.json"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q"]
        + ["--report", str(report), "--target", str(work / "unused"), *PIP_TARGET, *roots],
        check=True,
    )
    chosen = {}
    for item in json.loads(report.read_text())["install"]:
        meta = item["metadata"]
        chosen[norm(meta["name"])] = meta
    return chosen


def closure(vllm_version: str, wheels: Path) -> tuple[Path, list[str]]:
    """(vLLM's wheel, the requirement wheels downloaded); skipped names are printed.

    The versions are pip's resolution of the whole set; what is carried is what vLLM and eagle3
    reach through it without passing through a package the image has or one SKIPPED.
    """
    wheels.mkdir(parents=True, exist_ok=True)
    roots = [f"vllm=={vllm_version}", *EAGLE3_NEEDS, *VLLM_UNDECLARED]
    chosen = resolve(roots, wheels)
    vllm_wheel = download(f"vllm=={vllm_version}", wheels)
    queue = [(Requirement(r), set()) for r in roots[1:]]
    queue += [(r, set()) for r in requirements(vllm_wheel, set())]
    seen, got, skipped = {"vllm"}, [], set()
    while queue:
        req, _ = queue.pop(0)
        name = norm(req.name)
        if name in IMAGE_HAS or name in SKIPPED:
            skipped.add(name)
            continue
        if name in seen:
            continue
        seen.add(name)
        version = chosen[name]["version"]
        whl = download(f"{req.name}=={version}", wheels)
        got.append(whl.name)
        queue += [(r, set(r.extras)) for r in requirements(whl, set(req.extras))]
    print(f"closure: {len(got)} wheels; left to the image or skipped: {', '.join(sorted(skipped))}")
    return vllm_wheel, got


def pack(vllm_wheel: Path, wheels: Path, out_root: Path, part_mb: int) -> dict:
    """vLLM unpacked and pruned + the other wheels -> one tar.gz in parts, one folder a part."""
    with tempfile.TemporaryDirectory(prefix="eagle3-vllm-gpu-") as tmp:
        tmp = Path(tmp)
        site = tmp / "site"
        pruned = 0
        with zipfile.ZipFile(vllm_wheel) as zf:
            for info in zf.infolist():
                if any(p.search(info.filename) for p in PRUNED):
                    pruned += info.file_size
                    continue
                zf.extract(info, site)
        tar_path = tmp / "vllm_gpu.tar.gz"
        with tarfile.open(tar_path, "w:gz", compresslevel=6) as tar:
            tar.add(site, arcname="site")
            for whl in sorted(wheels.glob("*.whl")):
                if whl != vllm_wheel:
                    tar.add(whl, arcname=f"wheels/{whl.name}")
        data = tar_path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    size = part_mb * 1_000_000
    parts = [data[i : i + size] for i in range(0, len(data), size)]
    for old in out_root.glob("vllm_gpu_[0-9]*"):
        shutil.rmtree(old)
    manifest = {
        "vllm_wheel": vllm_wheel.name,
        "num_parts": len(parts),
        "sha256": digest,
        "bytes": len(data),
        "pruned_bytes": pruned,
    }
    for i, part in enumerate(parts, start=1):
        folder = out_root / f"vllm_gpu_{i}"
        folder.mkdir(parents=True)
        (folder / f"part.{i:02d}").write_bytes(part)
        (folder / "manifest.json").write_text(json.dumps(manifest) + "\n")
    return manifest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm", default="0.26.0", help="the vLLM release (its torch: the image's)")
    ap.add_argument("--part-mb", type=int, default=58, help="MB a part (a call carries 64 MiB)")
    ap.add_argument("--out", type=Path, default=ROOT / ".device", help="where the parts go")
    args = ap.parse_args()
    wheels = args.out / "vllm_gpu_wheels"
    vllm_wheel, _ = closure(args.vllm, wheels)
    manifest = pack(vllm_wheel, wheels, args.out, args.part_mb)
    print(json.dumps(manifest))
    folders = [f".device/vllm_gpu_{i}" for i in range(1, 1 + manifest["num_parts"])]
    print(f"carry one part a call: {', '.join(folders)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
