"""DeepSpeed checkpoints: ZeRO stages 1-3 and universal folders read without DeepSpeed (:mod:`.layout` finds the
checkpoint, :mod:`.zero` merges the ranks' partitions one parameter at a time through the one read gate), and
universal folders written for DeepSpeed to load (:mod:`.universal`)."""
