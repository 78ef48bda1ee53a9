"""Incremental checkpoints: the rows that changed since a base, found by row digests (:mod:`.rows`,
:mod:`.digests`), and the chain of links a load follows (:mod:`.chain`, :mod:`.chainread`).
"""
