"""Where a rollout worker may send the weights token: the origins the run announced (docs/security.md).

A fetch URL arrives in a control entry (the syncer's ``fetch``/``load``), but the token goes only to an origin
(scheme, host, port) that an authenticated process of the run announced: the trainer's weight server (the config's
``weights_url``, and the ``url`` of the newest version events the trainer published) and the relays of live
rollout workers (their heartbeats). A URL from a control entry alone gets no token and no request
(``weight_fetch.fetch`` refuses it with one line).
"""

from __future__ import annotations

from shared.protocol.episode.errors import EventError
from shared.protocol.streams import versions
from shared.runtime import heartbeat
from shared.runtime.weights.fetch import origin

# version events whose url counts as announced
RECENT_VERSIONS = 16


def announced(client, keys, weights_base_url: str = "") -> set[str]:
    """The origins the weights token may go to now: the configured trainer's, those of recent version events, and
    the relays in live rollout workers' heartbeats."""
    found = {origin(weights_base_url)}
    for entry_id, fields in client.xrevrange(keys.versions, count=RECENT_VERSIONS):
        try:
            found.add(origin(versions.decode(entry_id, fields).url))
        except EventError:
            continue
    for info in heartbeat.alive_of(client, keys, "rollout").values():
        found.add(origin(info.get("relay", "")))
    found.discard("")
    return found
