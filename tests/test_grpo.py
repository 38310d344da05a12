"""``plait train --method grpo``: TRL 1.16's GRPOTrainer, its rollouts from the policy's own shards.

Held to TRL: on fixed completions of a tiny Llama, plait's loss and every gradient equal GRPOTrainer's ``_compute_loss``
(each loss type, with and without the KL to the reference, a temperature that is not 1), and the advantages TRL's
formula. Then a real run (tp=2 with sequence parallelism, 2 processes) that logs TRL's metric names, and the refusals.
"""

from __future__ import annotations

import copy
from pathlib import Path
import json
import os
import re
import sys

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from plait import ParallelConfig, parallelize
from plait.base.config import ConfigError
from plait.data.chat_tokenizer import save_chat_tokenizer
from plait.run.methods.dpo import Reference
from plait.run.methods.grpo import GRPO
from plait.run.methods.grpo_prompts import read_prompts
from plait.run.methods.grpo_loss import advantages
from plait.run.metrics import read_metrics
from plait.run.train_args import TrainArgs
from processes import run as run_command

TEXT = "the cat sat on the mat. a dog ran in the park. birds sing in the morning light."
PROMPTS = ["the cat", "a dog ran in", "birds"]
REWARDS = '''
def length(prompts, completions, **columns):
    return [float(len(c)) for c in completions]


def has_a(prompts, completions, target, **columns):
    return [None if t == "skip" else float(t in c) for c, t in zip(completions, target)]
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    save_chat_tokenizer([TEXT] * 20, 300, root / "model")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=128)).save_pretrained(root / "model")
    targets = ["a", "skip", "e"]
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p, "target": t}) + "\n"
                                                for p, t in zip(PROMPTS, targets)))
    (root / "rewards.py").write_text(REWARDS)
    torch.manual_seed(0)  # four layers: two stages on each of two pipeline ranks
    LlamaForCausalLM(LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=128)).save_pretrained(root / "deep")
    save_chat_tokenizer([TEXT] * 20, 300, root / "deep")
    from plait_transformers import plait_tiny_config
    from transformers import AutoModelForCausalLM

    moe = plait_tiny_config("qwen3_moe")  # routed experts for ep (no load-balancing loss), the same tokenizer
    moe.vocab_size, moe.output_router_logits = 320, False
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(moe).save_pretrained(root / "moe")
    save_chat_tokenizer([TEXT] * 20, 300, root / "moe")
    return root


def grpo_args(root, **flags) -> TrainArgs:
    base = dict(method="grpo", model_name_or_path=str(root / "model"), train_file=str(root / "prompts.jsonl"),
                reward_funcs=f"{root / 'rewards.py'}:length,{root / 'rewards.py'}:has_a", reward_weights="0.1,1.0",
                num_generations=2, per_device_train_batch_size=6, block_size=24, max_completion_length=8,
                temperature=0.7, output_dir=str(root / "out"))
    return TrainArgs(**{**base, **flags})


def trl_trainer(root, loss_type: str, beta: float, bias_correction: bool = True):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    config = GRPOConfig(output_dir=str(root / "trl"), per_device_train_batch_size=6, num_generations=2,
                        max_completion_length=8, beta=beta, loss_type=loss_type, temperature=0.7, report_to="none",
                        use_cpu=True, epsilon_high=0.28, bf16=False, use_bias_correction_kl=bias_correction)
    trainer = GRPOTrainer(model=LlamaForCausalLM.from_pretrained(root / "model"), args=config,
                          reward_funcs=[lambda prompts, completions, **kw: [0.0] * len(completions)],
                          train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]),
                          processing_class=AutoTokenizer.from_pretrained(root / "model"))
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def moved(model: torch.nn.Module) -> torch.nn.Module:
    """A reference that differs from the policy (its first MLP moved): a KL that is not 0, with a gradient (at the
    starting policy both are 0, and so was every difference in how the KL term's gradient is taken)."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(2)
        for param in other.model.layers[0].mlp.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.1)
    return other


@pytest.mark.parametrize("old", [False, True], ids=["one_iteration", "old_logps"])
@pytest.mark.parametrize("beta, bias_correction", [(0.0, True), (0.04, True), (0.04, False)],
                         ids=["no_kl", "kl", "kl_uncorrected"])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
def test_a_step_on_fixed_completions_is_trls(files, loss_type, beta, bias_correction, old):
    """``old``: a later step of a cycle of --num_iterations, whose ratios are to the log-probs the rollouts were
    generated with (here the policy's own plus noise of +-0.3, so that some tokens are clipped on either side).
    ``bias_correction``: TRL 1.16's use_bias_correction_kl (its default), the KL term times the ratio."""
    args = grpo_args(files, loss_type=loss_type, beta=beta, epsilon_high=0.28,
                     use_bias_correction_kl=bias_correction)
    args.validate()
    tokenizer = AutoTokenizer.from_pretrained(files / "model")
    prompts = read_prompts(files / "prompts.jsonl", tokenizer, 16)
    model = LlamaForCausalLM.from_pretrained(files / "model")
    pmodel = parallelize(copy.deepcopy(model), ParallelConfig())
    reference = Reference(parallelize(moved(model), ParallelConfig())) if beta else None
    method = GRPO(prompts, args, tokenizer, reference, torch.device("cpu"))
    [batch] = method.micro_batches(torch.arange(3), pmodel.mesh, 1, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    completions = torch.randint(3, 300, (6, 8), generator=gen)
    completions[0, 3], completions[3, 0], completions[4, 7] = tokenizer.eos_token_id, tokenizer.eos_token_id, 9
    rows = [prompts[i] for i in range(3) for _ in range(2)]
    method.score_and_build([p.ids for p in rows], completions, rows)
    trainer = trl_trainer(files, loss_type, beta, bias_correction)
    if beta:
        trainer.ref_model.load_state_dict(moved(model).state_dict())
    r = method.rollouts
    width = r.ids.shape[1] - 8
    inputs = {"prompt_ids": r.ids[:, :width], "prompt_mask": r.mask[:, :width], "completion_ids": completions,
              "completion_mask": r.mask[:, width:], "advantages": r.advantages,
              "num_items_in_batch": r.mask[:, width:].sum()}
    if old:
        with torch.no_grad():
            own = trainer._get_per_token_logps_and_entropies(trainer.model, r.ids, r.mask, 8)[0]
        noise = (torch.rand(own.shape, generator=torch.Generator().manual_seed(3)) - 0.5) * 0.6
        inputs["old_per_token_logps"] = own + noise
        method.old = torch.zeros(r.ids.shape, dtype=torch.float64)  # shifted: position t holds token t + 1's
        method.old[:, width - 1: width + 7] = inputs["old_per_token_logps"].double()
    loss = method.micro_step(pmodel, batch, 6)
    if beta:
        with torch.no_grad():
            inputs["ref_per_token_logps"] = trainer._get_per_token_logps_and_entropies(
                trainer.ref_model, r.ids, r.mask, 8)[0]
    expected = trainer._compute_loss(trainer.model, inputs)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    theirs = dict(trainer.model.named_parameters())
    for name, param in pmodel.module.named_parameters():
        # measured: at most 2.2e-8 beyond rtol 1e-5 (7.8e-9 at one iteration): the ratio to old log-probs amplifies
        assert torch.allclose(param.grad, theirs[name].grad, rtol=1e-5, atol=3e-8), name
    metrics, theirs = method.step_metrics(pmodel), trainer._metrics["train" if trainer.model.training else "eval"]
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert metrics[name] == pytest.approx(theirs[name][-1], abs=1e-7), name
    assert (metrics["clip_ratio/region_mean"] > 0) == old
    if beta:
        assert metrics["kl"] == pytest.approx(theirs["kl"][-1], rel=1e-4)


def test_advantages_are_trls_formula(files):
    rewards = torch.tensor([[1.0, 0.0], [3.0, float("nan")], [2.0, 1.0], [2.0, 1.0]])
    weights = torch.tensor([0.5, 2.0])
    total = torch.tensor([0.5, 1.5, 3.0, 3.0])  # nansum, as TRL
    group = total.view(2, 2)
    expected = (total - group.mean(1).repeat_interleave(2)) / (group.std(1).repeat_interleave(2) + 1e-4)
    assert torch.allclose(advantages(rewards, weights, 2, "group"), expected)
    assert torch.allclose(advantages(rewards, weights, 2, "batch"),
                          (total - group.mean(1).repeat_interleave(2)) / (total.std() + 1e-4))
    assert torch.allclose(advantages(rewards, weights, 2, "none"), total - group.mean(1).repeat_interleave(2))


def test_a_run_on_tp2_with_sp_logs_trls_metrics(files):
    out = files / "run"
    done = run_command([sys.executable, "-m", "plait", "train", "--method", "grpo", "--model_name_or_path",
                        str(files / "model"), "--train_file", str(files / "prompts.jsonl"), "--reward_funcs",
                        f"{files / 'rewards.py'}:length,{files / 'rewards.py'}:has_a", "--num_generations", "2",
                        "--per_device_train_batch_size", "6", "--block_size", "24", "--max_completion_length", "8",
                        "--beta", "0.04", "--max_steps", "2", "--output_dir", str(out), "--nproc_per_node", "2",
                        "--tensor_parallel_size", "2"], timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    records = [r for r in read_metrics(out) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        for key in ("reward", "reward_std", "rewards/length/mean", "rewards/has_a/mean", "rewards/length/std",
                    "frac_reward_zero_std", "completions/mean_length", "kl", "grad_norm"):
            assert key in record, (key, record)
        assert 1 <= record["completions/mean_length"] <= 8


@pytest.mark.parametrize("flags, message", [
    (dict(num_generations=4), r"^--num_generations 4 does not divide the global batch of 6 completions "
                              r"\(--per_device_train_batch_size x dp x --gradient_accumulation_steps\); valid values: "
                              r"2, 3, 6$"),
    (dict(loss_type="sigmoid"), r"^--loss_type 'sigmoid' is not a GRPO loss; choose one of grpo, dr_grpo, dapo, bnpo$"),
    (dict(max_completion_length=30), r"^--max_completion_length 30 must be positive and below --block_size 24"),
    (dict(block_size=10), r"prompts.jsonl:2: the prompt has \d+ tokens, more than the 2 left for it"),
    (dict(reward_funcs="nowhere.py:f", reward_weights=None),
     r"^--reward_funcs 'nowhere.py:f': nowhere.py does not exist$"),
    (dict(reward_funcs="json:nothing", reward_weights=None),
     r"^--reward_funcs 'json:nothing': json has no function 'nothing'$"),
    (dict(reward_weights="1"), r"^--reward_weights has 1 weights for 2 --reward_funcs; give one per function$"),
    (dict(packing=True, data_format="chat"), r"^--packing, --data_format chat have no effect with --method grpo \(its "
                                             r"prompts are TRL's prompt-only rows, read as they are\); drop them$"),
    (dict(train_on_prompt=True), r"^--train_on_prompt has no effect with --method grpo"),
    (dict(num_iterations=3, max_steps=10, save_steps=6), r"^--max_steps 10 with --num_iterations 3: checkpoints land "
                                                         r"where a cycle of 3 steps on one batch of rollouts ends; "
                                                         r"give multiples of 3$"),
])
def test_bad_flags_are_one_line(files, flags, message):
    from plait.run.trainer import check_before_launch

    with pytest.raises(ConfigError, match=message):
        args = grpo_args(files, **flags)
        args.validate()
        check_before_launch(args, 1)


@pytest.mark.parametrize("body, message", [
    ("def f(prompts, completions, **kw):\n    return [1 / (len(c) > 3) for c in completions]",
     r"^reward function f raised ZeroDivisionError: division by zero at completion \d \(prompt '"),
    ("def f(prompts, completions, **kw):\n    return [1.0]",
     r"^reward function f returned 1 rewards for 6 completions"),
    ("def f(prompts, completions, **kw):\n    return ['a'] * len(completions)",
     r"^reward function f returned 'a' for completion 0 \("),
])
def test_a_bad_reward_function_is_one_line(files, tmp_path, body, message):
    (tmp_path / "bad.py").write_text(body)
    args = grpo_args(files, reward_funcs=f"{tmp_path / 'bad.py'}:f", reward_weights=None)
    tokenizer = AutoTokenizer.from_pretrained(files / "model")
    prompts = read_prompts(files / "prompts.jsonl", tokenizer, 16)
    method = GRPO(prompts, args, tokenizer, None, torch.device("cpu"))
    method.micro_batches(torch.arange(3), parallelize(LlamaForCausalLM.from_pretrained(files / "model"),
                                                      ParallelConfig()).mesh, 1, torch.device("cpu"))
    rows = [prompts[i] for i in range(3) for _ in range(2)]
    completions = torch.full((6, 8), 40)
    completions[0, 2] = tokenizer.eos_token_id  # a short one
    with pytest.raises(ConfigError, match=message):
        method.score_and_build([p.ids for p in rows], completions, rows)


def scored(files, args: TrainArgs, steps: tuple[int, ...] = (1,)) -> GRPO:
    """A GRPO method that has scored six fixed completions of the three prompts (two each) at each of ``steps``."""
    tokenizer = AutoTokenizer.from_pretrained(files / "model")
    prompts = read_prompts(files / "prompts.jsonl", tokenizer, 16)
    method = GRPO(prompts, args, tokenizer, None, torch.device("cpu"))
    method.micro_batches(torch.arange(3), parallelize(LlamaForCausalLM.from_pretrained(files / "model"),
                                                      ParallelConfig()).mesh, 1, torch.device("cpu"))
    rows = [prompts[i] for i in range(3) for _ in range(2)]
    for step in steps:
        method.score_and_build([p.ids for p in rows], torch.full((6, 8), 40), rows, step)
    return method


def test_completions_no_reward_function_scored_are_said_once(files, capsys):
    """has_a returns None for the prompt whose target is 'skip': as TRL, those completions train at advantage 0 and
    a warning names the functions and the step (TRL's logger warns each time; plait once per run, on rank 0)."""
    scored(files, grpo_args(files, reward_funcs=f"{files / 'rewards.py'}:has_a", reward_weights=None),
                    steps=(3, 4))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning")]
    assert len(lines) == 1 and re.match(r"^warning: step 3: every reward function \(has_a\) returned None or NaN for 2 "
                                        r"of 6 completions \(the first: prompt 'a dog ran in', completion '.*'\); as TRL, "
                                        r"they train at advantage 0, left out of their group's baseline and the logged "
                                        r"reward; make at least one return a number for each completion \(said once "
                                        r"per run\)$", lines[0]), lines
    scored(files, grpo_args(files))  # length scores every completion: nothing said
    assert "warning" not in capsys.readouterr().err


def test_unscorable_completions_train_at_advantage_zero_as_trls(files, tmp_path):
    """A completion no function scored is TRL 1.16's unscorable one: out of its group's mean and deviation and of the
    logged reward, its advantage 0. nansum made it a 0 reward that moved its group's baseline (the scored completion
    beside it got an advantage of -0.71 where TRL's is 0) and the logged reward (1.0 where TRL logs 2.0)."""
    from trl.trainer.utils import nanstd

    (tmp_path / "some.py").write_text("def f(prompts, completions, **kw):\n    return [1.0, 3.0, None, None, 2.0, "
                                      "None]\n")
    method = scored(files, grpo_args(files, reward_funcs=f"{tmp_path / 'some.py'}:f", reward_weights=None))
    per_func = torch.tensor([[1.0], [3.0], [float("nan")], [float("nan")], [2.0], [float("nan")]])
    rewards = per_func.nansum(dim=1)  # TRL's _generate_and_score_completions, sum_then_normalize, scale "group"
    rewards[torch.isnan(per_func).all(dim=1)] = torch.nan
    mean = torch.nanmean(rewards.view(-1, 2), dim=1).repeat_interleave(2)
    std = nanstd(rewards.view(-1, 2), dim=1).repeat_interleave(2)
    expected = torch.nan_to_num((rewards - mean) / (std + 1e-4), nan=0.0)
    assert torch.allclose(method.rollouts.advantages, expected) and expected[4] == 0 and expected[0] < 0
    assert method.metrics["reward"] == torch.nanmean(rewards).item() == 2.0


@pytest.mark.parametrize("value", ["None", "float('nan')"])
def test_a_step_no_completion_of_which_got_a_reward_is_refused(files, tmp_path, value):
    """Every function None (or NaN) for every completion: the step's advantages would all be 0 (grad_norm 0, reward
    logged 0) and the run went on silently; refused in one line naming the functions and the step."""
    (tmp_path / "none.py").write_text(f"def f(prompts, completions, **kw):\n    return [{value}] * len(completions)\n")
    args = grpo_args(files, reward_funcs=f"{tmp_path / 'none.py'}:f", reward_weights=None)
    with pytest.raises(ConfigError, match=r"^step 2: no completion got a reward: every reward function \(f\) "
                                          r"returned None or NaN for all 6 \(the first: prompt 'the cat', completion "
                                          r"'.*'\), so the step would train on nothing; make at least one return a "
                                          r"number for each completion \(0\.0 for no reward\)$"):
        scored(files, args, steps=(2,))


# Layouts of a world of 2 against one process, on the real path: the policy's own rollouts (sampling gives the same
# tokens in every layout), their rewards, the loss and the step-1 gradients. Global batch 6 completions (3 prompts).
LAYOUTS = {"tp2_sp": dict(tensor_parallel_size=2), "dp2": dict(per_device_train_batch_size=3),
           "dp2_accumulation": dict(per_device_train_batch_size=1, gradient_accumulation_steps=3),
           "zero1_dp2": dict(per_device_train_batch_size=3, zero_stage=1),
           "zero2_dp2": dict(per_device_train_batch_size=3, zero_stage=2),
           "zero3_dp2": dict(per_device_train_batch_size=3, zero_stage=3),
           "tp2_lora": dict(tensor_parallel_size=2, lora_r=4), "ep2": dict(expert_parallel_size=2,
                                                                          per_device_train_batch_size=3),
           # two optimizer steps on one batch of rollouts: the second's ratios to the log-probs they were drawn with
           "tp2_sp_mu2": dict(tensor_parallel_size=2, num_iterations=2),
           "dp2_mu2": dict(per_device_train_batch_size=3, num_iterations=2),
           # the rollouts decoded stage by stage, the loss on the last stage, rows padded to --block_size
           "pp2": dict(pipeline_parallel_size=2, num_microbatches=2),
           "pp2_mu2": dict(pipeline_parallel_size=2, num_microbatches=2, num_iterations=2),
           # two stages a rank (the interleaved schedule), rollouts through them too
           "pp2_vpp2": dict(pipeline_parallel_size=2, virtual_pipeline_size=2, num_microbatches=2,
                            pipeline_schedule="interleaved-1f1b"),
           # each cp rank its slice of every row's tokens: weights, old and reference log-probs cut alike; left-padded
           # rows through both strategies (a pad's query attends to nothing)
           "cp2": dict(context_parallel_size=2, cp_attention="all-to-all"),
           "cp2_ring_mu2": dict(context_parallel_size=2, cp_attention="ring", num_iterations=2)}
RUN = dict(beta=0.04, max_steps=2, learning_rate=1e-2, lr_scheduler_type="constant", device="cpu", save_final=False,
           loss_type="grpo")
KEYS = ("loss", "grad_norm", "reward", "reward_std", "rewards/length/mean", "completions/mean_length", "kl",
        "clip_ratio/region_mean")


@pytest.fixture(scope="module")
def one_process(files, tmp_path_factory):
    from plait.run.trainer import Trainer
    from workers.trainers import capture_gradients, whole

    runs = {}
    for name, extra in (("full", {}), ("lora", dict(lora_r=4)), ("moe", dict(model_name_or_path=str(files / "moe"))),
                        ("mu2", dict(num_iterations=2)), ("deep", dict(model_name_or_path=str(files / "deep")))):
        trainer = Trainer(grpo_args(files, output_dir=str(tmp_path_factory.mktemp(name)), **RUN, **extra))
        kept = capture_gradients(trainer)
        runs[name] = (trainer.train(), whole([kept]))
    return runs


@pytest.fixture(scope="module")
def layouts(files, tmp_path_factory):
    from plait.testing import launch

    out = tmp_path_factory.mktemp("layouts")
    cases = {name: {**grpo_args(files, output_dir=str(out / name), **RUN, **layout).__dict__}
             for name, layout in LAYOUTS.items()}
    cases["ep2"]["model_name_or_path"] = str(files / "moe")
    cases["pp2_vpp2"]["model_name_or_path"] = str(files / "deep")
    (out / "flags.json").write_text(json.dumps(cases))
    worker = str(Path(__file__).parent / "workers" / "trainers.py")
    launch([worker, str(out / "runs.json"), str(out / "flags.json")], 2, timeout=300)
    runs = json.loads((out / "runs.json").read_text())
    return {name: (records, torch.load(out / f"{name}.grads.pt")) for name, records in runs.items()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_gives_one_process_rollouts_losses_and_gradients(one_process, layouts, layout):
    from workers.trainers import assert_gradients_agree

    history, grads = one_process["lora" if "lora" in layout else "moe" if layout == "ep2" else
                                 "mu2" if layout.endswith("mu2") else "deep" if layout == "pp2_vpp2" else "full"]
    assert all(r["grad_norm"] > 1e-3 and r["reward_std"] > 0 for r in history)  # the groups' rewards differ: a signal
    records, got_grads = layouts[layout]
    for rank, record in enumerate(records):
        for got, expected in zip(record["history"], history, strict=True):
            for key in KEYS:  # the same completions (the rewards, lengths), then the loss and its gradient
                assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), (rank, got["step"], key)
    assert sorted(got_grads) == sorted(grads)
    assert_gradients_agree(got_grads, grads)


def test_trainable_tokens_counts_completions_as_the_readme_says(one_process):
    """GRPO's divisor (logged as trainable_tokens, the key kept for every method) is the step's completions (3
    prompts x 2); the README said 'labelled tokens of the global batch' for every method."""
    from test_dpo import readme_trainable_tokens

    assert [r["trainable_tokens"] for r in one_process["full"][0]] == [6, 6]
    assert "its completions for `--method grpo`" in readme_trainable_tokens()


def test_the_walkthroughs_grpo_words_are_its_commands_numbers():
    """docs/post-training.md's GRPO walkthrough: the steps and completions per step its prose gives are what its
    command runs (the global batch: --per_device_train_batch_size x dp, dp = --nproc_per_node / tp), and the
    prompts per step that batch over --num_generations (it said 32 completions where the command trains 16)."""
    from plait.cli import build_parser
    from plait.run.train_args import from_namespace

    text = (Path(__file__).resolve().parent.parent / "docs" / "post-training.md").read_text()
    command = text[text.index("plait train --method grpo --model_name_or_path runs/dpo/hf"):]
    command = command[:command.index("```")].replace("\\\n", " ").split()
    args = from_namespace(build_parser().parse_args(command[1:]), TrainArgs)
    dp = args.nproc_per_node // (args.tensor_parallel_size * args.pipeline_parallel_size * args.context_parallel_size)
    batch = args.global_batch(dp)
    prose = " ".join(text[text.index("GRPO (run as written"):].split())
    said = re.search(r"(\d+) s for (\d+) steps of (\d+) completions \((\d+) prompts x (\d+)\)", prose)
    assert said, prose[:300]
    assert (int(said[2]), int(said[3]), int(said[4]), int(said[5])) == \
        (args.max_steps, batch, batch // args.num_generations, args.num_generations)


@pytest.mark.parametrize("iterations, named", [(1, True), (2, True), (1, False)],
                         ids=["mu1", "mu2", "mu1_model_left_out"])
def test_a_run_resumed_mid_way_draws_and_trains_what_the_whole_run_did(files, tmp_path, iterations, named):
    """The rollouts' seed is the step's (the cycle's) and the sampler's state is in the checkpoint: resuming from step
    2 gives the uninterrupted run's steps 3 and 4 (prompts, completions, rewards, losses) exactly. ``named`` False:
    the resume leaves out --model_name_or_path, and the KL's reference is still the model the run started from (the
    checkpoint records it; it was a seeded init)."""
    from plait.run.trainer import Trainer

    run = {**RUN, "num_iterations": iterations}
    whole = Trainer(grpo_args(files, output_dir=str(tmp_path / "whole"), **{**run, "max_steps": 4})).train()
    Trainer(grpo_args(files, output_dir=str(tmp_path / "cut"), **{**run, "max_steps": 2}, save_steps=2)).train()
    left_out = {} if named else dict(model_name_or_path=None, tokenizer_name=str(files / "model"))
    resumed = Trainer(grpo_args(files, output_dir=str(tmp_path / "cut"), **{**run, "max_steps": 4},
                                resume_from_checkpoint="auto", **left_out)).train()
    assert [r["step"] for r in resumed] == [3, 4]
    for got, expected in zip(resumed, whole[2:], strict=True):
        assert {k: got[k] for k in KEYS} == {k: expected[k] for k in KEYS}


def test_rows_padded_for_sequence_parallelism_change_nothing(files):
    """Under SP a row's length is a multiple of tp: the rows are padded on the right (masked, unlabelled, weight 0),
    after every token, so one process's loss and gradients are the same with and without the padding."""
    tokenizer = AutoTokenizer.from_pretrained(files / "model")
    prompts = read_prompts(files / "prompts.jsonl", tokenizer, 16)
    rows = [prompts[i] for i in range(3) for _ in range(2)]
    completions = torch.randint(3, 300, (6, 7), generator=torch.Generator().manual_seed(2))
    found = []
    for multiple in (1, 4):
        args = grpo_args(files, beta=0.04, max_completion_length=7)
        model = LlamaForCausalLM.from_pretrained(files / "model")
        pmodel = parallelize(copy.deepcopy(model), ParallelConfig())
        method = GRPO(prompts, args, tokenizer, Reference(parallelize(model, ParallelConfig())), torch.device("cpu"),
                      multiple)
        [batch] = method.micro_batches(torch.arange(3), pmodel.mesh, 1, torch.device("cpu"))
        method.score_and_build([p.ids for p in rows], completions, rows)
        found.append((method.rollouts.ids.shape[1], method.micro_step(pmodel, batch, 6).item(),
                      [p.grad.clone() for p in pmodel.parameters()]))
    (width, loss, grads), (padded, padded_loss, padded_grads) = found
    assert padded % 4 == 0 and padded > width  # the test's rows are not a multiple of 4 already
    assert padded_loss == pytest.approx(loss, rel=1e-6)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-8) for a, b in zip(grads, padded_grads))


def test_a_stop_inside_a_cycle_of_iterations_waits_for_its_end(files, tmp_path):
    """SIGTERM after step 1 of a cycle of 2: the run trains step 2 (the cycle's end, where a checkpoint holds all it
    needs), saves it and stops there."""
    import signal

    from plait.run.stop import StopRequested
    from plait.run.trainer import Trainer

    trainer = Trainer(grpo_args(files, output_dir=str(tmp_path), **{**RUN, "max_steps": 4, "num_iterations": 2}))
    trainer.signals.signum = signal.SIGTERM  # as the handler sets it, before the first step ends
    with pytest.raises(StopRequested) as stopped:
        trainer.train()
    assert stopped.value.step == 2
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]


@pytest.mark.parametrize("flags, counted", [(dict(beta=0.04), True), (dict(beta=0.0), False),
                                            (dict(beta=0.04, lora_r=4), False)])
def test_plait_plan_counts_the_reference_where_the_run_holds_one(files, tmp_path, flags, counted):
    """``plait plan``'s second model: GRPO's reference (the starting policy, its shapes) where --beta > 0, none at
    beta 0 (no reference is loaded) nor under LoRA (the reference is the base with the adapters off)."""
    from plait.costs.estimate import estimate_layout
    from plait.plan_command import PlannedRun

    args = grpo_args(files, output_dir=str(tmp_path), **flags)
    run = PlannedRun.of(args, args.parallel_config(), 1)
    assert (run.second is not None) == counted
    estimate = estimate_layout(run.model, run.plan, run.batch, run.precision, run.trace, second=run.second)
    params = sum(p.numel() for p in LlamaForCausalLM.from_pretrained(files / "model").parameters())
    assert estimate.for_rank(0).second == (4 * params if counted else 0)  # fp32, one process: the whole policy


def test_chat_prompts_are_rendered_and_rewarded_as_trl_does(files, tmp_path):
    """A prompt given as chat messages is rendered with the template's generation prompt, and the reward functions
    get it as messages and each completion as [{"role": "assistant", "content": ...}], other columns by name."""
    tokenizer = AutoTokenizer.from_pretrained(files / "model")
    messages = [{"role": "user", "content": "the cat"}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"prompt": messages, "topic": "cats"}) + "\n")
    (tmp_path / "seen.py").write_text(
        "SEEN = []\n\ndef f(prompts, completions, completion_ids, topic, **kw):\n"
        "    SEEN.append((prompts, completions, completion_ids, topic))\n    return [1.0] * len(completions)\n")
    [prompt] = read_prompts(tmp_path / "chat.jsonl", tokenizer, 40)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert prompt.columns == {"topic": "cats"}
    args = grpo_args(files, train_file=str(tmp_path / "chat.jsonl"), reward_funcs=f"{tmp_path / 'seen.py'}:f",
                     reward_weights=None)
    method = GRPO([prompt], args, tokenizer, None, torch.device("cpu"))
    method.micro_batches(torch.arange(1), parallelize(LlamaForCausalLM.from_pretrained(files / "model"),
                                                      ParallelConfig()).mesh, 1, torch.device("cpu"))
    completions = torch.tensor([tokenizer("a dog", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                                + [0] * 3] * 2)[:, :8]
    method.score_and_build([prompt.ids] * 2, completions, [prompt] * 2)
    [(prompts, shown, ids, topic)] = method.funcs[0][1].__globals__["SEEN"]
    assert prompts == [messages] * 2 and topic == ["cats"] * 2
    assert shown == [[{"role": "assistant", "content": "a dog"}]] * 2
    said = tokenizer("a dog", add_special_tokens=False)["input_ids"]
    assert ids == [said + [tokenizer.eos_token_id]] * 2  # up to and with EOS


def test_the_logged_reward_metrics_are_trls():
    """The reward metrics as TRL 1.16 logs them (grpo_trainer.py: ``nanmean``/``nanstd`` of the weighted sums over the
    whole batch, an unscorable completion left out; each function's mean and std; the share of completions whose
    scaling deviation is zero). plait logged the mean of the groups' standard deviations as reward_std, which differs
    wherever the groups' means do: here 0.35 against TRL's 1.87; the per-function std and frac_reward_zero_std were
    missing."""
    from trl.trainer.utils import nanstd as trls_nanstd

    from plait.run.methods.grpo_loss import logged_rewards

    rewards = torch.tensor([[1.0, float("nan")], [1.0, 0.0], [3.0, float("nan")], [2.0, 0.0],
                            [float("nan"), float("nan")], [5.0, 1.0]])  # 3 groups of 2; the fifth scored by none
    weights = torch.tensor([1.0, 0.5])
    total = (rewards * weights).nansum(dim=1)
    total[rewards.isnan().all(dim=1)] = float("nan")  # TRL's unscorable_mask
    for scale, zero_std in (("group", 2 / 6), ("batch", 0.0)):  # group 1's two completions score alike
        found = logged_rewards(rewards, weights, ["f", "g"], 2, scale)
        assert found["reward"] == pytest.approx(torch.nanmean(total).item(), abs=1e-6)
        assert found["reward_std"] == pytest.approx(trls_nanstd(total).item(), abs=1e-6) and found["reward_std"] > 1.5
        for j, name in enumerate(["f", "g"]):
            assert found[f"rewards/{name}/mean"] == pytest.approx(torch.nanmean(rewards[:, j]).item(), abs=1e-6)
            assert found[f"rewards/{name}/std"] == pytest.approx(trls_nanstd(rewards[:, j]).item(), abs=1e-6)
        assert found["frac_reward_zero_std"] == pytest.approx(zero_std, abs=1e-6), scale
