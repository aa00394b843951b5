"""The save and restore machinery behind :class:`~ckptio.CheckpointManager`: the two data paths (:mod:`.saving`,
:mod:`.restoring`), their plans (:mod:`.plan`), the staging buffers and writer thread of async saves
(:mod:`.staging`, :mod:`.background`), the manifest (:mod:`.manifest`), step names and discovery (:mod:`.layout`),
retention (:mod:`.policies`), partial loads (:mod:`.partial`), replicated parts read once and sent
(:mod:`.shared_reads`) and ``ckptio inspect`` (:mod:`.describe`)."""
