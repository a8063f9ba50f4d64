"""Benchmarks of the event log: writes and replay, segments, storage tiers and their cost, the archiver, and what one
Redis node holds."""
