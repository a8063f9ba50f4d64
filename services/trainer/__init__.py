"""The trainer: reads finished samples exactly once (intake), takes one step (step, loss, batch), commits a version as
its ledger line and snapshots now and then (state/), publishes each version as what changed (publisher, publish);
alone or as ranks under torchrun (topology, distributed), chosen once."""
