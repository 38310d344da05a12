"""``python -m plait_transformers ARCH``: print the plans derived for ARCH (a model_type, a config.json or a model
directory) as the code of an explicit adapter to start from (``show_derived``; ``plait plan --show-derived ARCH``
prints the same)."""

import sys

from plait_transformers import show_derived

print(show_derived(sys.argv[1]))
