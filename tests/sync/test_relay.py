"""Weights pulled through relays, in one process with real parts: the trainer's weight server and a worker's relay
(the same server code over loopback HTTP, bearer token), real ``LocalWeights`` fetches checked by sha256, and the
control codec's ``targets`` / ``sources`` fields (old entries without them stay for everyone)."""

from __future__ import annotations

import threading

import httpx
import pytest

from services.rollout.weights.local import LocalWeights
from shared.protocol.episode.errors import EventError
from shared.protocol.streams import control
from shared.runtime import logs
from shared.runtime.config.keys import Config
from shared.runtime.weights.checksum import sha256_file
from shared.runtime.weights.server import WeightServer, file_name
from tests.support.models import nudged_weights

TOKEN = "relay-s3cret"


def _weights(keys, folder) -> LocalWeights:
    cfg = Config(run=keys.run, rollout_weights_dir=str(folder), weights_fetch="always", weights_token=TOKEN)
    return LocalWeights(cfg, logs.get("relay-test"))


def _fetch(weights: LocalWeights, version: int, path, digest: str, url: str, relay: str = "") -> tuple[bool, str]:
    done, out = threading.Event(), []
    weights.prefetch(
        version, str(path), digest, url, lambda ok, error: (out.append((ok, error)), done.set()), relay=relay
    )
    assert done.wait(60), "the fetch thread did not finish"
    return out[0]


@pytest.fixture
def trainer(tmp_path, tiny_model_dir):
    folder = tmp_path / "trainer"
    folder.mkdir()
    server = WeightServer(folder, token=TOKEN).start()
    path, digest = nudged_weights(tiny_model_dir, folder, 1)
    yield server, path, digest
    server.stop()


def test_a_relay_serves_its_verified_copy_so_the_trainer_sends_one_and_a_dead_relay_falls_back_to_the_trainer(
    keys, tmp_path, trainer
):
    server, path, digest = trainer
    size = path.stat().st_size
    a, b, c = (_weights(keys, tmp_path / w) for w in ("a", "b", "c"))
    assert _fetch(a, 1, path, digest, server.url_of(1)) == (True, "")
    assert server.sent_bytes == size
    assert a.served(file_name(1)) == (tmp_path / "a" / file_name(1), digest) and a.served(file_name(2)) is None
    relay = WeightServer(
        tmp_path / "unused", token=TOKEN, resolve=a.served, config_keys="relay_host, relay_port"
    ).start()
    try:
        # what the relay holds: only a's verified copies, with the token
        assert httpx.head(relay.url_of(1)).status_code == 401
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert httpx.head(relay.url_of(2), headers=auth).status_code == 404
        # b downloads from the relay: the trainer's server sends nothing more
        assert _fetch(b, 1, path, digest, server.url_of(1), relay=relay.url_of(1)) == (True, "")
        assert sha256_file(tmp_path / "b" / file_name(1)) == digest
        assert server.sent_bytes == size and relay.sent_bytes == size
        assert b.stats["relay_fetches"] == 1 and b.stats["trainer_fetches"] == 0
    finally:
        relay.stop()
    # the relay is gone: c's fetch from it fails and c gets the file from the trainer, checked all the same
    assert _fetch(c, 1, path, digest, server.url_of(1), relay=relay.url_of(1)) == (True, "")
    assert sha256_file(tmp_path / "c" / file_name(1)) == digest
    assert c.stats["relay_failures"] == 1 and c.stats["trainer_fetches"] == 1 and c.stats["relay_fetches"] == 0
    assert server.sent_bytes == 2 * size


def test_a_relay_serving_other_bytes_is_refused_by_sha256_and_the_trainers_copy_is_taken(keys, tmp_path, trainer):
    """A relay whose copy changed after it was verified serves nothing (``served`` checks the file is unchanged);
    one that serves a wrong file under the right name fails the digest, and the fetch falls back."""
    server, path, digest = trainer
    a, b = _weights(keys, tmp_path / "a"), _weights(keys, tmp_path / "b")
    assert _fetch(a, 1, path, digest, server.url_of(1))[0]
    copy = tmp_path / "a" / file_name(1)
    # changed after verification
    copy.write_bytes(copy.read_bytes()[:-10] + b"0123456789")
    assert a.served(file_name(1)) is None
    # a plain server over the damaged folder
    wrong = WeightServer(tmp_path / "a", token=TOKEN).start()
    try:
        assert _fetch(b, 1, path, digest, server.url_of(1), relay=wrong.url_of(1)) == (True, "")
    finally:
        wrong.stop()
    assert sha256_file(tmp_path / "b" / file_name(1)) == digest
    assert b.stats["relay_failures"] == 1 and b.stats["trainer_fetches"] == 1


def test_control_targets_and_sources_round_trip_and_old_entries_are_for_everyone():
    cmd = control.Command(
        "fetch",
        "v3-abc",
        3,
        "/w/v000003.safetensors",
        "ab" * 32,
        url="http://t/x",
        targets=("B", "A"),
        sources={"B": "http://a:1/weights/v000003.safetensors"},
    )
    back = control.decode_entry("1-0", control.encode_command(cmd))
    assert back.targets == ("A", "B") and back.sources == cmd.sources and back.url == cmd.url
    assert back.for_worker("A") and not back.for_worker("C")
    old = {"type": "cmd", "cmd": "pause", "sync": "s1", "version": "-1", "path": "", "sha256": ""}
    decoded = control.decode_entry("2-0", old)
    assert decoded.targets == () and decoded.sources == {} and decoded.for_worker("anyone")
    assert "targets" not in control.encode_command(decoded) and "sources" not in control.encode_command(decoded)
    with pytest.raises(EventError, match="targets.*JSON list of worker ids"):
        control.decode_entry("3-0", {**old, "targets": "A,B"})
    with pytest.raises(EventError, match="sources.*worker id -> URL"):
        control.decode_entry("4-0", {**old, "sources": '["A"]'})


def test_each_wave_of_a_round_is_written_once(client, keys):
    """Commands of one kind in one round (waves, fetch levels) differ by ``part``; a retried write of the same
    part adds nothing."""
    sent = [
        control.send_command(client, keys, control.Command("pause", "s1", targets=(w,)), part=str(i))
        for i, w in enumerate(("A", "B", "A"))
    ]
    again = control.send_command(client, keys, control.Command("pause", "s1", targets=("A",)), part="0")
    assert None not in sent and again is None
    targets = [c.targets for _, c in control.read_after(client, keys, "0-0")]
    assert targets == [("A",), ("B",), ("A",)]


@pytest.mark.parametrize(
    "flags, words",
    [
        ({"sync_mode": "waves"}, "config key 'sync_mode': expected 'global', 'rolling' or 'pull', got 'waves'"),
        ({"max_loading": "0"}, "config key 'max_loading': expected an integer >= 1, got 0"),
        ({"relay_fanout": "0"}, "config key 'relay_fanout': expected an integer >= 1, got 0"),
        ({"relay_port": "-2"}, "config key 'relay_port': expected a port 1-65535, -1 (a free one) or 0 (no relay)"),
        ({"relay_port": "9000", "relay_host": "0.0.0.0"}, "config key 'relay_host': expected an address other workers"),
    ],
)
def test_bad_rolling_and_relay_keys_name_the_key(flags, words):
    from shared.runtime.config.errors import ConfigError
    from shared.runtime.config.sources import load

    with pytest.raises(ConfigError) as err:
        load(env={}, overrides=flags)
    assert words in str(err.value)
    assert load(env={}, overrides={"sync_mode": "rolling", "relay_port": "-1"}).relay_port == -1
