"""Gateway calls served by a rollout worker: read from the ``calls`` stream, logged in the episode's stream,
resumed after an abort and taken over after a crash like groups."""
