"""Benchmarks of whole runs: the default pipeline, chaos, concurrent agents, stall drills, and the ui on a
finished run."""
