"""The fetch client: one published version's file, from a weight server (``shared/runtime/weights/server.py``) into a
folder of this host's own, checked by sha256.

``fetch(url, version, sha256, folder)``: the file goes to ``<folder>/.<name>.<sha256[:16]>.part``, is hashed while
it arrives, and is renamed to ``<folder>/v<NNNNNN>.safetensors`` only once its digest is the published one. A cut
transfer is resumed with ``Range: bytes=<have>-`` and ``If-Range: "<sha256>"`` (a server with other content answers
200 and the file starts over), by the next attempt in this call or by a later call (a worker that died mid-download).
Processes that share the folder take turns on a file (a lock file per version): the second one finds the file done.
Every failure is one ``FetchError`` line naming the version, the URL and what was expected.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from shared.runtime.weights.checksum import sha256_file
from shared.runtime.weights.server import DELTA, NAME, etag, file_name

# transfers per fetch: the first, then resumes of a cut one
ATTEMPTS = 3
CHUNK = 1 << 20
# a long download logs how far it got this often
PROGRESS_S = 5.0


def origin(url: str) -> str:
    """``scheme://host:port`` of ``url`` (the default port filled in), '' when it has none."""
    try:
        parts = urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower())
    except ValueError:
        return ""
    if not parts.hostname or not port:
        return ""
    return f"{parts.scheme.lower()}://{parts.hostname.lower()}:{port}"


class FetchError(ValueError):
    """A version that could not be had: the message names the version, the URL and what was expected."""


@dataclass(frozen=True)
class Fetched:
    path: Path
    # the file's size
    bytes: int
    # bytes that came over the network in this call (0: the file was already here)
    downloaded: int
    # bytes of a partial file a first request of this call resumed from (0: none)
    resumed_from: int
    # HTTP requests made
    requests: int
    seconds: float
    # it came from a relay (another worker), not from the trainer
    relayed: bool = False


def fetch(
    url: str,
    version: int,
    sha256: str,
    folder: str | Path,
    token: str = "",
    timeout: float = 60.0,
    log=None,
    attempts: int = ATTEMPTS,
    relayed: bool = False,
    trusted: set[str] | None = None,
) -> Fetched:
    """Version ``version``'s file from ``url``, verified against ``sha256``, at ``folder/v<NNNNNN>.safetensors``.
    ``trusted``: the origins the token may be sent to (weight_origins.announced); a URL elsewhere is refused
    before any request (None: no check, for callers that name the server themselves)."""
    if token and trusted is not None and origin(url) not in trusted:
        raise FetchError(
            f"weights v{version} from {url}: not an origin the run announced (the trainer's "
            f"weights_url, a version event's url, a live relay's heartbeat: {', '.join(sorted(trusted))}"
            f"); the weights token is not sent there"
        )
    if not url:
        raise FetchError(
            f"weights v{version}: no url to fetch it from (the version event has none: the trainer "
            f"serves weights only with weights_port > 0)"
        )
    if not sha256:
        raise FetchError(f"weights v{version} from {url}: the version event has no sha256 to check it against")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / file_name(version)
    t0 = time.monotonic()
    with open(folder / f".{final.name}.lock", "w") as lock:
        # another process on this folder fetching it: wait, then find it done
        fcntl.flock(lock, fcntl.LOCK_EX)
        if final.exists():
            if sha256_file(final) == sha256:
                return Fetched(final, final.stat().st_size, 0, 0, 0, time.monotonic() - t0, relayed)
            # left by an older run, or damaged: fetch it again
            final.unlink()
        part = folder / f".{final.name}.{sha256[:16]}.part"
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        state = _Transfer(url, version, sha256, part, log)
        try:
            # no redirects: the token goes to the announced origin and nowhere else
            with httpx.Client(
                timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)), headers=headers, follow_redirects=False
            ) as client:
                _download(client, state, attempts)
                if state.hash.hexdigest() != sha256 and state.resumed_from > 0:
                    # the partial file it went on from was bad: once more, from the first byte
                    state.restart()
                    _download(client, state, attempts)
        # not a cut (those are retried): a bad URL, redirects...
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise state.fail(f"{type(exc).__name__}: {exc}") from None
        digest = state.hash.hexdigest()
        if digest != sha256:
            part.unlink(missing_ok=True)
            raise FetchError(
                f"weights v{version} from {url}: sha256 {digest[:12]}... does not match the published "
                f"{sha256[:12]}... (corrupt or truncated file); discarded"
            )
        os.replace(part, final)
        return Fetched(
            final, state.have, state.downloaded, state.resumed_from, state.requests, time.monotonic() - t0, relayed
        )


def _download(client: httpx.Client, state: "_Transfer", attempts: int) -> None:
    for attempt in range(1, attempts + 1):
        try:
            return state.get(client)
        # cut, reset, timed out: resume from what we have
        except (httpx.TransportError, _Incomplete) as exc:
            if attempt == attempts:
                raise state.fail(
                    f"transfer failed {attempts} times, last: {exc or type(exc).__name__} "
                    f"({state.have} of {state.size or '?'} bytes)"
                ) from None
            if state.log is not None:
                state.log.warning(
                    "weights download cut; resuming",
                    version=state.version,
                    url=state.url,
                    have=state.have,
                    error=str(exc) or type(exc).__name__,
                )


class _Incomplete(Exception):
    """The body ended before Content-Length said it would (a cut the HTTP client let through)."""


class _Transfer:
    """One file's download into its .part file, resumable across requests."""

    def __init__(self, url: str, version: int, sha256: str, part: Path, log):
        self.url, self.version, self.sha256, self.part, self.log = url, version, sha256, part, log
        self.hash, self.have, self.size = hashlib.sha256(), 0, 0
        self.downloaded = self.requests = 0
        self.resumed_from = -1
        # a partial file from an earlier call: hash what is there and ask for the rest
        if part.exists():
            with open(part, "rb") as fh:
                for block in iter(lambda: fh.read(CHUNK), b""):
                    self.hash.update(block)
                    self.have += len(block)

    def fail(self, what: str) -> FetchError:
        return FetchError(
            f"weights v{self.version} from {self.url}: {what} (expected the file with sha256 {self.sha256[:12]}...)"
        )

    def get(self, client: httpx.Client) -> None:
        headers = {"Range": f"bytes={self.have}-", "If-Range": etag(self.sha256)} if self.have else {}
        if self.resumed_from < 0:
            self.resumed_from = self.have
        self.requests += 1
        with client.stream("GET", self.url, headers=headers) as r:
            # the partial file is as long as the file or longer: start over
            if r.status_code == 416:
                self.restart()
                raise _Incomplete("range not satisfiable; starting over")
            if r.status_code not in (200, 206):
                text = r.read().decode(errors="replace").strip()[:200]
                raise self.fail(f"HTTP {r.status_code} {r.reason_phrase}" + (f" ({text})" if text else ""))
            served = r.headers.get("etag", "")
            if served and served != etag(self.sha256):
                raise self.fail(
                    f"the server has another file under that name (ETag {served[:20]}...): not the "
                    f"published version, or pruned and written again"
                )
            # the server sent the whole file: the partial one is worth nothing
            if r.status_code == 200 and self.have:
                self.restart()
            if r.status_code == 206 and not r.headers.get("content-range", "").startswith(f"bytes {self.have}-"):
                raise self.fail(f"asked for bytes {self.have}- and got {r.headers.get('content-range')!r}")
            length = int(r.headers.get("content-length", "-1"))
            self.size = self.have + length if length >= 0 else 0
            got, next_log = 0, time.monotonic() + PROGRESS_S
            with open(self.part, "ab") as out:
                # as it arrives: a cut loses nothing already received
                for block in r.iter_raw():
                    out.write(block)
                    self.hash.update(block)
                    got += len(block)
                    self.have += len(block)
                    self.downloaded += len(block)
                    if self.log is not None and time.monotonic() >= next_log:
                        next_log = time.monotonic() + PROGRESS_S
                        self.log.info(
                            "downloading weights",
                            version=self.version,
                            have_mb=round(self.have / 1e6, 1),
                            of_mb=round(self.size / 1e6, 1) if self.size else None,
                        )
            if length >= 0 and got < length:
                raise _Incomplete(f"body ended after {got} of {length} bytes")

    def restart(self) -> None:
        self.part.unlink(missing_ok=True)
        self.hash, self.have = hashlib.sha256(), 0


def kept_versions(folder: str | Path) -> list[int]:
    """Version numbers of the files in ``folder``, oldest first."""
    return sorted(int(p.name[1:].split(".")[0]) for p in Path(folder).glob("v*.safetensors") if NAME.fullmatch(p.name))


def prune(folder: str | Path, keep: int, loaded: int) -> list[int]:
    """Keep ``loaded``, any newer version (fetched, not loaded yet) and the newest ``keep - 1`` older ones in
    ``folder``; delete the rest, and the deltas of versions up to the oldest kept. The versions deleted."""
    gone = []
    older = [v for v in kept_versions(folder) if v < loaded]
    for v in older[: max(0, len(older) - (keep - 1))]:
        name = file_name(v)
        # the file, its lock, a cut .part
        for path in [Path(folder) / name, *Path(folder).glob(f".{name}.*")]:
            path.unlink(missing_ok=True)
        gone.append(v)
    oldest = min(kept_versions(folder), default=None)
    # deltas kept for relaying: those a chain from a kept file can use
    for path in Path(folder).glob("v*.delta"):
        if oldest is None or DELTA.fullmatch(path.name) and int(path.name[1:].split(".")[0]) <= oldest:
            path.unlink(missing_ok=True)
    return gone
