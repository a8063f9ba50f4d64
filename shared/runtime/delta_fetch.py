"""A version made from deltas: the chain base+1 .. version fetched from a weight server (the trainer's or a relay's),
applied to this host's own verified copy of ``base``, and checked against the published sha256 before it is kept.

``chain(url_of, base, base_path, base_sha256, version, sha256, folder)``: each delta (``shared/protocol/
weight_delta.py``) must name the previous step's sha256 as its base and the next version as its target; every step's
result is checked against its delta's sha256, the last against the published one. Only then is the file written
(``<folder>/v<NNNNNN>.safetensors``, atomic rename), and each delta kept beside it (``v<NNNNNN>.delta``: a relay
serves them to its children). Nothing is written before the whole chain checks out, so a process killed mid-chain
leaves its last verified copy as it was, and starts again from it.

``DeltaMissing``: the server has no delta for a step (a snapshot version, pruned, deltas off): download the file.
``DeltaError`` / ``weight_fetch.FetchError``: a delta that does not apply or check out, or a transfer that failed:
the caller downloads the file, with one warning.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from shared.protocol import weight_delta
from shared.runtime.faults import crash_point
from shared.runtime.weight_fetch import FetchError, origin
from shared.runtime.weight_server import delta_name, file_name


class DeltaMissing(FetchError):
    """The server has no delta for a step of the chain (404): a snapshot, or deltas are off."""


@dataclass(frozen=True)
class Chained:
    path: Path
    steps: int  # deltas applied
    downloaded: int  # delta bytes that came over the network
    bytes: int  # the resulting file's size
    fetch_s: float
    apply_s: float


def url_of(file_url: str, version: int) -> str:
    """The URL of ``version``'s delta on the server that serves ``file_url`` (a version's file there)."""
    return f"{file_url.rsplit('/', 1)[0]}/{delta_name(version)}"


def chain(file_url: str, base: int, base_path: Path, base_sha256: str, version: int, sha256: str, folder: Path,
          token: str = "", timeout: float = 60.0, trusted: set[str] | None = None,
          max_bytes: int = 0) -> Chained:
    """``version``'s file, made from ``base``'s verified copy and the deltas base+1 .. version served beside
    ``file_url``; every delta at most ``max_bytes`` (0: no limit; the file's size: a delta larger is refused)."""
    if token and trusted is not None and origin(file_url) not in trusted:
        raise FetchError(f"weights deltas v{base}->v{version} from {file_url}: not an origin the run announced; the "
                         f"weights token is not sent there")
    if not 0 < version - base:
        raise FetchError(f"weights deltas v{base}->v{version}: nothing to chain")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    current, current_sha = Path(base_path).read_bytes(), base_sha256
    fetch_s = apply_s = 0.0
    downloaded = 0
    kept: list[tuple[int, bytes]] = []
    with httpx.Client(timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)), headers=headers,
                      follow_redirects=False) as client:
        for v in range(base + 1, version + 1):
            t0 = time.monotonic()
            delta = _get(client, url_of(file_url, v), v, max_bytes)
            t1 = time.monotonic()
            fetch_s += t1 - t0
            downloaded += len(delta)
            h = weight_delta.read_header(delta, f"weights delta v{v}")
            if (h["base"], h["version"], h["base_sha256"]) != (v - 1, v, current_sha):
                raise weight_delta.DeltaError(
                    f"weights delta v{v}: made from v{h['base']} (sha256 {h['base_sha256'][:12]}...) to v{h['version']}"
                    f", expected from v{v - 1} (sha256 {current_sha[:12]}...) to v{v}")
            if v == version and h["sha256"] != sha256:
                raise weight_delta.DeltaError(f"weights delta v{v}: its target sha256 {h['sha256'][:12]}... is not the "
                                              f"published {sha256[:12]}...")
            current, current_sha = weight_delta.apply(current, delta, f"weights delta v{v}"), h["sha256"]
            apply_s += time.monotonic() - t1
            kept.append((v, delta))
            crash_point("rollout", "delta_applied")  # tests only: a worker killed mid-chain (shared/runtime/faults.py)
    folder = Path(folder)
    final = folder / file_name(version)
    _write(final, current)
    for v, delta in kept:
        _write(folder / delta_name(v), delta)
    return Chained(final, len(kept), downloaded, len(current), fetch_s, apply_s)


def _get(client: httpx.Client, url: str, version: int, max_bytes: int) -> bytes:
    try:
        r = client.get(url)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise FetchError(f"weights delta v{version} from {url}: {type(exc).__name__}: {exc}") from None
    if r.status_code == 404:
        raise DeltaMissing(f"weights delta v{version}: none at {url} (a snapshot version, or pruned)")
    if r.status_code != 200:
        raise FetchError(f"weights delta v{version} from {url}: HTTP {r.status_code} {r.reason_phrase}")
    if max_bytes and len(r.content) > max_bytes:
        raise FetchError(f"weights delta v{version} from {url}: {len(r.content)} bytes, more than the file's "
                         f"{max_bytes}")
    return r.content


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.delta-tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)
