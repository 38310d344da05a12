"""Context parallelism: every sequence split over the ranks of a cp group, from the embedding to the loss.

sequence (which tokens a rank holds), masks (transformers' whole-sequence mask, evaluated block by block),
ulysses and ring (the two exact attention strategies), layout and dry_run (what cp can do for a model,
decided before launch), context (one rank's cutting and forward), attention (the implementation registered
with transformers), router (the MoE load-balancing loss over the whole forward).
"""
