"""Benchmarks of the trainer's own costs: what a version's commit puts on the training loop's critical path."""
