"""The stage declaration (eagle3.stage_graph) is the one place a stage is written down: the CLI, the
order of `eagle3 run`, the streaming step, `PipelineConfig.resolved()`, the upstream of the cache
keys and the Prefect tasks and GPU flows all follow from it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pydantic import Field

from eagle3.config import PipelineConfig, StageConfig, load_pipeline_config
from eagle3.stage_graph import (
    STAGES,
    Stage,
    external_inputs,
    pipeline_order,
    stage_names,
    upstream_of,
)

ROOT = Path(__file__).resolve().parents[1]


class ScoreConfig(StageConfig):
    """A stage that is declared only here."""

    target: str | None = Field(None, description="Target model dir")
    draft: str | None = Field(None, description="Exported draft to score")
    prompts: str | None = Field(None, description="Prompts to score it on")
    num_speculative_tokens: int | None = Field(None, description="Draft tokens per step")
    out: Path | None = Field(None, description="Where the scores go")


class ScoredPipelineConfig(PipelineConfig):
    score: ScoreConfig = Field(default_factory=ScoreConfig)


def run_score(cfg: ScoreConfig) -> dict:
    return {"draft": cfg.draft, "out": str(cfg.out)}


SCORE = Stage(
    "score",
    f"{__name__}:ScoreConfig",
    f"{__name__}:run_score",
    "score an exported draft",
    writes="scored",
    reads={"draft": "export", "prompts": "@eval_prompts"},
    settings={"num_speculative_tokens": "evaluate.num_speculative_tokens"},
)


def commands() -> dict:
    from eagle3.cli import build_parser

    return build_parser()._subparsers._group_actions[0].choices


def test_the_cli_commands_are_the_declared_stages_and_every_task_runs_one():
    from eagle3_prefect.flows import gpu_stages
    from eagle3_prefect.tasks.stages import STAGE_TASKS

    tools = {"run", "stream", "plan", "estimate"}  # the pipeline, its streaming step, two tools
    assert set(commands()) == set(STAGES) | tools
    assert set(STAGE_TASKS) == set(STAGES) - set(stage_names("stream"))
    assert all(task.name == name for name, task in STAGE_TASKS.items())
    from prefect import Flow

    flows = {v.name for v in vars(gpu_stages).values() if isinstance(v, Flow)}
    assert flows == {f"eagle3-{n}" for n, s in STAGES.items() if s.gpu}


def test_a_stage_added_to_the_declaration_reaches_the_cli_the_order_resolved_and_preflight(
    monkeypatch, tmp_path
):
    from eagle3.pipeline import enabled_stages
    from eagle3.stages import run_stage_function

    monkeypatch.setitem(STAGES, "score", SCORE)
    score = commands()["score"]
    flags = {a for action in score._actions for a in action.option_strings}
    assert {"--draft", "--prompts", "--num-speculative-tokens", "--out"} <= flags
    assert pipeline_order()[-1] == "score" and pipeline_order(streaming=True)[-1] == "score"
    assert STAGES["score"].needs == ("export",)

    cfg = ScoredPipelineConfig(
        target="t", data="d.jsonl", eval_prompts="p.jsonl", work_dir=tmp_path
    )
    assert enabled_stages(cfg)[-1] == "score"
    r = cfg.resolved()
    assert r.score.out == tmp_path / "scored"
    assert r.score.draft == str(r.export.out) == str(tmp_path / "draft")
    assert r.score.prompts == "p.jsonl" and r.score.target == "t"
    assert r.score.num_speculative_tokens == r.evaluate.num_speculative_tokens
    assert cfg.stage_config("score") == r.score
    assert run_stage_function("score", r.score) == {
        "draft": str(tmp_path / "draft"),
        "out": str(tmp_path / "scored"),
    }

    # the pre-flight walks it: its inputs from outside the pipeline, the outputs it reads
    from eagle3.preflight import check_pipeline

    assert not [p for p in check_pipeline(cfg) if p.startswith("score.")]
    cfg.score.prompts, cfg.score.draft = str(tmp_path / "gone.jsonl"), str(tmp_path / "no-draft")
    problems = check_pipeline(cfg)
    assert (
        f"score.prompts = {cfg.score.prompts!r} does not exist; point it at the prompts to "
        "score it on" in problems
    ), problems
    assert any(p.startswith(f"score.draft = {cfg.score.draft!r} does not exist") for p in problems)
    reader = dataclasses.replace(
        SCORE, reads={**SCORE.reads, "prompts": "synthesize/prompts.jsonl"}
    )
    monkeypatch.setitem(STAGES, "score", reader)
    cfg.score.prompts = None
    assert any(
        p.startswith("score.prompts reads synthesize's output")
        and "(synthesize.enabled is off)" in p
        for p in check_pipeline(cfg)
    ), check_pipeline(cfg)


def test_resolved_wires_every_declared_read():
    """Every stage writes <work_dir>/<writes>; every input field holds the output of the stage it
    reads, or what that stage would have read when the config does not run it."""
    for overrides in ({}, {"regenerate": {"enabled": True}, "refine": {"enabled": True}}):
        cfg = load_pipeline_config(ROOT / "configs" / "demo.yaml", overrides)
        r = cfg.resolved()
        for name in stage_names("pipeline"):
            stage, section = STAGES[name], getattr(r, name)
            assert section.out == r.work_dir / stage.writes, name
            for field, source in stage.reads.items():
                upstream, _, file = source.partition("/")
                if source.startswith("@"):
                    expected = getattr(r, source[1:])
                elif r.runs(upstream):
                    expected = str(r.work_dir / STAGES[upstream].writes / file).rstrip("/")
                else:
                    continue  # passed on: checked below
                assert getattr(section, field) == expected, (name, field)
    assert r.export.checkpoint == str(r.work_dir / "refine")
    off = load_pipeline_config(
        ROOT / "configs" / "demo.yaml",
        {"regenerate": {"enabled": False}, "refine": {"enabled": False}},
    )
    assert off.resolved().export.checkpoint == str(off.work_dir / "train")  # refine passes it on
    assert off.resolved().prepare.data == off.data  # regenerate and mix pass `data` on


def test_needs_and_the_streaming_step_follow_the_reads():
    assert upstream_of("export") == ("train", "refine")  # refine passes train's checkpoint on
    assert upstream_of("prepare") == ()  # its data is keyed by content
    assert upstream_of("refine") == ("prepare", "capture", "vocab", "train")
    assert upstream_of("stream-train") == ("stream-capture",)
    # the stream variants stand for capture and train, after the last stage they read (vocab)
    streaming = pipeline_order(streaming=True)
    assert streaming[streaming.index("vocab") + 1] == "stream"
    assert "capture" not in streaming and "train" not in streaming


def test_the_stream_variants_are_built_from_their_sections(tmp_path):
    cfg = load_pipeline_config(
        ROOT / "configs" / "demo.yaml",
        {"work_dir": str(tmp_path), "train": {"epochs": 2, "seed": 7}},
    )
    produce, consume = (cfg.stage_config(n) for n in stage_names("stream"))
    r = cfg.resolved()
    assert produce.out == tmp_path / "spool" and consume.captured == str(tmp_path / "spool")
    assert (produce.epochs, produce.seed) == (2, 7)
    assert produce.data == r.capture.data and consume.out == r.train.out


def test_the_external_inputs_are_derived_from_the_declaration(tmp_path):
    """The cache key fingerprints the fields a stage reads from outside the pipeline's outputs: the
    target (every section), `data` (passed on by mix and regenerate when they do not run), mix's
    sources (the pipeline's `data` first) and evaluate's prompts (`@eval_prompts`)."""
    from eagle3_prefect.tasks.manifest import EXTERNAL_INPUT_FIELDS, external_fingerprints

    assert external_inputs() == {
        "target": "target",
        "sources": "data",
        "data": "data",
        "prompts": "eval_prompts",
    }
    # the value once written by hand, and mix's list of sources, once keyed beside it
    assert [f for f in EXTERNAL_INPUT_FIELDS if f != "sources"] == ["target", "data", "prompts"]
    assert "sources" in EXTERNAL_INPUT_FIELDS
    (tmp_path / "a.jsonl").write_text("a")
    (tmp_path / "b.jsonl").write_text("b")
    cfg = load_pipeline_config(
        ROOT / "configs" / "demo.yaml",
        {
            "work_dir": str(tmp_path / "run"),
            "data": str(tmp_path / "a.jsonl"),
            "mix": {"sources": [{"path": str(tmp_path / "b.jsonl")}]},
        },
    ).resolved()
    mix = external_fingerprints(cfg.mix.model_dump(mode="json"), set())
    assert set(mix) == {"sources.0", "sources.1"} and mix["sources.0"] != mix["sources.1"]
    evaluate = external_fingerprints(cfg.evaluate.model_dump(mode="json"), set())
    assert set(evaluate) == {"target", "prompts"}  # its draft is export's output
