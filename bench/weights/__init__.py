"""Benchmarks of weight movement: delta sync, fetch fan-out, rolling sync, the pause per sync, and trainer memory."""
