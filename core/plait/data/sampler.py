"""Deterministic, resumable choice of training blocks.

The global batch of every optimizer step is a pure function of
(seed, step, num_blocks, global_batch_size). Resuming therefore needs only the
step number, and every data-parallel rank computes the same global batch by
itself, with no communication and no torch.distributed.
"""

import torch


class GlobalBatchSampler:
    """Hands out ``global_batch_size`` block indices per optimizer step.

    The blocks are read as one endless stream of epochs, epoch ``e`` being a
    permutation of all blocks drawn from a generator seeded with ``seed + e``.
    Step ``s`` takes stream positions ``[s * G, (s + 1) * G)``, so every block
    is seen once per epoch before any repeats, and any step is computed
    directly (one permutation per epoch it touches) without replaying earlier
    steps.
    """

    def __init__(self, num_blocks: int, global_batch_size: int, seed: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
        self.num_blocks = num_blocks
        self.global_batch_size = global_batch_size
        self.seed = seed
        self._cached_epoch: int | None = None
        self._cached_perm: torch.Tensor | None = None

    def _permutation(self, epoch: int) -> torch.Tensor:
        # Consecutive steps mostly stay in one epoch: keep its permutation.
        if epoch != self._cached_epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._cached_perm = torch.randperm(self.num_blocks, generator=generator)
            self._cached_epoch = epoch
        return self._cached_perm

    def indices(self, step: int) -> torch.LongTensor:
        """Return the ``global_batch_size`` block indices of optimizer step ``step`` (0-based)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        start = step * self.global_batch_size
        stop = start + self.global_batch_size
        parts = []
        while start < stop:
            epoch, offset = divmod(start, self.num_blocks)
            take = min(stop - start, self.num_blocks - offset)
            parts.append(self._permutation(epoch)[offset : offset + take])
            start += take
        return torch.cat(parts)

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint needs to reproduce the order; the step is the trainer's."""
        return {"seed": self.seed, "num_blocks": self.num_blocks, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore the seed of a checkpoint; then ask for the step after the last one trained.

        Raises:
            ValueError: if the checkpoint had a different number of blocks or
                global batch size, since its order would then not continue.
        """
        for key in ("num_blocks", "global_batch_size"):
            if state[key] != getattr(self, key):
                raise ValueError(f"checkpoint has {key}={state[key]} but this run has {key}={getattr(self, key)}")
        self.seed = state["seed"]
        self._cached_epoch = None
        self._cached_perm = None
