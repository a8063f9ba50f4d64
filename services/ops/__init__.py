"""The operator's side: the `streamrl` CLI, the checker, views, `streamrl run`, the embedded Redis. The composition root."""
