"""Checkpoints and run files in an object store: ``--output_dir`` (and ``--resume_from_checkpoint``, ``plait
consolidate``) may be any fsspec URL (``s3://bucket/run``, ``gs://``, ``az://`` ...), the store's own configuration
applying (for S3: the AWS_* variables, AWS_ENDPOINT_URL for an S3-compatible server; for Google Cloud Storage:
gcsfs's, Application Default Credentials or GOOGLE_APPLICATION_CREDENTIALS, STORAGE_EMULATOR_HOST for an emulator).

An object store has no rename, so a checkpoint cannot appear at once as a folder does on a disk. Each rank writes its
files to a folder of its own on the local disk (``stage``), as it would into the checkpoint folder, and uploads them
to the checkpoint's prefix; rank 0 uploads the index and the model's config last of the files and then writes the
commit object ``COMMITTED``. A checkpoint without it is a save that never finished: every reader skips it ("auto"
resumes from the newest committed one) and the next run removes it. Reading copies a committed checkpoint to the
local disk first (``fetch``), where the reader checks each shard's size and each tensor's checksum as for any
checkpoint. Every call to the store is retried with exponential backoff on the errors a network gives (a refused or
dropped connection, a throttled or failed request), which s3fs surfaces as ``OSError``; an object that is not there
is an answer, not retried.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from plait.base.config import ConfigError

COMMIT = "COMMITTED"
ATTEMPTS, BACKOFF = 6, 0.2  # tries of one call to the store, and the first wait (doubled after each failure)
# schemes with an extra of plait's (the suite runs them); for the others the refusal quotes fsspec's own advice
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gs", "gcs": "gs"}
T = TypeVar("T")


def is_url(path: Any) -> bool:
    """Whether ``path`` names a location in a store (``scheme://...``) rather than on this machine's disks."""
    return isinstance(path, str) and re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", path) is not None \
        and not path.startswith("file://")


def join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *parts])


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path in it; a one-line refusal naming the package a scheme needs."""
    import fsspec

    scheme = url.split("://", 1)[0]
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as err:
        extra = EXTRAS.get(scheme)
        fix = f"; pip install 'plait[{extra}]'" if extra else ""
        raise ConfigError(f"{url}: {scheme}:// needs a package that is not installed ({err}){fix}") from None
    except ValueError as err:  # fsspec: an unknown protocol
        raise ConfigError(f"{url}: {err} (fsspec's known protocols: fsspec.available_protocols())") from None


def retried(call: Callable[[], T], what: str) -> T:
    """``call()``, tried again after 0.2, 0.4, 0.8 ... s when the store fails it (``OSError``: s3fs's errors for
    a refused or dropped connection, a 5xx or throttled request), at most ``ATTEMPTS`` times. A missing object
    (``FileNotFoundError``) or a refused permission is raised at once."""
    for attempt in range(ATTEMPTS):
        try:
            return call()
        except (FileNotFoundError, PermissionError):
            raise
        except OSError as err:
            if attempt == ATTEMPTS - 1:
                raise OSError(f"{what}: the store failed {ATTEMPTS} times, the last with {type(err).__name__}: "
                              f"{err}") from None
            time.sleep(BACKOFF * 2 ** attempt)
    raise AssertionError("unreachable")


def stage(url: str, rank: int) -> Path:
    """A folder on this machine's disk for rank ``rank``'s files of ``url`` (``PLAIT_STAGE_DIR``, default the
    temporary directory): one per rank, so ranks on several machines never share one."""
    root = Path(os.environ.get("PLAIT_STAGE_DIR") or tempfile.gettempdir()) / "plait-stage"
    return root / hashlib.sha1(url.encode()).hexdigest()[:16] / f"rank{rank}"


def upload(local: Path, url: str) -> None:
    """Copy the file ``local`` to ``url``."""
    fs, path = filesystem(url)
    retried(lambda: fs.put_file(str(local), path), f"uploading {local} to {url}")


def upload_tree(local: Path, url: str, skip: set[str] = frozenset()) -> None:
    """Copy every file under ``local`` (but the relative paths in ``skip``) to the same paths under ``url``."""
    for file in sorted(p for p in local.rglob("*") if p.is_file()):
        relative = file.relative_to(local).as_posix()
        if relative not in skip:
            upload(file, join(url, relative))


def download(url: str, local: Path) -> Path:
    """Copy the object ``url`` to the file ``local``."""
    fs, path = filesystem(url)
    local.parent.mkdir(parents=True, exist_ok=True)
    retried(lambda: fs.get_file(path, str(local)), f"downloading {url}")
    return local


def exists(url: str) -> bool:
    fs, path = filesystem(url)
    return retried(lambda: fs.exists(path), f"looking up {url}")


def commit(url: str) -> None:
    """Mark the checkpoint at ``url`` complete: its commit object, written after every other file."""
    fs, path = filesystem(url)
    retried(lambda: fs.pipe_file(join(path, COMMIT), b"complete\n"), f"committing {url}")


def remove(url: str) -> None:
    """Delete everything under ``url``, its commit object first (a reader never sees a half-deleted checkpoint as
    complete)."""
    fs, path = filesystem(url)
    if retried(lambda: fs.exists(join(path, COMMIT)), f"looking up {url}"):
        retried(lambda: fs.rm_file(join(path, COMMIT)), f"deleting {url}")
    if retried(lambda: fs.exists(path), f"looking up {url}"):
        retried(lambda: fs.rm(path, recursive=True), f"deleting {url}")
    fs.invalidate_cache()


def checkpoints(output: str, prefix: str, committed: bool = True) -> list[tuple[int, str]]:
    """(step, URL) of the ``<prefix><step>`` checkpoints under ``output`` that are committed (or, with
    ``committed`` False, that are not), oldest first."""
    fs, path = filesystem(output)
    fs.invalidate_cache()
    if not retried(lambda: fs.exists(path), f"listing {output}"):
        return []
    found = []
    for entry in retried(lambda: fs.ls(path, detail=False), f"listing {output}"):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        match = re.fullmatch(rf"{re.escape(prefix)}(\d+)", name)
        if match and retried(lambda: fs.exists(join(entry, COMMIT)), f"listing {output}") == committed:
            found.append((int(match.group(1)), join(output, name)))
    return sorted(found)


def committed(url: str) -> bool | None:
    """Whether the checkpoint at ``url`` is committed (None: nothing is there)."""
    fs, path = filesystem(url)
    fs.invalidate_cache()
    if retried(lambda: fs.exists(join(path, COMMIT)), f"looking up {url}"):
        return True
    return False if retried(lambda: fs.exists(path), f"looking up {url}") else None


def fetch(url: str, shards: str, index: str) -> Path:
    """A local copy of the committed checkpoint at ``url`` (``committed`` first) but its tensor files (``.safetensors``
    under ``shards``, which a reader fetches when it first reads one), cached in this rank's ``stage``: kept, with
    the tensor files fetched into it, until the store's index object changes."""
    fs, path = filesystem(url)
    local = stage(url, int(os.environ.get("RANK", "0"))) / "copy"
    info = retried(lambda: fs.info(join(path, shards, index)), f"looking up {url}")
    stamp = str(info.get("ETag") or info["size"])
    if (local / COMMIT).is_file() and (local / COMMIT).read_text() == stamp:
        return local
    shutil.rmtree(local, ignore_errors=True)
    for entry in retried(lambda: fs.find(path), f"listing {url}"):
        relative = entry[len(path.rstrip("/")) + 1:]
        if relative != COMMIT and not (relative.startswith(f"{shards}/") and relative.endswith(".safetensors")):
            download(join(url, relative), local / relative)
    (local / COMMIT).write_text(stamp)
    return local
