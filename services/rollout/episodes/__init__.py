"""An episode's life in a rollout worker: the in-memory episode (live), its fenced events from start to end
(lifecycle), the agent loop as pure transitions, when writes travel (settlement), an engine step's writes on a
thread (step_writer), prompt ids and stop tokens (prompting), and `replay --continue` (continuation)."""
