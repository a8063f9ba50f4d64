"""The wire protocol: every key, one codec per stream, the episode fold, the staleness gate."""
