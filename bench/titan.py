"""torchtitan's Llama 3 trainer on the Llama-3.2-1B shapes of bench/gpu.py, one GPU: tokens/s, MFU, memory.

Run by hand on a GPU machine with torchtitan 0.2.2 and the few wheels it needs that the machine lacks (all
pure Python; .whl/titan/ holds them, git-ignored, fetched with `pip download`):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/titan .whl/titan/*.whl
    PYTHONPATH=/tmp/titan python3 bench/titan.py [--steps 10] [--only titan-eager,titan-compile]

Each variant runs in its own process (clean GPU memory and compile caches) and prints one JSON line; the parent
prints the table last. What runs is torchtitan's own Trainer (torchtitan.train.Trainer, a subclass that only
records), configured through torchtitan's own CLI parser (ConfigManager), with torchtitan's llama3 TrainSpec:
its Transformer, parallelize_llama (compile, AC, FSDP), AdamW builder, LR schedulers and cross-entropy loss.
Two things are swapped in the TrainSpec, through its public registry (register_train_spec):
  * model_args: a "1B" flavor with Llama-3.2-1B's dimensions (torchtitan ships 8B/70B/405B/debugmodel only);
  * the dataloader: uniform random token ids (no network, no dataset), wrapped in torchtitan's
    ParallelAwareDataloader exactly as its C4 loader is, yielding ({"input": ids[:-1]}, ids[1:]).
No tokenizer is built (build_tokenizer_fn=None): torchtitan 0.2.2 takes the vocabulary size from the model args,
and only flex/varlen attention needs a tokenizer.

Recipe at world size 1 (reported per run from the live objects, not assumed): data_parallel_shard_degree=-1
resolves to 1, so ParallelDims.fsdp_enabled is False and torchtitan applies neither FSDP nor its
MixedPrecisionPolicy; it runs fp32 parameters (the master weights themselves), fp32 gradients and fp32 AdamW
state, with torch.autocast(cuda, bfloat16) around forward + loss (torchtitan's maybe_enable_amp). titan-bf16*
(opt-in) set training.dtype=bfloat16: bf16 parameters, gradients and AdamW state, no fp32 copy, autocast still on.

torchtitan's Llama 3 cannot tie the embedding and the LM head (0.2.2 has no option), so its model has
1.50 B parameters where the tied HF model has 1.24 B. MFU here uses bench/gpu.py's formula,
6 N + 12 L h s per token over 989e12, with N = every parameter but the input embedding table: the matmul
parameters, the same N and so the same FLOPs as bench/gpu.py's tied count (its tied matrix counted once as the
LM head). mfu_all_params counts the untied embedding too; titan_* are torchtitan's own logged values over the
same timed steps (its N excludes the embedding as well; its peak comes from lspci: 989e12 for H100 SXM).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

from mfu import flops_per_token, peak_flops

VARIANTS = {  # name: (training.dtype, compile)
    "titan-eager": ("float32", False),
    "titan-compile": ("float32", True),
    "titan-bf16": ("bfloat16", False),
    "titan-bf16-compile": ("bfloat16", True),
}
DEFAULT_VARIANTS = "titan-eager,titan-compile"
MARK = "TITAN_BENCH_RESULT "
FLAVORS = {  # TransformerModelArgs keyword arguments
    # Llama-3.2-1B: ffn = 256 * ceil(int(1.5 * int(8 * 2048 / 3)) / 256) = 8192, head_dim 64
    "1B": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim_multiplier=1.5,
               multiple_of=256, norm_eps=1e-5, rope_theta=500000.0),
    # plumbing check only (CPU): same code path, small dims
    "tiny": dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=1024, ffn_dim_multiplier=1.5,
                 multiple_of=64, norm_eps=1e-5, rope_theta=500000.0),
}


# ----------------------------------------------------------------------------------------------- child process

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prepare_environment(cpu: bool) -> str:
    """A one-process torchrun world, offline hubs; returns how the `datasets` import was satisfied."""
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                       "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ[key] = value
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")  # one rank: NCCL's bootstrap stays on the loopback
    # torchtitan.models.llama3 imports torchtitan's HF text dataset module, hence `datasets`, at import time;
    # the benchmark never calls it. The real package is carried; should it fail to import on the machine
    # (pyarrow or fsspec versions), a stub that refuses every use stands in for it.
    try:
        import datasets
        datasets_used = f"datasets {datasets.__version__}"
    except Exception as exc:  # noqa: BLE001 - any import failure of an unused optional dependency
        def _unavailable(*args, **kwargs):
            raise RuntimeError("datasets is stubbed in bench/titan.py (import failed); the benchmark uses "
                               "synthetic data")

        stub = types.ModuleType("datasets")
        stub.__path__ = []
        stub.Dataset = type("Dataset", (), {})
        stub.IterableDataset = type("IterableDataset", (), {})
        stub.load_dataset = _unavailable
        stub_distributed = types.ModuleType("datasets.distributed")
        stub_distributed.split_dataset_by_node = _unavailable
        stub.distributed = stub_distributed
        for name in [n for n in sys.modules if n == "datasets" or n.startswith("datasets.")]:
            del sys.modules[name]
        sys.modules["datasets"] = stub
        sys.modules["datasets.distributed"] = stub_distributed
        datasets_used = f"stub ({type(exc).__name__}: {exc})"
    if cpu:
        _patch_for_cpu()
    return datasets_used


def _patch_for_cpu() -> None:
    """Local plumbing check only: torchtitan picks "cuda" when no accelerator is found (tools/utils.py
    get_device_info) and reads memory statistics through torch.cuda; point both at the CPU."""
    import torch
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"
    for name, fn in {"get_device_name": lambda *a, **k: "cpu",
                     "get_device_properties": lambda *a, **k: types.SimpleNamespace(total_memory=1 << 34),
                     "memory_stats": lambda *a, **k: {}, "reset_peak_memory_stats": lambda *a, **k: None,
                     "empty_cache": lambda *a, **k: None}.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)
    torch.cpu.current_device = lambda: 0  # torch.cpu's returns "cpu"; barrier(device_ids=[...]) wants an int


class _CaptureLogger:
    """Sits in front of torchtitan's metric logger container: keeps the metrics dict it computes per log."""

    def __init__(self, inner):
        self.inner = inner
        self.records: dict[int, dict] = {}

    def log(self, metrics, step):
        self.records[step] = dict(metrics)
        self.inner.log(metrics, step)

    def close(self):
        self.inner.close()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def run_variant(name: str, steps: int, warmup: int, batch: int, seq: int, flavor: str, cpu: bool,
                sdpa_backends: str | None = None) -> dict:
    datasets_used = _prepare_environment(cpu)
    import torch

    import torchtitan
    import torchtitan.models.llama3 as llama3
    from torch.utils.data import IterableDataset
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.config import ConfigManager
    from torchtitan.models.attention import ScaledDotProductAttentionWrapper
    from torchtitan.protocols.train_spec import register_train_spec
    from torchtitan.tools.logging import init_logger
    from torchtitan.train import Trainer

    dtype_name, compile_ = VARIANTS[name]
    total = warmup + steps
    device_is_cuda = not cpu

    class SyntheticTokens(IterableDataset):
        """Uniform random token ids, one (seq + 1)-long sample at a time, shifted as torchtitan's C4 loader does."""

        def __init__(self, vocab: int, seq_len: int, seed: int):
            self.vocab, self.seq_len, self.seed, self.samples = vocab, seq_len, seed, 0

        def __iter__(self):
            generator = torch.Generator().manual_seed(self.seed)
            while True:
                tokens = torch.randint(0, self.vocab, (self.seq_len + 1,), generator=generator)
                self.samples += 1
                yield {"input": tokens[:-1]}, tokens[1:]

        def state_dict(self):
            return {"samples": self.samples}

        def load_state_dict(self, state):
            self.samples = state["samples"]

    def build_synthetic_dataloader(dp_world_size, dp_rank, tokenizer, job_config, infinite=True):
        del tokenizer, infinite
        from dataclasses import asdict
        dataset = SyntheticTokens(FLAVORS[job_config.model.flavor]["vocab_size"], job_config.training.seq_len,
                                  seed=1234 + dp_rank)
        kwargs = {**asdict(job_config.training.dataloader), "batch_size": job_config.training.local_batch_size}
        return ParallelAwareDataloader(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, **kwargs)

    import dataclasses
    spec = dataclasses.replace(
        llama3.get_train_spec(),
        model_args={k: llama3.TransformerModelArgs(**v) for k, v in FLAVORS.items()},
        build_dataloader_fn=build_synthetic_dataloader,
        build_tokenizer_fn=None,
    )
    register_train_spec("llama3_plait_bench", spec)
    if sdpa_backends:  # default: torchtitan's own priority (its wrapper fills an empty class list per instance)
        from torch.nn.attention import SDPBackend
        ScaledDotProductAttentionWrapper.sdpa_backends = [getattr(SDPBackend, b) for b in sdpa_backends.split(",")]

    def sync():
        if device_is_cuda:
            torch.cuda.synchronize()

    class BenchTrainer(Trainer):
        """torchtitan's Trainer, unchanged, plus records: per-step loss tensors (no sync) and two clock reads."""

        bench_losses: list

        def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
            loss = super().forward_backward_step(input_dict=input_dict, labels=labels,
                                                 global_valid_tokens=global_valid_tokens)
            self.bench_losses.append(loss.detach())
            return loss

    dump = tempfile.mkdtemp(prefix="titan-bench-")
    cli = [
        "--job.dump_folder", dump,
        "--job.description", f"plait bench {name}",
        "--model.name", "llama3_plait_bench",
        "--model.flavor", flavor,
        "--training.local_batch_size", str(batch),
        "--training.seq_len", str(seq),
        "--training.steps", str(total),
        "--training.max_norm", "1.0",
        "--training.dtype", dtype_name,
        "--training.mixed_precision_param", "bfloat16",
        "--training.mixed_precision_reduce", "float32",
        "--parallelism.data_parallel_shard_degree", "-1",
        "--activation_checkpoint.mode", "none",
        "--optimizer.name", "AdamW",
        "--optimizer.lr", "1e-4",
        "--optimizer.beta1", "0.9",
        "--optimizer.beta2", "0.999",
        "--optimizer.eps", "1e-8",
        "--optimizer.weight_decay", "0.01",  # torch.optim.AdamW's defaults, as bench/gpu.py uses them
        "--optimizer.implementation", "fused",
        "--lr_scheduler.warmup_steps", "0",
        "--lr_scheduler.decay_ratio", "0.0",  # constant lr 1e-4
        "--metrics.log_freq", str(total),
        "--metrics.disable_color_printing",
        "--checkpoint.no-enable",
        "--debug.seed", "0",
    ]
    if compile_:
        cli += ["--compile.enable", "--compile.components", "model,loss"]
    else:
        cli += ["--compile.no-enable"]

    init_logger()
    config = ConfigManager().parse_args(cli)
    started = time.perf_counter()
    trainer = BenchTrainer(config)
    trainer.bench_losses = []
    setup_s = time.perf_counter() - started

    # torchtitan logs (a synchronizing loss.item()) at step 1, at the end of the warm-up and at the last step, so
    # its own tps / mfu of the last log cover exactly the timed steps; the clock is read at the same points.
    metrics = trainer.metrics_processor
    capture = _CaptureLogger(metrics.logger)
    metrics.logger = capture
    metrics.should_log = lambda step: step in (1, warmup, total)
    clock: dict[str, float] = {}
    original_log = metrics.log

    def log(step, *args, **kwargs):
        if step == total:
            sync()
            clock["end"] = time.perf_counter()
            if device_is_cuda:
                clock["peak_allocated"] = torch.cuda.max_memory_allocated()
                clock["peak_reserved"] = torch.cuda.max_memory_reserved()
        original_log(step, *args, **kwargs)
        if step == warmup:
            sync()
            if device_is_cuda:
                torch.cuda.reset_peak_memory_stats()
            clock["start"] = time.perf_counter()

    metrics.log = log
    train_started = time.perf_counter()
    try:
        trainer.train()
        try:  # the measurement stands even if a description fails
            recipe = describe_recipe(trainer, config, ScaledDotProductAttentionWrapper)
        except Exception as exc:  # noqa: BLE001
            recipe = {"error": f"{type(exc).__name__}: {exc}"}
        try:
            recipe.setdefault("attention", {})["sdpa_backend_probe"] = sdpa_backend_probe(
                trainer.model_args, seq, recipe["attention"].get("sdpa_backends"), trainer.device)
        except Exception as exc:  # noqa: BLE001
            recipe["attention"]["sdpa_backend_probe"] = f"probe failed: {type(exc).__name__}: {exc}"
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if "start" not in clock or "end" not in clock:
        raise RuntimeError(f"training stopped early: clock {clock}, step {trainer.step} of {total}")

    model = trainer.model_parts[0]
    params_total = sum(p.numel() for p in model.parameters())
    params_embedding = model.tok_embeddings.weight.numel()
    params_matmul = params_total - params_embedding
    margs = trainer.model_args
    seconds = (clock["end"] - clock["start"]) / steps
    tokens_per_s = batch * seq / seconds
    device_name = torch.cuda.get_device_name() if device_is_cuda else "cpu"
    peak = peak_flops(device_name)
    tflops = tokens_per_s * flops_per_token(params_matmul, margs.n_layers, margs.dim, seq)
    titan = capture.records.get(total, {})
    losses = [float(x) for x in trainer.bench_losses]
    return {
        "variant": name, "torchtitan": torchtitan.__version__, "torch": torch.__version__, "device": device_name,
        "params_total": params_total, "params_no_embedding": params_matmul, "params_embedding": params_embedding,
        "steps": steps, "warmup": warmup, "batch": batch, "seq": seq,
        "step_s": seconds, "tokens_per_s": tokens_per_s, "tflops": tflops / 1e12,
        "mfu": tflops / peak if peak else None,
        "mfu_all_params": (tokens_per_s * flops_per_token(params_total, margs.n_layers, margs.dim, seq) / peak
                           if peak else None),
        "titan_tps": titan.get("throughput(tps)"), "titan_tflops": titan.get("tflops"),
        "titan_mfu": None if titan.get("mfu(%)") is None else titan["mfu(%)"] / 100,
        "titan_peak_flops": metrics.gpu_peak_flops, "titan_flops_per_token": metrics.num_flops_per_token,
        "titan_mem_max_active_gib": titan.get("memory/max_active(GiB)"),
        "titan_mem_max_reserved_gib": titan.get("memory/max_reserved(GiB)"),
        "titan_loss_last": titan.get("loss_metrics/global_avg_loss"), "titan_grad_norm_last": titan.get("grad_norm"),
        "peak_gpu_gib": clock["peak_allocated"] / 2**30 if "peak_allocated" in clock else None,
        "peak_reserved_gib": clock["peak_reserved"] / 2**30 if "peak_reserved" in clock else None,
        "loss_first": losses[0], "loss_last": losses[-1], "n_losses": len(losses),
        "setup_s": setup_s, "warmup_s": clock["start"] - train_started, "datasets": datasets_used,
        "recipe": recipe,
    }


def describe_recipe(trainer, config, sdpa_wrapper_cls) -> dict:
    """What torchtitan actually ran, read from the live trainer after training."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    model = trainer.model_parts[0]
    params = list(model.parameters())
    optimizer = trainer.optimizers.optimizers[0]
    state = optimizer.state.get(params[0], {})
    amp = trainer.maybe_enable_amp
    blocks = list(model.layers.values())
    compiled_blocks = sum(isinstance(b, torch._dynamo.eval_frame.OptimizedModule) for b in blocks)
    sdpa = next((m for m in model.modules() if isinstance(m, sdpa_wrapper_cls)), None)
    first = blocks[0]._orig_mod if hasattr(blocks[0], "_orig_mod") else blocks[0]
    margs = trainer.model_args
    pdims = trainer.parallel_dims
    return {
        "world_size": pdims.world_size, "dp_shard": pdims.dp_shard, "fsdp_enabled": pdims.fsdp_enabled,
        "fsdp_modules": sum(isinstance(m, FSDPModule) for m in model.modules()),
        "param_dtypes": sorted({str(p.dtype) for p in params}),
        "grad_dtypes": sorted({str(p.grad.dtype) for p in params if p.grad is not None}),
        "optimizer_state_dtype": str(state["exp_avg"].dtype) if "exp_avg" in state else None,
        "master_weights": "the parameters themselves (no separate copy)",
        "autocast": (f"torch.autocast({amp.device}, {amp.fast_dtype})" if isinstance(amp, torch.autocast)
                     else f"none ({type(amp).__name__}: FSDP MixedPrecisionPolicy param "
                          f"{config.training.mixed_precision_param} reduce {config.training.mixed_precision_reduce})"),
        "training_dtype": config.training.dtype,
        "compile": {"scope": ("each TransformerBlock torch.compile(fullgraph=True) + the loss function; embedding, "
                              "final norm and output projection eager") if config.compile.enable else "eager",
                    "enable": config.compile.enable, "components": list(config.compile.components),
                    "backend": config.compile.backend, "compiled_blocks": f"{compiled_blocks}/{len(blocks)}",
                    "loss_compiled": hasattr(trainer.loss_fn, "_torchdynamo_orig_callable")
                    or "OptimizedModule" in type(trainer.loss_fn).__name__},
        "activation_checkpoint": config.activation_checkpoint.mode,
        "loss": "torchtitan cross_entropy_loss: logits.float(), sum / valid tokens",
        "optimizer": {"class": type(optimizer).__name__,
                      **{k: optimizer.defaults.get(k) for k in ("lr", "betas", "eps", "weight_decay", "fused",
                                                                 "foreach")}},
        "lr_schedule": f"warmup {config.lr_scheduler.warmup_steps}, decay_ratio {config.lr_scheduler.decay_ratio} "
                       "(constant)",
        "grad_clip": f"torchtitan clip_grad_norm_ foreach, max_norm {config.training.max_norm}",
        "attention": {"attn_type": getattr(margs, "attn_type", "sdpa"),
                      "sdpa_backends": [b.name for b in sdpa.sdpa_backends] if sdpa is not None else None},
        "tied_embeddings": model.output.weight is model.tok_embeddings.weight,
        "ffn_hidden": first.feed_forward.w1.out_features,
        "n_layers": margs.n_layers, "dim": margs.dim, "n_heads": margs.n_heads, "n_kv_heads": margs.n_kv_heads,
        "vocab": margs.vocab_size, "rope_theta": margs.rope_theta,
        "rope_scaling": dataclass_dict(margs.rope_scaling_args),
        "gc": f"automatic gc off, gc.collect every {config.training.gc_freq} steps (torchtitan GarbageCollection)",
        "data": "synthetic uniform token ids via torchtitan ParallelAwareDataloader; H2D copy per step (blocking)",
    }


def sdpa_backend_probe(margs, seq: int, backends: list[str] | None, device) -> str | None:
    """The first of torchtitan's SDPA backends (its priority order) that runs forward + backward on these shapes
    (bf16, causal, GQA): the kernel its attention gets, short of a profile."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    head_dim = margs.dim // margs.n_heads
    n_kv = margs.n_kv_heads or margs.n_heads
    for name in backends or []:
        try:
            q = torch.randn(1, margs.n_heads, seq, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(1, n_kv, seq, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn(1, n_kv, seq, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
            with sdpa_kernel([getattr(SDPBackend, name)]):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=n_kv != margs.n_heads)
                out.sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            return name
        except Exception:  # noqa: BLE001 - "No available kernel" and kin: try the next backend
            continue
    return None


def dataclass_dict(obj) -> dict:
    import dataclasses
    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else {"value": repr(obj)}


# ---------------------------------------------------------------------------------------------- parent process

def child(variant: str, ns: argparse.Namespace, timeout: float, log_dir: Path) -> dict:
    """One variant in its own process and session, its output in files (no pipe a compile worker could hold
    open); past its time the whole session is killed."""
    args = [sys.executable, __file__, "--variant", variant, "--steps", str(ns.steps), "--warmup", str(ns.warmup),
            "--batch", str(ns.batch), "--seq", str(ns.seq)]
    if ns.tiny:
        args.append("--tiny")
    if ns.cpu:
        args.append("--cpu")
    if ns.sdpa_backends:
        args += ["--sdpa-backends", ns.sdpa_backends]
    out_path, err_path = log_dir / f"{variant}.stdout.log", log_dir / f"{variant}.stderr.log"
    started = time.perf_counter()
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(args, stdout=out, stderr=err, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            code = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            code = f"killed after {timeout:.0f} s (--budget)"
    wall = time.perf_counter() - started
    stdout = out_path.read_text(errors="replace")
    stderr = err_path.read_text(errors="replace")
    for line in reversed(stdout.splitlines()):
        if line.startswith(MARK):
            row = json.loads(line[len(MARK):])
            row["wall_s"] = wall
            return row
    tail = [line for line in (stdout + "\n" + stderr).strip().splitlines() if line.strip()][-25:]
    return {"variant": variant, "error": f"exit {code}", "wall_s": wall, "tail": tail}


def fmt(value, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps after the warm-up")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--only", default=DEFAULT_VARIANTS, help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--budget", type=float, default=225.0, help="seconds for all variants; a child past it is "
                                                                       "killed and reported")
    parser.add_argument("--tiny", action="store_true", help="small model (plumbing check)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU with gloo (plumbing check, use --tiny)")
    parser.add_argument("--sdpa-backends", help="SDPBackend names in priority order, e.g. FLASH_ATTENTION "
                                                   "(default: torchtitan's CUDNN_ATTENTION,FLASH_ATTENTION,MATH)")
    parser.add_argument("--log-dir", help="full child logs and titan-results.json (default: $OUT if set)")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.warmup < 2:
        parser.error("--warmup must be at least 2 (torchtitan logs step 1 on its own)")
    flavor = "tiny" if ns.tiny else "1B"
    if ns.variant:
        row = run_variant(ns.variant, ns.steps, ns.warmup, ns.batch, ns.seq, flavor, ns.cpu, ns.sdpa_backends)
        print(MARK + json.dumps(row), flush=True)
        return

    names = [n for n in ns.only.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    log_dir = Path(ns.log_dir or os.environ.get("OUT") or tempfile.mkdtemp(prefix="titan-bench-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"torchtitan llama3 trainer, flavor {flavor}, batch {ns.batch} x {ns.seq}, {ns.steps} timed steps after "
          f"{ns.warmup} warm-up (device, versions, recipe: each JSON line); logs in {log_dir}", flush=True)
    deadline = time.perf_counter() + ns.budget
    rows = []
    for name in names:
        remaining = deadline - time.perf_counter()
        if remaining < 5:
            row = {"variant": name, "error": "skipped: --budget spent"}
        else:
            row = child(name, ns, remaining, log_dir)
        print(json.dumps(row), flush=True)
        rows.append(row)
    (log_dir / "titan-results.json").write_text(json.dumps(rows, indent=1))

    print()
    header = (f"{'variant':<20} {'step_s':>7} {'tokens/s':>9} {'mfu':>6} {'titan_tps':>9} {'titan_mfu':>9} "
              f"{'peak_GiB':>8} {'loss first->last':>17} {'wall_s':>6}")
    print(header)
    for row in rows:
        if "error" in row:
            print(f"{row['variant']:<20} ERROR {row['error']}")
            continue
        print(f"{row['variant']:<20} {fmt(row['step_s'], '7.4f')} {fmt(row['tokens_per_s'], '9.0f')} "
              f"{fmt(row['mfu'], '6.1%')} {fmt(row['titan_tps'], '9.0f')} {fmt(row['titan_mfu'], '9.1%')} "
              f"{fmt(row['peak_gpu_gib'], '8.2f')} {fmt(row['loss_first'], '8.4f')}->{fmt(row['loss_last'], '<8.4f')} "
              f"{fmt(row.get('wall_s'), '6.0f')}")
    device = next((row["device"] for row in rows if "device" in row), "?")
    torch_version = next((row["torch"] for row in rows if "torch" in row), "?")
    print(f"{device}, torch {torch_version}; "
          "mfu: bench/gpu.py's 6N+12Lhs, N = parameters without the (untied) input embedding = the tied model's N; "
          "recipe per variant in its JSON line")
    if any("error" in row for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
