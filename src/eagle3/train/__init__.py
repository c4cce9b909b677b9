"""Training the EAGLE-3 draft with training-time test (TTT).

run_train(cfg: TrainConfig) -> TrainResult              the `eagle3 train` stage
ttt_forward(model, batch, head, steps=7, ...)           one unrolled TTT forward on tensors
"""

from eagle3.train.step import (
    PackedBatch,
    StepOutput,
    TTTModule,
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
    "PackedBatch",
    "StepOutput",
    "TTTModule",
    "TrainResult",
    "run_train",
    "summarize",
    "ttt_forward",
]
