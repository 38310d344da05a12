"""Adapters as plugins: the hooks an adapter implements (``hookspecs``), the data its hooks return
(``declarations``; the tensor-parallel plans are ``plait.tp.plans``, beside the styles they hold) and the registry
that finds adapters in the ``plait.adapters`` entry-point group and asks them (``registry``).
"""
