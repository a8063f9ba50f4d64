"""How new versions reach a rollout worker: the sync modes (commanded, rolling, pulled, lockstep; chosen once),
each version's local file (local) and, for pulled syncs, the puller and its load policy."""
