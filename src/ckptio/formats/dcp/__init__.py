"""PyTorch Distributed Checkpoint (DCP) folders: reading and registering the format (:mod:`.format`), saving
(:mod:`.save`), the validated ``.metadata`` (:mod:`.metadata`), per-rank direct reads (:mod:`.direct`) and the
chunk archives (:mod:`.items`)."""
