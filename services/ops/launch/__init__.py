"""Starting a run and keeping it up: `streamrl run` (runner), its preflight, `streamrl keep`, the chaos
monkey, the embedded Redis server, the warm process starter (server and client) and the default tiny model."""
