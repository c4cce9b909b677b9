"""`eagle3 stream --config FILE`: streaming (bounded-disk) mode in one process.

The producer (eagle3.capture.spool.run_stream_capture) runs in a thread, the consumer
(eagle3.train.stream.run_stream_train) in the calling thread; they meet only through the spool
directory, so the same two functions also run as separate processes or on separate hosts (`eagle3
stream-capture` / `eagle3 stream-train`, or the Prefect flow flows/streaming.py). A failure on
either side is written into the spool and stops the other.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from eagle3.capture.spool import run_stream_capture
from eagle3.config import PipelineConfig
from eagle3.train.stream import run_stream_train


@dataclass
class StreamResult:
    capture: Any  # StreamCaptureResult
    train: Any  # TrainResult
    wall_s: float


def run_stream(cfg: PipelineConfig) -> StreamResult:
    """Capture and train concurrently through the spool (prepare and vocab must have run)."""
    t0 = time.time()
    produce, consume = cfg.stream_stages()
    box: dict[str, Any] = {}

    def producer() -> None:
        try:
            box["capture"] = run_stream_capture(produce)
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=producer, name="eagle3-stream-capture", daemon=True)
    t.start()
    try:
        train = run_stream_train(consume)
    except BaseException:
        t.join()  # the producer stops by itself: the consumer recorded its failure in the spool
        if "error" in box:  # the producer failed first: that is the cause
            raise box["error"] from None
        raise
    t.join()  # the producer has finished, or stops once it reads that the consumer is done
    if "error" in box:
        raise box["error"]
    return StreamResult(capture=box["capture"], train=train, wall_s=round(time.time() - t0, 3))
