"""GRPO (``plait train --method grpo``): TRL 1.16's GRPOTrainer, its rollouts generated from the policy's own shards.

Each optimizer step takes ``global batch / num_generations`` prompts from the sampler (every rank the same), and the
policy completes each ``num_generations`` times in the training layout (``ParallelModel.generate``: no second copy of
the weights; the step's seed is ``--seed`` and the step, so a resumed run draws what the uninterrupted one drew). Every
rank decodes the completions, calls the reward functions on all of them (TRL's signature) and computes the
advantages (``grpo_loss.advantages``); the rows ``prompt + completion`` (the prompt left padded, the completion right
padded, labelled up to and with its first EOS) are then split over the dp ranks and micro-steps as any batch is, and
each micro-step's loss is an objective of the policy's logits: TRL's per-token term (``grpo_loss.token_terms``, the
log-probs of logits divided by ``--temperature``, as TRL's) weighted by the loss type's fixed weights, so that the
shares of every rank and micro-step sum to one process's loss. With ``--beta`` > 0 the reference is the starting
policy laid out beside it (under LoRA the policy with its adapters off), as DPO's. The forwards pass no position ids,
as TRL's (positions count from the left pad). With ``--num_iterations`` mu > 1, mu optimizer steps train on one batch
of rollouts (the sampler's batch and the seed are the cycle's), their ratios taken to the log-probs the rollouts were
drawn with (kept per rank at the cycle's first step); a checkpoint lands only at a cycle's end (--max_steps and
--save_steps multiples of mu, a stop signal waits for it), so a resumed run regenerates nothing it had. Metrics carry
TRL's names: reward, reward_std, rewards/<func>/mean and /std, frac_reward_zero_std, completions/mean_length, kl,
clip_ratio/low_mean, high_mean and region_mean (token means over the step). Layouts: those generation serves (tp
with SP, pp with one or several stages a rank, whose rows are padded to --block_size, dp, ZeRO-1/2/3, ep, LoRA,
cp). Under cp each rank holds its slice of every row's tokens: the per-token weights, old and reference log-probs
are cut alike (``cp.take`` in the coordinates of the shifted labels), so its share is the sum of its own tokens'
terms and the metrics' sums add over the cp ranks too. An image-text policy reads TRL's vision prompt rows
(``grpo_prompts``): each completion's row carries its prompt's images (``Rollouts.images``) into the decoding, the
policy's forward and the reference's and old log-probs' reads.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from plait.base import comm
from plait.base.config import ConfigError
from plait.base.images import ImageBatch
from plait.base.mesh import Mesh
from plait.base.meta import takes_images
from plait.data import local_microbatch
from plait.data.paths import tokenizer_dir
from plait.data.pixel_loader import read_ahead
from plait.data.tokenizer import load_tokenizer
from plait.data.processors import load_processor, processor_of
from plait.data.vision import check_images_everywhere
from plait.parallel_model import ParallelModel
from plait.run.methods.base import TrainingMethod, micro_rows
from plait.run.methods.dpo import Reference
from plait.run.methods.frozen import SecondModel, frozen_on_mesh, read_rows
from plait.run.methods.grpo_args import call_rewards, reward_funcs, unrewarded
from plait.run.methods.grpo_loss import advantages, kl_k3, logged_rewards, token_terms, token_weights
from plait.run.methods.grpo_prompts import Prompt, prompt_images, read_image_prompts, read_prompts
from plait.run.prompts import completion_text, left_padded, pad_id
from plait.run.runtime import is_main_process
from plait.tp.logprobs import Logits
from plait.tp.loss import IGNORE_INDEX


@dataclasses.dataclass
class Rollouts:
    """A step's completions as training rows [completions, prompt + completion], all on every rank: ids, attention
    mask, labels (the completion's tokens to its first EOS), each completion's advantage, and the weight of each
    position's token term in ``shift_labels``' coordinates (position t: the token at t + 1)."""

    ids: torch.Tensor
    mask: torch.Tensor
    labels: torch.Tensor
    advantages: torch.Tensor
    weights: torch.Tensor
    images: ImageBatch | None = None

    @classmethod
    def build(cls, prompts: list[list[int]], completions: torch.Tensor, eos: int | None, pad: int,
              advantage: torch.Tensor, loss_type: str, max_length: int, micro_rows: list[torch.Tensor],
              multiple: int = 1, length: int = 0, image_prompts: list[Prompt] | None = None) -> Rollouts:
        """``prompts`` (token lists, one per completion) and ``completions`` [completions, new tokens]; bnpo's
        per-device batches are ``micro_rows`` (every rank's micro-batches' rows, in any order). The rows are padded
        on the right to a multiple of ``multiple`` (sequence parallelism's tp), or to ``length`` (pipeline
        parallelism's --block_size): after every token, so changing none. ``image_prompts``: an image-text policy's
        prompt of each completion, whose images the rows carry (``prompt_images``)."""
        prompt_ids, prompt_mask = left_padded(prompts, pad)
        done = completions == eos if eos is not None else torch.zeros_like(completions, dtype=torch.bool)
        # up to and with the first EOS, as TRL's completion mask
        completion_mask = (done.long().cumsum(1) - done.long() == 0).long()
        ids = torch.cat([prompt_ids, completions], dim=1)
        mask = torch.cat([prompt_mask, completion_mask], dim=1)
        labels = torch.cat([torch.full_like(prompt_ids, IGNORE_INDEX),
                            completions.masked_fill(completion_mask == 0, IGNORE_INDEX)], dim=1)
        per_token = token_weights(completion_mask, loss_type, max_length, micro_rows)
        weights = torch.cat([torch.zeros(prompt_ids.shape, dtype=torch.float64), per_token], dim=1)[:, 1:]
        weights = torch.nn.functional.pad(weights, (0, 1))  # shifted: position t weighs the token at t + 1
        extra = max(length - ids.shape[1], 0) or -ids.shape[1] % multiple
        pad_right = lambda t, value: torch.nn.functional.pad(t, (0, extra), value=value)  # noqa: E731
        ids = pad_right(ids, pad)
        pictures = None if image_prompts is None else prompt_images(image_prompts, pad, ids.shape[1])
        return cls(ids, pad_right(mask, 0), pad_right(labels, IGNORE_INDEX), advantage, pad_right(weights, 0.0),
                   pictures)


def _say(line: str) -> None:
    """A line for the user where no trainer's console is at hand: on stderr, from the main process."""
    if is_main_process():
        print(line, file=sys.stderr)


class GRPO(TrainingMethod):
    """Prompts, reward functions and the loss's settings; the reference where ``--beta`` > 0."""

    def __init__(self, prompts: list[Prompt], args: Any, tokenizer: Any, reference: Reference | None,
                 device: torch.device, multiple: int = 1, length: int = 0) -> None:
        self.prompts, self.args, self.tokenizer = prompts, args, tokenizer
        self.reference, self.device = reference, device
        self.multiple = multiple  # the rows' length a multiple of it: tp under SP, times 2 cp under cp
        # under pp every row --block_size long: torch's schedules are built (and kept) per batch shape
        self.length = length
        self.funcs = reward_funcs(args)
        self.eos, self.pad = tokenizer.eos_token_id, pad_id(tokenizer)
        self.epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
        self.rows: torch.Tensor | None = None  # the step's prompts
        self.all_micro: list[torch.Tensor] = []  # every rank's micro-batches' rows of the step (bnpo's batches)
        self.rollouts: Rollouts | None = None
        self.metrics: dict[str, float] = {}
        # each completion's sums over its tokens this step: KL, low / high / either clipped, tokens (by row: torch's
        # pipeline schedules may run a micro-batch's loss more than once, the last time on its real logits)
        self.counts = torch.zeros(0, 5, dtype=torch.float64)
        self.cycle: int | None = None  # the cycle of --num_iterations steps whose rollouts are held
        self.old: torch.Tensor | None = None  # their log-probs as generated (--num_iterations > 1), this rank's rows
        self.say: Callable[[str], None] = _say  # a line for the user (the trainer's console: the main process's)
        self.unrewarded_said = False  # completions no reward function scored: said once per run (``unrewarded``)

    @classmethod
    def load_data(cls, args: Any, model_config: Any, plan: Any) -> tuple[list[Prompt], None, Any]:
        folder = tokenizer_dir(args.tokenizer_name, args.model_name_or_path)
        if folder is None:
            raise ConfigError("--method grpo needs a tokenizer: give --model_name_or_path with one, or "
                              "--tokenizer_name")
        global_batch = args.global_batch(plan.config.dp)
        if global_batch % args.num_generations:
            valid = [g for g in range(2, global_batch + 1) if global_batch % g == 0]
            raise ConfigError(f"--num_generations {args.num_generations} does not divide the global batch of "
                              f"{global_batch} completions (--per_device_train_batch_size x dp x "
                              f"--gradient_accumulation_steps); valid values: {', '.join(map(str, valid))}")
        room = args.block_size - args.max_completion_length
        if takes_images(model_config):  # its processor encodes the prompts and their images
            processor = load_processor(folder)
            pad_id(processor.tokenizer)
            prompts = read_image_prompts(Path(args.train_file), processor, room)
            check_images_everywhere([p.example for p in prompts], plan.config.zero_stage)
            return prompts, None, processor.tokenizer
        tokenizer = load_tokenizer(folder, model_config.vocab_size)
        pad_id(tokenizer)
        return read_prompts(Path(args.train_file), tokenizer, room), None, tokenizer

    @classmethod
    def create(cls, trainer: Any) -> GRPO:
        args, reference = trainer.args, None
        if args.beta != 0.0:
            if trainer.pmodel.plan.lora is not None:
                reference = Reference(trainer.pmodel, adapters_off=True)
            else:
                source = args.model_name_or_path or trainer.pmodel.plan.model_config
                reference = Reference(frozen_on_mesh(source, args, trainer.pmodel, trainer.device))
        config = trainer.pmodel.config
        method = cls(trainer.blocks, args, trainer.tokenizer, reference, trainer.device, config.sequence_multiple,
                     args.block_size if config.pp > 1 else 0)
        method.say = lambda line: trainer.console.print(line, markup=False, highlight=False, soft_wrap=True)
        method.processor = processor_of(tokenizer_dir(args.tokenizer_name, args.model_name_or_path),
                                        trainer.pmodel.plan.model_config)
        return method

    @classmethod
    def second_model(cls, args: Any, model: Any, dtype: torch.dtype) -> SecondModel | None:
        # the starting policy where --beta > 0; none under LoRA (the base, adapters off)
        return SecondModel(model, "GRPO's reference") if args.beta != 0.0 and not args.lora_r else None

    def __len__(self) -> int:
        return len(self.prompts)

    def describe(self, block_size: int) -> str:
        return (f"{len(self):,} prompts, {self.args.num_generations} completions each of up to "
                f"{self.args.max_completion_length} tokens")

    def rows_per_step(self, global_batch: int) -> int:
        return global_batch // self.args.num_generations

    def divisor(self, rows: torch.Tensor) -> int:
        return len(rows) * self.args.num_generations

    def micro_batches(self, rows: torch.Tensor, mesh: Mesh, accumulation: int, device: torch.device) -> list[Any]:
        self.rows, completions = rows, torch.arange(len(rows) * self.args.num_generations)
        self.counts = torch.zeros(len(completions), 5, dtype=torch.float64)  # the step's metrics, filled by row
        self.all_micro = [local_microbatch(completions, rank, mesh.dp, accumulation, micro)
                          for micro in range(accumulation) for rank in range(mesh.dp)]
        return micro_rows(completions, mesh, accumulation)

    def sampler_step(self, step: int) -> int:
        return step // self.args.num_iterations

    def resumable_after(self, steps: int) -> bool:
        return steps % self.args.num_iterations == 0

    def read_ahead(self, step: int, rows: torch.Tensor, mesh: Mesh, accumulation: int) -> None:
        if step % self.args.num_iterations == 0:  # a cycle's first step generates from its prompts' pixels
            read_ahead(self.prompts[int(i)].example for i in rows)

    def before_step(self, pmodel: ParallelModel, batches: list[Any], step: int) -> None:
        """Generate the step's completions from the policy and score them (every rank alike); with --num_iterations
        > 1 only at a cycle's first step, keeping this rank's rows' log-probs under the policy that generated them
        for the ratios of the cycle's steps (TRL's old_per_token_logps)."""
        args, generations, cycle = self.args, self.args.num_generations, step // self.args.num_iterations
        if step % args.num_iterations and self.cycle == cycle:
            return  # the cycle's rollouts once more
        prompts = [self.prompts[int(i)] for i in self.rows for _ in range(generations)]
        ids, mask = left_padded([p.ids for p in prompts], self.pad, self.device)
        width, images = ids.shape[1], prompt_images(prompts, self.pad)
        out = pmodel.generate(ids, mask, max_new_tokens=args.max_completion_length, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, seed=args.seed * 1_000_003 + cycle,
                              eos_token_id=self.eos, pad_token_id=self.pad,
                              images=None if images is None else images.to(self.device))[:, width:].cpu()
        out = torch.nn.functional.pad(out, (0, args.max_completion_length - out.shape[1]), value=self.pad)
        self.score_and_build([p.ids for p in prompts], out, prompts, step + 1)
        self.cycle, self.old = cycle, None
        if args.num_iterations > 1:
            r = self.rollouts
            for rows in batches:  # None on the pipeline stages that compute no loss
                found = read_rows(pmodel, r.ids[rows].to(self.device), r.labels[rows].to(self.device),
                                  self.label_logps, attention_mask=r.mask[rows].to(self.device),
                                  images=self.images_of(rows))
                if found is not None:  # [rows, this rank's tokens]: under cp its slice of each row
                    if self.old is None:
                        self.old = torch.zeros(len(r.ids), found.shape[1], dtype=torch.float64)
                    self.old[rows] = found.cpu().double()

    def score_and_build(self, prompt_ids: list[list[int]], completions: torch.Tensor, prompts: list[Prompt],
                        step: int = 1) -> None:
        """Rewards, advantages and the training rows of ``completions`` [completions, max_completion_length], at step
        ``step`` (as logged, from 1)."""
        tokens = completions.tolist()
        texts, lengths = zip(*(completion_text(row, self.tokenizer, ()) for row in tokens))
        shown = [[{"role": "assistant", "content": t}] if isinstance(p.prompt, list) else t
                 for p, t in zip(prompts, texts)]
        views = {id(p): p.for_rewards() for p in prompts}  # a prompt's images read once for its generations
        given = [views[id(p)][0] for p in prompts]
        columns = {key: [views[id(p)][1].get(key) for p in prompts] for key in prompts[0].columns}
        found = call_rewards(self.funcs, given, shown,
                             [row[:n] for row, n in zip(tokens, lengths)], columns)
        line = unrewarded(found, [name for name, _, _ in self.funcs], given, shown, step)
        if line and not self.unrewarded_said:
            self.say(line)
            self.unrewarded_said = True
        rewards = torch.tensor(found, dtype=torch.float32)
        weights = torch.tensor([w for _, _, w in self.funcs])
        advantage = advantages(rewards, weights, self.args.num_generations, self.args.scale_rewards)
        self.rollouts = Rollouts.build(prompt_ids, completions, self.eos, self.pad, advantage, self.args.loss_type,
                                       self.args.max_completion_length, self.all_micro, self.multiple, self.length,
                                       prompts if prompts[0].example is not None else None)
        self.metrics = {**logged_rewards(rewards, weights, [name for name, _, _ in self.funcs],
                                         self.args.num_generations, self.args.scale_rewards),
                        "completions/mean_length": sum(lengths) / len(lengths)}

    def micro_step(self, pmodel: ParallelModel, batch: torch.Tensor, divisor: int) -> torch.Tensor:
        r = self.rollouts
        ids, mask, labels = (t[batch].to(self.device) for t in (r.ids, r.mask, r.labels))
        images, ref = self.images_of(batch), None
        if self.reference is not None:  # the reference's log-probs of the same tokens, without gradients
            ref = self.reference.read(ids, labels, self.label_logps, attention_mask=mask, images=images)
        weights, advantage = r.weights[batch].to(self.device), r.advantages[batch].to(self.device)
        if pmodel.cp is not None:  # this rank's tokens of each row, in the shifted labels' coordinates
            weights = pmodel.cp.take(weights)
        old = None if self.old is None else self.old[batch].to(self.device)

        def objective(logits: Logits) -> torch.Tensor:
            logps = self.label_logps(logits)
            rows = logits.rows
            own_ref = None if ref is None else ref[rows].to(logps.dtype)
            own_old = None if old is None else old[rows].to(logps.dtype)
            terms = token_terms(logps, own_old, own_ref, advantage[rows], self.args.epsilon, self.epsilon_high,
                                self.args.beta, self.args.use_bias_correction_kl)
            w = weights[rows].to(logps.dtype)
            self.count(batch[rows.cpu()], logps.detach(), own_old, own_ref, advantage[rows], (w > 0).to(logps.dtype))
            return (terms * w).sum()

        return pmodel.train_step(ids, labels, mask, objective=objective, images=images)

    def images_of(self, rows: torch.Tensor) -> ImageBatch | None:
        """The images of the rollouts' ``rows`` (a micro-batch's: contiguous), on the device; None for a text
        policy."""
        images = self.rollouts.images
        if images is None:
            return None
        start = int(rows[0])
        assert rows.tolist() == list(range(start, start + len(rows))), rows  # local_microbatch's slices
        return images.take(slice(start, start + len(rows))).to(self.device)

    def count(self, where: torch.Tensor, logps: torch.Tensor, old: torch.Tensor | None, ref: torch.Tensor | None,
              advantage: torch.Tensor, counted: torch.Tensor) -> None:
        """Keep the KL and clipped tokens of the completions ``where`` (TRL's kl and clip_ratio metrics)."""
        ratio = torch.ones_like(logps) if old is None else torch.exp(logps - old)
        a = advantage[:, None]
        low = ((ratio < 1 - self.args.epsilon) & (a < 0)).to(logps.dtype)
        high = ((ratio > 1 + self.epsilon_high) & (a > 0)).to(logps.dtype)
        kl = torch.zeros_like(logps) if ref is None else kl_k3(ref, logps)
        if self.args.use_bias_correction_kl:  # TRL logs the KL term as it enters the loss
            kl = kl * ratio
        sums = [(kl * counted).sum(-1), (low * counted).sum(-1), (high * counted).sum(-1),
                (torch.maximum(low, high) * counted).sum(-1), counted.sum(-1)]
        self.counts[where] = torch.stack(sums, dim=1).double().cpu()

    def label_logps(self, logits: Logits) -> torch.Tensor:
        """Each position's log-prob of its label under logits divided by --temperature (TRL's)."""
        if self.args.temperature != 1.0:
            logits = dataclasses.replace(logits, values=logits.values / self.args.temperature)
        return logits.label_logps()

    def step_metrics(self, pmodel: ParallelModel) -> dict[str, float]:
        """The rollouts' metrics, and TRL's kl and clip ratios as the step's completion-token means."""
        metrics = dict(self.metrics)
        # each dp rank's own rows (its tp ranks count alike) and cp rank's own tokens of them, counted on the last
        # pipeline stage (the others: 0)
        counts = self.counts.sum(dim=0)
        for group in (pmodel.mesh.dp_group, pmodel.mesh.cp_group, pmodel.mesh.pp_group):
            counts = comm.all_reduce(counts, group)
        kl, low, high, region, tokens = counts.clamp(min=0).tolist()
        tokens = max(tokens, 1.0)
        if self.reference is not None:
            metrics["kl"] = kl / tokens
        metrics.update({"clip_ratio/low_mean": low / tokens, "clip_ratio/high_mean": high / tokens,
                        "clip_ratio/region_mean": region / tokens})
        return metrics

    def step_tokens(self) -> int | None:
        return int(self.rollouts.mask.sum())

    def evaluate(self, pmodel: ParallelModel, data: Any, batch_size: int, device: torch.device) -> dict[str, float]:
        return {}
