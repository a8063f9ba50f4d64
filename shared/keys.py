"""Every Redis key streamrl uses, namespaced by run: ``streamrl:<run>:<name>``."""

from __future__ import annotations

PREFIX = "streamrl"


class Keys:
    def __init__(self, run: str):
        self.run = run
        self.base = f"{PREFIX}:{run}:"

    def episode(self, episode_id: str) -> str:
        return f"{self.base}ep:{episode_id}"

    def episode_id(self, key: str | bytes) -> str:
        key = key.decode() if isinstance(key, bytes) else key
        return key.removeprefix(f"{self.base}ep:")

    def alive(self, service: str, worker_id: str) -> str:
        """Heartbeat key: exists while the process is alive (TTL)."""
        return f"{self.base}alive:{service}:{worker_id}"

    @property
    def pattern(self) -> str:
        return f"{self.base}*"

    prompts = property(lambda self: f"{self.base}prompts")
    samples = property(lambda self: f"{self.base}samples")
    val_prompts = property(lambda self: f"{self.base}prompts:val")  # held-out prompt groups, served first, never trained
    val_samples = property(lambda self: f"{self.base}samples:val")  # their finished groups (read by the driver)
    versions = property(lambda self: f"{self.base}versions")
    control = property(lambda self: f"{self.base}control")
    metrics = property(lambda self: f"{self.base}metrics")
    gate = property(lambda self: f"{self.base}gate")
    gate_started = property(lambda self: f"{self.base}gate:started")
    dead_letters = property(lambda self: f"{self.base}dead")
