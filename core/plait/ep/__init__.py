"""Expert parallelism: each MoE layer's experts divided over the ranks of an ep group carved from dp x cp.

layout (which modules are routed experts and what each ep rank holds, decided before launch), dispatch (the
all-to-all that takes each routed token to its expert's rank and back, around transformers' own experts
kernel), optimizer (ZeRO-1 with dense and expert parameters sharded over their own replica groups).
"""
