"""Issue 47, point 1: checkpoints and run files in an object store (plait.checkpoint.store), against a real S3 server
that the tests start on loopback (moto's server mode) and reach through s3fs, configured as a user would: the AWS_*
variables and AWS_ENDPOINT_URL.

A 2-rank run at tp=2 saves to s3://, another resumes it with 'auto' from the store, each rank uploading its own files
and rank 0 committing; the losses equal one process's, and the store holds the run's metrics and loss curve. A
checkpoint without its commit object (a save that never finished) is skipped by 'auto', refused when named, and
removed by the next run; a damaged object is found by its checksum on read, named by its URL; `plait consolidate` reads
from and writes to the store, fetching only the tensor files it reads, and given the run's URL names its checkpoints.
Behind a proxy that fails a share of the requests (HTTP 503) the same run completes with the same losses.

A store that cannot be used (no bucket, no credentials, no endpoint, credentials that may only read: a proxy refusing
writes as S3 does) is refused in one line before the run or consolidation starts (exit 2), and a crash while a step is saved again leaves that step's committed checkpoint whole: a one-process run
resumes the 2-rank run's checkpoint-2 and is killed while re-saving step 4, the next such run saves it again.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from plait.base.config import ConfigError
from plait.checkpoint import store as object_store
from plait.checkpoint.format import CheckpointError, latest_checkpoint, read_index, remove_partial_checkpoints
from plait.checkpoint.load import CheckpointReader
from plait.checkpoint.st_io import CHECKSUM
from plait.cli import main
from plait.run.metrics import read_metrics
from plait.run.train_args import TrainArgs
from plait.testing import launch
from plait.testing.launcher import free_port, run_command
from tiny_models import tiny_config

BUCKET = "plait"


@pytest.fixture(scope="module")
def server():
    """moto's S3 server on a free loopback port; yields its address."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    try:
        yield "http://{}:{}".format(*moto.get_host_and_port())
    finally:
        moto.stop()


@pytest.fixture(scope="module")
def s3(server, tmp_path_factory):
    """The environment a user sets for an S3-compatible store, pointing at the server; a bucket in it."""
    import s3fs

    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": server, "PLAIT_STAGE_DIR": str(tmp_path_factory.mktemp("stage"))}
    with pytest.MonkeyPatch.context() as patch:  # the environment as it was, after the module
        for key, value in env.items():
            patch.setenv(key, value)
        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem().mkdir(BUCKET)
        try:
            yield f"s3://{BUCKET}"
        finally:
            s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(tiny_config("llama", vocab_size=300).to_json_string())
    return str(path)


def flags(model_config: str, out: str, *extra: str) -> list[str]:
    return ["--model_config", model_config, "--output_dir", out, "--max_steps", "4", "--block_size", "16",
            "--per_device_train_batch_size", "4", "--save_steps", "2", "--lr_scheduler_type", "constant", *extra]


def store_metrics(url: str, tmp_path: Path) -> list[dict]:
    local = object_store.download(object_store.join(url, "metrics.jsonl"), tmp_path / "metrics.jsonl")
    return read_metrics(local.parent)


def objects(url: str) -> list[str]:
    fs, path = object_store.filesystem(url)
    fs.invalidate_cache()
    return sorted(entry[len(path) + 1:] for entry in fs.find(path))


@pytest.fixture(scope="module")
def one_process(model_config, tmp_path_factory):
    out = tmp_path_factory.mktemp("local")
    main(["train", *flags(model_config, str(out))])
    return read_metrics(out)


@pytest.fixture(scope="module")
def run_url(s3, model_config):
    """2 steps at tp=2 saved to the store, then 'auto' resumes them from it for 2 more."""
    url = f"{s3}/run"
    first = flags(model_config, url, "--tensor_parallel_size", "2")
    first[first.index("--max_steps") + 1] = "2"
    launch(["-m", "plait", "train", *first], 2, timeout=240)
    launch(["-m", "plait", "train", *flags(model_config, url, "--tensor_parallel_size", "2",
                                            "--resume_from_checkpoint", "auto")], 2, timeout=240)
    return url


def test_a_run_saves_to_the_store_and_resumes_from_it(run_url, one_process, tmp_path):
    records = store_metrics(run_url, tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # the resumed run appended to the store's metrics
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in one_process], rel=1e-5)
    found = objects(run_url)
    for step in (2, 4):
        assert {f"checkpoint-{step}/{name}" for name in (
            "COMMITTED", "config.json", "shards/index.json", "shards/model-rank00000.safetensors",
            "shards/model-rank00001.safetensors")} <= set(found), found
    assert {"metrics.jsonl", "loss.png"} <= set(found)
    assert latest_checkpoint(run_url) == f"{run_url}/checkpoint-4"


def test_an_uncommitted_checkpoint_is_skipped_refused_and_removed(run_url):
    fs, path = object_store.filesystem(run_url)
    fs.copy(f"{path}/checkpoint-4", f"{path}/checkpoint-6", recursive=True)
    fs.rm_file(f"{path}/checkpoint-6/{object_store.COMMIT}")
    fs.invalidate_cache()
    assert latest_checkpoint(run_url) == f"{run_url}/checkpoint-4"  # what 'auto' resumes
    with pytest.raises(CheckpointError, match="checkpoint-6 has no commit object: its save never finished$"):
        read_index(f"{run_url}/checkpoint-6")
    assert remove_partial_checkpoints(run_url) == [f"{run_url}/checkpoint-6"]
    assert not any(name.startswith("checkpoint-6") for name in objects(run_url))


def test_a_run_url_given_as_a_checkpoint_names_its_checkpoints(run_url, tmp_path, capsys):
    with pytest.raises(SystemExit) as end:
        main(["consolidate", run_url, str(tmp_path / "out")])
    assert end.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"plait: error: {run_url} is not a plait checkpoint (no COMMITTED object); it holds checkpoints "
        f"['checkpoint-2', 'checkpoint-4'], pass one of them")
    with pytest.raises(SystemExit) as end:  # consolidate's own refusals name the URL too, not the local copy
        main(["consolidate", f"{run_url}/checkpoint-4", str(tmp_path / "out"), "--lora", "adapter"])
    assert capsys.readouterr().err.strip() == (
        f"plait: error: {run_url}/checkpoint-4 is a full checkpoint, not a LoRA one; consolidate it without --lora")


def test_consolidate_reads_and_writes_the_store(run_url, tmp_path, capsys, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("PLAIT_STAGE_DIR", str(tmp_path / "stage"))  # a local copy of its own, to look into
    main(["consolidate", f"{run_url}/checkpoint-4", str(tmp_path / "local")])
    fetched = sorted(p.name for p in (tmp_path / "stage").rglob("*.safetensors") if "copy" in p.parts)
    assert fetched == ["model-rank00000.safetensors", "model-rank00001.safetensors"]  # the optimizer's not read
    main(["consolidate", f"{run_url}/checkpoint-4", f"{run_url}/hf"])
    fs, path = object_store.filesystem(run_url)
    fs.get(f"{path}/hf", str(tmp_path / "copy"), recursive=True)
    local = AutoModelForCausalLM.from_pretrained(tmp_path / "local")
    copy = AutoModelForCausalLM.from_pretrained(tmp_path / "copy")
    for (name, a), (_, b) in zip(local.state_dict().items(), copy.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(SystemExit):
        main(["consolidate", f"{run_url}/checkpoint-4", f"{run_url}/hf"])
    assert capsys.readouterr().err.strip().endswith(f"output directory {run_url}/hf exists; choose a new one")
    with pytest.raises(SystemExit) as end:  # refused before any weight is read
        main(["consolidate", f"{run_url}/checkpoint-4", "s3://nobucket/hf"])
    assert end.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "plait: error: output directory s3://nobucket/hf cannot be used: its bucket 'nobucket' does not exist; create it "
        "(aws s3 mb s3://nobucket) or give a URL in an existing bucket")
    assert not (object_store.stage("s3://nobucket/hf", 0) / "consolidated").exists()


def test_generate_reads_a_checkpoint_in_the_store(run_url, tmp_path, monkeypatch):
    """``plait generate --model_name_or_path URL`` on a machine without a local copy fetches the tensor files it
    reads (it read the local copy, which held only the index: 'checkpoint shard .../model-rank00000.safetensors is
    missing'), and completes as from the same checkpoint on a disk."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "to be or"}\n')
    fs, path = object_store.filesystem(run_url)
    fs.get(f"{path}/checkpoint-4", str(tmp_path / "local"), recursive=True)
    outputs = {}
    for name, model in (("disk", str(tmp_path / "local")), ("store", f"{run_url}/checkpoint-4")):
        monkeypatch.setenv("PLAIT_STAGE_DIR", str(tmp_path / f"stage-{name}"))  # no local copy from before
        main(["generate", "--model_name_or_path", model, "--prompts", str(prompts), "--output",
              str(tmp_path / f"{name}.jsonl"), "--max_new_tokens", "4"])
        outputs[name] = (tmp_path / f"{name}.jsonl").read_text()
    assert outputs["store"] == outputs["disk"] and '"completion"' in outputs["disk"]


def test_a_lora_export_is_written_to_the_store(s3, model_config, tmp_path, monkeypatch, capsys):
    """``consolidate --lora adapter`` to a URL uploads the peft directory (it wrote a local folder named "s3:")."""
    monkeypatch.chdir(tmp_path)
    main(["train", *flags(model_config, str(tmp_path / "run"), "--lora_r", "4", "--max_steps", "2")])
    capsys.readouterr()
    main(["consolidate", str(tmp_path / "run" / "checkpoint-2"), f"{s3}/adapter", "--lora", "adapter"])
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(objects(f"{s3}/adapter"))
    assert not (tmp_path / "s3:").exists()
    assert f"wrote {s3}/adapter: load it with peft.PeftModel.from_pretrained(base, '{s3}/adapter') on a local copy" \
        in capsys.readouterr().out


def test_a_moment_without_the_endpoint_is_tried_again(monkeypatch):
    """botocore's connection errors, which s3fs passes on as they are, are tried again as its OSErrors are (an
    endpoint out of reach for a moment ended the run at its next save)."""
    from botocore.exceptions import EndpointConnectionError

    monkeypatch.setattr(object_store, "BACKOFF", 0.0)
    failures = [EndpointConnectionError(endpoint_url="http://127.0.0.1:1") for _ in range(2)]

    def flaky() -> str:
        if failures:
            raise failures.pop()
        return "read"

    assert object_store.retried(flaky, "reading x") == "read"

    def down() -> str:
        raise EndpointConnectionError(endpoint_url="http://127.0.0.1:1")

    with pytest.raises(OSError, match="^reading x: the store failed 6 times, the last with EndpointConnectionError"):
        object_store.retried(down, "reading x")


def test_a_damaged_object_is_found_by_its_checksum(run_url, tmp_path, monkeypatch, capsys):
    fs, path = object_store.filesystem(run_url)
    fs.copy(f"{path}/checkpoint-4", f"{path}/damaged", recursive=True)
    shard = f"{path}/damaged/shards/model-rank00001.safetensors"
    data = bytearray(fs.cat_file(shard))
    data[-3] ^= 0xFF  # a flipped byte in the last tensor's data: same size, header intact
    fs.pipe_file(shard, bytes(data))
    monkeypatch.setenv("PLAIT_STAGE_DIR", str(tmp_path / "fresh"))  # no local copy from before
    with pytest.raises(SystemExit):
        main(["consolidate", f"{run_url}/damaged", str(tmp_path / "out")])
    assert f"checkpoint shard {run_url}/damaged/shards/model-rank00001.safetensors: tensor 'lm_head.weight' is " \
        f"corrupted (xxh3_64 checksum" in capsys.readouterr().err  # the store's object, not its local copy


def test_a_diverged_run_leaves_its_record_and_curve_in_the_store(s3, model_config, tmp_path, monkeypatch, capsys):
    """The run's files reach the store when it ends by a divergence too (they were uploaded only at saves and at the
    last step: the store's metrics.jsonl lacked the step that stopped the run, and loss.png was missing)."""
    url = f"{s3}/diverged"
    monkeypatch.setenv("PLAIT_FAULT_INJECT", "0:3:nan")
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *flags(model_config, url)])
    assert exit_info.value.code == 3
    records = store_metrics(url, tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["nonfinite"]  # step 2 saved: 1, 2 before
    assert "loss.png" in objects(url)
    assert f"loss curve: {url}/loss.png" in capsys.readouterr().err  # the store's, not the local staging folder's


def test_a_store_without_its_package_is_refused_in_one_line(model_config, tmp_path):
    with pytest.raises(ConfigError, match=r"^az://bucket/run: az:// needs a package that is not installed \(Install "
                                          r"adlfs to access Azure Datalake Gen2 and Azure Blob Storage\)$"):
        TrainArgs(model_config=model_config, output_dir="az://bucket/run").validate()
    with pytest.raises(ConfigError, match=r"^nope://bucket/run: Protocol not known: nope"):
        TrainArgs(model_config=model_config, output_dir="nope://bucket/run").validate()


UNUSABLE = {  # what breaks, the environment that breaks it, the refusal's cause and fix
    "bucket": ({}, r"its bucket 'nobucket' does not exist; create it \(aws s3 mb s3://nobucket\) or give a URL in an "
                   r"existing bucket"),
    "credentials": ({"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None, "AWS_SHARED_CREDENTIALS_FILE": "none",
                     "AWS_CONFIG_FILE": "none", "AWS_EC2_METADATA_DISABLED": "true"},
                    r"no credentials for the store \(NoCredentialsError: Unable to locate credentials\); set "
                    r"AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY \(or AWS_PROFILE\)"),
    "endpoint": ({"AWS_ENDPOINT_URL": "http://127.0.0.1:{port}", "AWS_MAX_ATTEMPTS": "1"},
                 r"its endpoint cannot be reached \(EndpointConnectionError: Could not connect to the endpoint URL: "
                 r"\"http://127\.0\.0\.1:\d+/plait/run\"\); check AWS_ENDPOINT_URL and the network"),
}


@pytest.mark.parametrize("case", UNUSABLE)
def test_a_store_that_cannot_be_used_is_refused_before_the_run(case, s3, model_config, tmp_path, monkeypatch,
                                                               capsys):
    import s3fs

    env, cause = UNUSABLE[case]
    for key, value in env.items():
        if value is None:
            monkeypatch.delenv(key)
        else:
            monkeypatch.setenv(key, str(tmp_path / value) if value == "none" else value.format(port=free_port()))
    url = "s3://nobucket/run" if case == "bucket" else f"{s3}/run"
    s3fs.S3FileSystem.clear_instance_cache()  # s3fs keeps a client per arguments, not per environment
    try:
        with pytest.raises(ConfigError, match=rf"^--output_dir {re.escape(url)} cannot be used: {cause}$"):
            TrainArgs(model_config=model_config, output_dir=url).validate()
        with pytest.raises(SystemExit) as end:
            main(["train", *flags(model_config, url)])
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    assert end.value.code == 2
    assert re.fullmatch(rf"plait: error: --output_dir {re.escape(url)} cannot be used: {cause}",
                        capsys.readouterr().err.strip())  # one line: no step ran


def test_a_crash_while_a_step_is_saved_again_keeps_its_committed_checkpoint(run_url, model_config, tmp_path):
    fs, path = object_store.filesystem(run_url)
    url = f"{run_url}-resave"
    for step in (2, 4):
        fs.copy(f"{path}/checkpoint-{step}", f"{path}-resave/checkpoint-{step}", recursive=True)
    again = ["-m", "plait", "train", *flags(model_config, url, "--resume_from_checkpoint", f"{url}/checkpoint-2")]
    env = {**os.environ, "PLAIT_STAGE_DIR": str(tmp_path / "stage")}
    killed = run_command(again, timeout=240, env={**env, "PLAIT_FAULT_INJECT": "0:4:kill:save"})
    assert killed.returncode != 0, killed.stderr
    assert latest_checkpoint(url) == f"{url}/checkpoint-4"  # what 'auto' resumes: the one saved before
    whole(f"{url}/checkpoint-4", world_size=2)
    done = run_command(again, timeout=240, env=env)
    assert done.returncode == 0, done.stderr
    assert f"removed {url}/checkpoint-4/.save-" in " ".join(done.stderr.split())  # the killed save's files
    whole(f"{url}/checkpoint-4", world_size=1)  # the new save, in place of the old
    kept = [name for name in objects(url) if name.startswith("checkpoint-4/")]
    assert not any("rank00001" in name for name in kept), kept  # the old save's files are gone, and the crashed one's
    assert len([name for name in kept if name.endswith("shards/index.json")]) == 1, kept


def whole(url: str, world_size: int) -> None:
    """The checkpoint at ``url`` reads whole, as a resume reads it: every file the index lists, every checksum."""
    paths, index = read_index(url)
    assert index.step == 4 and index.world_size == world_size
    reader = CheckpointReader(paths, index)
    reader.validate_files()
    reader.verify((name, key) for name, file in index.files.items() for key in file[CHECKSUM])


class Proxy(BaseHTTPRequestHandler):
    """Forwards each request to the store (``target``), unless ``instead`` answers it itself."""

    protocol_version = "HTTP/1.1"  # keep-alive, and "Expect: 100-continue" answered before a body is read
    target = ""

    def instead(self) -> tuple[int, bytes] | None:
        """The status and body to answer with rather than the store's; None forwards the request."""
        return None

    def handle_one(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        refusal = self.instead()
        if refusal is not None:
            self.send_response(refusal[0])
            self.send_header("Content-Length", str(len(refusal[1])))
            self.end_headers()
            self.wfile.write(refusal[1])
            return
        connection = http.client.HTTPConnection(*self.target.removeprefix("http://").split(":"))
        headers = {k: v for k, v in self.headers.items() if k.lower() != "expect"}
        connection.request(self.command, self.path, body, headers)
        answer = connection.getresponse()
        payload = answer.read()
        self.send_response(answer.status)
        for key, value in answer.getheaders():
            if key.lower() not in ("transfer-encoding", "connection") and \
                    (key.lower() != "content-length" or self.command == "HEAD"):
                self.send_header(key, value)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = handle_one

    def log_message(self, *args) -> None:  # quiet
        pass


class FlakyProxy(Proxy):
    """Answers every ``EVERY``-th request with 503 (Slow Down) instead of the store."""

    EVERY, count, failed = 3, 0, 0
    lock = threading.Lock()

    def instead(self) -> tuple[int, bytes] | None:
        with FlakyProxy.lock:
            FlakyProxy.count += 1
            fail = FlakyProxy.count % FlakyProxy.EVERY == 0
            FlakyProxy.failed += fail
        return (503, b"") if fail else None


class ReadOnlyProxy(Proxy):
    """Refuses every write as S3 refuses credentials that may only read (403, AccessDenied)."""

    def instead(self) -> tuple[int, bytes] | None:
        if self.command in ("GET", "HEAD"):
            return None
        return 403, b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"


@pytest.fixture
def proxy(server, monkeypatch):
    """Starts a ``Proxy`` class in front of the store and points AWS_ENDPOINT_URL at it."""
    import s3fs

    started = []

    def start(handler: type[Proxy]) -> None:
        handler.target = server
        started.append(ThreadingHTTPServer(("127.0.0.1", 0), handler))
        threading.Thread(target=started[-1].serve_forever, daemon=True).start()
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{started[-1].server_address[1]}")
        s3fs.S3FileSystem.clear_instance_cache()  # s3fs keeps a client per arguments, not per environment

    yield start
    for each in started:
        each.shutdown()
    s3fs.S3FileSystem.clear_instance_cache()


def test_credentials_that_may_only_read_are_refused_before_the_run(s3, run_url, model_config, proxy, tmp_path,
                                                                   capsys):
    """A store that answers look-ups but refuses writes (read-only credentials) is refused where the run or the
    consolidation starts, in one line (exit 2), not at the first save after the training it was to keep."""
    proxy(ReadOnlyProxy)
    url = f"{s3}/read-only"
    cause = r"writing was refused \(PermissionError: Access Denied\); check the credentials and the bucket's policy"
    with pytest.raises(SystemExit) as end:
        main(["train", *flags(model_config, url)])
    assert end.value.code == 2
    assert re.fullmatch(rf"plait: error: --output_dir {re.escape(url)} cannot be used: {cause}",
                        capsys.readouterr().err.strip())
    with pytest.raises(SystemExit) as end:
        main(["consolidate", f"{run_url}/checkpoint-4", f"{url}/hf"])
    assert end.value.code == 2
    assert re.fullmatch(rf"plait: error: output directory {re.escape(url)}/hf cannot be used: {cause}",
                        capsys.readouterr().err.strip())


def test_a_store_failing_a_share_of_requests_still_gets_the_run(s3, server, model_config, one_process, tmp_path,
                                                                 monkeypatch, proxy):
    FlakyProxy.count, FlakyProxy.failed = 0, 0
    proxy(FlakyProxy)
    monkeypatch.setenv("PLAIT_STAGE_DIR", str(tmp_path / "stage"))
    url = f"{s3}/flaky"
    launch(["-m", "plait", "train", *flags(model_config, url, "--tensor_parallel_size", "2")], 2, timeout=240)
    main(["consolidate", f"{url}/checkpoint-4", str(tmp_path / "hf")])
    assert FlakyProxy.failed > 10, FlakyProxy.failed  # the store did fail requests
    monkeypatch.setenv("AWS_ENDPOINT_URL", server)
    records = store_metrics(url, tmp_path)
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in one_process], rel=1e-5)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "llama"
