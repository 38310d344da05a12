"""Issue 47, point 1 on Google Cloud Storage: checkpoints and run files at a gs:// URL through gcsfs, against a GCS
emulator the test starts on loopback (gcp-storage-emulator, in memory) and reaches as a user of an emulator does:
STORAGE_EMULATOR_HOST (gcsfs then sends no credentials) and GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false (gcsfs's
experimental bucket-type probe speaks gRPC, which the emulator does not: it waits 60 s a bucket, then falls back).

A 2-rank run at tp=2 saves 2 steps to gs://, another resumes it with 'auto' from there for 2 more: one process's
losses, every checkpoint's files and commit object and the run's metrics in the store; `plait consolidate` reads a
checkpoint from gs:// and writes to gs://, giving the model transformers loads. A checkpoint written again at the same
URL, its index the same size, is fetched again, not read from the local copy of the old one (gcsfs names its version
markers generation and etag, lower case, where s3fs has ETag). What the store layer does beyond
(uncommitted saves, checksums, a store failing requests) is the same code for every fsspec store:
tests/test_object_store.py runs it on S3.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from plait.base.config import ConfigError
from plait.checkpoint import store as object_store
from plait.checkpoint.format import latest_checkpoint, resolve
from plait.cli import main
from plait.run.train_args import TrainArgs
from plait.testing import launch
from plait.testing.launcher import free_port
from test_object_store import flags, model_config, objects, one_process, store_metrics  # noqa: F401 (fixtures)

BUCKET = "plait-gs"


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """The emulator on a free loopback port holding one bucket, and the environment pointing gcsfs at it."""
    from gcp_storage_emulator.server import create_server

    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    server.start()
    env = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
           "PLAIT_STAGE_DIR": str(tmp_path_factory.mktemp("stage"))}
    with pytest.MonkeyPatch.context() as patch:  # the environment as it was, after the module
        for key, value in env.items():
            patch.setenv(key, value)
        try:
            yield f"gs://{BUCKET}"
        finally:
            server.stop()


@pytest.fixture(scope="module")
def run_url(gcs, model_config):  # noqa: F811 (the fixture imported above)
    url = f"{gcs}/run"
    first = flags(model_config, url, "--tensor_parallel_size", "2")
    first[first.index("--max_steps") + 1] = "2"
    launch(["-m", "plait", "train", *first], 2, timeout=240)
    launch(["-m", "plait", "train", *flags(model_config, url, "--tensor_parallel_size", "2",
                                            "--resume_from_checkpoint", "auto")], 2, timeout=240)
    return url


def test_a_run_saves_to_gcs_and_resumes_from_it(run_url, one_process, tmp_path):  # noqa: F811
    records = store_metrics(run_url, tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in one_process], rel=1e-5)
    found = objects(run_url)
    for step in (2, 4):
        assert {f"checkpoint-{step}/{name}" for name in (
            "COMMITTED", "config.json", "shards/index.json", "shards/model-rank00000.safetensors",
            "shards/model-rank00001.safetensors")} <= set(found), found
    assert {"metrics.jsonl", "loss.png"} <= set(found)
    assert latest_checkpoint(run_url) == f"{run_url}/checkpoint-4"


def test_consolidate_reads_and_writes_gcs(run_url, tmp_path):
    from transformers import AutoModelForCausalLM

    main(["consolidate", f"{run_url}/checkpoint-4", str(tmp_path / "local")])
    main(["consolidate", f"{run_url}/checkpoint-4", f"{run_url}/hf"])
    fs, path = object_store.filesystem(run_url)
    fs.get(f"{path}/hf", str(tmp_path / "copy"), recursive=True)
    local = AutoModelForCausalLM.from_pretrained(tmp_path / "local")
    copy = AutoModelForCausalLM.from_pretrained(tmp_path / "copy")
    for (name, a), (_, b) in zip(local.state_dict().items(), copy.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_gcs_without_gcsfs_names_the_extra(model_config, monkeypatch):  # noqa: F811
    registry = importlib.import_module("fsspec.registry")  # the module (fsspec.registry is its read-only view)

    monkeypatch.setitem(sys.modules, "gcsfs", None)  # as if not installed: importing it raises ImportError
    monkeypatch.delitem(registry._registry, "gs", raising=False)  # the class fsspec imported before
    with pytest.raises(ConfigError, match=r"^gs://bucket/run: gs:// needs a package that is not installed \(.*\); "
                                          r"pip install 'plait\[gs\]'$"):
        TrainArgs(model_config=model_config, output_dir="gs://bucket/run").validate()


def test_a_checkpoint_written_again_is_fetched_again(gcs, tmp_path, monkeypatch):
    monkeypatch.setenv("PLAIT_STAGE_DIR", str(tmp_path / "stage"))
    url = f"{gcs}/again/checkpoint-1"
    fs, path = object_store.filesystem(url)
    seen = []
    for version in (b"1", b"2"):  # an index and a config of the same size each time
        fs.pipe_file(f"{path}/shards/index.json", b'{"version": %s}' % version)
        fs.pipe_file(f"{path}/config.json", version)
        fs.pipe_file(f"{path}/{object_store.COMMIT}", b"complete\n")
        fs.invalidate_cache()
        root = resolve(url).root
        seen.append(((root / "shards" / "index.json").read_bytes(), (root / "config.json").read_bytes()))
    assert seen == [(b'{"version": 1}', b"1"), (b'{"version": 2}', b"2")]
