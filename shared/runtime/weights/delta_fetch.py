"""A version made from deltas: the chain base+1 .. version fetched from a weight server (the trainer's or a relay's),
applied to this host's own verified copy of ``base``, and checked against the published sha256 before it is kept.

``chain(url_of, base, base_path, base_sha256, version, sha256, folder)``: each delta (``shared/protocol/
weight_delta.py``) must name the previous step's sha256 as its base and the next version as its target, the last one
the published sha256 as its target; the chain is applied in one buffer and the result checked against the published
sha256 (a wrong step anywhere makes it differ). Only then is the file written
(``<folder>/v<NNNNNN>.safetensors``, atomic rename), and each delta kept beside it (``v<NNNNNN>.delta``: a relay
serves them to its children). Nothing is written before the whole chain checks out, so a process killed mid-chain
leaves its last verified copy as it was, and starts again from it. Workers sharing a folder take turns on a version
(the lock file ``weight_fetch.fetch`` takes): the second finds it made.

``DeltaMissing``: the server has no delta for a step (a snapshot version, pruned, deltas off): download the file.
``DeltaError`` / ``weight_fetch.FetchError``: a delta that does not apply or check out, or a transfer that failed:
the caller downloads the file, with one warning.
"""

from __future__ import annotations

import fcntl
import os
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from shared.protocol.weights import delta as weight_delta
from shared.runtime.faults import crash_point
from shared.runtime.weights.checksum import sha256_file
from shared.runtime.weights.fetch import FetchError, origin
from shared.runtime.weights.server import delta_name, file_name


class DeltaMissing(FetchError):
    """The server has no delta for a step of the chain (404): a snapshot, or deltas are off."""


@dataclass(frozen=True)
class Chained:
    path: Path
    # deltas applied
    steps: int
    # delta bytes that came over the network
    downloaded: int
    # the resulting file's size
    bytes: int
    fetch_s: float
    apply_s: float


def url_of(file_url: str, version: int) -> str:
    """The URL of ``version``'s delta on the server that serves ``file_url`` (a version's file there)."""
    return f"{file_url.rsplit('/', 1)[0]}/{delta_name(version)}"


def chain(
    file_url: str,
    base: int,
    base_path: Path,
    base_sha256: str,
    version: int,
    sha256: str,
    folder: Path,
    token: str = "",
    timeout: float = 60.0,
    trusted: set[str] | None = None,
    max_bytes: int = 0,
) -> Chained:
    """``version``'s file, made from ``base``'s verified copy and the deltas base+1 .. version served beside
    ``file_url``; every delta at most ``max_bytes`` (0: no limit; the file's size: a delta larger is refused)."""
    if token and trusted is not None and origin(file_url) not in trusted:
        raise FetchError(
            f"weights deltas v{base}->v{version} from {file_url}: not an origin the run announced; the "
            f"weights token is not sent there"
        )
    if not 0 < version - base:
        raise FetchError(f"weights deltas v{base}->v{version}: nothing to chain")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / file_name(version)
    with open(folder / f".{final.name}.lock", "w") as lock:
        # another worker on this folder making it: wait, then find it done
        fcntl.flock(lock, fcntl.LOCK_EX)
        if final.exists() and sha256_file(final) == sha256:
            return Chained(final, 0, 0, final.stat().st_size, 0.0, 0.0)
        t0 = time.monotonic()
        deltas, current_sha = [], base_sha256
        with httpx.Client(
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)), headers=headers, follow_redirects=False
        ) as client:
            for v in range(base + 1, version + 1):
                delta = _get(client, url_of(file_url, v), v, max_bytes)
                h = weight_delta.read_header(delta, f"weights delta v{v}")
                if (h["base"], h["version"], h["base_sha256"]) != (v - 1, v, current_sha):
                    raise weight_delta.DeltaError(
                        f"weights delta v{v}: made from v{h['base']} (sha256 {h['base_sha256'][:12]}...) to "
                        f"v{h['version']}, expected from v{v - 1} (sha256 {current_sha[:12]}...) to v{v}"
                    )
                deltas.append(delta)
                current_sha = h["sha256"]
        if current_sha != sha256:
            raise weight_delta.DeltaError(
                f"weights delta v{version}: its target sha256 {current_sha[:12]}... is not "
                f"the published {sha256[:12]}..."
            )
        t1 = time.monotonic()
        # tests only: a worker killed mid-chain (shared/runtime/faults.py)
        crash_point("rollout", "delta_fetched")
        result = weight_delta.apply_chain(Path(base_path).read_bytes(), deltas, "weights deltas")
        t2 = time.monotonic()
        _write(final, result)
        for v, delta in zip(range(base + 1, version + 1), deltas):
            _write(folder / delta_name(v), delta)
    return Chained(final, len(deltas), sum(map(len, deltas)), len(result), t1 - t0, t2 - t1)


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
        raise FetchError(
            f"weights delta v{version} from {url}: {len(r.content)} bytes, more than the file's {max_bytes}"
        )
    return r.content


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.delta-tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)
