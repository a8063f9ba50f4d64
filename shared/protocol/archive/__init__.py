"""The log's files on disk: the episode segments (the cold tier: Parquet files, their column format, index
and templates), the tiers' sizes, the trainer's ledger and the kill-safe JSON-lines format both use."""
