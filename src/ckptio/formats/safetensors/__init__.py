"""safetensors in all its shapes: ckptio's per-rank shards (:mod:`.sharded`, :mod:`.format`, their
:mod:`.chunk_index`), the Hugging Face bundle (:mod:`.hf_bundle`, with block-FP8 releases in :mod:`.fp8_blocks`) and
PEFT adapters (:mod:`.peft_adapter`)."""
