"""``python -m plait`` (e.g. ``torchrun --nproc_per_node 2 -m plait train ...``)."""

from plait.cli import main

main()
