"""The weights token goes only to origins the run announced (shared/runtime/weights/origins.py): a forged fetch
command naming a listener of an attacker's gets no request with the token, and the worker acks it as failed."""

from __future__ import annotations

import http.server
import threading

from shared.protocol.streams import versions
from shared.runtime.config.keys import Config
from shared.runtime.weights.fetch import origin
from shared.runtime.weights.origins import announced
from tests.support.rollout_harness import acks, make_worker, send, tick_until


class _Listener(http.server.BaseHTTPRequestHandler):
    seen: list = []

    def do_GET(self):  # noqa: N802
        _Listener.seen.append(dict(self.headers))
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_origin_and_what_is_announced(client, keys):
    assert origin("http://127.0.0.1:9/x") == "http://127.0.0.1:9" and origin("HTTPS://Host/x") == "https://host:443"
    assert origin("not a url") == ""
    versions.publish(client, keys, versions.Version(1, "/w/v1", "ab" * 32, 1, 0.0, url="http://10.0.0.1:7/v1"))
    assert announced(client, keys, "http://127.0.0.1:8123") == {"http://127.0.0.1:8123", "http://10.0.0.1:7"}


def test_a_forged_fetch_command_sends_no_token_to_its_url(client, keys, tiny_model_dir, tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Listener)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Listener.seen = []
    try:
        cfg = Config(
            run=keys.run,
            model_dir=tiny_model_dir,
            max_tokens=4,
            weights_token="the-token",
            weights_fetch="always",
            rollout_weights_dir=str(tmp_path / "fetched"),
        )
        worker = make_worker(cfg, client)
        url = f"http://127.0.0.1:{server.server_address[1]}/weights/v000005.safetensors"
        send(
            client,
            keys,
            "fetch",
            sync="forged",
            version=5,
            path="/nowhere/v000005.safetensors",
            sha256="ab" * 32,
            url=url,
        )
        tick_until(worker, lambda: acks(client, keys, "fetch"))
        (ack,) = acks(client, keys, "fetch")
        assert ack["ok"] == "0" and "not an origin the run announced" in ack["error"]
        assert all("the-token" not in str(h) for h in _Listener.seen)
        # not even a request without it
        assert _Listener.seen == []
        worker.shutdown()
    finally:
        server.shutdown()
