"""Adopting folders other tools wrote: NeMo AutoModel steps (:mod:`.automodel`), foreign step folders resumed
as ckptio's (:mod:`.foreign`) and Hugging Face model folders loaded as pretrained weights (:mod:`.pretrained`)."""
