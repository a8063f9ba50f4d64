"""One episode's stream: the event schema (events, the one owner, also its documentation), the fold that
rebuilds an episode from its entries, the batched fenced log writer, and the sampling and log-prob rules."""
