"""The trainer's durable state, and how a restart gets it back.

A version commits as one fsynced ledger line naming what it trained, step by step (commit). Model, optimizer and RNG
are snapshotted every few versions, copied in memory and written in the background (snapshot; sharded under torchrun).
A restart loads the newest snapshot and re-trains the ledger's commits after it from the episode log (replay), so a
version costs its ledger line on the critical path, whatever the model's size."""
