"""The trainer: reads finished samples exactly once (intake), takes one step (step, loss, batch), commits
(commit, checkpoint) and publishes versions (publish, deltas); alone or as ranks under torchrun (topology,
distributed), chosen once."""
