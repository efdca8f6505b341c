"""`silod trace fetch NAME`: download a public trace silod may not ship (traces/public.py) from
its repository at the pinned commit, and keep it only if every file's SHA-256 is the pinned one.

Nothing is written to the destination until every file has arrived and matched: files are
downloaded into a temporary folder beside it and moved into place at the end, so a failed or
tampered download leaves the destination as it was.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from estimator.errors import RuntimeFailure, UserError
from traces.public import FETCHABLE, PublicTrace, default_fetch_dir

_CHUNK = 1 << 16


def resolve(name: str) -> PublicTrace:
    if name not in FETCHABLE:
        from estimator.errors import did_you_mean

        raise UserError(f"unknown trace {name!r}{did_you_mean(name, FETCHABLE)}; `silod trace fetch` knows: "
                        f"{', '.join(FETCHABLE)} (Gavel's msr traces ship with silod in traces/gavel-msr)")
    return FETCHABLE[name]


def fetch_trace(name: str, dest: Path | None = None, *, force: bool = False, base_url: str | None = None,
                timeout_s: float = 30.0, progress: Callable[[str], None] = lambda _: None) -> Path:
    """Download trace `name` into `dest` (default: traces.public.default_fetch_dir); returns it.

    UserError (exit 2): unknown name, or a file of the trace already in `dest` without `force`.
    RuntimeFailure (exit 1): the server cannot be reached or answers with an error, or a file's
    size or SHA-256 is not the pinned one (nothing is written then)."""
    import httpx

    trace = resolve(name)
    dest = default_fetch_dir(trace.name) if dest is None else Path(dest)
    present = [f.name for f in trace.files if (dest / f.name).exists()]
    if present and not force:
        raise UserError(f"{dest} already holds {', '.join(present)}; pass --force to download and replace them, "
                        f"or --dest DIR for another folder")
    if dest.exists() and not dest.is_dir():
        raise UserError(f"--dest {dest} is a file, not a folder; pass a folder")
    created = not dest.exists()
    dest.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{trace.name}-", dir=dest))
    try:
        with httpx.Client(timeout=timeout_s, follow_redirects=True) as client:
            for f in trace.files:
                url = trace.url(f, base_url)
                progress(f"fetching {url}")
                digest, size = hashlib.sha256(), 0
                try:
                    with client.stream("GET", url) as r, (staging / f.name).open("wb") as out:
                        if r.status_code != 200:
                            raise RuntimeFailure(f"{url} answered HTTP {r.status_code}; {_by_hand(trace)}")
                        for chunk in r.iter_bytes(_CHUNK):
                            size += len(chunk)
                            if size > f.size:  # the pinned size is also a cap: a server cannot fill the disk
                                raise RuntimeFailure(f"{url} sent more than the pinned {f.size:,} bytes of {f.name}; "
                                                     f"it is not the file at commit {trace.commit[:12]}; nothing was written")
                            digest.update(chunk)
                            out.write(chunk)
                except httpx.HTTPError as exc:
                    raise RuntimeFailure(f"could not download {url}: {exc.__class__.__name__}: {exc or 'no answer'}; "
                                         f"check the network, or {_by_hand(trace)}") from None
                if size != f.size or digest.hexdigest() != f.sha256:
                    raise RuntimeFailure(
                        f"{f.name} from {url} is {size:,} bytes with SHA-256 {digest.hexdigest()}; the file at commit "
                        f"{trace.commit[:12]} is {f.size:,} bytes with SHA-256 {f.sha256}. Nothing was written to {dest}")
        for f in trace.files:
            (staging / f.name).replace(dest / f.name)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if created:
            shutil.rmtree(dest, ignore_errors=True)  # only what this call made
        raise
    shutil.rmtree(staging, ignore_errors=True)
    return dest


def _by_hand(trace: PublicTrace) -> str:
    return (f"download {', '.join(f.name for f in trace.files)} from {trace.repository}/tree/{trace.commit}/{trace.folder} "
            f"yourself and pass their folder as --trace")


__all__ = ["fetch_trace", "resolve"]
