"""Benchmarks of what training learns: staleness tolerance, async vs sync, pulled weights vs a pause, the defaults'
reach, and the cost of rewards."""
