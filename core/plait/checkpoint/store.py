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

Saving a step again whose checkpoint is committed (a run resumed from an older checkpoint) must not lose the old one
before the new one is whole, as a crash between the two would on a store that cannot rename. So that save goes under
a folder of the checkpoint's own (``<checkpoint>/.save-<hex>/``, ``begin_save``), and its commit object, one
write that replaces the old one's, names that folder (``complete .save-<hex>``; ``complete`` alone: the files are
under the checkpoint itself); the old files are deleted after it. Readers see one thing, the commit object: the
checkpoint is the one it names, wherever a crash stopped (``committed_files``); what a crash leaves beside it is
deleted at the next start (``leftovers``) or commit of that step. Every checkpoint stays under its
``checkpoint-<step>`` prefix, so listing, rotating and removing checkpoints are as before.

A store that cannot be used (no bucket, no credentials, an endpoint that does not answer, credentials that may only
read) is refused where a command starts (``exists``, and ``writable`` where it will write), in one line naming the
URL, the cause and the fix, not trained against until the first save.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from plait.base.config import ConfigError

COMMIT = "COMMITTED"
SAVE_FOLDER = ".save-"  # the prefix of the folder a step saved again goes into while its old checkpoint stays
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


def transient() -> tuple[type[Exception], ...]:
    """What a store's call fails with for a moment: ``OSError`` (s3fs's errors for a refused or dropped connection,
    a 5xx or throttled request) and botocore's connection errors, which s3fs passes on as they are (an endpoint
    out of reach for a moment ended a run at its next save, untried again)."""
    try:
        from botocore.exceptions import ConnectionError as EndpointError, HTTPClientError  # noqa: PLC0415
    except ImportError:  # no S3 package: its errors cannot happen
        return (OSError,)
    return (OSError, EndpointError, HTTPClientError)


def retried(call: Callable[[], T], what: str) -> T:
    """``call()``, tried again after 0.2, 0.4, 0.8 ... s when the store fails it for a moment (``transient``), at
    most ``ATTEMPTS`` times. A missing object (``FileNotFoundError``) or a refused permission is raised at once."""
    for attempt in range(ATTEMPTS):
        try:
            return call()
        except (FileNotFoundError, PermissionError):
            raise
        except transient() as err:
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


def exists(url: str, what: str = "") -> bool:
    """Whether anything is at ``url``, asked where a command starts (``--output_dir``, ``plait consolidate``'s output,
    a run's metrics), so a store that cannot be used there is refused (ConfigError) in one line naming ``what``
    (the flag the URL came from) and the URL, the cause and the fix, before any work: no credentials, an endpoint
    that does not answer, a refused access, and where nothing is at ``url`` a bucket that does not exist (s3fs and
    gcsfs answer False for any path in it). One try: the store's client retries a failed request itself, and a
    store that does not answer is refused at once rather than after ``ATTEMPTS`` more rounds of those (5 s each
    for s3fs, 35 s for gcsfs). Writing is ``writable``'s."""
    fs, path = filesystem(url)
    named = f"{what} {url}" if what else url
    try:
        if fs.exists(path):
            return True
        bucket = fs.split_path(path)[0] if hasattr(fs, "split_path") else ""  # s3fs, gcsfs, adlfs: buckets
        if bucket and not _bucket_seen(fs, bucket):
            raise ConfigError(f"{named} cannot be used: its bucket {bucket!r} does not exist; "
                              f"{_fixes(url, bucket)['bucket']}")
    except ConfigError:
        raise
    except Exception as err:  # whatever the store's client raises (botocore's are no OSError): said as a refusal
        raise ConfigError(f"{named} cannot be used: {_cause(url, err)}") from None
    return False


def writable(url: str, what: str) -> None:
    """Refuse (ConfigError, one line naming ``what`` and ``url``, the cause and the fix) a store location this
    process cannot write to: read-only credentials, a bucket policy that allows reads only. A look-up (``exists``)
    passes there, and the refusal would otherwise come at the first save, after the training it was to keep. An
    empty object is written under ``url`` and deleted again (an object store has no folder to leave behind); one
    try, as for the look-up."""
    fs, path = filesystem(url)
    probe = join(path, f".plait-write-check-{uuid.uuid4().hex[:16]}")
    try:
        fs.pipe_file(probe, b"")
        fs.rm_file(probe)
    except Exception as err:  # whatever the store's client raises (botocore's are no OSError): said as a refusal
        raise ConfigError(f"{what} {url} cannot be used: {_cause(url, err, 'writing')}") from None


def _bucket_seen(fs: Any, bucket: str) -> bool:
    """Whether ``bucket`` is there: False only for the store's "no such bucket". A refused look at the bucket itself
    is taken as there: a user may hold rights on a prefix only, which the look-up of the path already used."""
    try:
        fs.info(bucket)
    except FileNotFoundError:
        return False
    except PermissionError:
        pass
    return True


def _fixes(url: str, bucket: str = "") -> dict[str, str]:
    """What the user does about each way a store cannot be used, in the words of the store's own tools."""
    scheme = EXTRAS.get(url.split("://", 1)[0])
    if scheme == "s3":
        return {"bucket": f"create it (aws s3 mb s3://{bucket}) or give a URL in an existing bucket",
                "credentials": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)",
                "endpoint": "check AWS_ENDPOINT_URL and the network",
                "access": "check the credentials and the bucket's policy"}
    if scheme == "gs":
        return {"bucket": f"create it (gcloud storage buckets create gs://{bucket}) or give a URL in an existing "
                          f"bucket",
                "credentials": "set GOOGLE_APPLICATION_CREDENTIALS or run gcloud auth application-default login",
                "endpoint": "check STORAGE_EMULATOR_HOST (for an emulator) and the network",
                "access": "check the credentials and the bucket's IAM permissions"}
    return {"bucket": "create it or give a URL in an existing bucket",
            "credentials": "give the store's credentials (its environment variables or configuration)",
            "endpoint": "check the store's endpoint and the network", "access": "check the credentials"}


def _cause(url: str, err: Exception, doing: str = "a look-up") -> str:
    """Why the store's client failed ``doing`` (a look-up, writing), and the fix. Told apart by the error's classes, whose modules differ
    by store (botocore's NoCredentialsError and EndpointConnectionError, aiohttp's ClientConnectorError, google-auth's
    DefaultCredentialsError): their names say credentials or connection."""
    first = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    said = f"{type(err).__name__}: {first}" if first else type(err).__name__
    names = [cls.__name__ for cls in type(err).__mro__]
    fixes = _fixes(url)
    if any("Credential" in name for name in names):
        return f"no credentials for the store ({said}); {fixes['credentials']}"
    if isinstance(err, PermissionError):
        return f"{'writing' if doing == 'writing' else 'access'} was refused ({said}); {fixes['access']}"
    if isinstance(err, ConnectionError) or any("Connect" in name for name in names):
        return f"its endpoint cannot be reached ({said}); {fixes['endpoint']}"
    return f"{doing} failed ({said}); {fixes['endpoint']}, and {fixes['access']}"


def begin_save(url: str) -> str:
    """Where a new save of the checkpoint at ``url`` puts its files (rank 0, before any rank uploads): ``url`` when
    nothing committed is there (an unfinished save is deleted first), else a new folder in it, so that the committed
    checkpoint stays whole until ``commit`` replaces it."""
    fs, path = filesystem(url)
    fs.invalidate_cache()
    if not retried(lambda: fs.exists(join(path, COMMIT)), f"looking up {url}"):
        remove(url)
        return url
    return join(url, f"{SAVE_FOLDER}{uuid.uuid4().hex[:16]}")


def commit(url: str, files: str) -> None:
    """Make the save whose files are at ``files`` (``begin_save``) the checkpoint at ``url``: its commit object, written
    after every other file in one write that replaces an older one's; then the older checkpoint's files go."""
    fs, path = filesystem(url)
    folder = files[len(url) + 1:]
    text = f"complete {folder}\n" if folder else "complete\n"
    retried(lambda: fs.pipe_file(join(path, COMMIT), text.encode()), f"committing {url}")
    if folder:
        try:
            for leftover in leftovers(url):
                remove(leftover)
        except OSError:  # the save is committed: what this leaves, readers skip and the next start removes
            pass


def committed_files(url: str) -> str:
    """The URL of the committed checkpoint ``url``'s files: the one its commit object names (``begin_save``)."""
    fs, path = filesystem(url)
    text = retried(lambda: fs.cat_file(join(path, COMMIT)), f"reading {join(url, COMMIT)}").decode(errors="replace")
    words = text.split()
    if words == ["complete"]:
        return url
    if len(words) == 2 and words[0] == "complete" and re.fullmatch(rf"{re.escape(SAVE_FOLDER)}[0-9a-f]+", words[1]):
        return join(url, words[1])
    raise ConfigError(f"{join(url, COMMIT)} holds {text.strip()[:80]!r}, not 'complete [{SAVE_FOLDER}<hex>]'; the "
                      f"checkpoint is damaged")


def leftovers(url: str) -> list[str]:
    """What is under the committed checkpoint ``url`` but not its own (``committed_files``): saves of its step that
    never finished (``.save-<hex>`` folders) and, once a later save is committed, files of the one it replaced."""
    fs, path = filesystem(url)
    fs.invalidate_cache()
    own = committed_files(url)
    found = []
    for entry in retried(lambda: fs.ls(path, detail=False), f"listing {url}"):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if name != COMMIT and join(url, name) != own and (own != url or name.startswith(SAVE_FOLDER)):
            found.append(join(url, name))
    return found


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


# What changes when an object is written again, as the stores name it: GCS's generation (new at every write), S3's
# VersionId (None in an unversioned bucket) and ETag (the content's MD5 for a single-part upload), gcsfs's lower-case
# etag and md5Hash, the time of the write; with the size, which alone misses an index rewritten at the same length.
VERSION_KEYS = ("generation", "VersionId", "ETag", "etag", "md5Hash", "LastModified", "updated", "mtime")


def version(info: dict[str, Any]) -> str:
    """The version marker of an object from its ``fs.info``: every key of ``VERSION_KEYS`` the store gives, and the
    size."""
    return " ".join([f"{key}={info[key]}" for key in VERSION_KEYS if info.get(key) not in (None, "")]
                    + [f"size={info.get('size')}"])


def fetch(url: str, shards: str, index: str) -> tuple[Path, str]:
    """A local copy of the committed checkpoint at ``url`` (``committed`` first) but its tensor files (``.safetensors``
    under ``shards``, which a reader fetches when it first reads one), cached in this rank's ``stage``: kept, with
    the tensor files fetched into it, while the commit object names the same files and the index object's
    ``version`` is the same. Returns the copy and the URL of the files it copies (``committed_files``)."""
    root = committed_files(url)
    fs, path = filesystem(root)
    path = path.rstrip("/")
    local = stage(url, int(os.environ.get("RANK", "0"))) / "copy"
    info = retried(lambda: fs.info(join(path, shards, index)), f"looking up {url}")
    stamp = f"{root} {version(info)}"
    if (local / COMMIT).is_file() and (local / COMMIT).read_text() == stamp:
        return local, root
    shutil.rmtree(local, ignore_errors=True)
    for entry in retried(lambda: fs.find(path), f"listing {url}"):
        relative = entry[len(path) + 1:]
        if relative == COMMIT or relative.startswith(SAVE_FOLDER):  # another save's files (leftovers)
            continue
        if not (relative.startswith(f"{shards}/") and relative.endswith(".safetensors")):
            download(join(root, relative), local / relative)
    (local / COMMIT).write_text(stamp)
    return local, root
