"""Multi-process checks of lazy loading, sharded checkpoints, exact resume, resharding and consolidation.

Three launches of tests/workers/checkpoint_worker.py: ``train`` (world 2), ``resume`` (world 2, new
processes, after this module damaged copies of a checkpoint), ``kv4`` (world 4, kv heads shared by tp ranks).
Each test asserts on the JSON a launch wrote, with messages that show the numbers.
"""

import json
import shutil
from pathlib import Path

import pytest

from plait.testing import launch

WORKER = str(Path(__file__).parent / "workers" / "checkpoint_worker.py")
ARCHS = ("gpt2", "llama", "mistral")
N = 3
RTOL = 1e-5


def run(mode: str, work: Path, world: int, timeout: float = 240) -> dict:
    out = work / f"{mode}.json"
    launch([WORKER, mode, str(work), str(out)], world, timeout=timeout)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def trained(work) -> dict:
    return run("train", work, 2)


def _damage(work: Path) -> None:
    """Damaged copies of the llama tp=2 checkpoint, one per failure mode, under work/bad."""
    good = work / "llama" / "tp2" / f"checkpoint-{N}"
    bad = work / "bad"
    cases = {name: bad / name for name in ("bad_index", "cannot_reshard", "corrupted", "missing_shard", "truncated")}
    for path in cases.values():
        shutil.copytree(good, path)
    (cases["missing_shard"] / "shards" / "optim-rank00001.safetensors").unlink()
    truncated = cases["truncated"] / "shards" / "model-rank00000.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:-64])
    corrupted = cases["corrupted"] / "shards" / "model-rank00001.safetensors"
    data = bytearray(corrupted.read_bytes())
    data[-10] ^= 0xFF  # inside the last tensor's bytes; the size and header stay valid
    corrupted.write_bytes(bytes(data))
    (cases["bad_index"] / "shards" / "index.json").write_text('{"format": "plait-checkpoint", ')
    # An index whose pieces come from rank 0 only: the tp=2 layout's rank-1 slices are in no file.
    index_path = cases["cannot_reshard"] / "shards" / "index.json"
    index = json.loads(index_path.read_text())
    for entry in index["tensors"].values():
        entry["pieces"] = [p for p in entry["pieces"] if "rank00001" not in p["file"]]
    index["files"] = {f: v for f, v in index["files"].items() if "rank00001" not in f}
    index_path.write_text(json.dumps(index))
    shutil.copytree(work / "gpt2" / "tp2" / f"checkpoint-{N}", bad / "other_architecture")


@pytest.fixture(scope="module")
def resumed(work, trained) -> dict:
    _damage(work)
    return run("resume", work, 2)


@pytest.fixture(scope="module")
def kv4(tmp_path_factory) -> dict:
    return run("kv4", tmp_path_factory.mktemp("kv4"), 4, timeout=300)


def rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


# -- loading ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_seeded_init_gives_same_full_weights_at_every_layout(trained, arch):
    r = trained[arch]
    assert r["init_diff_tp2_vs_tp1"] == 0.0, f"{arch}: tp=2 vs tp=1 full weights differ by {r['init_diff_tp2_vs_tp1']}"
    assert r["init_diff_other_seed"] > 1e-2, f"{arch}: another seed gave nearly the same weights"


@pytest.mark.parametrize("arch", ARCHS)
def test_meta_build_recomputes_rotary_buffers_and_keeps_ties(trained, arch):
    r = trained[arch]
    assert r["buffer_diff"] == 0.0, f"{arch}: buffers {r['buffers']} differ from transformers' by {r['buffer_diff']}"
    if arch != "gpt2":
        assert "model.rotary_emb.inv_freq" in r["buffers"]
    assert r["tied_kept"] is (arch == "gpt2"), f"{arch}: lm_head tied to the embedding = {r['tied_kept']}"


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_directory_loads_into_shards(trained, arch):
    r = trained[arch]
    assert "model.safetensors.index.json" in r["hf_src_files"], r["hf_src_files"]
    assert r["hf_load_diff"] == 0.0, f"{arch}: gathered weights differ from the saved model by {r['hf_load_diff']}"
    assert r["hf_load_logits_diff"] <= 1e-5, f"{arch}: logits differ by {r['hf_load_logits_diff']}"


# -- checkpoints -------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_replicated_tensors_are_saved_once(trained, arch):
    pieces = trained[arch]["pieces"]
    norm = "transformer.h.0.ln_1.weight" if arch == "gpt2" else "model.layers.0.input_layernorm.weight"
    sharded = "transformer.h.0.mlp.c_fc.weight" if arch == "gpt2" else "model.layers.0.mlp.up_proj.weight"
    assert pieces[norm] == 1 and pieces[f"optimizer/{norm}/exp_avg"] == 1, pieces
    assert pieces[sharded] == 2 and pieces[f"optimizer/{sharded}/exp_avg_sq"] == 2, pieces
    assert pieces[f"optimizer/{sharded}/step"] == 1, pieces
    if arch == "gpt2":
        assert "lm_head.weight" not in pieces  # tied: saved once, as the embedding
        assert pieces["transformer.h.0.attn.c_attn.weight"] == 6  # q|k|v ranges of 2 ranks
    else:
        assert pieces["lm_head.weight"] == 2
    if arch == "llama":  # its single kv head is held by both tp ranks
        assert pieces["model.layers.0.self_attn.k_proj.weight"] == 1, pieces


@pytest.mark.parametrize("arch", ARCHS)
def test_resume_in_a_new_process_is_bit_exact(trained, resumed, arch):
    straight, again = trained[arch]["tp2"], resumed[arch]["tp2_same"]
    assert again["losses"] == straight["losses"][N:], \
        f"{arch}: resumed {again['losses']} vs straight {straight['losses'][N:]}"
    assert again["probe"] == straight["probe"], f"{arch}: RNG after resume {again['probe']} vs {straight['probe']}"
    assert (again["step"], again["extra"]) == (N, {"consumed_samples": N * 4})
    assert again["rng_restored"] and not again["resharded"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case,original", [("tp1_to_tp2", "tp1"), ("tp2_to_tp1", "tp2")])
def test_resharded_resume_matches_original_layout(trained, resumed, arch, case, original):
    got, want = resumed[arch][case]["losses"], trained[arch][original]["losses"][N:]
    assert rel_diff(got, want) <= RTOL, f"{arch} {case}: {got} vs {want} (rel {rel_diff(got, want):.2e})"
    assert resumed[arch][case]["resharded"] and not resumed[arch][case]["rng_restored"]


def test_zero1_checkpoint_resumes_and_regroups(trained, resumed):
    """ZeRO-1 at dp=2 saves each parameter's AdamW state from the rank owning it; the index regroups it."""
    zero, tp2 = trained["llama"]["zero"]["losses"], trained["llama"]["tp2"]["losses"]
    got = resumed["llama"]
    assert got["zero_same"]["losses"] == zero[N:], f"{got['zero_same']['losses']} vs {zero[N:]}"
    assert rel_diff(got["zero_to_tp2"]["losses"], zero[N:]) <= RTOL, f"{got['zero_to_tp2']['losses']} vs {zero[N:]}"
    assert rel_diff(got["tp2_to_zero"]["losses"], tp2[N:]) <= RTOL, f"{got['tp2_to_zero']['losses']} vs {tp2[N:]}"


@pytest.mark.parametrize("arch", ARCHS)
def test_consolidated_model_loads_in_transformers(trained, arch):
    c = trained[arch]["consolidated"]
    assert c["loading_info"] == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    assert c["logits_diff"] <= 1e-5, f"{arch}: from_pretrained logits differ by {c['logits_diff']}"
    assert {"config.json", "generation_config.json", "model.safetensors"} <= set(c["files"]), c["files"]


BAD = {
    "missing_shard": ["optim-rank00001.safetensors is missing"],
    "truncated": ["model-rank00000.safetensors has", "bytes, the index recorded"],
    "corrupted": ["model-rank00001.safetensors", "is corrupted", "xxh3_64 checksum"],
    "bad_index": ["index.json is not valid JSON"],
    "other_architecture": ["holds a 'gpt2' model (GPT2LMHeadModel)", "this model is 'llama' (LlamaForCausalLM)"],
    "cannot_reshard": ["cannot be loaded at this layout", "is in no saved piece"],
    "config_mismatch": ["does not match the model config", "model.layers.0.mlp.gate_proj.weight",
                        "intermediate_size: checkpoint 64 vs model 96"],
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_checkpoint_is_a_clear_error(resumed, case):
    message = resumed["bad"][case]
    assert message.startswith("CheckpointError"), f"{case}: {message}"
    for part in BAD[case]:
        assert part in message, f"{case}: {part!r} not in {message!r}"


# -- kv heads shared by tp ranks (world of 4) ----------------------------------------------------------


def test_kv_heads_shared_by_tp_ranks_are_saved_once(kv4):
    pieces = kv4["pieces"]
    assert kv4["init_diff_tp4_vs_tp1"] == 0.0
    assert pieces["model.layers.0.self_attn.k_proj.weight"] == 2, pieces  # 4 ranks, 2 distinct kv heads
    assert pieces["optimizer/model.layers.0.self_attn.v_proj.weight/exp_avg"] == 2, pieces
    assert pieces["model.layers.0.self_attn.q_proj.weight"] == 4, pieces


@pytest.mark.parametrize("layout", ["tp2", "tp1"])
def test_kv_replicated_checkpoint_reshards(kv4, layout):
    assert rel_diff(kv4[layout], kv4["tp4"]) <= RTOL, f"tp4 -> {layout}: {kv4[layout]} vs {kv4['tp4']}"


def test_kv_replicated_checkpoint_consolidates(kv4):
    c = kv4["consolidated"]
    assert c["logits_diff"] <= 1e-5 and not c["loading_info"]["missing_keys"], c

