"""Megatron-LM and Megatron-Core checkpoints: reading (:mod:`.format`, :mod:`.layout`, :mod:`.config`, through
the restricted unpickler :mod:`ckptio.formats.safe_pickle`) and writing (:mod:`.write`)."""
