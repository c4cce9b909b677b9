"""Training the EAGLE-3 draft with training-time test (TTT).

    run_train(cfg: TrainConfig) -> TrainResult              the `eagle3 train` stage
    ttt_forward(model, batch, head, steps=7, ...)           one unrolled TTT forward on tensors
    build_benchmark(draft_cfg, ...) / run_benchmark_step()  model + one optimizer step, for GPU benchmarks
"""

from eagle3.train.step import (
    BenchmarkSetup,
    PackedBatch,
    StepOutput,
    TTTModule,
    build_benchmark,
    run_benchmark_step,
    summarize,
    ttt_forward,
)


def __getattr__(name: str):
    # lazy: the trainer pulls in pydantic configs; the tensor-level API above needs only torch
    if name in ("run_train", "TrainResult"):
        from eagle3.train import trainer

        return getattr(trainer, name)
    raise AttributeError(name)


__all__ = [
    "BenchmarkSetup",
    "PackedBatch",
    "StepOutput",
    "TTTModule",
    "TrainResult",
    "build_benchmark",
    "run_benchmark_step",
    "run_train",
    "summarize",
    "ttt_forward",
]
