"""The Prefect layer against a real `prefect server` with process workers, set up by running the bash block
of docs/operations.md "2. Local server + workers" line by line (so the documented commands cannot drift):
the deployments in prefect.yaml, hardware-tagged pools, GPU stages dispatched to the gpu-1x pool under the
per-host concurrency limit, artifacts; schedules that create and run flow runs; the failure-alert automation
(a webhook receiver on 127.0.0.1); one pipeline per work dir; config errors failing before any stage.

The server runs on PostgreSQL when the Debian package's binaries are installed (a throwaway cluster of its own
on a free port; EAGLE3_TEST_POSTGRES=0 forces SQLite), on SQLite otherwise. One server for the module;
everything it starts binds 127.0.0.1 and is stopped at the end.

Cheapest config: the tiny target, no regenerate, no evaluate (a vLLM engine costs minutes on this CPU;
the flow-level tests cover the evaluate artifacts with a stand-in).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import glob
import http.server
import json
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from test_flows import tiny_config

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DOC = ROOT / "docs" / "operations.md"
DOC_PORT, DOC_WEBHOOK = "4200", "https://hooks.example.com/eagle3"

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def doc_block(heading: str) -> list[str]:
    """The command lines of the first ```bash block under `heading` in docs/operations.md (comments dropped)."""
    text = DOC.read_text()
    start = text.index(heading)
    block = re.search(r"```bash\n(.*?)```", text[start:], re.S)
    assert block, f"no bash block under {heading!r} in {DOC}"
    lines = [re.sub(r"\s+#\s.*$", "", raw).strip() for raw in block.group(1).splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


# ------------------------------------------------------------------------------------------ PostgreSQL
def find_postgres_bin() -> Path | None:
    if os.environ.get("EAGLE3_TEST_POSTGRES", "1") == "0":
        return None
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


@contextlib.contextmanager
def postgres_cluster(bindir: Path):
    """A throwaway PostgreSQL cluster on a free 127.0.0.1 port (trust auth); yields (connection URL, start s).
    As root, the server runs as the `postgres` user (initdb refuses root)."""
    t0 = time.time()
    root = Path(tempfile.mkdtemp(prefix="eagle3-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        pg = pwd.getpwnam("postgres")
        os.chown(root, pg.pw_uid, pg.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    port = free_port()
    data, log = root / "data", root / "server.log"

    def run(*cmd: str) -> None:
        p = subprocess.run([*as_user, *cmd], capture_output=True, text=True, timeout=120, cwd=root)
        assert p.returncode == 0, f"{' '.join(cmd)} failed:\n{p.stdout}\n{p.stderr}"

    try:
        run(str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        run(str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-t", "60", "-o",
            f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off", "start")
        try:
            run(str(bindir.parent / "bin" / "psql"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "-c",
                "CREATE DATABASE prefect")
            yield f"postgresql+asyncpg://postgres@127.0.0.1:{port}/prefect", time.time() - t0
        finally:
            subprocess.run([*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"],
                           capture_output=True, timeout=60, cwd=root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------------------------------ webhook receiver
class Receiver:
    """An HTTP server on 127.0.0.1 recording the JSON bodies POSTed to it (the alert destination)."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        received = self.bodies

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                raw = self.rfile.read(int(self.headers.get("content-length") or 0))
                received.append(json.loads(raw or b"{}"))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, text: str, timeout_s: float) -> dict:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            for b in self.bodies:
                if text in json.dumps(b):
                    return b
            time.sleep(1)
        raise TimeoutError(f"no alert mentioning {text!r} within {timeout_s} s; received {self.bodies}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ------------------------------------------------------------------------------------------ the stack
class Stack:
    """The documented server + workers, each in its own process group, all stopped by close()."""

    def __init__(self, home: Path, database_url: str | None, webhook_url: str):
        self.port = str(free_port())
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.home = home
        self.webhook_url = webhook_url
        self.logs = home / "logs"
        self.logs.mkdir(parents=True)
        self.env = {
            **os.environ,
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "PREFECT_HOME": str(home / "prefect-home"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_LOCAL_STORAGE_PATH": str(home / "results"),
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PREFECT_WORKER_PREFETCH_SECONDS": "1",
            "PREFECT_LOGGING_TO_API_BATCH_INTERVAL": "0.5",
            # test speed only: the scheduler's main loop (default 60 s) picks up a schedule added later
            "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5",
            "EAGLE3_REPO_DIR": str(ROOT),
            "EAGLE3_RETRY_BASE_S": "1",
            # a lost GPU host (test_a_gpu_stage_whose_host_dies_runs_again): beat every second, lost after 15 s;
            # a dead holder's GPU slot is freed after Prefect's shortest lease (60 s) + one repossessor loop
            "EAGLE3_HEARTBEAT_S": "1",
            "EAGLE3_LOST_AFTER_S": "15",
            "EAGLE3_GPU_LEASE_S": "60",
            "PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS": "1",
            # test speed only: the parent notices a finished GPU stage run within 0.5 s (default 3 s)
            "EAGLE3_DISPATCH_POLL_S": "0.5",
            "TOKENIZERS_PARALLELISM": "false",
        }
        for key in ("EAGLE3_INPROCESS", "PREFECT_API_URL", "PREFECT_API_DATABASE_CONNECTION_URL",
                    "EAGLE3_ALERT_WEBHOOK_URL", "EAGLE3_ALERT_BLOCK"):
            self.env.pop(key, None)
        if database_url:
            self.env["PREFECT_API_DATABASE_CONNECTION_URL"] = database_url
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.run_line = ""

    def localize(self, line: str) -> str:
        return line.replace(DOC_PORT, self.port).replace(DOC_WEBHOOK, self.webhook_url)

    def start(self, name: str, command: str) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "w")
        p = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=ROOT, env=self.env, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((name, p))
        return p

    def sh(self, command: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        p = subprocess.run(["bash", "-c", command], cwd=ROOT, env=self.env, capture_output=True, text=True,
                           timeout=timeout)
        if check:
            assert p.returncode == 0, f"{command} failed:\n{p.stdout}\n{p.stderr}"
        return p

    def run_doc(self, lines: list[str]) -> None:
        """Run the documented setup; the final `prefect deployment run` line is kept for the tests."""
        for raw in lines:
            line = self.localize(raw)
            if line.startswith("export "):
                key, _, value = line[len("export "):].partition("=")
                self.env[key] = shlex.split(value)[0]
            elif line.startswith("prefect deployment run"):
                self.run_line = line
            elif line.endswith("&"):
                words = line[:-1].split()
                name = "server" if words[1] == "server" else f"worker-{words[words.index('--pool') + 1]}"
                self.start(name, line[:-1].strip())
                if name == "server":
                    self.env["PREFECT_API_URL"] = self.api
                    self.wait_healthy()
            else:
                self.sh(line)

    def post(self, path: str, body: dict | list, num_tries: int = 4) -> list | dict:
        """POST to the API; reads (`/filter`) are retried: a busy SQLite server answers late or 503
        ("database is locked", the reason docs/operations.md recommends PostgreSQL)."""
        import httpx

        for attempt in range(num_tries if path.endswith("/filter") else 1):
            try:
                r = httpx.post(f"{self.api}{path}", json=body, timeout=60)
                if r.status_code != 503:
                    break
            except httpx.TimeoutException:
                if attempt == num_tries - 1:
                    raise
            time.sleep(2)
        r.raise_for_status()
        return r.json()

    def wait_healthy(self, timeout_s: float = 180) -> None:
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

    def deploy_run(self, params: dict, deployment: str = "eagle3-pipeline/pipeline") -> str:
        """The documented run command with `params` in my-params.json; returns the flow run id."""
        (self.home / "my-params.json").write_text(json.dumps(params))
        line = self.run_line.replace("eagle3-pipeline/pipeline", deployment).replace(
            "my-params.json", str(self.home / "my-params.json"))
        out = self.sh(line).stdout
        return next(w.split()[-1] for w in out.splitlines() if "UUID" in w)

    def flow_run(self, flow_run_id: str) -> dict:
        return self.post("/flow_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})[0]

    def wait_flow_run(self, flow_run_id: str, timeout_s: float) -> dict:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            fr = self.flow_run(flow_run_id)
            if fr["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                return fr
            time.sleep(0.5)
        raise TimeoutError(f"flow run {flow_run_id} still {fr['state']['name']} after {timeout_s} s\n{self.tail_logs()}")

    def tail_logs(self) -> str:
        return "\n".join(f"--- {p.name}\n" + p.read_text()[-4000:] for p in sorted(self.logs.glob("*.log")))

    def close(self) -> None:
        for _name, p in reversed(self.procs):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for _name, p in reversed(self.procs):
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-server")
    receiver = Receiver()
    bindir = find_postgres_bin()
    t0 = time.time()
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(receiver.close)
        db_url, pg_s = cleanup.enter_context(postgres_cluster(bindir)) if bindir else (None, 0.0)
        s = Stack(home, db_url, receiver.url)
        s.receiver, s.database = receiver, "postgresql" if db_url else "sqlite"
        cleanup.callback(s.close)
        s.run_doc(doc_block("## 2. Local server + workers"))
        s.setup_s, s.postgres_s = time.time() - t0, pg_s
        print(f"\n[server] database {s.database} (cluster start {pg_s:.1f} s); documented setup {s.setup_s:.1f} s")
        yield s


def params_for(cfg) -> dict:
    return {"config": cfg.model_dump(mode="json")}


@pytest.fixture(scope="module")
def tiny_cfg(tiny_llama, tmp_path_factory):
    """The module's pipeline config (one work dir: the scheduled run re-uses the first test's cached stages)."""
    return tiny_config(tiny_llama, tmp_path_factory.mktemp("work"), eval_prompts=False)


# ------------------------------------------------------------------------------------------ tests
def test_pipeline_deployment_gpu_pool_and_one_run_per_work_dir(stack, tiny_cfg):
    cfg, work = tiny_cfg, tiny_cfg.work_dir
    deployments = {d["name"] for d in stack.post("/deployments/filter", {})}
    assert {"pipeline", "retrain-nightly", "layer-sweep", "gpu-1x", "gpu-8x"} <= deployments

    t0 = time.time()
    first = stack.deploy_run(params_for(cfg))
    second = stack.deploy_run(params_for(cfg))      # same work dir while the first runs
    runs = {i: stack.wait_flow_run(i, timeout_s=480) for i in (first, second)}
    run_s = time.time() - t0
    states = sorted(fr["state"]["type"] for fr in runs.values())
    assert states == ["COMPLETED", "FAILED"], f"{[fr['state'] for fr in runs.values()]}\n{stack.tail_logs()}"
    done = next(i for i, fr in runs.items() if fr["state"]["type"] == "COMPLETED")
    lost = next(fr for fr in runs.values() if fr["state"]["type"] == "FAILED")
    assert "is being written by" in lost["state"]["message"] and str(work) in lost["state"]["message"], lost["state"]
    assert not stack.post("/task_runs/filter", {"flow_runs": {"id": {"any_": [lost["id"]]}}})  # no stage started

    # capture and train ran as runs of their gpu-1x deployments, children of the pipeline run
    children = stack.post("/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [done]}}})
    assert sorted(c["name"] for c in children) == ["tiny-capture", "tiny-train"], children
    assert all(c["state"]["type"] == "COMPLETED" and c["deployment_id"] for c in children)
    task_names = {t["name"] for t in stack.post("/task_runs/filter", {"flow_runs": {"id": {"any_": [done]}}})}
    assert {"capture on eagle3-capture/gpu-1x", "train on eagle3-train/gpu-1x"} <= task_names, task_names
    gpu_limit = f"gpu-host-{socket.gethostname().lower()}"
    assert any(limit["name"] == gpu_limit for limit in stack.post("/v2/concurrency_limits/filter", {}))

    run_ids = [done, *(c["id"] for c in children)]
    arts = {a["key"]: a for a in stack.post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": run_ids}}})}
    for key in ("tiny-pipeline", "tiny-prepare-summary", "tiny-capture-summary", "tiny-capture-progress",
                "tiny-train-summary", "tiny-train-progress", "tiny-train-metrics", "tiny-draft"):
        assert key in arts, (key, sorted(arts))
    assert arts["tiny-draft"]["type"] == "markdown"      # a link artifact is stored as markdown (the doc says so)
    assert "GPU slot wait s" in arts["tiny-pipeline"]["data"]
    assert (Path(cfg.resolved().export.out) / "config.json").is_file()

    # the losing run's failure reached the webhook through the automation deploy.sh created
    alert = stack.receiver.wait_for(lost["name"], timeout_s=90)
    assert "eagle3-pipeline" in alert["subject"] and "Failed" in alert["subject"], alert
    print(f"[server] {stack.database}: two overlapping pipeline runs {run_s:.1f} s")


def test_config_errors_fail_before_any_stage(stack, tiny_llama, tmp_path_factory):
    cfg = tiny_config(tiny_llama, tmp_path_factory.mktemp("bad"), eval_prompts=False,
                      capture={"aux_layer_ids": [1, 2, 9]})
    t0 = time.time()
    run_id = stack.deploy_run(params_for(cfg))
    fr = stack.wait_flow_run(run_id, timeout_s=240)
    assert fr["state"]["type"] == "FAILED", fr["state"]
    msg = fr["state"]["message"]
    assert "capture.aux_layer_ids = [1, 2, 9]" in msg and "[9] out of range for this 5-layer target" in msg, msg
    assert "use ids in 1..4" in msg, msg
    assert not stack.post("/task_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}})
    assert not stack.post("/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [run_id]}}})
    fail_s = time.time() - t0

    # what the server can check itself is refused before a run exists
    p = stack.sh(f"{stack.run_line.split(' --params')[0].replace('eagle3-pipeline/pipeline', 'eagle3-layer-sweep/layer-sweep')}"
                 " --param max_concurrency=0", check=False)
    assert p.returncode != 0 and "max_concurrency" in p.stdout + p.stderr, (p.stdout, p.stderr)
    stack.receiver.wait_for(fr["name"], timeout_s=90)
    print(f"[server] {stack.database}: bad config failed in {fail_s:.1f} s")


def test_schedules_create_runs_and_a_scheduled_run_executes(stack, tiny_cfg):
    deps = {d["name"]: d for d in stack.post("/deployments/filter", {})}
    retrain = deps["retrain-nightly"]
    assert retrain["schedules"] and retrain["schedules"][0]["schedule"]["cron"] == "0 3 * * *"
    deadline = time.time() + 90
    while True:  # the scheduler creates the nightly runs ahead of time
        scheduled = stack.post("/flow_runs/filter", {"flow_runs": {"deployment_id": {"any_": [retrain["id"]]},
                                                                    "state": {"type": {"any_": ["SCHEDULED"]}}}})
        if scheduled or time.time() > deadline:
            break
        time.sleep(2)
    server_log = (stack.logs / "server.log").read_text()
    assert scheduled, f"no scheduled retrain runs; scheduler errors: {server_log.count('bulk DML')} bulk DML"
    assert all(dt.datetime.fromisoformat(r["expected_start_time"]).astimezone(dt.UTC).hour == 3 for r in scheduled)
    assert "Can't evaluate bulk DML" not in server_log

    # a schedule that is due now, with the tiny (cached) config as its parameters: its run executes
    pipeline = deps["pipeline"]
    anchor = (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=5)).isoformat()
    stack.post(f"/deployments/{pipeline['id']}/schedules",
               [{"schedule": {"interval": 3600, "anchor_date": anchor, "timezone": "UTC"}, "active": True,
                 "parameters": params_for(tiny_cfg)}])
    deadline, run = time.time() + 120, None
    while run is None and time.time() < deadline:
        runs = stack.post("/flow_runs/filter", {"flow_runs": {"deployment_id": {"any_": [pipeline["id"]]},
                                                              "tags": {"all_": ["auto-scheduled"]}}})
        run = min(runs, key=lambda r: r["expected_start_time"]) if runs else None
        time.sleep(2)
    assert run, "the scheduler created no run for the new schedule"
    fr = stack.wait_flow_run(run["id"], timeout_s=300)
    assert fr["state"]["type"] == "COMPLETED", f"{fr['state']}\n{stack.tail_logs()}"


def test_a_gpu_stage_whose_host_dies_runs_again(stack, tiny_llama, tmp_path_factory):
    """The gpu-1x worker and the capture run under it are SIGKILLed as soon as that run is Running (a lost host:
    nobody reports its state); a new worker comes up. The parent marks the silent run Crashed and dispatches
    capture again, and the pipeline completes."""
    import psutil

    cfg = tiny_config(tiny_llama, tmp_path_factory.mktemp("lost-host"), eval_prompts=False)
    run_id = stack.deploy_run(params_for(cfg))
    deadline, child = time.time() + 300, None
    while child is None:
        assert time.time() < deadline, f"no Running capture run\n{stack.tail_logs()}"
        runs = stack.post("/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [run_id]}}})
        child = next((r for r in runs if r["name"] == "tiny-capture" and r["state"]["type"] == "RUNNING"), None)
        time.sleep(0.3)
    name, worker = next((n, p) for n, p in stack.procs if n == "worker-gpu-1x")
    tree = [psutil.Process(worker.pid), *psutil.Process(worker.pid).children(recursive=True)]
    for p in tree:  # freeze all first, so no process of the "host" gets to report anything
        with contextlib.suppress(psutil.NoSuchProcess):
            p.suspend()
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    worker.wait(timeout=30)
    stack.procs.remove((name, worker))
    # the replacement host: another node, so another GPU slot (the dead run's stays taken until its lease runs out)
    stack.sh('prefect gcl create "gpu-host-replacement-node" --limit 1')
    node = f"EAGLE3_NODE_NAME=replacement-node {worker.args[-1].removeprefix('exec ')}"
    stack.start("worker-gpu-1x", f"env {node}")

    fr = stack.wait_flow_run(run_id, timeout_s=480)
    assert fr["state"]["type"] == "COMPLETED", f"{fr['state']}\n{stack.tail_logs()}"
    children = {c["name"]: c for c in stack.post("/flow_runs/filter",
                                                 {"flow_runs": {"parent_flow_run_id": {"any_": [run_id]}}})}
    assert sorted(children) == ["tiny-capture", "tiny-capture-again1", "tiny-train"], sorted(children)
    lost = children["tiny-capture"]["state"]
    assert lost["type"] == "CRASHED" and "lost: Running, but" in lost["message"], lost
    assert "EAGLE3_LOST_AFTER_S=15" in lost["message"] and "its host or process is gone" in lost["message"], lost
    assert children["tiny-capture-again1"]["state"]["type"] == "COMPLETED"
    task_runs = stack.post("/task_runs/filter", {"flow_runs": {"id": {"any_": [children["tiny-capture-again1"]["id"]]}}})
    logs = stack.post("/logs/filter", {"logs": {"flow_run_id": {"any_": [children["tiny-capture-again1"]["id"]]},
                                                "text": {"query": "got GPU slot"}}})
    assert task_runs and any("'gpu-host-replacement-node'" in log["message"] for log in logs), logs
    assert (Path(cfg.resolved().export.out) / "config.json").is_file()
