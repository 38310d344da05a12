"""Bad input never costs a hang or data: one table of refusals of ``plait train``.

Each row runs ``plait.cli.main`` in-process and checks: exit status 2, a message naming the values (and
the fix), under a second of the command's own work (imports are warmed first), output_dir never created,
and that neither torch.distributed nor a weight was touched (those entry points raise if reached).
A few rows also run as real processes (`python -m plait`, torchrun) to prove the exit status there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import plait
from plait.cli import main
from plait.data import default_corpus_path
import plait.cli
import plait.plugin.registry
import plait.run.runtime
import plait.run.trainer
import plait.run.torchrun
from plait.testing import launch
import processes
from tiny_models import tiny_config

WORKERS = Path(__file__).parent / "workers"


def write_config(tmp_path: Path, arch: str = "llama", **overrides) -> str:
    path = tmp_path / f"{arch}-config.json"
    path.write_text(tiny_config(arch, **overrides).to_json_string())
    return str(path)


def _adapter(name: str, architectures: tuple[str, ...], *, tp_plan: plait.TPPlan | None = None,
             hooks: tuple[str, ...] = ("info", "tp", "leaves")) -> types.ModuleType:
    """An in-process adapter module with only the hooks named in ``hooks``."""
    module = types.ModuleType(name)

    @plait.hookimpl
    def plait_adapter_info():
        return plait.AdapterInfo(name, architectures, plait.Capabilities(sp=False))

    @plait.hookimpl
    def plait_tp_plan(config):
        return tp_plan or plait.TPPlan(())

    @plait.hookimpl
    def plait_leaf_modules(config):
        return ["model.layers.*"]

    for key, fn in (("info", plait_adapter_info), ("tp", plait_tp_plan), ("leaves", plait_leaf_modules)):
        if key in hooks:
            setattr(module, fn.__name__, fn)
    return module


def load_extra_adapter(monkeypatch, module: types.ModuleType, *, block: str = "") -> None:
    """The default registry, rebuilt on first use inside main(), loads ``module`` after the installed ones."""
    original = plait.plugin.registry.Registry.load_entry_points

    def load(self):
        original(self)
        self.register(module)

    monkeypatch.setattr(plait.plugin.registry, "_default", None)
    monkeypatch.setattr(plait.plugin.registry.Registry, "load_entry_points", load)
    if block:
        monkeypatch.setenv(plait.plugin.registry.BLOCKED_ENV, block)


def duplicate_claim(monkeypatch, tmp_path):
    load_extra_adapter(monkeypatch, _adapter("my_llama", ("llama",)))
    return []


def missing_hook(monkeypatch, tmp_path):
    load_extra_adapter(monkeypatch, _adapter("half_done", ("opt",), hooks=("info", "tp")))
    return []


def plan_names_missing_module(monkeypatch, tmp_path):
    plan = plait.TPPlan((plait.Column("model.layers.*.mlp.not_there"),))
    load_extra_adapter(monkeypatch, _adapter("typo", ("llama",), tp_plan=plan), block="llama")
    return ["--tensor_parallel_size", "2", "--disable_sequence_parallel"]


def world_size(n: int):
    def setup(monkeypatch, tmp_path):
        monkeypatch.setenv("WORLD_SIZE", str(n))
        return []
    setup.world = n  # through the launcher: --nproc_per_node n
    return setup


def under_own_torchrun(monkeypatch, tmp_path):
    """A worker of a torchrun the user started (LOCAL_RANK set; plait's launcher would also set its error dir)."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv(plait.run.runtime.ERROR_DIR, raising=False)
    return []


def model(arch="llama", **overrides):
    def setup(monkeypatch, tmp_path):
        return ["--model_config", write_config(tmp_path, arch, **overrides)]
    return setup


def file_with(name: str, text: str, flag: str):
    def setup(monkeypatch, tmp_path):
        path = tmp_path / name
        path.write_text(text)
        return [flag, str(path)]
    return setup


FOUR_LAYERS = model(num_hidden_layers=4)
# Doge's dt_proj reads every kv head's values and its output feeds each head's mask: no rule splits it
DOGE_CONFIG = ('{"model_type": "doge", "vocab_size": 61, "hidden_size": 32, "intermediate_size": 64, '
               '"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, '
               '"max_position_embeddings": 64}')

# (id, flags, setup(monkeypatch, tmp_path) -> more flags, substring of the message)
CASES = [
    ("heads_vs_tp", ["--tensor_parallel_size", "3", "--disable_sequence_parallel"], world_size(3),
     "num_attention_heads=4 is not divisible by --tensor_parallel_size 3"),
    ("kv_heads_vs_tp", ["--tensor_parallel_size", "4"],
     model(num_attention_heads=12, num_key_value_heads=6, hidden_size=48), "num_key_value_heads=6 is not divisible by --tensor_parallel_size 4"),
    ("tp_not_multiple_of_kv", ["--tensor_parallel_size", "6", "--disable_sequence_parallel"],
     model(num_attention_heads=12, num_key_value_heads=4, hidden_size=48), "tp=6 is not a multiple of num_key_value_heads=4"),
    ("intermediate_vs_tp", ["--tensor_parallel_size", "4"], model(intermediate_size=66),
     "output features = 66 is not divisible by --tensor_parallel_size 4"),
    ("layers_lt_stages", ["--pipeline_parallel_size", "3", "--num_microbatches", "4"], world_size(3),
     "2 layers cannot fill 3 pipeline stages"),
    ("virtual_stages_gt_layers", ["--pipeline_parallel_size", "2", "--virtual_pipeline_size", "3", "--num_microbatches",
                                  "4", "--pipeline_schedule", "interleaved-1f1b"], FOUR_LAYERS,
     "4 layers cannot fill 6 pipeline stages (pp*virtual_pipeline_size = 2*3)"),
    ("interleaved_needs_v", ["--pipeline_parallel_size", "2", "--num_microbatches", "2", "--pipeline_schedule",
                             "interleaved-1f1b"], None, "--pipeline_schedule interleaved-1f1b needs --virtual_pipeline_size >= 2"),
    ("1f1b_with_v", ["--pipeline_parallel_size", "2", "--virtual_pipeline_size", "2", "--num_microbatches", "2"],
     FOUR_LAYERS, "--pipeline_schedule 1f1b runs one stage per rank but --virtual_pipeline_size 2"),
    ("interleaved_rounds", ["--pipeline_parallel_size", "2", "--virtual_pipeline_size", "2", "--num_microbatches", "5",
                            "--per_device_train_batch_size", "5", "--pipeline_schedule", "interleaved-1f1b"],
     FOUR_LAYERS, "num_microbatches=5 is not a multiple of its 2 rounds; use a multiple of 2"),
    ("batch_vs_microbatches", ["--num_microbatches", "3"], None,
     "--per_device_train_batch_size=4 is not divisible by --num_microbatches=3"),
    ("microbatches_lt_pp", ["--pipeline_parallel_size", "2", "--num_microbatches", "1"], None,
     "needs num_microbatches >= pp, got num_microbatches=1 < pp=2"),
    ("pp_batch_too_small", ["--pipeline_parallel_size", "2", "--per_device_train_batch_size", "1"], None,
     "--pipeline_parallel_size=2 needs at least 2 microbatches per micro-step, but --per_device_train_batch_size=1 "
     "cannot be split into them; use --per_device_train_batch_size 2"),
    ("bad_pipeline_cut", ["--pipeline_parallel_size", "2", "--num_microbatches", "2", "--pipeline_cuts", "model.layers.7"],
     None, "pipeline cut 'model.layers.7' is not a leaf module"),
    ("seq_vs_tp_with_sp", ["--tensor_parallel_size", "2", "--block_size", "15"], None,
     "--block_size=15 is not divisible by --tensor_parallel_size=2 under sequence parallelism"),
    ("seq_vs_tp3_with_sp", ["--tensor_parallel_size", "3", "--block_size", "32"], world_size(3),
     "--block_size=32 is not divisible by --tensor_parallel_size=3 under sequence parallelism; use --block_size 30 or "
     "33 (a multiple of 3) or --disable_sequence_parallel"),
    ("world_not_divisible", ["--tensor_parallel_size", "2"], world_size(3),
     "world size 3 is not divisible by tp*pp = 2*1 = 2"),
    ("layout_larger_than_world", ["--tensor_parallel_size", "2", "--pipeline_parallel_size", "2", "--num_microbatches",
                                  "2"], world_size(2), "world size 2 is not divisible by tp*pp = 2*2 = 4"),
    ("tp_plan_refused", ["--tensor_parallel_size", "2"], file_with("config.json", DOGE_CONFIG, "--model_config"),
     "doge: model.layers.*.self_attn.dt_proj: transformers' style 'rowwise' inside attention has no plait rule"),
    ("duplicate_adapter_claim", [], duplicate_claim, "claimed by two adapters: 'llama'"),
    ("adapter_missing_hook", [], missing_hook, "'half_done' does not implement required hook(s) plait_leaf_modules"),
    ("plan_names_missing_module", [], plan_names_missing_module,
     "names 'model.layers.*.mlp.not_there', but the model (LlamaForCausalLM) has no such module"),
    ("missing_train_file", ["--train_file", "/nonexistent/train.txt"], None,
     "--train_file '/nonexistent/train.txt' does not exist"),
    ("missing_model_config", ["--model_config", "/nonexistent/config.json"], None,
     "--model_config '/nonexistent/config.json' does not exist"),
    ("missing_validation_file", ["--validation_file", "/nonexistent/val.txt"], None, "--validation_file '/nonexistent/val.txt'"),
    ("empty_train_file", [], file_with("empty.txt", "", "--train_file"), "empty.txt: the file is empty"),
    ("empty_jsonl_big_vocab", [], lambda mp, tmp: [*model(vocab_size=300)(mp, tmp), *file_with("e.jsonl", "", "--train_file")(mp, tmp)],
     "e.jsonl"),
    ("config_without_model_type", [], file_with("config.json", '{"hidden_size": 32}', "--model_config"),
     "has no 'model_type'"),
    ("block_larger_than_positions", ["--block_size", "128"], None,
     "--block_size=128 is larger than the model's max_position_embeddings=64; use --block_size 64 or less"),
    ("config_and_pretrained", ["--model_name_or_path", "/tmp"], None, "not both"),
    ("negative_learning_rate", ["--learning_rate", "-1"], None, "--learning_rate=-1.0 must be a finite number >= 0"),
    ("infinite_learning_rate", ["--learning_rate", "inf"], None, "--learning_rate=inf must be a finite number >= 0"),
    ("nan_weight_decay", ["--weight_decay", "nan"], None, "--weight_decay=nan must be a finite number >= 0"),
    ("nan_max_grad_norm", ["--max_grad_norm", "nan"], None, "--max_grad_norm=nan must be >= 0 (0 turns clipping off)"),
    ("unknown_backend", ["--backend", "foo"], None,
     "--backend='foo': foo is not a torch.distributed backend here; use auto or one of"),
    ("block_of_one_token", ["--block_size", "1"], None,
     "--block_size=1 leaves no token to train on (a block's first token has no label); use --block_size 2 or more"),
    ("sp_switch_without_tp", ["--disable_sequence_parallel"], None,
     "--disable_sequence_parallel has no effect without tensor parallelism (--tensor_parallel_size 1)"),
    ("embedding_switch_without_tp", ["--disable_embedding_parallelization"], None,
     "--disable_embedding_parallelization has no effect without tensor parallelism (--tensor_parallel_size 1)"),
    ("negative_steps", ["--max_steps", "-1"], None, "--max_steps=-1 must be >= 0"),
    ("zero_batch", ["--per_device_train_batch_size", "0"], None, "--per_device_train_batch_size=0 must be positive"),
    ("unknown_scheduler", ["--lr_scheduler_type", "exp"], None, "--lr_scheduler_type='exp' is unknown; choose one of"),
    ("unknown_optimizer_dtype", ["--optimizer_dtype", "float16"], None, "choose float32 or bfloat16"),
    ("bf16_and_autocast", ["--bf16", "--bf16_autocast"], None, "not both"),
    ("unknown_pipeline_schedule", ["--pipeline_schedule", "fast"], None, "--pipeline_schedule='fast' is unknown"),
    ("zero_stage_unknown", ["--zero_stage", "5"], None, "--zero_stage=5 must be 0, 1, 2 or 3"),
    ("zero_1_and_stage_2", ["--zero_1", "--zero_stage", "2"], None,
     "--zero_1 is ZeRO stage 1 but --zero_stage is 2; give one of them"),
    ("zero_at_one_rank", ["--zero_stage", "3"], world_size(1),
     "--zero_stage 3 has no effect with one data-parallel rank (world 1 = tp 1 x pp 1): ZeRO shards over the "
     "data-parallel (x cp) ranks; drop it, or launch 2 processes for dp=2"),
    ("zero_1_beside_tp_alone", ["--zero_1", "--tensor_parallel_size", "2"], world_size(2),
     "--zero_1 has no effect with one data-parallel rank (world 2 = tp 2 x pp 1)"),
    ("exclude_embeddings_without_decay", ["--exclude_embeddings_from_weight_decay"], None,
     "--exclude_embeddings_from_weight_decay has no effect with --weight_decay 0 (nothing is decayed)"),
    ("sft_flags_on_plain_text", ["--packing", "--overlong", "drop"], None,
     "--packing, --overlong have no effect: the SFT flags shape .jsonl chat or prompt_completion examples, and this "
     "data is plain text"),
    ("text_field_on_txt", ["--text_field", "body"], None,
     "--text_field has no effect: it names the field of .jsonl lines and the column of Parquet files and "
     "--dataset_name, and this data is .txt files"),
    ("save_steps_past_the_end", ["--save_steps", "10"], None,
     "--save_steps=10 never saves: the run ends at step 3 (--max_steps)"),
    ("save_async_without_a_save_before_the_end", ["--save_steps", "3", "--save_async"], None,
     "--save_async overlaps a checkpoint's writing with the steps after it, and no --save_steps save falls before the "
     "last step (--save_steps 3, --max_steps 3)"),
    ("save_total_limit_without_saves", ["--save_total_limit", "2", "--no_save_final"], None,
     "--save_total_limit=2 has no effect: with --save_steps 0 and --no_save_final this run saves no checkpoint"),
    ("eval_steps_without_evaluation", ["--eval_steps", "2"], None,
     "--eval_steps=2 has no effect without something to evaluate; give --validation_file or --eval_prompts"),
    ("warmup_under_constant", ["--warmup_steps", "2", "--lr_scheduler_type", "constant"], None,
     "--warmup_steps=2 has no effect under --lr_scheduler_type constant; use --lr_scheduler_type "
     "constant_with_warmup"),
    ("max_restarts_under_own_torchrun", ["--max_restarts", "2"], under_own_torchrun,
     "--max_restarts=2 is for plait's launcher, and this process is a worker of a torchrun started by hand; give "
     "torchrun --max-restarts 2 instead"),
    ("nproc_under_own_torchrun", ["--nproc_per_node", "2"], under_own_torchrun,
     "--nproc_per_node=2 launches plait's processes, and this process is a worker of a torchrun started by hand"),
    ("not_an_int", ["--max_steps", "ten"], None, "argument --max_steps: invalid int value: 'ten'"),
    ("toml_unknown_key", [], file_with("run.toml", "learning_rate = 1e-3\nlearnin_rate = 2e-3\n", "--config"),
     "unknown key(s) learnin_rate; valid keys:"),
    ("toml_wrong_type", [], file_with("run.toml", 'max_steps = "ten"\n', "--config"),
     "max_steps = 'ten' should be of type int"),
    ("toml_bool_for_int", [], file_with("run.toml", "max_steps = true\n", "--config"),
     "max_steps = True should be of type int"),
    ("toml_invalid", [], file_with("run.toml", "max_steps = \n", "--config"), "not valid TOML"),
    ("config_not_json", [], file_with("config.json", '{"model_type": "llama", ', "--model_config"),
     "config.json: not valid JSON (Expecting property name enclosed in double quotes"),
    ("config_transformers_refuses", [], file_with("config.json", '{"model_type": "llama", "hidden_size": 30, '
                                                  '"num_attention_heads": 4}', "--model_config"),
     "transformers refuses this llama config: Class validation error for validator 'validate_architecture': "
     "ValueError: The hidden size (30) is not a multiple of the number of attention heads (4)."),
    ("config_unknown_model_type", [], file_with("config.json", '{"model_type": "lama"}', "--model_config"),
     "model_type 'lama' is not one transformers"),
    ("train_dir_without_data", [], lambda mp, tmp: ["--train_file", str((tmp / "empty-dir").mkdir() or tmp / "empty-dir")],
     "is a directory without .txt, .jsonl or .parquet files"),
    ("output_dir_is_a_file", [], lambda mp, tmp: ["--output_dir", str((tmp / "afile").write_text("x") and tmp / "afile")],
     "is an existing file, not a directory; give a directory"),
    ("encoder_decoder", [], file_with("config.json", '{"model_type": "t5", "d_model": 32, "num_heads": 4}',
                                      "--model_config"),
     "t5 is an encoder-decoder model; plait trains decoder-only causal LMs"),
    ("encoder_only", [], file_with("config.json", '{"model_type": "bert", "hidden_size": 32, "num_attention_heads": '
                                                  '4}', "--model_config"),
     "bert is an encoder-only model (its causal-LM head runs only with is_decoder=true in the config)"),
    ("no_causal_lm_class", [], file_with("config.json", '{"model_type": "vit"}', "--model_config"),
     "transformers has no causal-LM or image-text-to-text class for 'vit'"),
    ("vpp_without_pp", ["--virtual_pipeline_size", "3"], None,
     "--virtual_pipeline_size=3 has no effect without pipeline parallelism (--pipeline_parallel_size 1); drop it"),
    ("cp_attention_without_cp", ["--cp_attention", "ring"], None,
     "--cp_attention=ring has no effect without context parallelism (--context_parallel_size 1)"),
    ("lora_settings_without_lora", ["--lora_alpha", "32", "--lora_target_modules", "q_proj"], None,
     "--lora_alpha, --lora_target_modules have no effect without LoRA (--lora_r 0)"),
    ("unknown_device", ["--device", "gpu"], None, "--device='gpu' is not a device torch knows"),
    ("model_config_is_a_directory", [], lambda mp, tmp: ["--model_config", str(tmp)],
     "is a directory; give its config.json, or load the model's weights with --model_name_or_path"),
    ("tokenizer_dir_without_tokenizer", [], lambda mp, tmp: ["--tokenizer_name", str((tmp / "tok").mkdir() or
                                                                                    tmp / "tok")],
     "no tokenizer transformers can load in"),
    ("toml_is_a_directory", [], lambda mp, tmp: ["--config", str(tmp)], "is not a TOML file (IsADirectoryError)"),
    ("preference_row_with_null", ["--method", "dpo"], lambda mp, tmp: preference_rows(tmp, {"chosen": None}),
     "pairs.jsonl line 2: 'chosen' is null; give it as a text, or as a list of chat messages"),
]


def preference_rows(tmp_path: Path, bad: dict) -> list[str]:
    """A DPO run's flags: a model whose vocabulary a chat tokenizer fits, and pairs whose second row is ``bad``."""
    from plait.data.chat_tokenizer import save_chat_tokenizer

    save_chat_tokenizer(["hi four five"] * 4, 300, tmp_path / "tok")
    good = {"prompt": "hi", "chosen": " four", "rejected": " five"}
    (tmp_path / "pairs.jsonl").write_text(json.dumps(good) + "\n" + json.dumps({**good, **bad}) + "\n")
    return ["--model_config", write_config(tmp_path, vocab_size=320), "--tokenizer_name", str(tmp_path / "tok"),
            "--train_file", str(tmp_path / "pairs.jsonl")]


@pytest.fixture(scope="module")
def warm():
    """Pay the one-off import costs (lazy transformers model modules, adapter entry points) up front."""
    from transformers import DogeConfig

    for config in (tiny_config("llama"), tiny_config("gpt2"), DogeConfig(**json.loads(DOGE_CONFIG))):
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(config)
    plait.plugin.registry.default_registry()


def base_flags(tmp_path: Path) -> list[str]:
    path = tmp_path / "base-config.json"
    path.write_text(tiny_config("llama").to_json_string())
    return ["--model_config", str(path), "--output_dir", str(tmp_path / "out"), "--max_steps", "3",
            "--per_device_train_batch_size", "4", "--block_size", "16"]


def never(what: str):
    def reached(*args, **kwargs):
        raise AssertionError(f"bad input reached {what}")
    return reached


@pytest.mark.parametrize("flags, setup, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_refused_at_once(warm, tmp_path, monkeypatch, capsys, flags, setup, message):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(plait.run.trainer, "init_distributed", never("torch.distributed initialisation"))
    monkeypatch.setattr(plait.run.trainer, "materialize", never("the weights"))
    extra = setup(monkeypatch, tmp_path) if setup else []
    argv = ["train", *base_flags(tmp_path), *flags, *extra]  # later flags override earlier ones
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert message in err.strip().splitlines()[-1], err  # the last line says it, without a traceback
    assert not (tmp_path / "out").exists()


# Refusals that need the model (a layout, its limits, an adapter's plan) at a world of 2, or the data, so the
# launching process must plan on the meta model and prepare the data to make them.
NPROC_CASES = ["seq_vs_tp_with_sp", "layout_larger_than_world", "block_larger_than_positions", "tp_plan_refused",
               "bad_pipeline_cut", "plan_names_missing_module", "pp_batch_too_small", "empty_train_file",
               "config_not_json"]


@pytest.mark.parametrize("case", NPROC_CASES)
def test_launcher_refuses_before_any_worker_starts(warm, tmp_path, monkeypatch, capsys, case):
    """``--nproc_per_node 2``: the launching process plans the run on the meta model, so bad input is one line and
    exit 2 there, instead of one line per worker and torchrun's ChildFailedError dump."""
    _, flags, setup, message = next(c for c in CASES if c[0] == case)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(plait.run.torchrun, "run_under_torchrun", never("torchrun"))
    extra = setup(monkeypatch, tmp_path) if setup else []
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *base_flags(tmp_path), "--nproc_per_node", "2", *flags, *extra])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert err.strip().splitlines()[-1].startswith("plait: error: ") and message in err.strip().splitlines()[-1], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, setup, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_every_bad_input_through_the_launcher(warm, tmp_path, monkeypatch, capsys, flags, setup, message):
    """The whole table again through ``--nproc_per_node N`` (2, or the world a row is about): each is one
    ``plait: error:`` line and exit 2 in the launching process, before torchrun starts, and an output dir that
    already holds a run's files gets nothing new."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(plait.run.torchrun, "run_under_torchrun", never("torchrun"))
    nproc = getattr(setup, "world", 2)
    extra = setup(monkeypatch, tmp_path) if setup and not hasattr(setup, "world") else []
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *base_flags(tmp_path), "--nproc_per_node", str(nproc), *flags, *extra])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2, last
    assert message in last and "error: " in last, last
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def checkpoint_dir_without_index(tmp_path: Path) -> list[str]:
    (tmp_path / "ckpt" / "shards").mkdir(parents=True)
    return [str(tmp_path / "ckpt"), str(tmp_path / "hf")]


def unfinished_save(tmp_path: Path) -> list[str]:
    """A checkpoint folder a save left before its rename (``checkpoint-N.tmp``), index and all."""
    (tmp_path / "run" / "checkpoint-2.tmp" / "shards").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint-2.tmp" / "shards" / "index.json").write_text("{}")
    return [str(tmp_path / "run" / "checkpoint-2.tmp"), str(tmp_path / "hf")]


# The other commands: (id, argv, setup(tmp_path) -> more argv, substring of the one line)
COMMAND_CASES = [
    ("consolidate_missing", ["consolidate", "/nonexistent/checkpoint-2", "/tmp/never-written"], None,
     "checkpoint /nonexistent/checkpoint-2 does not exist"),
    ("consolidate_not_a_checkpoint", ["consolidate"], checkpoint_dir_without_index, "is not a plait checkpoint"),
    ("consolidate_unfinished_save", ["consolidate"], unfinished_save,
     "is a save that never finished (a checkpoint loses .tmp when every rank has written it)"),
    ("plan_heads_vs_tp", ["plan", "--tensor_parallel_size", "3", "--world_size", "3", "--block_size", "48"], None,
     "num_attention_heads=4 is not divisible by --tensor_parallel_size 3"),
    ("plan_world_of_none", ["plan", "--world_size", "0"], None, "--world_size=0 must be positive"),
    ("plan_top_none", ["plan", "--search", "--hardware", "h100", "--top", "0"], None, "--top=0 must be positive"),
    ("plan_two_devices", ["plan", "--hardware", "h100", "--calibrate"], None,
     "--hardware h100 and --calibrate both name the device: give one"),
    ("plan_missing_config", ["plan", "--model_config", "/nonexistent/config.json"], None,
     "--model_config '/nonexistent/config.json' does not exist"),
    ("plan_bad_memory", ["plan", "--device_memory", "lots"], None, "--device_memory"),
    ("check_adapter_unknown", ["check-adapter", "no_such_adapter"], None,
     "no installed adapter is named 'no_such_adapter'"),
    ("prepare_data_missing_file", ["prepare-data", "--train_file", "/nonexistent/train.txt"], None,
     "--train_file '/nonexistent/train.txt' does not exist"),
    ("prepare_data_sft_flag_on_text", ["prepare-data", "--train_on_prompt"], None,
     "--train_on_prompt has no effect: the SFT flags shape .jsonl chat or prompt_completion examples"),
    ("prepare_data_vision", ["prepare-data", "--data_format", "vision"], None,
     "plait prepare-data caches text and SFT data; image-text rows (--data_format vision) are encoded by plait train"),
    ("prepare_data_empty_file", ["prepare-data"], lambda tmp: ["--train_file", str((tmp / "e.txt").write_text("")
                                                                                  or tmp / "e.txt")],
     "e.txt: the file is empty"),
]


@pytest.mark.parametrize("argv, setup, message", [c[1:] for c in COMMAND_CASES], ids=[c[0] for c in COMMAND_CASES])
def test_other_commands_refuse_in_one_line(warm, tmp_path, capsys, argv, setup, message):
    """plan, consolidate, check-adapter and prepare-data: one ``plait: error:`` line, exit 2, no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, *(setup(tmp_path) if setup else [])])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert err.strip().splitlines()[-1].startswith("plait: error: ") and message in err.strip().splitlines()[-1], err
    assert "Traceback" not in err
    assert not Path("/tmp/never-written").exists() and not (tmp_path / "hf").exists()


@pytest.mark.parametrize("argv", [["train", "--logging_steps", "x"], ["plan", "--hardware", "h900"], ["trian"],
                                  ["train", "--no_such_flag"], ["consolidate", "ckpt"]],
                         ids=["not_an_int", "not_a_choice", "unknown_command", "unknown_flag", "missing_argument"])
def test_what_argparse_refuses_is_one_line(argv, capsys):
    """A value of the wrong type or not among the choices, an unknown command or flag, a missing argument: one
    ``plait: error:`` line naming it and --help, exit 2 (argparse printed its whole usage above: 74-81 lines)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("plait: error: ") and "--help)" in err, err


# The matrix over every flag: each numeric one given -3, each text one a path that does not exist ("bogus"); each is
# refused in one line naming the flag or the value, or is a value the flag takes, for the reason given here.
TAKES = {
    "output_dir=bogus": "a new directory is made",
    "data_cache_dir=bogus": "a new cache directory is made",
    "seed=-3": "any integer seeds the generators",
    "backend=bogus": "torch.distributed backends are registered by plugins at run time (torch_xla's xla); a single "
                     "process never starts one",
}


def every_flag_value() -> list[tuple[str, str]]:
    from dataclasses import fields

    from plait.run.train_args import TrainArgs

    values = []
    for f in fields(TrainArgs):
        kind = str(f.type)
        if kind in ("int", "float"):
            values.append((f.name, "-3"))
        elif kind.startswith("str"):
            values.append((f.name, "bogus"))
    return values


@pytest.mark.parametrize("name, value", every_flag_value(), ids=[f"{n}={v}" for n, v in every_flag_value()])
def test_every_flag_refuses_a_bad_value(warm, tmp_path, monkeypatch, capsys, name, value):
    if f"{name}={value}" in TAKES:
        pytest.skip(f"--{name} {value} is taken: {TAKES[name + '=' + value]}")
    monkeypatch.chdir(tmp_path)  # "bogus" is resolved here, where nothing of that name exists
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(plait.run.trainer, "init_distributed", never("torch.distributed initialisation"))
    monkeypatch.setattr(plait.run.trainer, "materialize", never("the weights"))
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *base_flags(tmp_path), f"--{name}", value])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2, last
    assert "error: " in last and (name in last or value in last), last
    assert not (tmp_path / "out").exists()


def test_table_is_large_enough():
    assert len(CASES) >= 25 and len({c[0] for c in CASES}) == len(CASES)


def run_plait(argv: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return processes.run(argv, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def test_launcher_refusal_as_a_real_command(tmp_path):
    """``plait train --nproc_per_node 2`` with bad input as a real command (``python -m plait`` is
    ``plait.cli.main()``, plait/__main__.py, which every row of the table runs in-process): exit status 2, one line,
    the last, no traceback, no torchrun started, output_dir untouched."""
    result = run_plait([sys.executable, "-m", "plait", "train", *base_flags(tmp_path), "--nproc_per_node", "2",
                        "--tensor_parallel_size", "2", "--block_size", "15"])
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("plait: error: ")]
    assert len(lines) == 1 and "--block_size=15 is not divisible by --tensor_parallel_size=2" in lines[0]
    assert lines[0] == result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr and "OMP_NUM_THREADS" not in \
        result.stderr + result.stdout  # torchrun prints its OMP banner when it starts: it never did


def test_a_workers_error_is_one_line_for_the_job(tmp_path):
    """Issue 28: an error the workers meet after start-up (a truncated weights file: the launcher checks the
    layout, the workers read the weights) is one ``plait: error:`` line for the job, not one per rank under
    torchrun's report (a traceback and a 20-line summary), and the exit status is the worker's: 2, bad input."""
    model = tmp_path / "model"
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(model)
    weights = model / "model.safetensors"
    with open(weights, "r+b") as file:
        file.truncate(weights.stat().st_size - 100)
    result = run_plait([sys.executable, "-m", "plait", "train", "--model_name_or_path", str(model), "--nproc_per_node",
                        "2", "--output_dir", str(tmp_path / "out"), "--max_steps", "1", "--block_size", "16"])
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert lines == [f"plait: error: {weights}: file has {weights.stat().st_size} bytes but its header describes "
                     f"{weights.stat().st_size + 100} (truncated or appended to)"], result.stderr
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr


def test_workers_lines_are_said_once_with_the_ranks_where_they_differ(tmp_path, capsys):
    from plait.run.torchrun import say_once

    for rank, text in enumerate(["plait: error: A", "plait: error: B", "plait: error: A"]):
        (tmp_path / f"rank{rank}.txt").write_text(text)
    (tmp_path / "failed.txt").write_text("worker rank 0 (h, pid 7) exited with code 2")
    say_once(tmp_path, 3)
    assert capsys.readouterr().err.splitlines() == ["plait: error: ranks 0, 2: A", "plait: error: rank 1: B"]
    (tmp_path / "rank1.txt").write_text("plait: error: A")
    say_once(tmp_path, 3)  # every rank said it: no rank named
    assert capsys.readouterr().err.splitlines() == ["plait: error: A"]
    say_once(tmp_path, 4)  # one rank of four did not: the ranks that said it are named
    assert capsys.readouterr().err.splitlines() == ["plait: error: ranks 0, 1, 2: A"]
    (tmp_path / "failed.txt").write_text("worker rank 3 (h, pid 9) was killed by SIGKILL")
    say_once(tmp_path, 4)  # a killed worker is the culprit: the others' lost connections follow from it
    assert capsys.readouterr().err.splitlines() == ["plait: error: worker rank 3 (h, pid 9) was killed by SIGKILL"]
    for rank in range(3):
        (tmp_path / f"rank{rank}.txt").unlink()
    (tmp_path / "failed.txt").write_text("worker rank 1 (h, pid 8) exited with code 1")
    say_once(tmp_path, 3)  # no worker said why: how the first failed one ended
    assert capsys.readouterr().err.splitlines() == ["plait: error: worker rank 1 (h, pid 8) exited with code 1"]


def test_the_culprit_is_the_worker_a_signal_killed():
    """torchrun reports every failed worker, also those it ended itself; among those it saw first, the one killed
    by a signal (not torchrun's own SIGTERM) is named, rather than a peer that failed on its lost connection."""
    from types import SimpleNamespace as Failure

    from plait.run.torchrun import culprit

    failures = {0: Failure(timestamp=10, exitcode=1), 1: Failure(timestamp=10, exitcode=-9),
                2: Failure(timestamp=10, exitcode=-15)}
    assert culprit(failures)[0] == 1  # seen at once: the killed one, not the peer that lost it, nor a SIGTERM
    failures[1] = Failure(timestamp=20, exitcode=-9)  # killed by torchrun itself after its grace: not the culprit
    assert culprit(failures)[0] == 0
    failures[0], failures[1] = Failure(timestamp=10, exitcode=-15), Failure(timestamp=10, exitcode=2)
    assert culprit(failures)[0] == 1  # the rank that failed, not the one torchrun ended in the same second


def test_torchrun_world_mismatch_exits_without_rendezvous_hang(tmp_path):
    """tp=2 in a world of 3 (as torchrun starts it: RANK, WORLD_SIZE, MASTER_ADDR set): every rank refuses before
    init_process_group, so nothing waits; a rank that went on would wait there for the others and time out."""
    start = time.monotonic()
    outputs = launch([str(WORKERS / "exit_status.py"), "train", *base_flags(tmp_path), "--tensor_parallel_size", "2"],
                     3, timeout=60)
    print(f"world-size mismatch: every rank ended after {time.monotonic() - start:.1f}s")
    for output in outputs:
        assert "world size 3 is not divisible by tp*pp = 2*1 = 2" in output, output
        assert "plait exited with status 2" in output, output
    assert not (tmp_path / "out").exists()


# -- checkpoints: damaged or of another model -----------------------------------------------------------

def _damage(how: str):
    def setup(checkpoint: Path) -> None:
        shard = checkpoint / "shards" / "model-rank00000.safetensors"
        if how == "missing":
            shard.unlink()
        elif how == "truncated":
            shard.write_bytes(shard.read_bytes()[:-100])
        elif how == "corrupted":
            data = bytearray(shard.read_bytes())
            data[-50] ^= 0xFF  # inside the last tensor's bytes: only its checksum can tell
            shard.write_bytes(bytes(data))
    return setup


CHECKPOINT_CASES = [
    ("missing_shard", _damage("missing"), None, "model-rank00000.safetensors is missing (the index lists it)"),
    ("truncated_shard", _damage("truncated"), None, "the index recorded 92080 (truncated or overwritten)"),
    ("corrupted_shard", _damage("corrupted"), None, "is corrupted (xxh3_64 checksum"),
    ("other_architecture", None, "gpt2", "holds a llama model (LlamaForCausalLM) that differs from --model_config's gpt2"),
    ("other_model_size", None, "llama4", "differs from --model_config's llama model (first difference: model.layers.2."),
]


# a resume restores these from the checkpoint (saved with --learning_rate 0.001, --weight_decay 0.0, --block_size 16
# and 2 sequences a step), so other values are refused rather than silently not used
CHANGED_ON_RESUME = [
    ("learning_rate", ["--learning_rate", "0.01"],
     "was saved with --learning_rate 0.001, which a resume restores (optimizer, schedule and data order), so this "
     "run's --learning_rate 0.01 would not take effect"),
    ("weight_decay_and_block", ["--weight_decay", "0.1", "--block_size", "32"],
     "was saved with --weight_decay 0.0 --block_size 16, which"),
    ("global_batch", ["--gradient_accumulation_steps", "2"],
     "was saved by a run of 2 sequences a step (--per_device_train_batch_size x data-parallel ranks x "
     "--gradient_accumulation_steps), this run has 4"),
    ("seed", ["--seed", "7"], "was saved with --seed 0, which a resume restores"),
    ("other_data", ["--train_file", str(default_corpus_path())],
     "examples (blocks, pairs or prompts) and this run's data has"),
]


@pytest.fixture(scope="module")
def small_text(tmp_path_factory) -> str:
    from plait.data import default_corpus_path

    path = tmp_path_factory.mktemp("data") / "train.txt"
    path.write_text(default_corpus_path().read_text()[:30000])
    return str(path)


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory, warm, small_text) -> Path:
    """A single-process run of 2 steps with a checkpoint at step 2."""
    tmp = tmp_path_factory.mktemp("ckpt")
    main(["train", *base_flags(tmp), "--train_file", small_text, "--max_steps", "2", "--save_steps", "2", "--output_dir", str(tmp / "run"),
          "--per_device_train_batch_size", "2"])
    return tmp / "run" / "checkpoint-2"


@pytest.mark.parametrize("damage, model_arch, message", [c[1:] for c in CHECKPOINT_CASES],
                         ids=[c[0] for c in CHECKPOINT_CASES])
def test_bad_checkpoint_refused(saved_checkpoint, small_text, tmp_path, capsys, damage, model_arch, message):
    """Exit 2 with the file and the numbers named, before any training step (no output dir is made)."""
    import shutil

    checkpoint = tmp_path / "checkpoint-2"
    shutil.copytree(saved_checkpoint, checkpoint)
    if damage:
        damage(checkpoint)
    flags = base_flags(tmp_path) + ["--train_file", small_text, "--per_device_train_batch_size", "2",
                                    "--resume_from_checkpoint", str(checkpoint)]
    if model_arch:
        config = tiny_config("gpt2") if model_arch == "gpt2" else tiny_config("llama", num_hidden_layers=4)
        (tmp_path / "other.json").write_text(config.to_json_string())
        flags += ["--model_config", str(tmp_path / "other.json")]
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *flags])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert message in err.strip().splitlines()[-1], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("changed, message", [c[1:] for c in CHANGED_ON_RESUME], ids=[c[0] for c in CHANGED_ON_RESUME])
def test_resuming_with_what_the_checkpoint_restores_changed_is_refused(saved_checkpoint, small_text, tmp_path, capsys,
                                                                        changed, message):
    """Exit 2 naming the checkpoint's values and this run's, before any weight is read (no output dir is made): the
    learning rate, weight decay and schedule come back with the optimizer's state and the data order with the
    sampler's (a changed --learning_rate trained on at the old one; a changed batch failed after loading)."""
    flags = base_flags(tmp_path) + ["--train_file", small_text, "--per_device_train_batch_size", "2",
                                    "--resume_from_checkpoint", str(saved_checkpoint), *changed]
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *flags])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert message in err.strip().splitlines()[-1], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("output, extra, message", [
    ("afile", [], "output directory {tmp}/afile is an existing file; choose a directory"),
    ("afile/sub", [], "output directory {tmp}/afile/sub cannot be made: {tmp}/afile is a file; choose another path"),
    ("hf", ["--max_shard_size", "0"], "max_shard_size='0' is no bytes; give a size such as 5GB or 500MB"),
], ids=["output_is_a_file", "output_under_a_file", "shards_of_no_bytes"])
def test_consolidate_refuses_what_it_cannot_write_in_one_line(saved_checkpoint, tmp_path, capsys, output, extra,
                                                              message):
    """Exit 2 before anything is written: an output path that is a file or lies under one (the OS's
    NotADirectoryError named an internal temporary folder), and shards of no bytes (0 wrote a file per tensor)."""
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit) as exit_info:
        main(["consolidate", str(saved_checkpoint), str(tmp_path / output), *extra])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.strip() == f"plait: error: {message.format(tmp=tmp_path)}", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
