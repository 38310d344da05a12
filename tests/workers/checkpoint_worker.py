"""Worker for tests/test_checkpoint_dist.py: one launch runs many checks and writes JSON results (rank 0).

Modes (argv: MODE WORKDIR RESULTS_JSON):
  train   world 2: seeded init equal across layouts; N steps, save, N more at tp=2, tp=1 (dp=2), pp=2
          and ZeRO-1;
          consolidate and compare logits with from_pretrained; load a Hugging Face directory at tp=2.
  resume  world 2, new processes: resume the tp=2 checkpoint (exact losses), reshard tp1 -> tp2 and
          tp2 -> tp1, pp=2 <-> tp=2, ZeRO-1 (dp=2) <-> plain AdamW at tp=2, consolidate the pp=2 checkpoint,
          and try every damaged checkpoint the test prepared under WORKDIR/bad.
  kv4     world 4: Llama with 2 kv heads at tp=4 (replicated kv ranges), save, reshard to tp=2 and tp=1.
The reference for losses is the same training at the saved layout; for weights, plain transformers.
"""

import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig

from plait import ParallelConfig
from plait.base import comm
from plait.checkpoint import CheckpointError, consolidate, load_checkpoint, save_checkpoint
from plait.checkpoint.format import read_index
from plait.checkpoint.gather import gather_full
from plait.checkpoint.materialize import load_parallel_model
from plait.optim import OptimizerStep, build_optimizer

SEED, N, BATCH, SEQ = 7, 3, 4, 16
PP2 = ParallelConfig(pp=2, num_microbatches=2)


def model_configs() -> dict:
    tiny = dict(vocab_size=61, bos_token_id=0, eos_token_id=1)
    return {
        "gpt2": GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                           attn_pdrop=0.0, **tiny),
        # One kv head: at tp=2 both ranks hold it (replicated, gradients summed, saved once).
        "llama": LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=1, max_position_embeddings=64, **tiny),
        "mistral": MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=64, sliding_window=8, **tiny),
    }


def local_batch(step: int, vocab: int, pmodel) -> torch.Tensor:
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(1000 + step))
    return ids.chunk(pmodel.mesh.dp)[pmodel.mesh.dp_rank]


def make_optimizer(pmodel, zero: bool = False):
    """The trainer's optimizer; ``zero``: ZeRO-1, each dp rank holding the AdamW state of its partition."""
    opt = build_optimizer(pmodel, torch.optim.AdamW, zero_1=zero, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4) * 0.9 ** s)
    return opt, sched


def train(pmodel, opt, sched, start: int, stop: int) -> list[float]:
    """Optimizer steps [start, stop) as plait's trainer runs them (train_step, then OptimizerStep)."""
    losses = []
    vocab = pmodel.module.config.vocab_size
    optimizer_step = OptimizerStep(pmodel.grad_sync, opt)
    for step in range(start, stop):
        ids = local_batch(step, vocab, pmodel)
        loss = pmodel.train_step(ids, ids, num_items_in_batch=BATCH * (SEQ - 1))
        optimizer_step()
        sched.step()
        losses.append(comm.all_reduce(loss.detach().clone(), pmodel.mesh.dp_group).item())
    return losses


def full_logits(pmodel, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return pmodel.gather_logits(pmodel(ids))


def max_diff_to_layout(pmodel, other) -> float:
    """Max |full weight of pmodel - full weight of other| over parameters (both gathered)."""
    worst = 0.0
    others = dict(other.module.named_parameters())
    for name, param in pmodel.module.named_parameters():
        a = gather_full(pmodel, name, param.data)
        b = gather_full(other, name, others[name].data)
        worst = max(worst, (a - b).abs().max().item())
    return worst


def consolidated_check(pmodel, ckpt: Path, out: Path, rank: int) -> dict:
    if rank == 0:
        consolidate(ckpt, out)
    dist.barrier()
    hf, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    ids = torch.randint(0, hf.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        diff = (hf(ids).logits - full_logits(pmodel, ids)).abs().max().item()
    return {"logits_diff": diff, "loading_info": {k: sorted(map(str, v)) for k, v in info.items()},
            "files": sorted(os.listdir(out))}


def mode_train(work: Path, rank: int) -> dict:
    results = {}
    for arch, cfg in model_configs().items():
        r = results[arch] = {}
        pm2 = load_parallel_model(cfg, ParallelConfig(tp=2), seed=SEED)
        pm1 = load_parallel_model(cfg, ParallelConfig(tp=1), seed=SEED)
        r["init_diff_tp2_vs_tp1"] = max_diff_to_layout(pm2, pm1)
        other_seed = load_parallel_model(cfg, ParallelConfig(tp=1), seed=SEED + 1)
        r["init_diff_other_seed"] = max_diff_to_layout(pm1, other_seed)
        embed = pm2.module.get_input_embeddings().weight
        r["tied_kept"] = pm2.module.get_output_embeddings().weight is embed
        torch.manual_seed(1234)
        reference = AutoModelForCausalLM.from_config(cfg)
        ref_buffers = dict(reference.named_buffers())
        r["buffer_diff"] = max([(b - ref_buffers[n]).abs().max().item() for n, b in pm2.module.named_buffers()],
                               default=0.0)
        r["buffers"] = sorted(n for n, _ in pm2.module.named_buffers())
        layouts = [("tp2", pm2, False), ("tp1", pm1, False)]
        if arch != "mistral":  # pipeline stages (GPT2: the tied embedding and head on different stages)
            pp2 = load_parallel_model(cfg, PP2, seed=SEED)
            full = dict(pm1.module.named_parameters(remove_duplicate=False))  # tp=1: local == full
            diff = max((p - full[n]).abs().max() for n, p in pp2.module.named_parameters())
            r["init_diff_pp2_vs_tp1"] = comm.all_reduce(diff, comm.world_group(), op="max").item()  # both stages
            layouts.append(("pp2", pp2, False))
        if arch == "llama":
            layouts.append(("zero", load_parallel_model(cfg, ParallelConfig(tp=1), seed=SEED), True))
        for layout, pm, zero in layouts:
            opt, sched = make_optimizer(pm, zero)
            losses = train(pm, opt, sched, 0, N)
            save_checkpoint(work / arch / layout / f"checkpoint-{N}", pm, opt, sched, step=N,
                            extra={"consumed_samples": N * BATCH})
            probe = torch.rand(4).tolist()  # the RNG stream right after the save (training draws none)
            losses += train(pm, opt, sched, N, 2 * N)
            r[layout] = {"losses": losses, "probe": probe}
            if layout == "tp2":
                final = save_checkpoint(work / arch / layout / f"checkpoint-{2 * N}", pm, opt, sched, step=2 * N)
                r["consolidated"] = consolidated_check(pm, final, work / arch / "hf_out", rank)
                _, index = read_index(final)
                r["pieces"] = {name: len(t.pieces) for name, t in index.tensors.items()}
                r["files"] = sorted(index.files)

        # A Hugging Face directory (sharded: several files and model.safetensors.index.json) loaded at tp=2.
        src = work / arch / "hf_src"
        if rank == 0:
            reference.save_pretrained(src, max_shard_size="20KB")
        dist.barrier()
        pm = load_parallel_model(src, ParallelConfig(tp=2))
        state = reference.state_dict()
        r["hf_load_diff"] = max((gather_full(pm, n, p.data) - state[n]).abs().max().item()
                                for n, p in pm.module.named_parameters())
        ids = torch.randint(0, cfg.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(6))
        with torch.no_grad():
            r["hf_load_logits_diff"] = (reference(ids).logits - full_logits(pm, ids)).abs().max().item()
        r["hf_src_files"] = sorted(os.listdir(src))
    return results


def resume(source: Path, cfg, layout: ParallelConfig, *, via_model: bool = False, zero: bool = False) -> dict:
    if via_model:  # build straight from the checkpoint (any layout), then restore optimizer state only
        pm = load_parallel_model(source, layout)
        opt, sched = make_optimizer(pm, zero)
        state = load_checkpoint(source, pm, opt, sched, weights=False)
    else:
        pm = load_parallel_model(cfg, layout, seed=SEED + 1)
        opt, sched = make_optimizer(pm, zero)
        state = load_checkpoint(source, pm, opt, sched)
    probe = torch.rand(4).tolist()
    losses = train(pm, opt, sched, state.step, state.step + N)
    return {"losses": losses, "probe": probe, "step": state.step, "extra": state.extra,
            "resharded": state.resharded, "rng_restored": state.rng_restored}


def mode_resume(work: Path, rank: int) -> dict:
    results = {}
    configs = model_configs()
    for arch, cfg in configs.items():
        results[arch] = {
            "tp2_same": resume(work / arch / "tp2" / f"checkpoint-{N}", cfg, ParallelConfig(tp=2)),
            "tp1_to_tp2": resume(work / arch / "tp1" / f"checkpoint-{N}" / "shards", cfg, ParallelConfig(tp=2)),
            "tp2_to_tp1": resume(work / arch / "tp2" / f"checkpoint-{N}", cfg, ParallelConfig(tp=1), via_model=True),
        }
    for arch in ("gpt2", "llama"):
        pp_ckpt = work / arch / "pp2" / f"checkpoint-{N}"
        results[arch].update(
            pp2_same=resume(pp_ckpt, configs[arch], PP2),
            pp2_to_tp2=resume(pp_ckpt, configs[arch], ParallelConfig(tp=2)),
            tp2_to_pp2=resume(work / arch / "tp2" / f"checkpoint-{N}", configs[arch], PP2),
            pp2_consolidated=consolidated_check(load_parallel_model(pp_ckpt, ParallelConfig(tp=2)), pp_ckpt,
                                                work / arch / "pp2_hf", rank),
        )
    llama = configs["llama"]
    zero_ckpt, tp2_ckpt = work / "llama" / "zero" / f"checkpoint-{N}", work / "llama" / "tp2" / f"checkpoint-{N}"
    results["llama"].update(
        zero_same=resume(zero_ckpt, llama, ParallelConfig(tp=1), zero=True),
        zero_to_tp2=resume(zero_ckpt, llama, ParallelConfig(tp=2)),
        tp2_to_zero=resume(tp2_ckpt, llama, ParallelConfig(tp=1), zero=True),
    )
    pm = load_parallel_model(llama, ParallelConfig(tp=2), seed=SEED)
    opt, sched = make_optimizer(pm)
    bad = {}
    for case in sorted((work / "bad").iterdir()):
        try:
            load_checkpoint(case, pm, opt, sched)
            bad[case.name] = "no error"
        except CheckpointError as exc:
            bad[case.name] = f"CheckpointError: {exc}"
    wider = load_parallel_model(LlamaConfig(**{**llama.to_dict(), "intermediate_size": 96}), ParallelConfig(tp=2))
    try:
        load_checkpoint(work / "llama" / "tp2" / f"checkpoint-{N}", wider)
        bad["config_mismatch"] = "no error"
    except CheckpointError as exc:
        bad["config_mismatch"] = f"CheckpointError: {exc}"
    results["bad"] = bad
    return results


def mode_kv4(work: Path, rank: int) -> dict:
    # 4 heads, 2 kv heads: at tp=4 each kv head is shared by 2 ranks.
    cfg = LlamaConfig(**{**model_configs()["llama"].to_dict(), "num_key_value_heads": 2})
    r = {}
    pm4 = load_parallel_model(cfg, ParallelConfig(tp=4), seed=SEED)
    pm1 = load_parallel_model(cfg, ParallelConfig(tp=1), seed=SEED)
    r["init_diff_tp4_vs_tp1"] = max_diff_to_layout(pm4, pm1)
    opt, sched = make_optimizer(pm4)
    train(pm4, opt, sched, 0, N)
    ckpt = save_checkpoint(work / "kv4" / f"checkpoint-{N}", pm4, opt, sched, step=N)
    _, index = read_index(ckpt)
    r["pieces"] = {name: len(t.pieces) for name, t in index.tensors.items()}
    r["tp4"] = train(pm4, opt, sched, N, 2 * N)
    final = save_checkpoint(work / "kv4" / f"checkpoint-{2 * N}", pm4, opt, sched, step=2 * N)
    r["consolidated"] = consolidated_check(pm4, final, work / "kv4" / "hf_out", rank)
    for name, layout in (("tp2", ParallelConfig(tp=2)), ("tp1", ParallelConfig(tp=1))):
        pm = load_parallel_model(cfg, layout, seed=SEED + 1)
        opt, sched = make_optimizer(pm)
        state = load_checkpoint(ckpt, pm, opt, sched)
        r[name] = train(pm, opt, sched, state.step, state.step + N)
    return r


def main() -> None:
    mode, work, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    results = {"train": mode_train, "resume": mode_resume, "kv4": mode_kv4}[mode](work, rank)
    if rank == 0:
        out.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
