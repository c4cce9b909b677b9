"""The Prefect layer against a real `prefect server` with process workers: the deployments in
prefect.yaml, hardware-tagged pools, GPU stages dispatched to the gpu-1x pool under the per-host
concurrency limit, artifacts. Everything it starts binds 127.0.0.1 and is stopped at the end.

Cheapest config: the tiny target, no regenerate, no evaluate (a vLLM engine costs minutes on this CPU;
the flow-level tests cover the evaluate artifacts with a stand-in).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_flows import tiny_config

ROOT = Path(__file__).resolve().parents[1]
PREFECT = str(Path(sys.executable).with_name("prefect"))

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """A prefect server + workers, each in its own process group, all stopped by close()."""

    def __init__(self, home: Path):
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.logs = home / "logs"
        self.logs.mkdir(parents=True)
        self.env = {
            **os.environ,
            "PREFECT_HOME": str(home / "prefect-home"),
            "PREFECT_API_URL": self.api,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_LOCAL_STORAGE_PATH": str(home / "results"),
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PREFECT_WORKER_PREFETCH_SECONDS": "1",
            "PREFECT_LOGGING_TO_API_BATCH_INTERVAL": "0.5",
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
            "EAGLE3_REPO_DIR": str(ROOT),
            "EAGLE3_RETRY_BASE_S": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        self.env.pop("EAGLE3_INPROCESS", None)
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "w")
        p = subprocess.Popen([PREFECT, *args], cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        self.procs.append((name, p))
        return p

    def cli(self, *args: str, timeout: float = 180) -> str:
        p = subprocess.run([PREFECT, "--no-prompt", *args], cwd=ROOT, env=self.env, capture_output=True,
                           text=True, timeout=timeout)
        assert p.returncode == 0, f"prefect {' '.join(args)} failed:\n{p.stdout}\n{p.stderr}"
        return p.stdout

    def api_post(self, path: str, body: dict) -> list | dict:
        import httpx

        r = httpx.post(f"{self.api}{path}", json=body, timeout=30)
        r.raise_for_status()
        return r.json()

    def wait_healthy(self, timeout_s: float = 120) -> None:
        import httpx

        deadline = time.time() + timeout_s
        while time.time() < deadline:
            try:
                if httpx.get(f"{self.api}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"prefect server did not come up: {(self.logs / 'server.log').read_text()[-3000:]}")

    def close(self) -> None:
        for _name, p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
        for _name, p in reversed(self.procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)


@pytest.fixture
def stack(tmp_path):
    s = Stack(tmp_path)
    try:
        yield s
    finally:
        s.close()


def wait_flow_run(stack: Stack, flow_run_id: str, timeout_s: float) -> dict:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        fr = stack.api_post("/flow_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})[0]
        if fr["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return fr
        time.sleep(2)
    raise TimeoutError(f"flow run {flow_run_id} still {fr['state']['name']} after {timeout_s} s; logs in {stack.logs}")


def test_pipeline_deployment_on_real_server_with_gpu_pool(stack, tiny_llama, tmp_path):
    t0 = time.time()
    stack.start("server", "server", "start", "--host", "127.0.0.1", "--port", str(stack.port))
    stack.wait_healthy()
    for pool in ("cpu", "gpu-1x", "gpu-8x"):
        stack.cli("work-pool", "create", pool, "--type", "process")
    gpu_limit = f"gpu-host-{socket.gethostname().lower()}"
    stack.cli("global-concurrency-limit", "create", gpu_limit, "--limit", "1")
    stack.cli("deploy", "--all")
    deployments = {f"{d['name']}" for d in stack.api_post("/deployments/filter", {})}
    assert {"pipeline", "retrain-nightly", "layer-sweep", "gpu-1x", "gpu-8x"} <= deployments
    stack.start("worker-cpu", "worker", "start", "--pool", "cpu", "--type", "process")
    stack.start("worker-gpu-1x", "worker", "start", "--pool", "gpu-1x", "--type", "process")
    startup_s = time.time() - t0

    cfg = tiny_config(tiny_llama, tmp_path / "work", eval_prompts=False)
    params = json.dumps({"config": cfg.model_dump(mode="json")})
    out = stack.cli("deployment", "run", "eagle3-pipeline/pipeline", "--params", params)
    flow_run_id = next(line.split()[-1] for line in out.splitlines() if "UUID" in line)
    fr = wait_flow_run(stack, flow_run_id, timeout_s=480)
    run_s = time.time() - t0 - startup_s
    logs = "\n".join(f"--- {p.name}\n" + p.read_text()[-4000:] for p in sorted(stack.logs.glob("*.log")))
    assert fr["state"]["type"] == "COMPLETED", f"{fr['state']}\n{logs}"

    # capture and train ran as runs of their gpu-1x deployments, children of the pipeline run
    children = stack.api_post("/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [flow_run_id]}}})
    child_names = sorted(c["name"] for c in children)
    assert child_names == ["tiny-capture", "tiny-train"], child_names
    assert all(c["state"]["type"] == "COMPLETED" and c["deployment_id"] for c in children)
    limits = stack.api_post("/v2/concurrency_limits/filter", {})
    assert any(limit["name"] == gpu_limit for limit in limits)

    run_ids = [flow_run_id, *(c["id"] for c in children)]
    arts = stack.api_post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": run_ids}}})
    keys = {a["key"] for a in arts}
    for key in ("tiny-pipeline", "tiny-prepare-summary", "tiny-capture-summary", "tiny-capture-progress",
                "tiny-train-summary", "tiny-train-progress", "tiny-train-metrics", "tiny-draft"):
        assert key in keys, (key, sorted(keys))
    assert (Path(cfg.resolved().export.out) / "config.json").is_file()
    print(f"server + pools + deploy + workers: {startup_s:.1f} s; pipeline run: {run_s:.1f} s")
    shutil.rmtree(tmp_path / "work", ignore_errors=True)
