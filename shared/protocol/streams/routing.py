"""Routing a keyed raw command inside a pipeline.

On a Redis Cluster client, a pipelined raw command (``EVALSHA``, which a cluster pipeline only takes raw) is
routed by asking a server which keys it touches: one ``COMMAND GETKEYS`` round trip per command in redis-py
8.1 (64 of them per 64-episode flush, measured with ``bench/log/redis_capacity.py``). Naming the key's node up
front skips that; a single server needs nothing.
"""

from __future__ import annotations


def node_of(client, key: str) -> dict:
    """Options for ``pipe.execute_command(..., **node_of(client, key))``."""
    get = getattr(client, "get_node_from_key", None)
    return {"target_nodes": get(key)} if get else {}
