"""The bottom of the stack: what every other layer reads, importing nothing of plait above it.

``device`` and ``host_memory`` are the only modules that know device types and the C library's allocator; the
rest is the layout a user asks for (``config``: ``ParallelConfig`` and the errors), the pipeline schedule table,
collectives with their checks (``comm``), module-name patterns, the meta device, seeds and fault injection.
"""
