"""Versions as deltas over the wire, with the real parts: the trainer's publisher (its thread, its version events
and ``publish`` metrics records in real Redis), the real weight server over loopback HTTP with the publisher's lookup
(a full file it never wrote made from the chain on demand), and a rollout worker's ``LocalWeights`` (its own folder,
weights_fetch always). Each version is a real model's bf16 weights after an AdamW step at a low learning rate (most
bf16 elements keep their bits)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.rollout.weights.local import LocalWeights
from services.trainer.publish import frozen
from services.trainer.publisher import Publisher
from shared.protocol.streams import metrics
from shared.protocol.streams import versions as pversions
from shared.runtime import logs
from shared.runtime.config.keys import Config
from shared.runtime.weights import chain
from shared.runtime.weights.checksum import sha256_file
from shared.runtime.weights.server import WeightServer, delta_name, file_name


@pytest.fixture
def published(client, keys, tiny_model_dir, tmp_path):
    """Versions 1..5 published by the real publisher, each one AdamW step (lr 1e-5) from the one before, bf16: v1 a
    full file (the first), v2..v5 deltas only; the folder served with the publisher's lookup. ``files[v]``: the path
    the version event names (made on demand) and its sha256."""
    folder = tmp_path / "trainer"
    folder.mkdir()
    cfg = Config(run=keys.run, delta_max_chain=4, max_staleness=100)
    writer = Publisher(cfg, client, keys, folder, logs.get("delta-test"))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    torch.manual_seed(0)
    for v in range(1, 6):
        ids = torch.randint(0, model.config.vocab_size, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        writer.submit(v, v, frozen(model, "bfloat16"))
    writer.wait_idle()
    files = {v.version: (folder / file_name(v.version), v.sha256) for v in pversions.read_all(client, keys)}
    assert sorted(p.name for p in folder.glob("v*")) == [file_name(1)] + [delta_name(v) for v in range(2, 6)]
    server = WeightServer(folder, resolve=writer.resolve).start()
    yield files, server
    server.stop()
    writer.close()


def _worker(tmp_path, keys, max_chain=4) -> LocalWeights:
    cfg = Config(
        run=keys.run, weights_fetch="always", rollout_weights_dir=str(tmp_path / "mine"), delta_max_chain=max_chain
    )
    return LocalWeights(cfg, logs.get("weights-test"))


def _get(w: LocalWeights, files, server, v):
    path, digest = files[v]
    return w.local(v, str(path), digest, server.url_of(v))


def test_versions_come_as_deltas_bit_identical_and_too_far_behind_as_the_file(published, tmp_path, client, keys):
    files, server = published
    records = {r["version"]: r for _, r in metrics.read(client, keys, "publish")}
    assert [records[v]["snapshot"] for v in range(1, 6)] == [True, False, False, False, False]
    assert (
        records[1]["reason"] == "first version since the trainer started"
        and not (server.directory / delta_name(1)).exists()
    )
    for v in (2, 3, 4, 5):
        r = records[v]
        assert 0 < r["changed"] < r["elements"] and r["floor_bytes"] <= r["delta_bytes"] < r["full_bytes"] / 2
    w = _worker(tmp_path, keys, max_chain=1)
    for v in (1, 2):
        assert sha256_file(_get(w, files, server, v)) == files[v][1]
    assert w.stats["delta_versions"] == 1 and w.stats["delta_bytes"] < files[1][0].stat().st_size / 2
    full_bytes = w.stats["fetched_bytes"] - w.stats["delta_bytes"]
    assert sha256_file(_get(w, files, server, 3)) == files[3][1]
    w.loaded(3)
    assert w.stats["delta_versions"] == 2 and w.stats["fetched_bytes"] - w.stats["delta_bytes"] == full_bytes
    # 3 -> 5 is longer than delta_max_chain 1: the file
    assert sha256_file(_get(w, files, server, 5)) == files[5][1]
    assert w.stats["delta_versions"] == 2 and w.stats["fetched_bytes"] - w.stats["delta_bytes"] > full_bytes
    # a relay serves its deltas
    assert w.stats["delta_fallbacks"] == 0 and w.served(delta_name(3)) is not None


def test_a_corrupt_delta_is_caught_never_loaded_and_the_file_downloaded(published, tmp_path, keys, capsys):
    files, server = published
    w = _worker(tmp_path, keys)
    _get(w, files, server, 1)
    # v2's file made (as a worker too far behind would have had it made), then its delta damaged on disk
    chain.make(server.directory, 2)
    delta = server.directory / delta_name(2)
    data = bytearray(delta.read_bytes())
    # one bit of one changed element's new value
    data[-5] ^= 0x01
    delta.write_bytes(bytes(data))
    got = _get(w, files, server, 2)
    assert sha256_file(got) == files[2][1] and got.read_bytes() == files[2][0].read_bytes()
    assert w.stats["delta_fallbacks"] == 1 and w.stats["delta_versions"] == 0
    # console lines on stdout, or JSON on stderr when an earlier test set that up
    logged = capsys.readouterr()
    assert "weights delta chain refused; downloading the full file" in logged.out + logged.err
    # a refused delta is not kept for relaying
    assert not (tmp_path / "mine" / delta_name(2)).exists()


KILLED_MID_CHAIN = """
import sys
from services.rollout.weights.local import LocalWeights
from shared.runtime import logs
from shared.runtime.config.keys import Config
from shared.runtime.weights import chain
folder, path, digest, url = sys.argv[1:]
w = LocalWeights(Config(run="t", weights_fetch="always", rollout_weights_dir=folder, delta_max_chain=4),
                 logs.get("dying"))
w.local(3, path, digest, url)
print("not killed")
"""


def test_a_worker_killed_mid_chain_resumes_from_its_last_loaded_version(published, tmp_path, keys):
    files, server = published
    w = _worker(tmp_path, keys)
    _get(w, files, server, 1)
    w.loaded(1)
    mine = tmp_path / "mine"
    # SIGKILL with the chain fetched, not applied
    env = {"FAULT_INJECT_STREAMRL_CRASH": "rollout:delta_fetched"}
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_MID_CHAIN, str(mine), str(files[3][0]), files[3][1], server.url_of(3)],
        env={**_env(), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stdout + proc.stderr
    # nothing of the chain written
    assert sorted(p.name for p in mine.glob("v*")) == [file_name(1)]
    # the worker restarted: a new process knows only its folder
    again = _worker(tmp_path, keys)
    assert sha256_file(_get(again, files, server, 3)) == files[3][1]
    assert again.stats["delta_versions"] == 1 and again.stats["delta_steps"] == 2
    assert again.stats["delta_chain_max"] == 2 and again.stats["delta_fallbacks"] == 0


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("FAULT_INJECT")}


def test_two_workers_on_one_folder_take_turns_on_a_chain(published, tmp_path, keys):
    files, server = published
    first, second = _worker(tmp_path, keys), _worker(tmp_path, keys)
    _get(first, files, server, 1)
    # found in the shared folder
    _get(second, files, server, 1)
    results = []
    threads = [
        threading.Thread(target=lambda w=w: results.append(sha256_file(_get(w, files, server, 3))))
        for w in (first, second)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [files[3][1]] * 2
    assert first.stats["delta_fallbacks"] == second.stats["delta_fallbacks"] == 0
    assert first.stats["delta_bytes"] + second.stats["delta_bytes"] > 0
    # one chain fetched, for both
    assert min(first.stats["delta_bytes"], second.stats["delta_bytes"]) == 0


def test_a_relay_forwards_the_deltas_it_applied(published, tmp_path, keys):
    files, server = published
    parent = _worker(tmp_path / "parent", keys)
    for v in (1, 2, 3):
        _get(parent, files, server, v)
    relay = WeightServer(tmp_path / "parent" / "mine", resolve=parent.served).start()
    try:
        child = _worker(tmp_path / "child", keys)
        _get(child, files, server, 1)
        path, digest = files[3]
        done = threading.Event()
        child.prefetch(3, str(path), digest, server.url_of(3), lambda ok, error: done.set(), relay=relay.url_of(3))
        # the relay first, as a sync or a pull names it
        assert done.wait(60)
        got = child.local(3, str(path), digest, server.url_of(3))
        assert sha256_file(got) == digest and child.sources[3] == "relay"
        assert child.stats["delta_steps"] == 2 and child.stats["delta_fallbacks"] == 0
        # deltas, from the relay
        assert 0 < relay.sent_bytes == child.stats["delta_bytes"] < got.stat().st_size / 2
    finally:
        relay.stop()


def test_a_worker_on_the_trainers_host_makes_a_delta_versions_file_from_the_chain_there(published, tmp_path, keys):
    """weights_fetch auto, no server: the version event's file is not in the trainer's folder (v3 was published as a
    delta), so the worker makes it there from v1's file and the deltas, checks it against the published sha256 and
    loads it; a second worker finds it made."""
    files, server = published
    path, digest = files[3]
    assert not path.exists()
    cfg = Config(run=keys.run, weights_fetch="auto", rollout_weights_dir=str(tmp_path / "mine"))
    first, second = LocalWeights(cfg, logs.get("local-a")), LocalWeights(cfg, logs.get("local-b"))
    assert first.local(3, str(path), digest) == path and sha256_file(path) == digest
    made = path.stat().st_mtime_ns
    assert second.local(3, str(path), digest) == path and path.stat().st_mtime_ns == made
    # a wrong published sha256: the made file is refused, never loaded
    with pytest.raises(ValueError, match="made from v3 and 1 deltas, its sha256 is not the published 000000000000"):
        LocalWeights(cfg, logs.get("local-c")).local(4, str(files[4][0]), "0" * 64)
