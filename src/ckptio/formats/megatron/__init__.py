"""Megatron-LM and Megatron-Core checkpoints: reading (:mod:`.format`, :mod:`.layout`, :mod:`.config`, the
restricted unpickler :mod:`.safe_pickle`) and writing (:mod:`.write`)."""
