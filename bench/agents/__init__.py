"""Benchmarks of agents trained through the gateway: the stock-agent framework matrix."""
