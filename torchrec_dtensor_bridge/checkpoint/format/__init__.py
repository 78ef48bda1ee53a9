"""The bytes a checkpoint holds: its manifest of checksums (:mod:`.manifest`), DCP's ``.metadata`` checked
(:mod:`.validate`), saved tensors parsed (:mod:`.savedtensor`) and planned (:mod:`.plan`); the writer that
checksums what it writes (:mod:`.writer`) and the reader that verifies what it reads (:mod:`.reader`).
"""
