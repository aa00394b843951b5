"""NeMo: ``.nemo`` archives (:mod:`.format`, :mod:`.config`), ``save_nemo``/``restore_nemo`` of a live model
(:mod:`.model`) and quantized ``.qnemo`` exports (:mod:`.qnemo`)."""
