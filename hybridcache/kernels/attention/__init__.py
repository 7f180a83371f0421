"""Paged attention kernels: the KV write to flat KV rows (`kv_rows`) and causal GQA attention over block tables.

`reference.py`: `write_kv`, `gather_kv`, `paged_attention`, `paged_decode_attention` (torch);
`triton_paged.py`: the CUDA kernels. `latent.py` / `triton_latent.py`: Kimi Linear's MLA over cached latent rows
(the backends' `mla_attention` op), torch and CUDA; `mla_prefill.py` its expanded prefill. The attention backends
(`base.AttentionBackend`), registered by name in `hybridcache.kernels.registry.ATTENTION` when this package is
imported: `reference_backend.py` ("reference"), `triton_backend.py` ("triton"). A new backend is one more module
here, imported below."""

from hybridcache.kernels.attention import reference_backend, triton_backend  # noqa: F401 (they register)
