"""The rollout worker: generates episodes from claimed prompt groups and writes every token to the episode log.
Its tick is ``worker.py``; the rooms below hold the engine, an episode's life, groups, weights, gateway calls, jobs."""
