"""Failures reach the user as one paragraph, data loss stops the run, engines die with their parent.

One test per probe of the hostile test of 2026-12-03, on the tiny toy target: rows lost to a JSON
array saved as .jsonl, a UTF-8 BOM, `limit: true` and a share of bad rows over
`max_skipped_fraction`; a capture manifest that lost a shard's entry; a disk that fills while a
checkpoint is written; a corrupt draft; token ids outside the target's vocabulary; and processes
left running when a stage's parent is killed (a Prefect stage process, a job of `run_in_subprocess`,
an earlier run's engines found by the next run). The kill of a real vLLM capture is in
test_engine_lifetime.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from eagle3.cli import main

ROOT = Path(__file__).resolve().parents[1]


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    """`eagle3 ARGV` in this process: (exit code, stderr). What the CLI sets up for a terminal (its
    environment defaults, its log handlers on this test's captured stderr) is undone after."""
    import logging

    from eagle3.console import PROGRESS

    env = dict(os.environ)
    loggers = [logging.getLogger(), logging.getLogger(PROGRESS)]
    saved = [(lg, list(lg.handlers), lg.level, lg.propagate) for lg in loggers]
    try:
        rc = main([str(a) for a in argv])
    finally:
        os.environ.clear()
        os.environ.update(env)
        for lg, handlers, level, propagate in saved:
            lg.handlers[:] = handlers
            lg.setLevel(level)
            lg.propagate = propagate
    return rc, capsys.readouterr().err


def error_line(err: str, command: str) -> str:
    """The CLI's one-paragraph error: the last line of stderr, `eagle3 COMMAND: error: ...`."""
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert lines and lines[-1].startswith(f"eagle3 {command}: error: "), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    return lines[-1]


def chat_rows(n: int) -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": f"question number {i}"},
                {"role": "assistant", "content": f"the answer is {i}"},
            ]
        }
        for i in range(n)
    ]


def write_jsonl(path: Path, rows: list, bad_lines: dict[int, str] | None = None) -> Path:
    lines = [json.dumps(r) for r in rows]
    for i, text in (bad_lines or {}).items():
        lines[i] = text
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------ data
# loss
@pytest.mark.parametrize("layout", ["indented", "one_row_per_line"])
def test_json_array_saved_as_jsonl_is_read_whole(tmp_path, layout):
    from eagle3.chat_formats import read_conversations

    rows = chat_rows(50)
    if layout == "indented":
        text = json.dumps(rows, indent=2)
    else:  # `[`, then `{...},` per line: only the last row parses as a JSON line
        text = "[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n"
    p = tmp_path / "chats.jsonl"
    p.write_text(text)
    read = read_conversations(p)
    assert len(read.conversations) == 50 and read.num_skipped == 0


def test_json_array_in_jsonl_that_does_not_parse_is_refused_with_a_hint(tmp_path):
    from eagle3.chat_formats import read_conversations
    from eagle3.errors import UserError

    p = tmp_path / "chats.jsonl"
    p.write_text(json.dumps(chat_rows(3), indent=2)[:-3])  # truncated array
    with pytest.raises(
        UserError, match=r"chats\.jsonl.*JSON array.*not valid JSON.*one row per line"
    ):
        read_conversations(p)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_utf8_bom_costs_no_row(tmp_path, suffix):
    from eagle3.chat_formats import read_conversations

    rows = chat_rows(50)
    p = tmp_path / f"chats{suffix}"
    text = "\n".join(json.dumps(r) for r in rows) if suffix == ".jsonl" else json.dumps(rows)
    p.write_text(text + "\n", encoding="utf-8-sig")
    read = read_conversations(p)
    assert len(read.conversations) == 50 and read.num_skipped == 0
    assert read.conversations[0].messages[0]["content"] == "question number 0"


def _int_fields(model: type[BaseModel]):
    import types
    import typing

    for name, field in model.model_fields.items():
        tp = field.annotation
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            tp = next((a for a in typing.get_args(tp) if a is not type(None)), tp)
        if typing.get_origin(tp) is typing.Annotated:
            tp = typing.get_args(tp)[0]
        if tp in (int, float):
            yield name


def test_booleans_are_refused_for_every_count_field():
    """`limit: true` was read as 1: every number field of every config (stage configs, plan,
    estimate) refuses a boolean, naming the field."""
    import eagle3.config as config
    from eagle3.plan import PlanConfig
    from eagle3.train.estimate import EstimateConfig

    models = [
        c
        for c in vars(config).values()
        if isinstance(c, type)
        and issubclass(c, BaseModel)
        and c.__module__.startswith(config.__name__ + ".")
    ] + [PlanConfig, EstimateConfig]
    checked = []
    for model in models:
        for name in _int_fields(model):
            with pytest.raises(ValidationError, match=rf"{name}[\s\S]*boolean"):
                model.model_validate({name: True})
            checked.append(f"{model.__name__}.{name}")
    assert {
        "PrepareConfig.limit",
        "MixConfig.num_rows",
        "TrainConfig.epochs",
        "PlanConfig.num_gpus",
    } <= set(checked)
    assert len(checked) > 90, checked


def test_limit_true_in_a_config_file_is_a_one_paragraph_error(tmp_path, capsys, tiny_llama):
    from eagle3.cli import build_parser, stage_config_from_args

    data = write_jsonl(tmp_path / "chats.jsonl", chat_rows(4))
    cfg_file = tmp_path / "prepare.yaml"
    cfg_file.write_text("limit: true\n")
    rc, err = run_cli(
        capsys,
        "prepare",
        "--config",
        cfg_file,
        "--target",
        tiny_llama,
        "--data",
        data,
        "--out",
        tmp_path / "p",
    )
    line = error_line(err, "prepare")
    assert rc == 2 and "limit" in line and "boolean" in line and not (tmp_path / "p").exists()
    # whole numbers still come through YAML and the command line
    cfg_file.write_text("limit: 3\nmax_seq_len: 64\n")
    args = build_parser().parse_args(["prepare", "--config", str(cfg_file), "--limit", "2"])
    cfg = stage_config_from_args("prepare", args)
    assert (cfg.limit, cfg.max_seq_len) == (2, 64)


def test_prepare_stops_when_more_rows_are_skipped_than_allowed(tmp_path, capsys, tiny_llama):
    bad = {3: "{not json", 7: "{not json", 9: '{"messages": []}', 12: '{"foo": 1}', 20: "[1, 2"}
    data = write_jsonl(tmp_path / "chats.jsonl", chat_rows(40), bad)
    rc, err = run_cli(
        capsys, "prepare", "--target", tiny_llama, "--data", data, "--out", tmp_path / "p"
    )
    line = error_line(err, "prepare")
    assert rc == 2, err
    assert "5 of 40 input rows (12.5%)" in line and "max_skipped_fraction = 0.05" in line, line
    assert "invalid_json 3 (lines 4, 8, 21)" in line and str(data) in line, line
    assert "missing_fields 2 (lines 10, 13)" in line and "--max-skipped-fraction" in line, line
    assert not (tmp_path / "p" / "manifest.json").exists()
    rc, err = run_cli(
        capsys,
        "prepare",
        "--target",
        tiny_llama,
        "--data",
        data,
        "--out",
        tmp_path / "p",
        "--max-skipped-fraction",
        "0.2",
    )
    assert (
        rc == 0 and json.loads((tmp_path / "p" / "manifest.json").read_text())["num_samples"] == 35
    )


def test_mix_stops_when_a_source_loses_too_many_rows(tmp_path, capsys):
    good = write_jsonl(tmp_path / "good.jsonl", chat_rows(20))
    lossy = write_jsonl(tmp_path / "lossy.jsonl", chat_rows(20), {0: "{", 5: "{", 6: "{"})
    rc, err = run_cli(capsys, "mix", "--sources", f"{good}=1,{lossy}=1", "--out", tmp_path / "m")
    line = error_line(err, "mix")
    assert (
        rc == 2
        and "sources[1]" in line
        and str(lossy) in line
        and "3 of 20 input rows (15.0%)" in line
    ), line
    assert "invalid_json 3 (lines 1, 6, 7)" in line, line
    rc, _ = run_cli(
        capsys,
        "mix",
        "--sources",
        f"{good}=1,{lossy}=1",
        "--out",
        tmp_path / "m",
        "--max-skipped-fraction",
        "0.15",
    )
    assert rc == 0


def test_regenerate_stops_before_generating_when_too_many_rows_are_skipped(
    tmp_path, capsys, tiny_llama
):
    data = write_jsonl(tmp_path / "chats.jsonl", chat_rows(10), {2: "{", 4: '{"foo": 1}'})
    rc, err = run_cli(
        capsys,
        "regenerate",
        "--target",
        tiny_llama,
        "--data",
        data,
        "--out",
        tmp_path / "r",
        "--backend",
        "hf",
        "--device",
        "cpu",
        "--max-new-tokens",
        "2",
    )
    line = error_line(err, "regenerate")
    assert rc == 2 and "2 of 10 input rows (20.0%)" in line and "max_skipped_fraction" in line, line
    assert not (tmp_path / "r" / "conversations.jsonl").exists()


@pytest.fixture(scope="module")
def captured(tiny_llama, tmp_path_factory):
    from tests.synthetic_capture import capture_samples, frequent_ids, write_vocab

    samples, manifest = capture_samples(
        tiny_llama, num=12, aux_layer_ids=(1, 2, 4), min_len=16, max_len=40
    )
    vocab = write_vocab(tmp_path_factory.mktemp("vocab"), 512, frequent_ids(samples, 200, 512))
    return samples, manifest, vocab


def train_args(target, cap, vocab, out) -> list:
    return [
        "train",
        "--target",
        target,
        "--captured",
        cap,
        "--vocab",
        vocab,
        "--out",
        out,
        "--max-steps",
        "2",
        "--device",
        "cpu",
        "--loader-max-seq-len",
        "64",
        "--loss-ttt-steps",
        "2",
        "--checkpoint-eval-every",
        "2",
        "--checkpoint-save-every",
        "2",
        "--loader-val-fraction",
        "0.2",
    ]


def test_manifest_that_lost_a_shard_entry_is_refused(tmp_path, capsys, captured, tiny_llama):
    from tests.synthetic_capture import write_captured

    from eagle3.errors import UserError
    from eagle3.train.data import CapturedDataset

    samples, manifest, vocab = captured
    cap = write_captured(tmp_path / "cap", samples, manifest, shard_samples=4)
    m = json.loads((cap / "manifest.json").read_text())
    del m["shards"][1]  # samples 4..7: the file stays on disk, the manifest no longer lists it
    (cap / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(UserError, match=r"shard-00001\.safetensors"):
        CapturedDataset(cap)
    rc, err = run_cli(capsys, *train_args(tiny_llama, cap, vocab, tmp_path / "t"))
    line = error_line(err, "train")
    assert rc == 2 and "8 of the 12 samples" in line and "rows 4..7" in line, line
    assert "shard-00001.safetensors" in line and "eagle3 capture" in line, line
    assert not (tmp_path / "t" / "final").exists()


def test_capture_rebuilds_a_manifest_that_lost_a_shard_entry(tmp_path, tiny_llama):
    from eagle3.artifacts import CaptureManifest
    from eagle3.capture import run_capture
    from eagle3.config import CaptureConfig
    from test_capture import make_prepared

    prepared = make_prepared(tiny_llama, tmp_path / "prepared", num=8, step=9)
    cfg = CaptureConfig(
        target=str(tiny_llama),
        data=str(prepared),
        out=tmp_path / "cap",
        backend="hf",
        aux_layer_ids=[1, 2, 4],
        device="cpu",
        batch_tokens=60,
        shard_tokens=60,
        dtype="float32",
        storage_dtype="float32",
    )
    first = run_capture(cfg)
    m = json.loads((cfg.out / "manifest.json").read_text())
    assert first.num_shards >= 3
    lost = m["shards"].pop(1)
    (cfg.out / "manifest.json").write_text(json.dumps(m))
    again = run_capture(cfg)
    assert again.num_samples == first.num_samples == 8 and again.resumed_shards == 1
    rebuilt = CaptureManifest.load(cfg.out)  # covers its samples again
    assert rebuilt.shards[1].sha256 == lost["sha256"]  # captured again bit for bit


# ------------------------------------------------------------------------------------ one error
# path
def test_token_ids_outside_the_target_vocab_name_shard_sample_and_id(
    tmp_path, capsys, captured, tiny_llama
):
    from tests.synthetic_capture import write_captured

    samples, manifest, vocab = captured
    bad = [dict(s) for s in samples]
    ids = bad[5]["input_ids"].clone()
    ids[3] = 700  # the tiny target has 512 tokens; the shard's sha256 is computed over this id
    bad[5]["input_ids"] = ids
    cap = write_captured(tmp_path / "cap", bad, manifest, shard_samples=4)
    rc, err = run_cli(capsys, *train_args(tiny_llama, cap, vocab, tmp_path / "t"))
    line = error_line(err, "train")
    assert (
        rc == 2 and "shard-00001.safetensors" in line and "sample s5" in line and "700" in line
    ), line
    assert "vocabulary of 512" in line and "eagle3 capture" in line, line


def test_corrupt_draft_weights_are_named_before_an_engine_starts(tmp_path, capsys, tiny_llama):
    from tests.random_draft import build_random_draft

    draft = build_random_draft(
        tiny_llama, tmp_path / "draft", draft_vocab_size=256, aux_layer_ids=[1, 2, 4]
    ).path
    weights = draft / "model.safetensors"
    assert weights.is_file()
    weights.write_bytes(struct.pack("<Q", 1 << 40) + weights.read_bytes()[8:])  # "header too large"
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "hello"}, {"prompt": "world"}])
    t0 = time.time()
    rc, err = run_cli(
        capsys,
        "evaluate",
        "--target",
        tiny_llama,
        "--draft",
        draft,
        "--prompts",
        prompts,
        "--out",
        tmp_path / "e",
        "--num-prompts",
        "2",
        "--max-tokens",
        "4",
        "--no-baseline",
    )
    line = error_line(err, "evaluate")
    assert rc == 2 and str(draft / "model.safetensors") in line and "eagle3 export" in line, line
    assert time.time() - t0 < 60, "the draft is checked before vLLM starts"
    rc, err = run_cli(
        capsys,
        "evaluate",
        "--target",
        tiny_llama,
        "--draft",
        draft,
        "--prompts",
        prompts,
        "--out",
        tmp_path / "e",
        "--num-prompts",
        "2",
        "--verbose",
    )
    assert rc == 2 and "Traceback" in err


def test_disk_full_while_a_checkpoint_is_written(tmp_path, captured, tiny_llama):
    """A 3 MB tmpfs (own mount namespace): best/ and the checkpoint's weights fit, optimizer.pt does
    not, and torch reports that as `RuntimeError: [enforce fail at inline_container.cc] unexpected
    pos`."""
    from tests.synthetic_capture import write_captured

    if (
        shutil.which("unshare") is None
        or subprocess.run(
            ["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True
        ).returncode
    ):
        pytest.skip("no user and mount namespaces here (unshare) for a small tmpfs")
    samples, manifest, vocab = captured
    cap = write_captured(tmp_path / "cap", samples, manifest, shard_samples=4)
    small = tmp_path / "small"
    small.mkdir()
    args = " ".join(str(a) for a in train_args(tiny_llama, cap, vocab, small / "t"))
    script = (
        f"mount -t tmpfs -o size=3m tmpfs {small} && exec {sys.executable} -m eagle3.cli {args}"
    )
    p = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    line = error_line(p.stderr, "train")
    assert p.returncode == 2, p.stderr[-3000:]
    assert "disk full" in line and f"{small}/t/checkpoints/step-2" in line, line
    assert "B free on the filesystem" in line and "B needed" in line and "resume" in line, line


# ------------------------------------------------------------------------------- processes that
# stay
def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting for its reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.time() + timeout_s
    while time.time() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _wait_file(path: Path, timeout_s: float) -> str:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if path.is_file() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.1)
    raise AssertionError(f"{path} did not appear within {timeout_s} s")


def test_crashed_stage_process_takes_its_group_along(tmp_path, monkeypatch):
    """A stage process that dies (here: SIGKILL) without its children: the runner ends the rest of
    its group."""
    from eagle3_prefect.tasks import subprocess_runner
    from eagle3_prefect.tasks.errors import StageCrashed

    pid_file = tmp_path / "child.pid"
    code = (
        "import os, signal, subprocess, sys, time\n"
        "p = subprocess.Popen(['sleep', '300'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    monkeypatch.setattr(subprocess_runner, "build_command", lambda *a: [sys.executable, "-c", code])
    with pytest.raises(StageCrashed, match="killed by signal 9"):
        subprocess_runner.run_stage_subprocess("capture", {}, timeout_s=60)
    left = int(pid_file.read_text())
    try:
        assert not _wait_gone([left], 5), f"pid {left} (the stage's child) still runs"
    finally:
        if _alive(left):
            os.kill(left, signal.SIGKILL)


JOB_CALLER = """
import os, sys, time
import eagle3.vllm_engine as ve

def job(path):
    open(path, "w").write(str(os.getpid()))
    time.sleep(300)

if __name__ == "__main__":
    ve.FORKSERVER_PRELOAD = []  # the job itself is what is tested, not vLLM's import
    ve.run_in_subprocess(job, sys.argv[1])
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_job_of_run_in_subprocess_dies_with_its_caller(tmp_path, sig):
    script = tmp_path / "caller.py"
    script.write_text(JOB_CALLER)
    pid_file = tmp_path / "job.pid"
    caller = subprocess.Popen([sys.executable, str(script), str(pid_file)], cwd=tmp_path)
    job = None
    try:
        job = int(_wait_file(pid_file, 120))
        caller.send_signal(sig)
        caller.wait(timeout=30)
        assert not _wait_gone([job], 5), f"job pid {job} outlived its caller"
    finally:
        if caller.poll() is None:
            caller.kill()
        if job and _alive(job):
            os.kill(job, signal.SIGKILL)


def test_vllm_plugin_leaves_a_fork_server_job_running(tmp_path):
    """The plugin runs in every process that loads vLLM's plugins, a job of run_in_subprocess with
    its engine in process included: its parent is the fork server, not the caller multiprocessing
    names, and it must run on."""
    script = tmp_path / "caller.py"
    script.write_text(
        "import os\nimport eagle3.vllm_engine as ve\n"
        "from eagle3.vllm_ext import die_with_parent_plugin\n"
        "if __name__ == '__main__':\n"
        "    ve.FORKSERVER_PRELOAD = []\n"
        "    os.environ['EAGLE3_ENGINE_DIES_WITH_PARENT'] = '1'\n"
        "    print('job returned', ve.run_in_subprocess(die_with_parent_plugin))\n"
    )
    p = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert p.returncode == 0 and "job returned None" in p.stdout, p.stderr[-2000:]


def _start_time(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def test_engines_of_a_dead_run_are_reported_with_a_kill_command(tmp_path):
    """The lock file of a run that died lists its engine processes; the next run on that directory
    finds the ones still running (same pid and start time) and stops, naming them and the command
    that ends them."""
    from eagle3.lock import LOCK_NAME, StaleEngineError, dir_lock

    dead = subprocess.Popen(["true"])
    dead.wait()
    engine = subprocess.Popen(
        ["sleep", "300"]
    )  # stands for an engine process left running under PID 1
    try:
        holder = {
            "pid": dead.pid,
            "host": os.uname().nodename,
            "command": "eagle3 capture",
            "started": "earlier",
            "engines": [
                {"pid": engine.pid, "start_time": _start_time(engine.pid), "name": "VLLM::Worker"}
            ],
        }
        (tmp_path / LOCK_NAME).write_text(json.dumps(holder))
        with pytest.raises(
            StaleEngineError, match=rf"pid {engine.pid} \(VLLM::Worker[\s\S]*kill {engine.pid}"
        ):
            with dir_lock(tmp_path, "capture out"):
                pass
        # a recorded pid that now belongs to another process (another start time) is not an engine
        # of that run
        holder["engines"][0]["start_time"] += 1
        (tmp_path / LOCK_NAME).write_text(json.dumps(holder))
        with dir_lock(tmp_path, "capture out"):
            pass
    finally:
        engine.kill()
        engine.wait()


def test_lock_file_records_the_engine_processes(tmp_path):
    from eagle3.lock import LOCK_NAME, dir_lock, record_engine_processes

    child = subprocess.Popen(["sleep", "300"])
    try:
        with dir_lock(tmp_path, "capture out"):
            record_engine_processes()
            held = json.loads((tmp_path / LOCK_NAME).read_text())
        assert held["pid"] == os.getpid()
        assert {
            "pid": child.pid,
            "start_time": _start_time(child.pid),
            "name": "sleep 300",
        } in held["engines"]
    finally:
        child.kill()
        child.wait()


LOCKED_JOB = """
import json, os, sys, time
import eagle3.vllm_engine as ve
from eagle3.lock import LOCK_NAME, dir_lock

def job(path):
    time.sleep(2.5)  # the caller records what runs below it about once a second
    return os.getpid(), json.loads(open(path).read())

if __name__ == "__main__":
    ve.FORKSERVER_PRELOAD = []
    with dir_lock(sys.argv[1], "evaluate out") as lock:
        pid, held = ve.run_in_subprocess(job, str(lock))
    print(json.dumps({"job": pid, "engines": [e["pid"] for e in held.get("engines", [])]}))
"""


def test_a_running_job_is_recorded_in_the_callers_lock_file(tmp_path):
    """evaluate's engines run in a job of run_in_subprocess (forked by the fork server, not a child
    of the caller): while it runs, the caller records it, and what it starts, in the lock files it
    holds."""
    script = tmp_path / "caller.py"
    script.write_text(LOCKED_JOB)
    p = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["job"] in got["engines"], got


def test_engine_processes_get_a_parent_death_signal(tmp_path):
    """What the vLLM plugin does in each engine process (EngineCore, Worker): SIGKILL when its
    parent dies, and an exit at once when the parent is already gone."""
    code = (
        "import os, sys, time\n"
        "from eagle3.processes import die_with_parent\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    die_with_parent()\n"
        f"    open({str(tmp_path / 'child.pid')!r}, 'w').write(str(os.getpid()))\n"
        "    time.sleep(300)\n"
        "    os._exit(0)\n"
        "time.sleep(300)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code])
    child = None
    try:
        child = int(_wait_file(tmp_path / "child.pid", 60))
        parent.kill()
        parent.wait()
        assert not _wait_gone([child], 5)
    finally:
        if parent.poll() is None:
            parent.kill()
        if child and _alive(child):
            os.kill(child, signal.SIGKILL)
