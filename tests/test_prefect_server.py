"""The Prefect layer against a real `prefect server` with process workers, set up by running the
bash block of docs/operations.md "2. Local server + workers" line by line (so the documented
commands cannot drift): the deployments in prefect.yaml, hardware-tagged pools, GPU stages
dispatched to the gpu-1x pool under the per-host concurrency limit, artifacts; schedules that create
and run flow runs; the failure-alert automation (a webhook receiver on 127.0.0.1); one pipeline per
work dir; config errors failing before any stage.

The server runs on PostgreSQL when the Debian package's binaries are installed (a throwaway cluster
of its own on a free port; EAGLE3_TEST_POSTGRES=0 forces SQLite), on SQLite otherwise. One server
for the module; everything it starts binds 127.0.0.1 and is stopped at the end.

Cheapest config: the tiny target, no regenerate, no evaluate (a vLLM engine costs minutes on this
CPU; the flow-level tests cover the evaluate artifacts with a stand-in).
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
    """The command lines of the first ```bash block under `heading` in docs/operations.md (comments
    dropped)."""
    text = DOC.read_text()
    start = text.index(heading)
    block = re.search(r"```bash\n(.*?)```", text[start:], re.S)
    assert block, f"no bash block under {heading!r} in {DOC}"
    lines = [re.sub(r"\s+#\s.*$", "", raw).strip() for raw in block.group(1).splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


# --------------------------------------------------------------------------------------- PostgreSQL
def find_postgres_bin() -> Path | None:
    if os.environ.get("EAGLE3_TEST_POSTGRES", "1") == "0":
        return None
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4])
    )
    return Path(found[-1]).parent if found else None


@contextlib.contextmanager
def postgres_cluster(bindir: Path):
    """A throwaway PostgreSQL cluster on a free 127.0.0.1 port (trust auth); yields (connection URL,
    start s). As root, the server runs as the `postgres` user (initdb refuses root)."""
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
        run(
            str(bindir / "initdb"),
            "-D",
            str(data),
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-sync",
        )
        run(
            str(bindir / "pg_ctl"),
            "-D",
            str(data),
            "-l",
            str(log),
            "-w",
            "-t",
            "60",
            "-o",
            f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off",
            "start",
        )
        try:
            run(
                str(bindir.parent / "bin" / "psql"),
                "-h",
                "127.0.0.1",
                "-p",
                str(port),
                "-U",
                "postgres",
                "-c",
                "CREATE DATABASE prefect",
            )
            yield f"postgresql+asyncpg://postgres@127.0.0.1:{port}/prefect", time.time() - t0
        finally:
            subprocess.run(
                [*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"],
                capture_output=True,
                timeout=60,
                cwd=root,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


# --------------------------------------------------------------------------------- webhook receiver
class Receiver:
    """An HTTP server on 127.0.0.1 recording the JSON bodies POSTed to it (the alert
    destination)."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        received = self.bodies

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server's name
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
                if text in json.dumps(b, ensure_ascii=False):
                    return b
            time.sleep(0.2)
        raise TimeoutError(
            f"no alert mentioning {text!r} within {timeout_s} s; received {self.bodies}"
        )

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ---------------------------------------------------------------------------------------- the stack
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
            # test speed only: the scheduler's main loop (default 60 s) picks up a schedule added
            # later, and the proactive automations (eagle3-run-lost) are evaluated every second
            # (default 5 s)
            "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "1",
            "PREFECT_SERVER_EVENTS_PROACTIVE_GRANULARITY": "PT1S",
            "EAGLE3_REPO_DIR": str(ROOT),
            "EAGLE3_RETRY_BASE_S": "1",
            # lost runs (test_lost_runs_are_crashed_alerted_and_resumed) are found with the
            # documented defaults (Prefect's heartbeat every 30 s, EAGLE3_LOST_AFTER_S=60); a dead
            # holder's GPU slot is freed after Prefect's shortest lease (60 s) + one repossessor
            # loop
            "EAGLE3_GPU_LEASE_S": "60",
            "PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS": "1",
            # test speed only: the parent notices a finished GPU stage run within 0.5 s (default 3
            # s)
            "EAGLE3_DISPATCH_POLL_S": "0.5",
            "TOKENIZERS_PARALLELISM": "false",
        }
        for key in (
            "EAGLE3_INPROCESS",
            "PREFECT_API_URL",
            "PREFECT_API_DATABASE_CONNECTION_URL",
            "EAGLE3_ALERT_WEBHOOK_URL",
            "EAGLE3_ALERT_BLOCK",
            "EAGLE3_LOST_AFTER_S",
            "PREFECT_FLOWS_HEARTBEAT_FREQUENCY",
            "EAGLE3_RESULT_STORAGE",
        ):
            self.env.pop(key, None)
        if database_url:
            self.env["PREFECT_API_DATABASE_CONNECTION_URL"] = database_url
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.run_line = ""
        self.outputs: dict[str, str] = {}  # what each documented command printed

    def localize(self, line: str) -> str:
        """A documented line for this stack: its port, its webhook, the params file in its home."""
        return (
            line.replace(DOC_PORT, self.port)
            .replace(DOC_WEBHOOK, self.webhook_url)
            .replace("my-params.json", str(self.home / "my-params.json"))
        )

    def start(self, name: str, command: str) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "w")
        p = subprocess.Popen(
            ["bash", "-c", f"exec {command}"],
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs.append((name, p))
        return p

    def sh(
        self, command: str, timeout: float = 300, check: bool = True
    ) -> subprocess.CompletedProcess:
        p = subprocess.run(
            ["bash", "-c", command],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check:
            assert p.returncode == 0, f"{command} failed:\n{p.stdout}\n{p.stderr}"
        return p

    def run_doc(self, lines: list[str]) -> None:
        """Run the documented setup; the final `prefect deployment run` line is kept for the
        tests."""
        for raw in lines:
            line = self.localize(raw)
            if line.startswith("export "):
                key, _, value = line[len("export ") :].partition("=")
                if key == "PREFECT_API_DATABASE_CONNECTION_URL":
                    continue  # the stack's own database: a throwaway cluster, or SQLite
                self.env[key] = shlex.split(value)[0]
            elif line.startswith("prefect deployment run"):
                self.run_line = line
            elif line.endswith("&"):
                words = line[:-1].split()
                name = (
                    "server"
                    if words[1] == "server"
                    else f"worker-{words[words.index('--pool') + 1]}"
                )
                self.start(name, line[:-1].strip())
                if name == "server":
                    self.env["PREFECT_API_URL"] = self.api
                    self.wait_healthy()
            else:
                p = self.sh(line)
                self.outputs[line] = p.stdout + p.stderr

    def kill_tree(self, name: str) -> tuple[list[int], str]:
        """SIGKILL the process `name` started and everything under it at once (a lost host: nobody
        reports anything); returns the killed pids and the command that started it."""
        import psutil

        proc = next(p for n, p in self.procs if n == name)
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        for p in tree:  # freeze all first, so no process of the "host" gets to report anything
            with contextlib.suppress(psutil.NoSuchProcess):
                p.suspend()
        for p in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        proc.wait(timeout=30)
        self.procs.remove((name, proc))
        return [p.pid for p in tree], proc.args[-1].removeprefix("exec ")

    def children_of(self, flow_run_id: str) -> dict[str, dict]:
        return {
            c["name"]: c
            for c in self.post(
                "/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [flow_run_id]}}}
            )
        }

    def artifacts_of(self, flow_run_id: str) -> dict[str, dict]:
        return {
            a["key"]: a
            for a in self.post(
                "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}}
            )
        }

    def task_runs_of(self, flow_run_id: str) -> list[dict]:
        return self.post("/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})

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

    def emit(self, event: str, resource: dict, related: list[dict]) -> None:
        """Send one event to the server, as a client's events worker does."""
        import uuid

        import httpx

        body = [
            {
                "id": str(uuid.uuid4()),
                "occurred": dt.datetime.now(dt.UTC).isoformat(),
                "event": event,
                "resource": resource,
                "related": related,
                "payload": {},
            }
        ]
        httpx.post(f"{self.api}/events", json=body, timeout=60).raise_for_status()

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
        raise TimeoutError(
            f"prefect server did not come up: {(self.logs / 'server.log').read_text()[-3000:]}"
        )

    def deploy_run(self, params: dict, deployment: str = "eagle3-pipeline/pipeline") -> str:
        """The documented run command with `params` in my-params.json; returns the flow run id."""
        (self.home / "my-params.json").write_text(json.dumps(params))
        line = self.run_line.replace("eagle3-pipeline/pipeline", deployment)
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
        raise TimeoutError(
            f"flow run {flow_run_id} still {fr['state']['name']} after {timeout_s} "
            f"s\n{self.tail_logs()}"
        )

    def tail_logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n" + p.read_text()[-4000:] for p in sorted(self.logs.glob("*.log"))
        )

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
        print(
            f"\n[server] database {s.database} (cluster start {pg_s:.1f} s); documented setup "
            f"{s.setup_s:.1f} s"
        )
        yield s


def params_for(cfg) -> dict:
    return {"config": cfg.model_dump(mode="json")}


@pytest.fixture(scope="module")
def tiny_cfg(tiny_llama, tmp_path_factory):
    """The module's pipeline config (one work dir: the scheduled run re-uses the first test's cached
    stages): the smoke pipeline, evaluate included, with n-gram and plain decoding beside the draft
    (three small vLLM engines on the tiny target)."""
    return tiny_config(
        tiny_llama,
        tmp_path_factory.mktemp("work"),
        evaluate={"compare": ["ngram"], "baseline": True, "num_prompts": 2, "max_tokens": 8},
    )


def server_errors(stack: Stack) -> list[str]:
    """The server log's ERROR records (their first lines)."""
    return [
        line
        for line in read_text(stack.logs / "server.log").splitlines()
        if re.search(r"\|\s*ERROR\s*\|| ERROR ", line)
    ]


# ------------------------------------------------------------------------------------------ tests
def test_pipeline_deployment_gpu_pool_and_one_run_per_work_dir(stack, tiny_cfg):
    """The documented setup and one smoke pipeline through the `pipeline` deployment, as the UI
    shows them: the user's deployments first and every deployment ready, the run named for its
    config and the moment, its state message and summary artifact leading with tokens per target
    step of the draft and of n-gram, its stage runs named as its children, no ERROR record in the
    runs' logs or the server's. Meanwhile a second run on the same work dir fails on the lock."""
    cfg, work = tiny_cfg, tiny_cfg.work_dir
    # the UI's Deployments page (A to Z) leads with what a person runs; the GPU stage deployments
    # the pipeline launches are named for what they are (subflows) and where they run
    first = stack.post("/deployments/filter", {"sort": "NAME_ASC", "limit": 4})
    assert [d["name"] for d in first] == [
        "layer-sweep",
        "pipeline",
        "retrain-nightly",
        "streaming",
    ], first
    deployments = {d["name"] for d in stack.post("/deployments/filter", {})}
    assert {"subflow · capture · gpu-1x", "subflow · evaluate · gpu-1x"} <= deployments
    assert not [d for d in deployments if "gpu-8x" in d], deployments  # no gpu-8x pool here
    deploy_out = next(out for line, out in stack.outputs.items() if "deploy.sh" in line)
    assert "Still processing items" not in deploy_out and "eagle3-run-lost" in deploy_out, (
        deploy_out
    )
    # the gpu-8x pool's deployments are skipped, saying how to add them: none is left Not Ready
    assert "skipping 5 deployment(s) on work pool 'gpu-8x'" in deploy_out, deploy_out
    # the documented parameters command wrote a file the server takes (the demo config)
    documented = json.loads((stack.home / "my-params.json").read_text())
    assert documented["config"]["name"] == "demo", documented

    t0 = time.time()
    first = stack.deploy_run(params_for(cfg))
    second = stack.deploy_run(params_for(cfg))  # same work dir while the first runs
    runs = {i: stack.wait_flow_run(i, timeout_s=480) for i in (first, second)}
    run_s = time.time() - t0
    states = sorted(fr["state"]["type"] for fr in runs.values())
    assert states == ["COMPLETED", "FAILED"], (
        f"{[fr['state'] for fr in runs.values()]}\n{stack.tail_logs()}"
    )
    done = next(i for i, fr in runs.items() if fr["state"]["type"] == "COMPLETED")
    lost = next(fr for fr in runs.values() if fr["state"]["type"] == "FAILED")
    msg = lost["state"]["message"]
    assert "is being written by" in msg and str(work) in msg, lost["state"]
    # the lock names the run that holds it: its name, id and UI link (not prefect's engine.py)
    assert (
        f"flow run {runs[done]['name']!r} ({done}, http://127.0.0.1:{stack.port}/" in msg
        and f"/flow-run/{done}): pid " in msg
    ), msg
    assert not stack.task_runs_of(lost["id"])  # no stage started

    # the run: named for its config and the moment; its state message holds the result
    name, message = runs[done]["name"], runs[done]["state"]["message"]
    assert re.fullmatch(r"tiny · \d{4}-\d\d-\d\d \d\d:\d\d", name), name
    assert re.match(
        r"draft \d+\.\d\d vs n-gram \d+\.\d\d tokens/target step \(τ \d+\.\d\d vs ", message
    ), message
    draft = str(Path(cfg.resolved().export.out).resolve())
    assert "predicted on h200 TP 1 at one request: " in message, message
    assert message.endswith(f"; draft {draft}"), message

    # capture, train and evaluate ran as runs of their gpu-1x deployments, named as the pipeline
    # run's children
    children = stack.children_of(done)
    assert sorted(children) == [f"{name} › {s}" for s in ("capture", "evaluate", "train")], children
    assert all(c["state"]["type"] == "COMPLETED" and c["deployment_id"] for c in children.values())
    task_names = {t["name"] for t in stack.task_runs_of(done)}
    assert {
        "capture on gpu-1x",  # the stage and the pool
        "capture on eagle3-capture/subflow · capture · gpu-1x",  # the child run's placeholder
        "train on eagle3-train/subflow · train · gpu-1x",
    } <= task_names, task_names
    gpu_limit = f"gpu-host-{socket.gethostname().lower()}"
    assert any(
        limit["name"] == gpu_limit for limit in stack.post("/v2/concurrency_limits/filter", {})
    )

    run_ids = [done, *(c["id"] for c in children.values())]
    arts = {
        a["key"]: a
        for a in stack.post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": run_ids}}})
    }
    for key in (
        "tiny-pipeline",
        "tiny-prepare-summary",
        "tiny-capture-summary",
        "tiny-capture-progress",
        "tiny-train-summary",
        "tiny-train-progress",
        "tiny-train-curves",
        "tiny-draft",
        "tiny-evaluate-tau",
    ):
        assert key in arts, (key, sorted(arts))
    assert "tiny-train-metrics" not in arts  # the per-step metrics stay in their file
    # the pipeline run's own Artifacts tab has the reports of its GPU stage runs' files
    own = stack.artifacts_of(done)
    assert {"tiny-pipeline", "tiny-train-curves", "tiny-evaluate-tau", "tiny-draft"} <= set(own)
    # the summary, under the stable key tiny-pipeline: the result, then the comparison (draft,
    # n-gram, plain decoding), the draft's path to copy, the stages, links to the other artifacts
    summary = own["tiny-pipeline"]["data"]
    assert summary.startswith(f"# {name}\n\n**{message}**\n"), summary[:400]
    for text in ("| draft (EAGLE-3) |", "| n-gram |", "| plain decoding | 1.00 |"):
        assert text in summary, (text, summary)
    assert f"```text\n{draft}\n```" in summary and "file://" not in summary, summary
    assert "GPU slot wait" in summary and "/artifacts/key/tiny-evaluate-tau" in summary, summary
    assert "file://" not in own["tiny-draft"]["data"], own["tiny-draft"]["data"]
    assert (Path(cfg.resolved().export.out) / "config.json").is_file()

    # the cache records belong to the work dir, not to Prefect's process-wide storage
    records = work / ".prefect-results"
    stage_keys = {
        json.loads((Path(c["out"]) / ".eagle3-stage.json").read_text())["key"]
        for c in (cfg.resolved().prepare.model_dump(), cfg.resolved().train.model_dump())
    }
    assert stage_keys <= {p.name for p in records.iterdir()}, sorted(records.iterdir())
    for elsewhere in (
        stack.home / "results",
        stack.home / "prefect-home" / "storage",
        Path.home() / ".prefect" / "storage",
    ):
        assert not [p for p in elsewhere.rglob("*") if p.name in stage_keys], elsewhere

    # the losing run's failure reached the webhook through the automation deploy.sh created, naming
    # the holder
    alert = stack.receiver.wait_for(lost["name"], timeout_s=90)
    assert "eagle3-pipeline" in alert["subject"] and "Failed" in alert["subject"], alert
    assert runs[done]["name"] in alert["body"], alert

    # every deployment the documented commands registered is ready (its pool has a live worker)
    statuses = {d["name"]: d["status"] for d in stack.post("/deployments/filter", {})}
    assert set(statuses.values()) == {"READY"}, statuses
    # quiet: no ERROR record in the run's or its stage runs' logs, none in the server's log
    errors = stack.post(
        "/logs/filter", {"logs": {"flow_run_id": {"any_": run_ids}, "level": {"ge_": 40}}}
    )
    assert not errors, [e["message"][:300] for e in errors]
    # (on SQLite Prefect 3.7.7's server logs `database is locked` while workers poll, whatever the
    # settings: the count is recorded, and docs/operations.md sends a server with workers to
    # PostgreSQL)
    server = server_errors(stack)
    assert stack.database == "sqlite" or not server, server[:20]
    print(
        f"[server] {stack.database}: two overlapping pipeline runs {run_s:.1f} s; "
        f"{len(server)} ERROR records in the server log; the run: {name!r}: {message}"
    )


def test_config_errors_fail_before_any_stage(stack, tiny_llama, tmp_path_factory):
    """Every problem in one pass (a missing eval_prompts file does not hide two bad aux-id lists),
    before any stage, as one ERROR record of a few lines in the run's log (the tracebacks at DEBUG).
    """
    work = tmp_path_factory.mktemp("bad")
    cfg = tiny_config(
        tiny_llama,
        work,
        eval_prompts=False,
        capture={"aux_layer_ids": [1, 2, 9]},
        train={"aux_layer_ids": [1, 3]},
    )
    cfg.eval_prompts = str(work / "gone.jsonl")
    t0 = time.time()
    run_id = stack.deploy_run(params_for(cfg))
    fr = stack.wait_flow_run(run_id, timeout_s=240)
    assert fr["state"]["type"] == "FAILED", fr["state"]
    msg = fr["state"]["message"]
    assert (
        "capture.aux_layer_ids = [1, 2, 9]" in msg
        and "[9] out of range for this 5-layer target" in msg
    ), msg
    assert (
        "use ids in 1..4" in msg and f"eval_prompts = {cfg.eval_prompts!r} does not exist" in msg
    ), msg
    assert "train.aux_layer_ids = [1, 3]: id(s) [3] are not in" in msg, msg
    assert not stack.task_runs_of(run_id)
    assert not stack.children_of(run_id)
    fail_s = time.time() - t0
    deadline = time.time() + 30
    while True:  # the run's records reach the API a moment after its state
        errors = stack.post(
            "/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}, "level": {"ge_": 40}}}
        )
        if errors or time.time() > deadline:
            break
        time.sleep(1)
    time.sleep(3)  # any record that came with it
    errors = stack.post(
        "/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}, "level": {"ge_": 40}}}
    )
    assert len(errors) == 1, [e["message"] for e in errors]
    assert (
        "Traceback" not in errors[0]["message"] and len(errors[0]["message"].splitlines()) <= 6
    ), errors[0]

    # what the server can check itself is refused before a run exists
    sweep = stack.run_line.split(" --params")[0].replace(
        "eagle3-pipeline/pipeline", "eagle3-layer-sweep/layer-sweep"
    )
    p = stack.sh(f"{sweep} --param max_concurrency=0", check=False)
    assert p.returncode != 0 and "max_concurrency" in p.stdout + p.stderr, (p.stdout, p.stderr)
    stack.receiver.wait_for(fr["name"], timeout_s=90)
    print(f"[server] {stack.database}: bad config failed in {fail_s:.1f} s")


def test_schedules_create_runs_and_a_scheduled_run_executes(stack, tiny_cfg):
    deps = {d["name"]: d for d in stack.post("/deployments/filter", {})}
    retrain = deps["retrain-nightly"]
    assert retrain["schedules"] and retrain["schedules"][0]["schedule"]["cron"] == "0 3 * * *"
    deadline = time.time() + 90
    while True:  # the scheduler creates the nightly runs ahead of time
        scheduled = stack.post(
            "/flow_runs/filter",
            {
                "flow_runs": {
                    "deployment_id": {"any_": [retrain["id"]]},
                    "state": {"type": {"any_": ["SCHEDULED"]}},
                }
            },
        )
        if scheduled or time.time() > deadline:
            break
        time.sleep(0.5)
    server_log = (stack.logs / "server.log").read_text()
    assert scheduled, (
        f"no scheduled retrain runs; scheduler errors: {server_log.count('bulk DML')} bulk DML"
    )
    assert all(
        dt.datetime.fromisoformat(r["expected_start_time"]).astimezone(dt.UTC).hour == 3
        for r in scheduled
    )
    assert "Can't evaluate bulk DML" not in server_log

    # a schedule that is due now, with the tiny (cached) config as its parameters: its run executes
    pipeline = deps["pipeline"]
    anchor = (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=5)).isoformat()
    stack.post(
        f"/deployments/{pipeline['id']}/schedules",
        [
            {
                "schedule": {"interval": 3600, "anchor_date": anchor, "timezone": "UTC"},
                "active": True,
                "parameters": params_for(tiny_cfg),
            }
        ],
    )
    deadline, run = time.time() + 120, None
    while run is None and time.time() < deadline:
        runs = stack.post(
            "/flow_runs/filter",
            {
                "flow_runs": {
                    "deployment_id": {"any_": [pipeline["id"]]},
                    "tags": {"all_": ["auto-scheduled"]},
                }
            },
        )
        run = min(runs, key=lambda r: r["expected_start_time"]) if runs else None
        time.sleep(0.5)
    assert run, "the scheduler created no run for the new schedule"
    fr = stack.wait_flow_run(run["id"], timeout_s=300)
    assert fr["state"]["type"] == "COMPLETED", f"{fr['state']}\n{stack.tail_logs()}"


def test_a_worker_started_in_the_background_stops_on_sigterm(stack):
    """The documented worker command, started with `&` from a script (SIGINT ignored, as bash does
    for background jobs), exits within a few seconds of a SIGTERM (Prefect's own worker did not exit
    at all)."""
    line = next(x for x in doc_block("## 2. Local server + workers") if "--pool gpu-1x" in x)
    command = line.rstrip("&").strip().replace("gpu-1x", "gpu-8x")  # an idle pool
    log = stack.logs / "worker-sigterm.log"
    shell = subprocess.Popen(
        ["bash", "-c", f"{command} > {log} 2>&1 & echo $!; wait"],
        cwd=ROOT,
        env=stack.env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    pid = int(shell.stdout.readline())
    try:
        wait_until("the worker to start", lambda: "started" in read_text(log), 120, stack, 0.5)
        t0 = time.time()
        os.kill(pid, signal.SIGTERM)
        shell.wait(timeout=30)
        stop_s = time.time() - t0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)
    assert stop_s < 5, (stop_s, log.read_text()[-2000:])
    print(f"[server] a background worker stopped {stop_s:.1f} s after SIGTERM")


def wait_until(what: str, predicate, timeout_s: float, stack: Stack, poll_s: float = 0.3):
    deadline = time.time() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.time() < deadline, f"{what}: not within {timeout_s} s\n{stack.tail_logs()}"
        time.sleep(poll_s)


def test_lost_runs_are_crashed_alerted_and_resumed(stack, tiny_llama, tmp_path_factory):
    """Two runs lose their processes, with the documented defaults (heartbeat 30 s, lost after
    60 s):

    1. a pipeline run on the cpu worker (dispatch: local) is SIGKILLed with its worker during
       capture. The server's automation eagle3-run-lost sets it Crashed, the alert goes out; the
       next run on its work dir takes the lock over, closes the task runs the lost one left Running,
       resumes capture from its shards and says so;
    2. a GPU host dies: the gpu-1x worker and the train run under it are SIGKILLed after a
       checkpoint. The train run is set Crashed (alert), its parent closes its `train` task run and
       runs it again on a new worker (another node), which resumes from the checkpoint; the summary
       names the crash, the time lost and the checkpoint; metrics.jsonl and TensorBoard hold each
       step once; the dead run's temp dir is gone.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t_start = time.time()
    # 0. a run that ended Failed, whose last heartbeat reached the server after its final state
    ended, t_heartbeat = _a_failed_run_with_a_late_heartbeat(stack)
    # 1. a pipeline run on the cpu worker, lost with its worker during capture
    cfg_b = tiny_config(
        tiny_llama,
        tmp_path_factory.mktemp("lost-parent"),
        eval_prompts=False,
        name="lost-parent",
        prepare={"limit": 24},
        capture={"shard_tokens": 128},
    )
    out_b = Path(cfg_b.resolved().capture.out)
    run_b = stack.deploy_run({**params_for(cfg_b), "dispatch": "local"})
    # 2. at the same time, a pipeline run (in a process of its own) whose train run's host dies
    cfg_a = tiny_config(
        tiny_llama,
        tmp_path_factory.mktemp("lost-host"),
        eval_prompts=False,
        name="lost-host",
        train={
            "max_steps": 120,
            "checkpoint": {"save_every": 10, "log_every": 2, "eval_every": 60},
        },
    )
    out_a = Path(cfg_a.resolved().train.out)
    (stack.home / "lost-host.json").write_text(cfg_a.model_dump_json())
    stack.start(
        "pipeline-lost-host",
        f"{sys.executable} -c 'import json, sys\n"
        "from eagle3.config import PipelineConfig\n"
        "from eagle3_prefect.flows.pipeline import eagle3_pipeline\n"
        "cfg = PipelineConfig.model_validate_json(open(sys.argv[1]).read())\n"
        'eagle3_pipeline(cfg, dispatch="deployments")\''
        f" {stack.home / 'lost-host.json'}",
    )

    def capturing() -> bool:  # a finished shard of the first run's capture
        return bool(read_json(out_b / "progress.json").get("shards"))

    def checkpointed_and_past_it() -> bool:  # a train checkpoint and metrics logged after it
        metrics = out_a / "logs" / "metrics.jsonl"
        rows = metrics.read_text().splitlines() if metrics.is_file() else []
        ckpts = list((out_a / "checkpoints").glob("step-*/trainer_state.json"))
        return bool(ckpts) and any(read_json(r, text=True).get("step", 0) > 10 for r in rows)

    t_kill_a = t_kill_b = None
    deadline = time.time() + 400
    while t_kill_a is None or t_kill_b is None:  # whichever comes first
        assert time.time() < deadline, f"no capture shard or train checkpoint\n{stack.tail_logs()}"
        if t_kill_b is None and capturing():
            _, cpu_worker = stack.kill_tree("worker-cpu")
            t_kill_b = time.time()
            stack.start("worker-cpu", cpu_worker)
        if t_kill_a is None and checkpointed_and_past_it():
            dead_pids, gpu_worker = stack.kill_tree("worker-gpu-1x")
            t_kill_a = time.time()
            # the replacement host: another node, so another GPU slot (the dead run's stays taken
            # until its lease runs out)
            stack.sh('prefect gcl create "gpu-host-replacement-node" --limit 1')
            stack.start("worker-gpu-1x", f"env EAGLE3_NODE_NAME=replacement-node {gpu_worker}")
        time.sleep(0.2)

    # 1: found and ended by the automation within about a minute, alerted; then the next run takes
    # over
    fr_b = stack.wait_flow_run(run_b, timeout_s=150)
    found_b_s = time.time() - t_kill_b
    assert (
        fr_b["state"]["type"] == "CRASHED"
        and "no flow-run heartbeat for 60 s" in fr_b["state"]["message"]
    ), fr_b
    alert = stack.receiver.wait_for(fr_b["name"], timeout_s=60)
    assert "eagle3-pipeline" in alert["subject"] and "Crashed" in alert["subject"], alert
    # 0: the late heartbeat's window ran out and the automation fired for the run that ended; the
    # server refused to set it Crashed, so it stays Failed
    refused = _lost_run_actions_refused(stack, ended, deadline=t_heartbeat + 90)
    assert any("terminal state" in e["payload"].get("reason", "") for e in refused), refused
    assert stack.flow_run(ended)["state"]["type"] == "FAILED", stack.flow_run(ended)["state"]
    run_b2 = stack.deploy_run({**params_for(cfg_b), "dispatch": "local"})

    # 2: the lost train run is Crashed and alerted, its parent runs it again, and the pipeline
    # completes
    fr_a = stack.wait_flow_run(_parent_of(stack, "lost-host · ", " › capture"), timeout_s=420)
    assert fr_a["state"]["type"] == "COMPLETED", f"{fr_a['state']}\n{stack.tail_logs()}"
    children = stack.children_of(fr_a["id"])
    parent = fr_a["name"]
    assert sorted(children) == [
        f"{parent} › capture",
        f"{parent} › train",
        f"{parent} › train (again 1)",
    ], sorted(children)
    lost = children[f"{parent} › train"]
    assert (
        lost["state"]["type"] == "CRASHED"
        and "no flow-run heartbeat for 60 s" in lost["state"]["message"]
    ), lost
    found_a_s = dt.datetime.fromisoformat(lost["state"]["timestamp"]).timestamp() - t_kill_a
    assert all(
        t["state"]["type"] not in ("RUNNING", "PENDING") for t in stack.task_runs_of(lost["id"])
    )
    alert = stack.receiver.wait_for(f"{lost['name']} Crashed", timeout_s=30)
    assert "eagle3-train" in alert["subject"] and "Crashed" in alert["subject"], alert
    again = children[f"{parent} › train (again 1)"]
    logs = stack.post(
        "/logs/filter",
        {"logs": {"flow_run_id": {"any_": [again["id"]]}, "text": {"query": "got GPU slot"}}},
    )
    assert any("'gpu-host-replacement-node'" in log["message"] for log in logs), logs
    summary = stack.artifacts_of(fr_a["id"])["lost-host-pipeline"]["data"]
    assert (
        "## Crashes and resumes" in summary
        and f"train: run `{lost['name']}` ended Crashed after" in summary
    )
    assert "(time lost)" in summary and "resumed from checkpoint step" in summary, summary
    rows = [json.loads(r) for r in (out_a / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert len({(r["step"], r["split"]) for r in rows}) == len(rows), [
        (r["step"], r["split"]) for r in rows
    ]
    acc = EventAccumulator(str(out_a / "tb"))
    acc.Reload()
    steps = [e.step for e in acc.Scalars("train/loss")]
    assert steps == sorted(set(steps)) and steps[-1] == 120, steps
    left = [
        p
        for p in Path(tempfile.gettempdir()).glob("eagle3-*")
        if any(f"-{pid}-" in p.name for pid in dead_pids)
    ]
    assert not left, left

    # 1, continued: the next run completed, resumed capture, and closed what the lost run left
    fr_b2 = stack.wait_flow_run(run_b2, timeout_s=300)
    assert fr_b2["state"]["type"] == "COMPLETED", f"{fr_b2['state']}\n{stack.tail_logs()}"
    assert all(t["state"]["type"] not in ("RUNNING", "PENDING") for t in stack.task_runs_of(run_b))
    summary = stack.artifacts_of(run_b2)["lost-parent-pipeline"]["data"]
    assert f"took the work dir over from flow run `{fr_b['name']}` (Crashed after" in summary, (
        summary
    )
    assert "capture: resumed from" in summary and "finished shard(s)" in summary, summary
    print(
        f"[server] {stack.database}: lost runs found {found_b_s:.0f} s (pipeline) and "
        f"{found_a_s:.0f} s (train) "
        f"after their processes were killed; test {time.time() - t_start:.0f} s"
    )


def read_text(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


def read_json(source: Path | str, text: bool = False) -> dict:
    """A JSON object from a file (or a line, with text=True) being written meanwhile; {} until it
    parses."""
    try:
        return json.loads(source if text else Path(source).read_text())
    except (OSError, ValueError):
        return {}


def _a_failed_run_with_a_late_heartbeat(stack: Stack) -> tuple[str, float]:
    """A pipeline flow run set Running, then Failed, then sent one more heartbeat: the race where
    Prefect's heartbeat thread sends just as the run ends. Returns the run id and when the heartbeat
    went out."""
    import httpx

    flow = httpx.get(f"{stack.api}/flows/name/eagle3-pipeline", timeout=60).json()
    run = stack.post("/flow_runs/", {"flow_id": flow["id"], "name": "ended-before-its-heartbeat"})
    for state in ("RUNNING", "FAILED"):
        stack.post(f"/flow_runs/{run['id']}/set_state", {"state": {"type": state}, "force": True})
    # the heartbeat comes after the Failed event (had it come between, nothing would fire)
    deadline = time.time() + 60
    while not stack.post(
        "/events/filter",
        {
            "filter": {
                "event": {"name": ["prefect.flow-run.Failed"]},
                "resource": {"id": [f"prefect.flow-run.{run['id']}"]},
            }
        },
    )["events"]:
        assert time.time() < deadline, "the server recorded no Failed event"
        time.sleep(0.5)
    time.sleep(2)
    stack.emit(
        "prefect.flow-run.heartbeat",
        {
            "prefect.resource.id": f"prefect.flow-run.{run['id']}",
            "prefect.resource.name": run["name"],
        },
        [
            {
                "prefect.resource.id": f"prefect.flow.{flow['id']}",
                "prefect.resource.role": "flow",
                "prefect.resource.name": "eagle3-pipeline",
            }
        ],
    )
    return run["id"], time.time()


def _lost_run_actions_refused(stack: Stack, flow_run_id: str, deadline: float) -> list[dict]:
    """The failed actions of an automation on `flow_run_id` (its target), waited for until
    `deadline` (a time.time())."""
    while True:
        events = stack.post(
            "/events/filter",
            {
                "filter": {
                    "event": {"name": ["prefect.automation.action.failed"]},
                    "related": {"id": [f"prefect.flow-run.{flow_run_id}"]},
                }
            },
        )["events"]
        if events or time.time() > deadline:
            return events
        time.sleep(0.5)


def _parent_of(stack: Stack, prefix: str, suffix: str) -> str:
    """The id of the flow run whose stage run's name starts with `prefix` and ends with `suffix` (a
    pipeline run started outside a deployment)."""
    (child,) = [
        r
        for r in stack.post("/flow_runs/filter", {"flow_runs": {"name": {"like_": suffix}}})
        if r["name"].startswith(prefix) and r["name"].endswith(suffix)
    ]
    (task_run,) = stack.post(
        "/task_runs/filter", {"task_runs": {"id": {"any_": [child["parent_task_run_id"]]}}}
    )
    return task_run["flow_run_id"]
