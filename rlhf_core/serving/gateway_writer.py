"""The gateway's one writer to the feedback store, committing writes in groups."""
from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future

from rlhf_core.feedback.store import FeedbackStore

log = logging.getLogger(__name__)

class BatchWriter:
    """One thread applies the gateway's store writes, all those waiting in one transaction
    (group commit): concurrent SQLite writers would queue on the file lock, each paying its own
    fsync, and SQLite's busy handler sleeps in steps of milliseconds. A write's future resolves
    only after the transaction holding it committed."""

    def __init__(self, store: FeedbackStore, max_batch: int = 256):
        self.store, self.max_batch = store, max_batch
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="feedback-store-writer", daemon=True)
        self._thread.start()

    def submit(self, call) -> Future:
        future: Future = Future()
        self._queue.put((call, future))
        return future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            batch = [item]
            while len(batch) < self.max_batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)  # stop after this batch
                    break
                batch.append(item)
            try:
                results = self.store.apply([call for call, _ in batch])
            except Exception as e:  # noqa: BLE001 - the commit failed: every write of the batch failed
                log.exception("a feedback store transaction failed")
                results = [e] * len(batch)
            for (_, future), result in zip(batch, results):
                if isinstance(result, Exception):
                    future.set_exception(result)
                else:
                    future.set_result(result)
