"""The delta benchmark's reward (bench/weights/delta_sync.py): a random-init model never solves a task, so every group's
rewards would be equal, every advantage 0 and every gradient 0 (no weight would change). This reward is the share of
distinct characters in the response: it varies within a group, so the real trainer takes real AdamW steps. Marked
inline (services/rollout/jobs/rewards.py): called in the rollout worker, no rq job."""


def distinct_chars(response: str, task: dict) -> float:
    text = response.strip()
    return len(set(text)) / max(1, len(text))


distinct_chars.streamrl_inline = True
