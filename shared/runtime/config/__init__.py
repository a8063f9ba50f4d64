"""The one config object: its keys (keys), their value rules (checks), where values come from (sources)
and the documentation `--help` reads from the source (doc)."""
