"""Cost estimates of a layout before launch, ``plait plan``'s answers (``plait.plan_command``): memory,
communication, bubble, step time and which layout to use.

Everything is computed from the ``LayoutPlan`` of a meta model (``plait.layout_plan``): the same shard specs,
stage split and recompute leaves ``parallelize`` applies, so the estimates see exactly what a run would hold.
``estimate.estimate_layout`` answers for one layout; ``search.search_layouts`` ranks the layouts that fit.
Submodules are imported where used: ``plait plan --help`` needs only ``device.PRESETS``.
"""
