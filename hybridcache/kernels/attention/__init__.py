"""Paged attention kernels: the KV write through a slot mapping and causal GQA attention over block tables.

`reference.py`: `write_kv`, `gather_kv`, `paged_attention`, `paged_decode_attention` (torch)."""
