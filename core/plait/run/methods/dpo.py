"""DPO and its family (``plait train --method dpo``): TRL 1.16's DPOTrainer on any layout.

Each micro-step takes this rank's preference pairs as rows, each pair's chosen completion beside its rejected one
(``pair_rows``: one forward for both, as TRL concatenates them), and the reference model's summed log-probs of the
same rows. The policy's loss is an objective of its logits (``plait.tp.logprobs``): each row's summed log-prob of
its completion (vocab-parallel under tp, summed over the cp ranks' slices under cp, on the last pipeline stage under
pp), then ``PreferenceLoss`` per pair, summed and divided by the global batch's pair count, so any split over ranks
and micro-steps gives one process's loss.

The reference is the starting policy (or --ref_model_name_or_path), laid out on the same mesh as a second, frozen
model, read forward-only each step; under LoRA it is the policy's frozen base, read with the adapters off (TRL's and
peft's way: no second copy); with --precompute_ref_log_probs it is read once over the whole dataset before the first
step (a second model then dropped). TRL's metrics (rewards/chosen, rewards/rejected, rewards/accuracies,
rewards/margins, logps/chosen, logps/rejected) are means over the global batch's pairs. An image-text policy's pairs
are TRL's vision preference rows (``preference_images``): each pair's two rows carry the prompt's images into the
policy's forward, the reference's and the evaluation's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from plait.base import comm
from plait.base.config import ConfigError
from plait.base.images import ImageBatch
from plait.base.mesh import Mesh
from plait.base.meta import takes_images
from plait.base.meta import build_meta_model
from plait.checkpoint.materialize import resolve_source
from plait.data.paths import tokenizer_dir
from plait.data.pixel_loader import read_ahead
from plait.data.tokenizer import load_tokenizer
from plait.data.processors import load_processor, processor_of
from plait.data.vision import check_images_everywhere
from plait.lora import switch
from plait.parallel_model import ParallelModel
from plait.run.methods.base import TrainingMethod, micro_rows
from plait.run.methods.frozen import SecondModel, check_vocabulary, frozen_on_mesh, read_rows
from plait.run.methods.preference_data import DOC, Pair, pack_pairs, pair_rows, read_pairs, real_tokens
from plait.run.methods.preference_images import pair_images, read_image_pairs
from plait.run.methods.preference_loss import PairLogps, PreferenceLoss
from plait.tp.logprobs import Logits
from plait.tp.loss import IGNORE_INDEX, labelled_tokens

# ids, labels, rows' completion tokens, pair ids, and under --packing the packed rows (pack_pairs), else None
Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple | None, ImageBatch | None]


class DPO(TrainingMethod):
    """Preference pairs, the loss's settings and the reference: a frozen model on the same mesh, or a table of
    every row's log-prob read from it before training (--precompute_ref_log_probs)."""

    def __init__(self, pairs: list[Pair], loss: PreferenceLoss, reference: Reference | None, pad_id: int,
                 max_length: int, truncation_mode: str, batch_pairs: int, precompute: bool,
                 device: torch.device, val_pairs: list[Pair] | None = None, mesh: Mesh | None = None,
                 masked: bool = False, packing: bool = False) -> None:
        self.pairs, self.loss, self.pad_id, self.batch_pairs = pairs, loss, pad_id, batch_pairs
        self.max_length, self.truncation_mode = max_length, truncation_mode
        self.reference = reference  # None: a reference-free loss (CPO, ORPO), whose reference log-probs are zeros
        # an MoE model's load-balancing loss counts real tokens only, as TRL's (its collator's attention mask)
        self.masked = masked
        self.table: torch.Tensor | None = None  # precomputed: [pairs, 2] reference log-probs
        self.val_table: torch.Tensor | None = None  # the same for the validation pairs
        mesh = reference.model.mesh if reference is not None else mesh
        config = mesh.config
        self.multiple = config.sequence_multiple  # the sequence length the layout splits
        # under pp every row is padded to --block_size: torch's schedules are built (and kept) per batch shape, and a
        # length per batch would build a new one almost every step
        self.length = -(-max_length // self.multiple) * self.multiple if mesh.pp > 1 else None
        # --packing: the policy reads a micro-batch's pairs packed into rows of up to two --block_size (a pair always
        # fits), documents kept apart by their position ids; under pp those rows are that long and fill the schedule's
        # micro-batches (an empty row where one is short); the reference reads them unpacked (pack_pairs)
        self.packing = packing
        self.capacity = -(-2 * max_length // self.multiple) * self.multiple
        self.rows_multiple = config.num_microbatches if mesh.pp > 1 else 1
        self.seen: list[tuple[torch.Tensor, ...]] = []  # the step's (policy, nll, reference, tokens) by row
        self.step_pairs, self.tokens = 0, 0  # the step's global pairs, and the tokens of its padded rows
        self.chosen_tokens = 1  # the step's chosen tokens the NLL averages over (sft's divisor)
        self.local_tokens = 0  # the tokens of this rank's rows in the step
        if precompute:
            self.table = self._read_all(pairs, reference.logps, mesh, device)
            if val_pairs is not None:
                self.val_table = self._read_all(val_pairs, reference.logps, mesh, device)
            self.reference = None  # a second model's memory back before training starts

    @classmethod
    def load_data(cls, args: Any, model_config: Any, plan: Any) -> tuple[list[Pair], list[Pair] | None, Any]:
        if not args.train_file:
            raise ConfigError("--method dpo needs --train_file: a .jsonl of preference rows ('prompt', 'chosen', "
                              "'rejected')")
        folder = tokenizer_dir(args.tokenizer_name, args.model_name_or_path)
        if folder is None:
            raise ConfigError("--method dpo needs a tokenizer: give --model_name_or_path with one, or --tokenizer_name")
        if args.ref_model_name_or_path:  # before any process group: its config alone
            check_vocabulary("--ref_model_name_or_path", args.ref_model_name_or_path, "reference", "policy",
                             model_config)
        args.refuse_unread(("train_on_prompt", "overlong"), "--method dpo trains on each pair's completions and "
                           "truncates pairs by its own rules (--truncation_mode)")
        check_packing(args, model_config)
        if takes_images(model_config):  # its processor encodes the prompts and their images
            check_image_pairs(args)
            processor = load_processor(folder)
            tokenizer = processor.tokenizer

            def read(path: str) -> list[Pair]:
                pairs = read_image_pairs(Path(path), processor, args.block_size)
                check_images_everywhere([pair.example for pair in pairs], plan.config.zero_stage)
                return pairs
        else:
            tokenizer = load_tokenizer(folder, model_config.vocab_size)
            read = lambda path: read_pairs(Path(path), tokenizer, args.block_size, args.truncation_mode)  # noqa: E731
        return read(args.train_file), read(args.validation_file) if args.validation_file else None, tokenizer

    @classmethod
    def create(cls, trainer: Any) -> "DPO":
        args = trainer.args
        loss = PreferenceLoss(args.beta, tuple(args.dpo_loss_types()), args.dpo_loss_weights(), args.label_smoothing)
        if trainer.pmodel.plan.lora is not None and not args.ref_model_name_or_path:
            reference = Reference(trainer.pmodel, adapters_off=True)  # the base: peft's disable_adapter, no copy
        else:
            source = args.ref_model_name_or_path or args.model_name_or_path or trainer.pmodel.plan.model_config
            reference = Reference(frozen_on_mesh(source, args, trainer.pmodel, trainer.device))
        tokenizer = trainer.tokenizer
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        method = cls(trainer.blocks, loss, reference, pad_id, args.block_size, args.truncation_mode,
                     args.per_device_train_batch_size, args.precompute_ref_log_probs, trainer.device,
                     trainer.val_blocks, masked=routed(trainer.pmodel), packing=args.packing)
        method.processor = processor_of(tokenizer_dir(args.tokenizer_name, args.model_name_or_path),
                                        trainer.pmodel.plan.model_config)
        return method

    def describe(self, block_size: int) -> str:
        return f"{len(self):,} preference pairs of up to {block_size} tokens"

    @classmethod
    def second_model(cls, args: Any, model: Any, dtype: torch.dtype) -> SecondModel | None:
        # none under LoRA (the base, adapters off) nor precomputed (freed before the first step)
        if args.precompute_ref_log_probs or (args.lora_r and not args.ref_model_name_or_path):
            return None
        if not args.ref_model_name_or_path:
            return SecondModel(model, "DPO's reference")  # the policy as it starts: the same shapes
        return SecondModel(build_meta_model(resolve_source(args.ref_model_name_or_path)[0], dtype), "DPO's reference")

    def __len__(self) -> int:
        return len(self.pairs)

    def divisor(self, rows: torch.Tensor) -> int:
        if self.loss.sft_weight:  # TRL's sft term is a mean over the global batch's chosen tokens
            ids, labels = pair_rows(self.pairs, rows.tolist(), self.pad_id, self.max_length, self.truncation_mode, 1)
            self.chosen_tokens = int(labelled_tokens(self.model_labels(ids, labels)[0::2]).sum())
        return len(rows)  # the global batch's pairs: the loss and every metric are means over them

    def micro_batches(self, rows: torch.Tensor, mesh: Mesh, accumulation: int, device: torch.device) -> list[Batch]:
        batches, self.local_tokens = [], 0
        for micro in micro_rows(rows, mesh, accumulation):
            pairs = micro.tolist()
            ids, labels = pair_rows(self.pairs, pairs, self.pad_id, self.max_length, self.truncation_mode,
                                    self.multiple, self.length)
            tokens, labels = labelled_tokens(labels), self.model_labels(ids, labels)
            packed = None
            if self.packing:
                packed = pack_pairs(ids, labels, self.pad_id, self.capacity, self.multiple, self.rows_multiple,
                                    self.capacity if self.length else None)
                packed = (*(t.to(device) for t in packed[:3]), packed[3])
            self.local_tokens += (packed[0] if packed else ids).numel()
            images = pair_images(self.pairs, pairs, ids.shape[1], self.pad_id)
            batches.append((ids.to(device), labels.to(device), tokens.to(device), torch.tensor(pairs, device=device),
                            packed, None if images is None else images.to(device)))
        return batches

    def read_ahead(self, step: int, rows: torch.Tensor, mesh: Mesh, accumulation: int) -> None:
        read_ahead(self.pairs[int(r)].example for micro in micro_rows(rows, mesh, accumulation) for r in micro)

    def model_labels(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The labels the policy's forward is given for rows ``ids`` labelled on their completions (``read_logps``
        reads them back): these labels (ORPO's also mark its prompt tokens)."""
        return labels

    def read_logps(self, logits: Logits, sums: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row [rows] (or per document, ``sums`` of per-position values): the summed log-prob of its completion,
        and of the tokens the NLL term averages (the same for DPO and CPO; ORPO's whole row)."""
        logps = (sums or logits.sequence_sum)(logits.label_logps())
        return logps, logps

    def micro_step(self, pmodel: ParallelModel, batch: Batch, divisor: int) -> torch.Tensor:
        ids, labels, tokens, pairs, packed, images = batch
        if self.table is not None:
            reference = self.table[pairs.to(self.table.device)].reshape(-1).to(ids.device)
        elif self.reference is None:
            reference = torch.zeros(ids.shape[0], dtype=torch.float64, device=ids.device)
        elif packed is not None:  # the policy's packed rows, so that both read the same forward's numbers
            reference = self._packed_reference(packed, ids.shape[0])
        else:
            reference = self.reference.logps(ids, labels, images)
        self.step_pairs = divisor
        policy = torch.full_like(reference, float("nan"))  # each row's log-prob, where this rank computes the loss
        nll = torch.full_like(reference, float("nan"))
        self.seen.append((policy, nll, reference, tokens))
        if packed is not None:
            ids, labels, positions, docs = packed
            return pmodel.train_step(ids, labels, position_ids=positions,
                                     objective=self._objective(policy, nll, reference, tokens, divisor, docs))
        mask = real_tokens(labels) if self.masked else None
        return pmodel.train_step(ids, labels, attention_mask=mask, images=images,
                                 objective=self._objective(policy, nll, reference, tokens, divisor))

    def _objective(self, policy: torch.Tensor, nll: torch.Tensor, reference: torch.Tensor, tokens: torch.Tensor,
                   divisor: int, docs: list[list[int]] | None = None):
        """The loss of a micro-batch's logits: per row, or with ``docs`` (packed rows: each one's documents) per
        document, each carried by its labels (``pack_pairs``)."""
        def objective(logits: Logits) -> torch.Tensor:
            if docs is None:
                logps, nll_logps = self.read_logps(logits)
                rows = logits.rows
            else:
                rows = torch.tensor([d for r in logits.rows.tolist() for d in docs[r]], dtype=torch.long,
                                    device=logits.rows.device)
                if not len(rows):  # an empty row filling the pipeline's micro-batches
                    return logits.values.sum() * 0
                logps, nll_logps = self._read_documents(logits, rows)
            ref = reference[rows].to(logps.dtype)
            # kept by row, not summed: torch's pipeline schedules may compute a micro-batch's loss twice
            policy[rows], nll[rows] = logps.detach().to(policy), nll_logps.detach().to(nll)
            counts = tokens[rows].to(logps.dtype)
            pairs = PairLogps(logps[0::2], logps[1::2], ref[0::2], ref[1::2], counts[0::2], counts[1::2],
                              nll_logps[0::2])
            loss = self.loss.per_pair(pairs).sum() / divisor
            if self.loss.sft_weight:
                loss = loss - self.loss.sft_weight * pairs.nll_chosen.sum() / max(self.chosen_tokens, 1)
            return loss / logits.cp  # each cp rank holds the whole sequences' sums: its share is 1/cp
        return objective

    def _packed_reference(self, packed: tuple, count: int) -> torch.Tensor:
        """The reference's completion log-probs of the ``count`` documents of packed rows [count] (zeros on the ranks
        that compute no loss)."""
        ids, labels, positions, docs = packed

        def read(logits: Logits) -> torch.Tensor:  # [rows, count]: each row's documents at their places
            rows = logits.rows.tolist()
            owner = torch.tensor([i for i, r in enumerate(rows) for _ in docs[r]], dtype=torch.long)
            documents = torch.tensor([d for r in rows for d in docs[r]], dtype=torch.long, device=ids.device)
            out = logits.values.new_zeros((len(rows), count), dtype=torch.float64)
            if len(documents):
                out[owner.to(out.device), documents] = self._read_documents(logits, documents)[0].double()
            return out

        found = self.reference.read(ids, labels, read, positions)
        return ids.new_zeros(count, dtype=torch.float64) if found is None else found.sum(dim=0)

    def _read_documents(self, logits: Logits, documents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``read_logps`` per document of packed rows: each position's document from its label, the labels
        without it."""
        carried = logits.labels != IGNORE_INDEX
        doc = torch.where(carried, logits.labels // DOC - 1, -1)
        plain = replace(logits, labels=torch.where(carried, logits.labels % DOC, IGNORE_INDEX))
        mine = doc.unsqueeze(0) == documents.view(-1, 1, 1)  # [documents, rows, seq]

        def sums(values: torch.Tensor) -> torch.Tensor:
            return plain.sequence_sum((values.unsqueeze(0) * mine).sum(dim=1))

        return self.read_logps(plain, sums)

    def step_metrics(self, pmodel: ParallelModel) -> dict[str, float]:
        """The step's TRL metrics, the same on every rank: the sums over this rank's pairs (where it computed the
        loss: the last pipeline stage), summed over the ranks that split the batch (dp x cp, each cp rank holding the
        same whole-sequence sums) and sent from the last pipeline stage."""
        mesh = pmodel.mesh
        names = self.loss.metrics
        sums = torch.zeros(len(names) + 1, dtype=torch.float64, device=self.seen[0][0].device)
        sums[-1] = self.local_tokens / mesh.cp  # this replica's rows (every cp rank reads them all)
        for policy, nll, reference, tokens in self.seen:
            if not policy.isnan().any():
                counts = tokens.to(policy)
                pairs = PairLogps(policy[0::2], policy[1::2], reference[0::2], reference[1::2], counts[0::2],
                                  counts[1::2], nll[0::2])
                found = self.loss.metric_sums(pairs)
                sums[:-1] += torch.stack([found[name] for name in names]).to(sums) / mesh.cp
        self.seen = []
        sums = comm.all_reduce(sums, mesh.replica_group)
        if mesh.pp > 1:
            sums = comm.broadcast(sums, mesh.pp_group, src=mesh.pp - 1)
        *means, self.tokens = sums.tolist()
        return self.loss.metric_means(dict(zip(names, means)), self.step_pairs, self.chosen_tokens)

    def step_tokens(self) -> int:
        return int(self.tokens)

    def _read_all(self, pairs: list[Pair], logps: Callable, mesh: Mesh, device: torch.device,
                  values: int = 1) -> torch.Tensor:
        """Every pair's log-probs [pairs, 2] (or ``values`` per row: [pairs, 2, values]) under ``logps`` (a model's
        ``row_logps``), labels as ``model_labels`` gives them, on every rank: each dp replica
        reads every dp-th pair, in batches of a micro-step's pairs (the last one filled up with pair 0, read and
        dropped), the same number of batches on every rank (expert parallelism's dispatch is a collective over dp
        ranks); the last pipeline stage's values are sent to the others."""
        size = self.batch_pairs
        table = torch.zeros(len(pairs), 2, *((values,) if values > 1 else ()), dtype=torch.float64, device=device)
        mine = list(range(mesh.dp_rank, len(pairs), mesh.dp))
        for start in range(0, -(-len(pairs) // mesh.dp), size):
            chunk = mine[start:start + size]
            padded = chunk + [0] * (size - len(chunk))
            ids, labels = pair_rows(pairs, padded, self.pad_id, self.max_length, self.truncation_mode, self.multiple,
                                    self.length)
            images = pair_images(pairs, padded, ids.shape[1], self.pad_id)
            found = logps(ids.to(device), self.model_labels(ids, labels).to(device),
                          None if images is None else images.to(device)).reshape(-1, *table.shape[1:])
            if chunk:
                table[torch.tensor(chunk, device=device)] = found[:len(chunk)].to(table)
        table = comm.all_reduce(table, mesh.dp_group)
        return comm.broadcast(table, mesh.pp_group, src=mesh.pp - 1) if mesh.pp > 1 else table

    @torch.no_grad()
    def evaluate(self, pmodel: ParallelModel, data: list[Pair], batch_size: int, device: torch.device) -> dict:
        """TRL's evaluation: the loss and the six metrics over every validation pair (``eval_`` before their names),
        read with the policy and the reference on the training layout, the same on every rank."""
        read = lambda logits: torch.stack(self.read_logps(logits), dim=-1)  # noqa: E731
        both = self._read_all(data, lambda ids, labels, images: row_logps(pmodel, ids, labels, read, 2, images),
                              pmodel.mesh, device, 2)
        policy, nll = both[..., 0], both[..., 1]
        reference = self.val_table if self.val_table is not None else torch.zeros_like(policy) \
            if self.reference is None else self._read_all(data, self.reference.logps, pmodel.mesh, device)
        ids, labels = pair_rows(data, list(range(len(data))), self.pad_id, self.max_length, self.truncation_mode, 1)
        counts = labelled_tokens(labels).to(policy)
        nll_tokens = int(labelled_tokens(self.model_labels(ids, labels)[0::2]).sum())
        pairs = PairLogps(policy[:, 0], policy[:, 1], reference[:, 0], reference[:, 1], counts[0::2], counts[1::2],
                          nll[:, 0])
        loss = self.loss.per_pair(pairs).mean() - self.loss.sft_weight * pairs.nll_chosen.sum() / nll_tokens
        means = self.loss.metric_means(self.loss.metric_sums(pairs), len(data), nll_tokens)  # tensors, as TRL's
        return {"eval_loss": loss.item(), **{f"eval_{name}": float(value) for name, value in means.items()}}


def check_image_pairs(args: Any) -> None:
    """What TRL's DPOTrainer refuses for image-text pairs, refused by flag before any process group: keep_end
    truncation (it may cut the prompt's image tokens and leave their pixels) and precomputed reference log-probs; and
    --packing, whose packed rows plait does not give images."""
    given = [flag for flag, on in (("--truncation_mode keep_end", args.truncation_mode == "keep_end"),
                                   ("--precompute_ref_log_probs", args.precompute_ref_log_probs),
                                   ("--packing", args.packing)) if on]
    if given:
        raise ConfigError(f"{', '.join(given)} with an image-text model's preference pairs: TRL's DPOTrainer refuses "
                          f"keep_end (it may cut image tokens) and precomputed reference log-probs for them, and plait "
                          f"packs text pairs only; drop {'them' if len(given) > 1 else 'it'}")


def check_packing(args: Any, model_config: Any) -> None:
    """--packing with a model adding a load-balancing loss: refused (its attention mask, which keeps padding out of
    that loss, would stop transformers from reading the packed documents off the position ids)."""
    if args.packing and getattr(model_config, "output_router_logits", False):
        raise ConfigError(f"--packing with --method {args.method}: the model adds its routers' load-balancing loss "
                          f"(output_router_logits), whose padding mask cannot go with packed pairs; drop --packing")


def routed(pmodel: ParallelModel) -> bool:
    """Whether the model adds a load-balancing loss of its routers (``output_router_logits``)."""
    return bool(getattr(pmodel.module.config, "output_router_logits", False))


class Reference:
    """Where the reference's log-probs come from: a frozen model on the policy's mesh, or under LoRA the policy itself
    with its adapters off (its frozen base)."""

    def __init__(self, model: ParallelModel, adapters_off: bool = False) -> None:
        self.model, self.adapters_off = model, adapters_off

    def logps(self, ids: torch.Tensor, labels: torch.Tensor, images: ImageBatch | None = None) -> torch.Tensor:
        with switch.adapters_off() if self.adapters_off else contextlib.nullcontext():
            return row_logps(self.model, ids, labels, images=images)

    def read(self, ids: torch.Tensor, labels: torch.Tensor, read: Callable[[Logits], torch.Tensor],
             position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
             images: ImageBatch | None = None) -> torch.Tensor | None:
        """``read_rows`` of the reference (None on the ranks that compute no loss)."""
        with switch.adapters_off() if self.adapters_off else contextlib.nullcontext():
            return read_rows(self.model, ids, labels, read, position_ids, attention_mask, images)


def row_logps(model: ParallelModel, ids: torch.Tensor, labels: torch.Tensor,
              read: Callable[[Logits], torch.Tensor] | None = None, values: int = 1,
              images: ImageBatch | None = None) -> torch.Tensor:
    """Each row's summed log-prob of its labelled tokens under ``model`` (or ``read`` of its logits: ``values`` per
    row), without gradients, in float64 (zeros on the ranks that compute no loss: every pipeline stage but the
    last); ``images``: an image-text model's, of these rows."""
    found = read_rows(model, ids, labels, read or (lambda logits: logits.sequence_sum(logits.label_logps())),
                      images=images)
    if found is None:
        return ids.new_zeros((ids.shape[0], *((values,) if values > 1 else ())), dtype=torch.float64)
    return found.double()
