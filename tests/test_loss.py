"""The vocab-parallel cross-entropy equals torch's on the whole vocabulary (single process, both paths)."""

import pytest
import torch
import torch.nn.functional as F

from plait.tp.loss import _VocabParallelCrossEntropy, vocab_parallel_cross_entropy


@pytest.mark.parametrize("ignore", [False, True])
def test_parallel_kernel_matches_torch(ignore):
    torch.manual_seed(0)
    logits = torch.randn(12, 37, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 37, (12,))
    if ignore:
        target[::3] = -100
    ours = _VocabParallelCrossEntropy.apply(logits, target, 0, None)
    theirs = F.cross_entropy(logits, target, ignore_index=-100, reduction="none")
    torch.testing.assert_close(ours, theirs)
    (g_ours,) = torch.autograd.grad(ours.sum(), logits)
    (g_theirs,) = torch.autograd.grad(theirs.sum(), logits)
    torch.testing.assert_close(g_ours, g_theirs)


def test_causal_shift_and_normaliser():
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1))
    torch.testing.assert_close(vocab_parallel_cross_entropy(logits, labels, 0, None), expected)
    torch.testing.assert_close(vocab_parallel_cross_entropy(logits, labels, 0, None, num_items_in_batch=16), expected / 2)
