"""The coordination streams, one codec module each (prompts, samples, versions, control, calls, pulls,
repacks, metrics, dead letters), their trimmed heads, and the small write helpers every stream shares."""
