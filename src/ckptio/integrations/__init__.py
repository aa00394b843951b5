"""What the framework integrations (``ckptio.lightning``, ``ckptio.hf_trainer``, ``ckptio.accelerate``) share:
the folders they write in a framework's own layout (:mod:`.framework_dirs`), their background saves
(:mod:`.framework_async`), and the helpers of one framework each (:mod:`.hf_trainer_save`,
:mod:`.lightning_keep`, :mod:`.lightning_load`)."""
