"""The archiver: moves trained episodes out of Redis into the run's Parquet segments
(shared/protocol/archive/segments.py)."""
