"""Prompt groups in a rollout worker: claiming them through the staleness gate, taking over a dead worker's
groups (claims), and handing long-tail groups to a long-tail worker (repack_policy, repacker)."""
