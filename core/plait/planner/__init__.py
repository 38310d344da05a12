"""``plait plan``'s answers before launch: memory, communication, bubble and which layout to use.

Everything is computed from the ``LayoutPlan`` of a meta model (``plait.layout_plan``): the same shard specs,
stage split and recompute leaves ``parallelize`` applies, so the planner sees exactly what a run would hold.
``estimate.estimate_layout`` answers for one layout; ``search.search_layouts`` ranks the layouts that fit.
Submodules are imported where used: ``plait plan --help`` needs only ``device.PRESETS``.
"""
