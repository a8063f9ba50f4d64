"""Benchmarks of mixture-of-experts policies: routing replay's route mismatch, importance ratios and learning, and
the bytes its routes cost in the episode log."""
