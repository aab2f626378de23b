"""The rollout engine's worker extension with a record of what the colocated sync's wire calls
carried into it: loaded by vLLM's worker, in another process than the test's
(`test_ipc_transfer.py`'s engine-core test names it by module path)."""
from __future__ import annotations

from rlhf_core.rollout.ipc_wire import handles_from_wire
from rlhf_core.rollout.weight_transfer import EngineWorkerExtension


class RecordingExtension(EngineWorkerExtension):
    """`EngineWorkerExtension`, whose wire method first records, as plain values, what the handles
    it got rebuild to, then runs as it does in a run (vLLM's `update_weights`), recording how that ends."""

    received: list = []

    def rlhf_update_weights_from_wire(self, update_info: dict) -> None:
        rebuilt = handles_from_wire(update_info["ipc_handles"])
        for handles in rebuilt if isinstance(rebuilt, list) else [rebuilt]:
            for gpu, args in handles.items():
                type(self).received.append({"gpu": gpu, "tensor": args[0].__name__, "size": type(args[1]).__name__,
                                            "storage": args[4].__name__, "dtype": str(args[5]),
                                            "handle": type(args[7]).__name__, "names": list(update_info["names"])})
        try:
            super().rlhf_update_weights_from_wire(update_info)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            type(self).received.append({"raised": f"{type(exc).__name__}: {exc}"})

    def rlhf_received(self) -> list:
        return type(self).received
