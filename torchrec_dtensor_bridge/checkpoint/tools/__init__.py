"""What runs in one process, no group: :mod:`.inspect`, :mod:`.export`, :mod:`.compact`, :mod:`.migrate`.
"""
