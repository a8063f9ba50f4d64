"""The syncer: moves each published version to the rollout workers (a relay tree, all at once or in rolling
waves) and opens the staleness gate; with pulled syncs it only announces (announce)."""
