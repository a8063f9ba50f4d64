"""Weights over the wire, against the real weight server (uvicorn in a thread, real HTTP on loopback): what it
serves and refuses, the fetch client's range resume after a transfer cut by a real connection drop, its sha256
check, and how a rollout worker decides between the published file and a download (weights_fetch)."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest

from services.rollout.weights.local import LocalWeights
from shared.protocol.streams import versions
from shared.runtime import logs
from shared.runtime.config.errors import ConfigError
from shared.runtime.config.keys import Config
from shared.runtime.config.sources import load
from shared.runtime.weights.checksum import sha256_file
from shared.runtime.weights.fetch import FetchError, fetch, prune
from shared.runtime.weights.server import WeightServer, file_name

# a few chunks, not a round number
SIZE = 3 * 1024 * 1024 + 17


@pytest.fixture
def published(tmp_path):
    """The trainer's folder with version 7 in it (random bytes: the transport does not care what they mean)."""
    folder = tmp_path / "trainer"
    folder.mkdir()
    path = folder / file_name(7)
    path.write_bytes(bytes(range(256)) * (SIZE // 256) + b"x" * (SIZE % 256))
    (tmp_path / "secret.txt").write_text("not for the wire")
    return path, sha256_file(path)


@pytest.fixture
def server(published):
    srv = WeightServer(published[0].parent).start()
    yield srv
    srv.stop()


def test_server_serves_ranges_head_and_digest_and_nothing_else(server, published):
    path, digest = published
    url = server.url_of(7)
    full = httpx.get(url)
    assert full.status_code == 200 and full.content == path.read_bytes()
    assert full.headers["etag"] == f'"{digest}"' and full.headers["accept-ranges"] == "bytes"
    part = httpx.get(url, headers={"Range": "bytes=1000-1999"})
    assert part.status_code == 206 and part.content == path.read_bytes()[1000:2000]
    assert part.headers["content-range"] == f"bytes 1000-1999/{SIZE}"
    head = httpx.head(url)
    assert head.status_code == 200 and head.content == b"" and int(head.headers["content-length"]) == SIZE
    # If-Range with another digest: the whole file, not the range
    assert httpx.get(url, headers={"Range": "bytes=10-", "If-Range": '"' + "0" * 64 + '"'}).status_code == 200
    for other in (
        "/weights/v000008.safetensors",
        "/weights/..%2Fsecret.txt",
        "/weights/../secret.txt",
        "/secret.txt",
        "/weights/secret.txt",
        "/weights/v7.safetensors",
    ):
        assert httpx.get(server.url + other).status_code == 404, other
    assert httpx.post(url).status_code == 405


def test_server_with_a_token_refuses_requests_without_it(published, tmp_path):
    srv = WeightServer(published[0].parent, token="s3cret").start()
    try:
        url = srv.url_of(7)
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer s3cr\u00e9t".encode("latin-1")}).status_code == 401
        got = fetch(url, 7, published[1], tmp_path / "mine", token="s3cret")
        assert sha256_file(got.path) == published[1]
        with pytest.raises(FetchError, match="HTTP 401"):
            fetch(url, 7, published[1], tmp_path / "other")
    finally:
        srv.stop()


def test_a_second_server_on_a_taken_port_is_one_clear_error(server, published):
    with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{server.port} .*weights_port"):
        WeightServer(published[0].parent, port=server.port).start()


class CutOnce:
    """A TCP relay in front of the weight server that closes the FIRST connection after ``cut_after`` bytes of
    the answer (a real connection drop mid-body) and relays later ones whole; it keeps each request's head."""

    def __init__(self, upstream_port: int, cut_after: int):
        self.upstream, self.cut_after = upstream_port, cut_after
        self.requests: list[str] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        first = True
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client, first), daemon=True).start()
            first = False

    def _relay(self, client: socket.socket, cut: bool) -> None:
        up = socket.create_connection(("127.0.0.1", self.upstream))
        head = b""
        while b"\r\n\r\n" not in head:
            head += client.recv(65536)
        self.requests.append(head.decode(errors="replace"))
        up.sendall(head)
        sent = 0
        while True:
            data = up.recv(65536)
            if not data:
                break
            if cut and sent + len(data) >= self.cut_after:
                client.sendall(data[: self.cut_after - sent])
                break
            client.sendall(data)
            sent += len(data)
        client.close()
        up.close()

    def close(self) -> None:
        self.sock.close()


def test_a_download_cut_mid_body_is_resumed_with_a_range_request(server, published, tmp_path):
    path, digest = published
    relay = CutOnce(server.port, cut_after=SIZE // 3)
    try:
        got = fetch(f"http://127.0.0.1:{relay.port}/weights/{file_name(7)}", 7, digest, tmp_path / "mine")
    finally:
        relay.close()
    assert got.requests == 2 and got.path.read_bytes() == path.read_bytes()
    assert "range" not in relay.requests[0].lower()
    (line,) = [h for h in relay.requests[1].split("\r\n") if h.lower().startswith("range:")]
    resumed_at = int(line.split("=")[1].rstrip("-"))
    # what the cut connection delivered, less the response's head
    assert 0 < resumed_at < SIZE // 3
    # every byte came over the network once: the resume asked for the rest only
    assert got.downloaded == SIZE
    assert not list((tmp_path / "mine").glob("*.part"))


def test_a_partial_file_left_by_a_dead_fetch_is_resumed_and_a_bad_one_started_over(server, published, tmp_path):
    path, digest = published
    mine = tmp_path / "mine"
    mine.mkdir()
    part = mine / f".{file_name(7)}.{digest[:16]}.part"
    part.write_bytes(path.read_bytes()[: SIZE // 2])
    got = fetch(server.url_of(7), 7, digest, mine)
    assert (got.resumed_from, got.downloaded, got.requests) == (SIZE // 2, SIZE - SIZE // 2, 1)
    assert sha256_file(got.path) == digest
    got.path.unlink()
    # not a prefix of the file: the digest fails, it starts over once
    part.write_bytes(b"garbage" * 1000)
    got = fetch(server.url_of(7), 7, digest, mine)
    assert got.requests == 2 and got.downloaded == SIZE - 7000 + SIZE and sha256_file(got.path) == digest


def test_a_digest_mismatch_or_an_http_error_is_one_clear_error_and_leaves_no_file(server, published, tmp_path):
    path, digest = published
    wrong = "ab" * 32
    with pytest.raises(FetchError) as exc:
        fetch(server.url_of(7), 7, wrong, tmp_path / "mine")
    msg = str(exc.value)
    assert msg.startswith(f"weights v7 from {server.url_of(7)}: ") and "abababababab" in msg
    with pytest.raises(FetchError, match=r"weights v8 from .*v000008.safetensors: HTTP 404"):
        fetch(server.url_of(8), 8, digest, tmp_path / "mine")
    with pytest.raises(FetchError, match="no url"):
        fetch("", 7, digest, tmp_path / "mine")
    assert not list((tmp_path / "mine").glob("v*.safetensors"))


def test_prune_keeps_the_loaded_version_newer_ones_and_a_few_older(tmp_path):
    for v in (1, 2, 3, 4, 6):
        (tmp_path / file_name(v)).write_bytes(b"w")
        (tmp_path / f".{file_name(v)}.lock").write_bytes(b"")
    assert prune(tmp_path, keep=2, loaded=4) == [1, 2]
    assert sorted(p.name for p in tmp_path.glob("v*")) == [file_name(v) for v in (3, 4, 6)]
    assert not (tmp_path / f".{file_name(1)}.lock").exists()


def _weights(tmp_path, mode: str) -> LocalWeights:
    cfg = Config(
        run="t", weights_fetch=mode, rollout_weights_dir=str(tmp_path / "mine"), weights_dir=str(tmp_path / "trainer")
    )
    return LocalWeights(cfg, logs.get("weights-test"))


def test_auto_reads_a_readable_published_file_and_downloads_an_unreadable_one(server, published, tmp_path):
    path, digest = published
    auto = _weights(tmp_path, "auto")
    # readable here: no download at all
    assert auto.local(7, str(path), digest, server.url_of(7)) == path
    assert not (tmp_path / "mine").exists() and auto.stats["fetches"] == 0
    # the path as the trainer wrote it
    elsewhere = str(tmp_path / "on-the-trainer-host" / file_name(7))
    auto = _weights(tmp_path, "auto")
    got = auto.local(7, elsewhere, digest, server.url_of(7))
    assert got == tmp_path / "mine" / file_name(7) and sha256_file(got) == digest and auto.stats["fetches"] == 1
    always = _weights(tmp_path / "b", "always")
    assert always.local(7, str(path), digest, server.url_of(7)).parent == tmp_path / "b" / "mine"
    never = _weights(tmp_path / "c", "never")
    with pytest.raises(ValueError, match="not readable on this host .weights_fetch = never"):
        never.local(7, elsewhere, digest, server.url_of(7))
    with pytest.raises(ValueError, match="no url"):
        auto.local(8, str(tmp_path / "nowhere" / file_name(8)), digest, "")


def test_a_prefetch_acks_from_its_thread_and_a_failed_one_is_what_the_load_refuses_with(server, published, tmp_path):
    path, digest = published
    w = _weights(tmp_path, "always")
    done = threading.Event()
    results = []
    w.prefetch(7, str(path), "cd" * 32, server.url_of(7), lambda ok, error: (results.append((ok, error)), done.set()))
    assert done.wait(30)
    ((ok, error),) = results
    assert not ok and "cdcdcdcdcdcd" in error
    with pytest.raises(ValueError) as exc:
        w.local(7, str(path), "cd" * 32, server.url_of(7))
    # the same error, at once: no second download inside the pause
    assert str(exc.value) == error
    # a later load tries again
    assert w.local(7, str(path), digest, server.url_of(7)).parent == tmp_path / "mine"


def test_version_events_carry_the_url_and_old_ones_without_it_decode():
    old = versions.decode(
        "1-0", {b"version": b"3", b"path": b"/w/v3", b"sha256": b"ab", b"step": b"3", b"time": b"1.5"}
    )
    assert old.url == "" and old.version == 3
    v = versions.Version(4, "/w/v4", "cd", 4, 2.0, url="http://h:1/weights/v000004.safetensors")
    assert versions.encode(v)["url"] == v.url and "url" not in versions.encode(old)
    assert versions.decode("2-0", versions.encode(v)).url == v.url


@pytest.mark.parametrize(
    "env, message",
    [
        ({"STREAMRL_WEIGHTS_FETCH": "sometimes"}, "'weights_fetch': expected 'auto', 'always' or 'never'"),
        ({"STREAMRL_WEIGHTS_PORT": "70000"}, "'weights_port': expected a port"),
        ({"STREAMRL_WEIGHTS_URL": "ftp://x"}, "'weights_url': expected an http"),
        ({"STREAMRL_WEIGHTS_PORT": "8322", "STREAMRL_WEIGHTS_HOST": "0.0.0.0"}, "set weights_url"),
        ({"STREAMRL_WEIGHTS_DIR": "/tmp/w", "STREAMRL_ROLLOUT_WEIGHTS_DIR": "/tmp/w/"}, "is the trainer's weights_dir"),
        ({"STREAMRL_ROLLOUT_WEIGHTS_KEEP": "0"}, "rollout_weights_keep"),
    ],
)
def test_bad_transport_config_is_one_clear_error(env, message):
    with pytest.raises(ConfigError, match=message):
        load(env=env)


def test_the_advertised_url_defaults_to_host_and_port_and_is_empty_without_a_server():
    assert load(env={}).weights_base_url == ""
    assert load(env={"STREAMRL_WEIGHTS_PORT": "8322"}).weights_base_url == "http://127.0.0.1:8322"
    cfg = load(
        env={
            "STREAMRL_WEIGHTS_PORT": "8322",
            "STREAMRL_WEIGHTS_HOST": "0.0.0.0",
            "STREAMRL_WEIGHTS_URL": "http://trainer.lan:8322/",
        }
    )
    assert cfg.weights_base_url == "http://trainer.lan:8322"


def test_bytes_that_do_not_hash_to_the_published_sha256_are_discarded_after_the_download(published, tmp_path):
    """A server that sends no digest (here the standard library's, over a folder with other bytes under the name):
    the check after the download refuses them and nothing is left behind."""
    import functools
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    other = tmp_path / "other" / "weights"
    other.mkdir(parents=True)
    (other / file_name(7)).write_bytes(b"not the published bytes" * 1000)
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(tmp_path / "other"))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/weights/{file_name(7)}"
        with pytest.raises(FetchError) as exc:
            fetch(url, 7, published[1], tmp_path / "mine")
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert str(exc.value) == (
        f"weights v7 from {url}: sha256 {sha256_file(other / file_name(7))[:12]}... does not "
        f"match the published {published[1][:12]}... (corrupt or truncated file); discarded"
    )
    assert not [p.name for p in (tmp_path / "mine").iterdir() if not p.name.endswith(".lock")]
