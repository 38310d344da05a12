"""One rank on CUDA with NCCL and real one-rank process groups (PLAIT_SINGLETON_GROUPS=1): every collective
call site gets device tensors. Loads a Hugging Face dir lazily onto the GPU, compares logits with plain
transformers, then takes ZeRO-1 + fp32-master optimizer steps and checks where every tensor lives.

    PLAIT_SINGLETON_GROUPS=1 torchrun --nproc_per_node 1 tests/workers/gpu_worker.py HF_DIR
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM

from plait.base import comm
from plait.base.config import ParallelConfig
from plait.checkpoint.materialize import load_parallel_model
from plait.optim import OptimizerStep, build_optimizer
from plait.run.runtime import init_distributed, pick_device


def main(hf_dir: str) -> None:
    assert comm.singleton_groups(), "run with PLAIT_SINGLETON_GROUPS=1"
    device = pick_device("cuda")
    assert init_distributed(device, "nccl", 120)
    assert torch.distributed.get_backend() == "nccl"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    pmodel = load_parallel_model(hf_dir, ParallelConfig(zero_1=True), device=device)
    assert all(p.device.type == "cuda" for p in pmodel.parameters()), "a parameter stayed off the GPU"
    assert all(b.device.type == "cuda" for b in pmodel.buffers()), "a buffer stayed off the GPU"
    assert pmodel.mesh.dp_group is not None and pmodel.mesh.tp_group is not None, "groups of one were not built"
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device)
    ids = torch.randint(0, reference.config.vocab_size, (2, 32), device=device)
    with torch.no_grad():
        ours, theirs = pmodel(ids).float(), reference(input_ids=ids, use_cache=False).logits.float()
    error = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    assert error < 1e-5, f"logits of the lazily loaded model differ from transformers': rel {error:.2e}"

    # bf16 parameters, fp32 masters, ZeRO-1 over a real (one-rank) dp group: every reduce and broadcast on NCCL.
    pmodel.to(torch.bfloat16)
    optimizer = build_optimizer(pmodel, torch.optim.AdamW, lr=1e-3, optimizer_dtype=torch.float32, fused=True)
    step = OptimizerStep(pmodel.grad_sync, optimizer, max_grad_norm=1.0)
    losses = []
    with comm.count_collectives() as counter:
        for _ in range(3):
            losses.append(pmodel.train_step(ids, ids).item())
            norm = step()
    assert counter.count() > 0, "no collective ran: the call sites were not exercised"
    assert norm.device.type == "cuda" and torch.isfinite(norm), norm
    assert losses[-1] < losses[0], losses
    state = [t for s in optimizer.optim.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    assert state and all(t.device.type == "cuda" and t.dtype == torch.float32 for t in state)
    print(f"GPU OK: logits rel error {error:.2e}, losses {losses}, collectives {counter.count()} "
          f"({sorted({op for op, _ in counter.records})})")


if __name__ == "__main__":
    main(sys.argv[1])
