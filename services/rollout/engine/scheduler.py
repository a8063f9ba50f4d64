"""Waiting and running queues of the torch engine: admission and finishing."""

from __future__ import annotations

from collections import deque

from services.rollout.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, max_batch_size: int, max_model_len: int):
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.running or any(s.request_id == request_id for s in self.waiting)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Move waiting requests into the running batch while it has room; they prefill this step."""
        admitted = []
        while self.waiting and len(self.running) < self.max_batch_size:
            seq = self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running[seq.request_id] = seq
            admitted.append(seq)
        return admitted

    def check_finished(self, seq: Sequence) -> bool:
        if seq.last_token in seq.params.stop_token_ids:
            self._finish(seq, "stop")
        elif seq.num_generated >= seq.max_new_tokens or len(seq.token_ids) >= self.max_model_len:
            self._finish(seq, "length")
        return seq.status is Status.FINISHED

    def remove(self, request_id: str) -> Sequence | None:
        """Take a request out of either queue, marking it aborted unless it already finished."""
        seq = self.running.pop(request_id, None)
        if seq is None:
            seq = next((s for s in self.waiting if s.request_id == request_id), None)
            if seq is None:
                return None
            self.waiting.remove(seq)
        if seq.status is not Status.FINISHED:
            self._finish(seq, "abort")
        return seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @staticmethod
    def _finish(seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
