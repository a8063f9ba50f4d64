"""Mixture-of-experts policies: whether a model is one and the shape of its expert routes, read from its config
(``shape``), and its routers hooked to record the experts they choose while sampling and to be forced to the logged
ones while training (``routers``; routing replay, docs/models.md)."""
