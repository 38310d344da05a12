"""``plait train --method dpo`` held to TRL 1.16's DPOTrainer and to one process on every layout.

TRL's DPOTrainer trains the same tiny model (it and its reference loaded from one directory) on the same pairs in
the order plait's seeded sampler draws them, in fp32 (DPOConfig turns bf16 on by default: off here), with the same
AdamW, learning-rate schedule and clipping; each step's loss and TRL's logged metrics (rewards/chosen,
rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected) must agree within 5e-7 for
every loss type plait offers, for two combined with weights, for RPO (sigmoid with TRL's sft term), and under LoRA
(TRL's reference is then peft's model with its adapters off, plait's the same: no second copy). Then one launched
world of 2 ranks runs DPO at tp=2 with SP, pp=2 (and with activation checkpointing), cp=2, ZeRO-1, ZeRO-2 and ZeRO-3
at dp=2, dp=2 with accumulation, tp=2 with the reference's log-probs precomputed, LoRA at tp=2 and at pp=2
(precomputed), RPO at cp=2 and at dp=2 with accumulation, and ep=2 on a tiny Qwen3-MoE: every rank's loss,
gradient norm and metrics at every step equal one process's. ``plait plan``'s count of the reference is held to
what those ranks held.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from plait.base.config import ConfigError
from plait.data import GlobalBatchSampler
from plait.data.chat_tokenizer import save_chat_tokenizer
from plait.run.methods.preference_loss import METRICS
from plait.run.methods.table import METHODS
from plait.run.method_args import METHODS as METHOD_NAMES
from plait.run.train_args import TrainArgs
from plait.run.trainer import Trainer
from plait.testing import launch
from plait_transformers import plait_tiny_config
from tiny_models import tiny_config
from workers.trainers import capture_gradients, whole

WORKER = str(Path(__file__).parent / "workers" / "trainers.py")
VOCAB, BLOCK, BATCH, STEPS, LR = 320, 32, 4, 2, 1e-3
TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # named: peft's default for Llama is q and v
WORDS = ["what is two plus two", "four", "five", "name a colour", "blue", "green", "hello there", "hi", "a cat",
         "a dog"]
# each loss type plait offers, with the label smoothing the ones that read it need; and two of them combined
LOSSES = {name: {"loss_type": name} for name in ("sigmoid", "hinge", "ipo", "apo_zero", "apo_down", "nca_pair",
                                                  "bco_pair", "sppo_hard", "sigmoid_norm")}
LOSSES |= {"robust": {"loss_type": "robust", "label_smoothing": 0.1},
           "exo_pair": {"loss_type": "exo_pair", "label_smoothing": 1e-3},
           "sigmoid+ipo": {"loss_type": "sigmoid,ipo", "loss_weights": "1.0,0.5"},
           "rpo": {"loss_type": "sigmoid,sft", "loss_weights": "1.0,0.5"},  # the sft term: over the batch's tokens
           "sigmoid, LoRA": {"loss_type": "sigmoid", "lora_r": 4, "lora_target_modules": TARGETS}}
LAYOUTS = {"tp2_sp": dict(tensor_parallel_size=2),
           "pp2": dict(pipeline_parallel_size=2, num_microbatches=2),
           "cp2": dict(context_parallel_size=2),
           "zero1_dp2": dict(zero_1=True, per_device_train_batch_size=BATCH // 2),
           "zero3_dp2": dict(zero_stage=3, per_device_train_batch_size=BATCH // 2),
           "dp2_accumulation": dict(per_device_train_batch_size=1, gradient_accumulation_steps=2),
           "tp2_precomputed": dict(tensor_parallel_size=2, precompute_ref_log_probs=True),
           "pp2_recompute": dict(pipeline_parallel_size=2, num_microbatches=2, gradient_checkpointing=True),
           "zero2_dp2": dict(zero_stage=2, per_device_train_batch_size=BATCH // 2),
           "tp2_lora": dict(tensor_parallel_size=2, lora_r=4),
           "pp2_lora_precomputed": dict(pipeline_parallel_size=2, num_microbatches=2, lora_r=4,
                                        precompute_ref_log_probs=True)}
LORA_LAYOUTS = ("tp2_lora", "pp2_lora_precomputed")
MOE_LAYOUTS = ("ep2",)
RPO = dict(loss_type="sigmoid,sft", loss_weights="1.0,0.5")
# the first step's gradients per element: |got - one process| <= GRAD_ATOL + GRAD_RTOL * |one process| (measured up to
# 0.27 of it in fp32, the LM head's and the input embedding's, whose rows sum over many tokens; bf16: 0.33 of 1e4 times it)
GRAD_ATOL, GRAD_RTOL = 1e-7, 1e-5
LAYOUTS["ep2"] = dict(expert_parallel_size=2, per_device_train_batch_size=BATCH // 2)  # on the MoE model
# its load-balancing loss over the global batch (as one process), padding masked
LAYOUTS["ep2_aux"] = dict(expert_parallel_size=2, per_device_train_batch_size=BATCH // 2,
                          moe_aux_loss_scope="global_batch")
LAYOUTS |= {"cp2_rpo": dict(context_parallel_size=2, **RPO),  # the sft term: its token count global, 1/cp per rank
            "dp2_accumulation_rpo": dict(per_device_train_batch_size=1, gradient_accumulation_steps=2, **RPO)}
# the reference-free methods (tests/test_reference_free.py holds them to TRL): per-token means, the NLL's global count,
# and ORPO's prompt-marked labels through tp, cp's split, pp's stages and accumulation
FREE = {"simpo": dict(method="cpo", loss_type="simpo", cpo_alpha=0.0, beta=2.0), "cpo": dict(method="cpo"),
        "orpo": dict(method="orpo", beta=0.2)}
# every pipeline schedule: gpipe on the 2-layer model, the interleaved ones (2 stages a rank) on a 4-layer one
SCHEDULE_LAYOUTS = ("pp2_gpipe", "pp2_interleaved_deep", "pp2_zero_bubble_deep")
LAYOUTS |= {"pp2_gpipe": dict(pipeline_parallel_size=2, num_microbatches=2, pipeline_schedule="gpipe"),
            "pp2_interleaved_deep": dict(pipeline_parallel_size=2, num_microbatches=2, virtual_pipeline_size=2,
                                         pipeline_schedule="interleaved-1f1b"),
            "pp2_zero_bubble_deep": dict(pipeline_parallel_size=2, num_microbatches=2, virtual_pipeline_size=2,
                                         pipeline_schedule="zero-bubble")}
LAYOUTS["tp2_sp_bf16"] = dict(tensor_parallel_size=2, bf16=True)  # bf16 parameters, fp32 masters: against one bf16 process
# --packing: each micro-batch's pairs packed (documents apart by their position ids), against one unpacked process
LAYOUTS |= {"tp2_sp_packed": dict(tensor_parallel_size=2, packing=True),
            "cp2_packed": dict(context_parallel_size=2, packing=True),
            "pp2_packed": dict(pipeline_parallel_size=2, num_microbatches=2, packing=True),
            "dp2_accumulation_packed_orpo": dict(per_device_train_batch_size=1, gradient_accumulation_steps=2,
                                                 packing=True, method="orpo", beta=0.2)}
LAYOUTS |= {"tp2_sp_simpo": dict(tensor_parallel_size=2, **FREE["simpo"]),
            "cp2_cpo": dict(context_parallel_size=2, **FREE["cpo"]),
            "cp2_orpo": dict(context_parallel_size=2, **FREE["orpo"]),
            "pp2_orpo": dict(pipeline_parallel_size=2, num_microbatches=2, **FREE["orpo"]),
            "dp2_accumulation_orpo": dict(per_device_train_batch_size=1, gradient_accumulation_steps=2,
                                          **FREE["orpo"])}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return build_root(tmp_path_factory.mktemp("dpo"))


def build_root(root: Path) -> Path:
    """The tiny models (Llama, a 4-layer Llama, Qwen3-MoE) with a chat tokenizer, and the pairs, under ``root``."""
    save_chat_tokenizer(WORDS * 20, VOCAB, root / "model")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=VOCAB)).save_pretrained(root / "model")
    save_chat_tokenizer(WORDS * 20, VOCAB, root / "deep")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=VOCAB, num_hidden_layers=4)).save_pretrained(
        root / "deep")
    moe = plait_tiny_config("qwen3_moe")  # routed experts, for ep (moe: no load-balancing loss)
    moe.vocab_size = VOCAB
    for name, aux in (("moe", False), ("moe_aux", True)):  # moe_aux: its load-balancing loss, 10x transformers' coef
        moe.output_router_logits, moe.router_aux_loss_coef = aux, 0.01
        save_chat_tokenizer(WORDS * 20, VOCAB, root / name)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(moe).save_pretrained(root / name)
    rng = random.Random(0)
    for name, count in (("pairs.jsonl", 32), ("validation.jsonl", 6)):  # 6: plait's last batch is filled up
        with open(root / name, "w") as file:
            for i in range(count):
                a, b, c = rng.sample(WORDS, 3)
                file.write(json.dumps({"prompt": f"{a} {i % 7}", "chosen": f" {b}", "rejected": f" {c} {c}"}) + "\n")
    return root


def flags(root: Path, **extra) -> dict:
    return {**dict(method="dpo", model_name_or_path=str(root / "model"), train_file=str(root / "pairs.jsonl"),
                   validation_file=str(root / "validation.jsonl"),
                   block_size=BLOCK, per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=LR,
                   device="cpu", save_final=False, seed=0), **extra}


def plait_history(root: Path, out: Path, **extra) -> list[dict]:
    return Trainer(TrainArgs(**flags(root, output_dir=str(out), **extra))).train()


def plait_run(root: Path, out: Path, **extra) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """The history and the gradients the first optimizer step applied (workers/trainers.py's capture)."""
    trainer = Trainer(TrainArgs(**flags(root, output_dir=str(out), **extra)))
    kept = capture_gradients(trainer)
    return trainer.train(), whole([kept])


def peft_model(root: Path, lora_r: int):
    """The model under peft's LoRA as ``plait train --lora_r`` starts it: peft's config from the same flags, A from
    plait's seeded init (B is zero in both)."""
    from peft import get_peft_model

    from plait.lora.layers import full_init

    args = TrainArgs(**flags(root, lora_r=lora_r, lora_target_modules=TARGETS))
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32), args.lora())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name:
                plain = name.removeprefix("base_model.model.").replace(".default.", ".")
                param.copy_(full_init(plain, tuple(param.shape), True, args.seed))
    return model


def trl_history(root: Path, out: Path, loss_type: str, loss_weights: str | None = None,
                label_smoothing: float = 0.0, lora_r: int = 0, lora_target_modules: str = "",
                evaluate: bool = False, model: str = "model") -> list[dict]:
    from trl import DPOConfig, DPOTrainer

    rows = [json.loads(line) for line in (root / "pairs.jsonl").read_text().splitlines()]
    sampler = GlobalBatchSampler(len(rows), BATCH, 0)
    order = [rows[i] for step in range(STEPS) for i in sampler.indices(step).tolist()]
    model = root / model
    config = DPOConfig(output_dir=str(out), per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=LR,
                       logging_steps=1, report_to=[], max_length=BLOCK, use_cpu=True, save_strategy="no", bf16=False,
                       train_sampling_strategy="sequential", seed=0, loss_type=loss_type.split(","),
                       loss_weights=None if loss_weights is None else [float(w) for w in loss_weights.split(",")],
                       label_smoothing=label_smoothing,
                       **(dict(eval_strategy="steps", eval_steps=STEPS, per_device_eval_batch_size=3)
                          if evaluate else {}))
    if lora_r:  # TRL's reference is then the model with its adapters off
        policy, reference = peft_model(root, lora_r), None
    else:
        policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    trainer = DPOTrainer(model=policy, ref_model=reference, args=config,
                         train_dataset=Dataset.from_list(order), processing_class=AutoTokenizer.from_pretrained(model),
                         **(dict(eval_dataset=Dataset.from_list(validation(root))) if evaluate else {}))
    trainer.train()
    history = [record for record in trainer.state.log_history if "loss" in record]
    for record in trainer.state.log_history:  # an evaluation is a record of its own: put it beside its step's
        if "eval_loss" in record:
            next(r for r in history if r["step"] == record["step"]).update(record)
    return history


def validation(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "validation.jsonl").read_text().splitlines()]


def scale(record: dict, key: str, beta: float) -> float:
    """What a difference in ``key`` is measured against: the value itself, but for a reward, which is beta x a
    difference of two summed log-probs of tens (fp32 leaves it 1e-7 of noise however small it is), beta x those
    log-probs; a count of pairs (accuracies) must be exact."""
    prefix = "eval_" if key.startswith("eval_") else ""
    name = key.removeprefix(prefix)
    if name == "rewards/accuracies":
        return 0.0
    if name.startswith("rewards/"):
        sides = {"chosen": ("chosen",), "rejected": ("rejected",), "margins": ("chosen", "rejected")}[name[8:]]
        return beta * sum(abs(record[f"{prefix}logps/{side}"]) for side in sides)
    return abs(record[key])


EVALUATION = ("eval_loss", *(f"eval_{name}" for name in METRICS))


def worst(got: list[dict], expected: list[dict], keys=("loss", *METRICS), beta: float = 0.1) -> tuple[float, str]:
    """The largest difference over steps and ``keys`` (and the evaluation's, at the steps that have one), relative to
    ``scale``, and where."""
    found = [(abs(g[k] - e[k]) / scale(e, k, beta) if scale(e, k, beta) else float(g[k] != e[k]),
              f"step {e['step']} {k}: {g[k]} vs {e[k]}")
             for g, e in zip(got, expected, strict=True) for k in (*keys, *(k for k in EVALUATION if k in e))]
    return max(found)


def test_the_method_table_and_the_flag_name_the_same_methods():
    assert tuple(METHODS) == METHOD_NAMES


@pytest.mark.parametrize("case", LOSSES)
def test_each_loss_type_matches_trls_dpo_trainer(root, tmp_path, case):
    settings = LOSSES[case]
    expected = trl_history(root, tmp_path / "trl", **settings)
    got = plait_history(root, tmp_path / "plait", **settings)
    assert [r["step"] for r in got] == [r["step"] for r in expected] == list(range(1, STEPS + 1))
    difference, where = worst(got, expected)
    assert difference <= 5e-7, where  # measured up to 8.6e-8: fp32 rounding (1.2e-7 is one ulp)
    assert got[-1]["rewards/margins"] != 0.0  # step 2 trains on what step 1 learned


def test_packed_pairs_give_the_unpacked_numbers(root, one_process, tmp_path):
    """One process with --packing: the pairs of a step in packed rows (pack_pairs), each document apart by its position
    ids and read back by its labels, give the unpacked run's loss, gradient norm and metrics."""
    got = plait_history(root, tmp_path, packing=True)
    difference, where = worst(got, one_process["full"][0], ("loss", "grad_norm", *METRICS))
    assert difference <= 5e-7, where


def test_packing_with_a_load_balancing_loss_is_refused(root, tmp_path):
    with pytest.raises(ConfigError, match=r"^--packing with --method dpo: the model adds its routers' load-balancing "
                                          r"loss \(output_router_logits\), whose padding mask cannot go with packed "
                                          r"pairs; drop --packing$"):
        plait_history(root, tmp_path, packing=True, model_name_or_path=str(root / "moe_aux"))


def test_an_moe_models_load_balancing_loss_counts_real_tokens_as_trls(root, tmp_path):
    """An MoE model adding its routers' load-balancing loss (output_router_logits): TRL gives the model its collator's
    attention mask, so padding is not routed in the loss; plait passes the same mask (each row's real tokens)."""
    expected = trl_history(root, tmp_path / "trl", "sigmoid", model="moe_aux")
    got = plait_history(root, tmp_path / "plait", model_name_or_path=str(root / "moe_aux"), validation_file=None)
    difference, where = worst(got, expected)
    assert difference <= 5e-7, where


@pytest.mark.parametrize("case", ["sigmoid", "ipo"])
def test_evaluation_matches_trls(root, tmp_path, case):
    """--validation_file: the loss and TRL's metrics over every validation pair at the last step, named as TRL logs
    them (eval_loss, eval_rewards/chosen, ...). TRL averages its metrics over evaluation batches (a mean of batch
    means), plait over pairs: the same where TRL's batches are equal (6 pairs in 2 of 3 here). RPO's sft term is not
    compared here: TRL takes it per evaluation batch (its token mean), plait over every validation token."""
    expected = trl_history(root, tmp_path / "trl", evaluate=True, **LOSSES[case])
    got = plait_history(root, tmp_path / "plait", **LOSSES[case])
    assert all(name in got[-1] for name in EVALUATION) and all(name in expected[-1] for name in EVALUATION)
    difference, where = worst(got, expected)
    assert difference <= 5e-7, where


@pytest.fixture(scope="module")
def layouts(root, tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("layouts")
    cases = {name: flags(root, output_dir=str(out / name), **layout) for name, layout in LAYOUTS.items()}
    for name in MOE_LAYOUTS:
        cases[name]["model_name_or_path"] = str(root / "moe")
    cases["ep2_aux"]["model_name_or_path"] = str(root / "moe_aux")
    for name in (n for n in LAYOUTS if n.endswith("_deep")):
        cases[name]["model_name_or_path"] = str(root / "deep")
    (out / "flags.json").write_text(json.dumps(cases))
    launch([WORKER, str(out / "runs.json"), str(out / "flags.json")], 2, timeout=300)
    runs = json.loads((out / "runs.json").read_text())
    return {name: {"ranks": records, "grads": torch.load(out / f"{name}.grads.pt")} for name, records in runs.items()}


@pytest.fixture(scope="module")
def one_process(root, tmp_path_factory) -> dict[str, list[dict]]:
    runs = {"full": {}, "lora": dict(lora_r=4), "rpo": RPO, "moe": dict(model_name_or_path=str(root / "moe")),
            "deep": dict(model_name_or_path=str(root / "deep")), "bf16": dict(bf16=True),
            "moe_aux": dict(model_name_or_path=str(root / "moe_aux")), **FREE}
    return {name: plait_run(root, tmp_path_factory.mktemp(f"one_{name}"), **extra) for name, extra in runs.items()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_gives_one_process_numbers(layouts, one_process, layout):
    free = next((name for name in FREE if layout.endswith(f"_{name}")), None)
    expected = one_process[free or ("lora" if layout in LORA_LAYOUTS else "rpo" if layout.endswith("rpo") else
                                    "moe" if layout in MOE_LAYOUTS else "deep" if layout.endswith("_deep") else
                                    "bf16" if layout.endswith("_bf16") else "moe_aux" if layout == "ep2_aux" else
                                    "full")]
    history, grads = expected
    bf16 = layout.endswith("_bf16")
    scale = 1e4 if bf16 else 1  # bf16: 1e4 times fp32's tolerance (bf16 keeps 8 bits: its matmuls at tp=2 differ)
    for rank, record in enumerate(layouts[layout]["ranks"]):
        difference, where = worst(record["history"], history, ("loss", "grad_norm", *METRICS))
        # measured up to 1.7e-7 in fp32 (dp2 with accumulation); bf16's matmuls at tp=2 against one process's: 2.2e-4
        assert difference <= (1e-3 if bf16 else 5e-7), f"rank {rank}: {where}"
    assert_gradients(layouts[layout]["grads"], grads, scale)


def assert_gradients(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], scale: float = 1.0) -> None:
    """The first step's gradients, gathered whole from every rank, element by element against one process's (within
    GRAD_ATOL + GRAD_RTOL |g|, ``scale`` times it); tests/test_kd.py uses it too."""
    assert sorted(got) == sorted(expected), "the parameters the first step updated differ"
    for name, reference in expected.items():
        assert not got[name].isnan().any(), f"{name}: elements no rank held"
        error = ((got[name] - reference).abs() / (GRAD_ATOL + GRAD_RTOL * reference.abs())).max().item() / scale
        assert error <= 1, f"step 1 gradient of {name}: {error:.2f}x the tolerance"


@pytest.mark.parametrize("layout", ["tp2_sp", "pp2", "tp2_precomputed", "tp2_lora"])
def test_plait_plan_counts_the_references_bytes_each_rank_holds(root, layouts, tmp_path, layout):
    """``plait plan``'s 'second model' per rank: the reference's parameters on the policy's layout, as each rank of
    the run held them; none where the run holds none (precomputed log-probs free it; LoRA's is the base itself)."""
    from plait.costs.estimate import estimate_layout
    from plait.plan_command import PlannedRun

    args = TrainArgs(**flags(root, output_dir=str(tmp_path), **LAYOUTS[layout]))
    run = PlannedRun.of(args, args.parallel_config(), 2)
    estimate = estimate_layout(run.model, run.plan, run.batch, run.precision, run.trace, second=run.second)
    for rank, record in enumerate(layouts[layout]["ranks"]):
        assert estimate.for_rank(rank).second == (record["second_model_bytes"] or 0), (rank, record)
    assert (run.second is None) == (layout in ("tp2_precomputed", "tp2_lora"))


def test_plait_plan_counts_two_rows_per_pair(root, tmp_path):
    """A DPO example is a pair: its activations, FLOPs and communication are those of twice the rows."""
    from plait.costs.estimate import estimate_layout
    from plait.plan_command import PlannedRun

    def estimate(**extra):
        args = TrainArgs(**{**flags(root, output_dir=str(tmp_path), precompute_ref_log_probs=True), **extra})
        run = PlannedRun.of(args, args.parallel_config(), 1)
        return estimate_layout(run.model, run.plan, run.batch, run.precision, run.trace, second=run.second)

    pairs, rows = estimate(per_device_train_batch_size=2), estimate(method="next_token", per_device_train_batch_size=4,
                                                                    precompute_ref_log_probs=False)
    assert pairs.ranks[0].activations == rows.ranks[0].activations and pairs.flops == rows.flops
    assert pairs.comm == rows.comm and pairs.peak == rows.peak


@pytest.mark.parametrize(("extra", "message"), [
    (dict(loss_type="aot"), r"--loss_type aot: unknown \(aot: its value depends on how the batch is split"),
    (dict(loss_type="sigmoid,ipo", loss_weights="1"), r"--loss_weights has 1 values for 2 loss types"),
    (dict(method="next_token", beta=0.2), r"--beta has no effect without --method dpo"),
])
def test_bad_flags_are_one_line_before_anything_runs(root, tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        TrainArgs(**{**flags(root, output_dir=str(tmp_path / "out")), **extra}).validate()
    assert not (tmp_path / "out").exists()


def test_bad_data_is_one_line_naming_the_row(root, tmp_path, capsys):
    from plait.run.methods.preference_data import read_pairs

    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "hi", "chosen": " four", "rejected": " five"}) + "\n"
                    + json.dumps({"prompt": "hello there", "chosen": " four", "rejected": " four"}) + "\n")
    with pytest.raises(ConfigError, match=rf"^{rows} line 2: 'chosen' and 'rejected' are the same completion"):
        read_pairs(rows, tokenizer, BLOCK, "keep_start")
    rows.write_text(json.dumps({"prompt": "hi", "chosen": " four", "rejected": " five"}) + "\n"
                    + json.dumps({"prompt": "hello there " * 20, "chosen": " four", "rejected": " five"}) + "\n")
    assert len(read_pairs(rows, tokenizer, BLOCK, "keep_start")) == 1
    assert f"note: dropped 1 preference row(s) of {rows} whose prompt alone fills --block_size {BLOCK} (lines 2)" in \
        capsys.readouterr().err
    assert len(read_pairs(rows, tokenizer, BLOCK, "keep_end")) == 2


def test_a_reference_with_another_vocabulary_is_refused_before_any_process_group(root, tmp_path):
    from plait.run.methods.dpo import DPO
    from plait.run.model_config import read_model_config

    AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=VOCAB + 64)).save_pretrained(tmp_path / "ref")
    args = TrainArgs(**flags(root, output_dir=str(tmp_path / "out"), ref_model_name_or_path=str(tmp_path / "ref")))
    with pytest.raises(ConfigError, match=rf"^--ref_model_name_or_path {tmp_path / 'ref'} has vocab_size {VOCAB + 64}, "
                                          rf"the policy {VOCAB}; the reference must share the policy's tokenizer$"):
        DPO.load_data(args, read_model_config(args, None), None)  # the trainer reads data before any group exists


def test_rows_are_trls_collator_and_a_fixed_length_pads_them_alike(root):
    """pair_rows makes TRL's collated rows, each pair's chosen then rejected (TRL puts all chosen first), padded to
    the longest or to a fixed length (what pipeline parallelism asks: one schedule shape), the labels on the
    completions only."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from plait.run.methods.preference_data import pair_rows, read_pairs

    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    pairs = read_pairs(root / "pairs.jsonl", tokenizer, 8, "keep_start")
    batch = DataCollatorForPreference(pad_token_id=0, max_length=8)([
        {"prompt_ids": p.prompt, "chosen_ids": p.chosen, "rejected_ids": p.rejected} for p in pairs[:3]])
    order = [0, 3, 1, 4, 2, 5]  # TRL: chosen rows, then rejected rows
    ids, labels = pair_rows(pairs, [0, 1, 2], 0, 8, "keep_start", 1)
    width = batch["input_ids"].shape[1]
    assert torch.equal(ids[:, :width], batch["input_ids"][order]) and (ids[:, width:] == 0).all()
    expected = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)[order]
    assert torch.equal(labels[:, :width], expected)
    fixed, fixed_labels = pair_rows(pairs, [0, 1, 2], 0, 8, "keep_start", 1, length=12)
    assert fixed.shape == (6, 12) and torch.equal(fixed[:, :ids.shape[1]], ids)
    assert (fixed_labels[:, ids.shape[1]:] == -100).all()


def test_the_bundled_pairs_train(tmp_path):
    """examples/preference/pairs.jsonl is what its script writes from the bundled conversations, and DPO trains on it
    (conversational rows, a chat tokenizer's template) as docs/post-training.md's walkthrough does, on a tiny model."""
    import subprocess
    import sys

    examples = Path(__file__).resolve().parent.parent / "examples"
    subprocess.run([sys.executable, str(examples / "preference" / "make_pairs.py"), "--out", str(tmp_path / "p.jsonl")],
                   check=True)
    assert (tmp_path / "p.jsonl").read_text() == (examples / "preference" / "pairs.jsonl").read_text()
    texts = [m["content"] for line in (examples / "sft" / "conversations.jsonl").read_text().splitlines()
             for m in json.loads(line)["messages"]]
    save_chat_tokenizer(texts, 512, tmp_path / "model")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=512, max_position_embeddings=128)
                                     ).save_pretrained(tmp_path / "model")
    history = Trainer(TrainArgs(method="dpo", model_name_or_path=str(tmp_path / "model"), block_size=64,
                                train_file=str(examples / "preference" / "pairs.jsonl"), per_device_train_batch_size=8,
                                max_steps=3, learning_rate=1e-3, device="cpu", save_final=False,
                                output_dir=str(tmp_path / "out"))).train()
    assert history[0]["loss"] == pytest.approx(0.6931472, abs=1e-6)  # ln 2: the policy is its reference
    assert history[-1]["rewards/margins"] > 0 and history[-1]["loss"] < history[0]["loss"]


def test_a_resume_reads_the_reference_the_run_started_from(root, tmp_path):
    """The reference is read again on a resume: without --model_name_or_path (the tokenizer from --tokenizer_name) it
    was a seeded init, not the model the run started from, and step 2 differed (loss 0.6535 for 0.6394 in the audit).
    The checkpoint records that model; the resume reads it and gives the uninterrupted run's step 2."""
    run = dict(validation_file=None, lr_scheduler_type="constant", learning_rate=1e-2)
    whole = plait_history(root, tmp_path / "whole", **run)
    plait_history(root, tmp_path / "cut", **{**run, "max_steps": 1, "save_steps": 1})
    resumed = plait_history(root, tmp_path / "cut", **run, model_name_or_path=None,
                            tokenizer_name=str(root / "model"),
                            resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-1"))
    assert [r["step"] for r in resumed] == [2]
    difference, where = worst(resumed, whole[1:], ("loss", "grad_norm", *METRICS))
    assert difference == 0.0, where


def test_a_resume_that_would_change_the_reference_is_refused(root, tmp_path):
    """Another model than the recorded one is refused in one line; a recorded one that is gone is named, and the
    flag then gives its new place."""
    import shutil

    from plait.run.trainer import plan_run

    start = tmp_path / "start"
    shutil.copytree(root / "model", start)
    plait_history(root, tmp_path / "cut", validation_file=None, model_name_or_path=str(start), max_steps=1,
                  save_steps=1)
    checkpoint = tmp_path / "cut" / "checkpoint-1"
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=VOCAB)).save_pretrained(tmp_path / "other")

    def resume(**extra):
        return plan_run(TrainArgs(**flags(root, output_dir=str(tmp_path / "cut"), validation_file=None,
                                          resume_from_checkpoint=str(checkpoint), **extra)), 1)

    with pytest.raises(ConfigError, match=rf"^--resume_from_checkpoint {checkpoint} was started from "
                                          rf"--model_name_or_path {start}, which gives DPO's reference; this run's "
                                          rf"--model_name_or_path {tmp_path / 'other'} would change it: resume with "
                                          rf"that one, or without the flag$"):
        resume(model_name_or_path=str(tmp_path / "other"))
    start.rename(tmp_path / "moved")
    with pytest.raises(ConfigError, match=rf"^--resume_from_checkpoint {checkpoint} was started from "
                                          rf"--model_name_or_path {start}, which is DPO's reference and is gone; give "
                                          rf"its new place with --model_name_or_path$"):
        resume(model_name_or_path=None, tokenizer_name=str(root / "model"))
    resume(model_name_or_path=str(tmp_path / "moved"))  # its new place


def readme_trainable_tokens() -> str:
    """README's words for metrics.jsonl's ``trainable_tokens`` (tests/test_grpo.py reads them too)."""
    text = " ".join((Path(__file__).resolve().parent.parent / "README.md").read_text().split())
    start = text.index("`trainable_tokens` (")
    return text[start:text.index("`tokens_per_s`", start)]


@pytest.mark.parametrize("method", ["dpo", "cpo"])
def test_trainable_tokens_counts_pairs_as_the_readme_says(root, tmp_path, method):
    """DPO's divisor (logged as trainable_tokens, the key kept for every method) is the global batch's pairs; the
    README said 'labelled tokens of the global batch' for every method."""
    history = plait_history(root, tmp_path, method=method, validation_file=None, max_steps=1)
    assert history[0]["trainable_tokens"] == BATCH
    assert "its preference pairs for `--method dpo`, `cpo` and `orpo`" in readme_trainable_tokens()


def test_a_checkpoint_from_before_the_record_needs_the_start_named():
    """A checkpoint saved before runs recorded the model they started from: the resume names it, by
    --model_name_or_path, or by --model_config for a run that started from that config's seeded init (the resume's
    seed gives it again; that one was refused too)."""
    from plait.run.resume_checks import restore_reference
    from plait.run.train_args import TrainArgs

    old = {"learning_rate": 1e-3}  # what such a checkpoint records: flags, no start
    with pytest.raises(ConfigError, match=r"^--resume_from_checkpoint ckpt does not record the model the run started "
                                          r"from, which is DPO's reference; give it with --model_name_or_path \(or "
                                          r"--ref_model_name_or_path, where the run had one\), or --model_config"):
        restore_reference(TrainArgs(method="dpo"), old, "ckpt")
    for named in (dict(model_config="config.json"), dict(model_name_or_path="model")):
        restore_reference(TrainArgs(method="dpo", **named), old, "ckpt")
