"""Gated delta rule kernels (the gated DeltaNet recurrence S = exp(g) S + k (beta (v - S^T k))^T).

`reference.py`: `chunk_gated_delta_rule` (one sequence, chunked WY form), `recurrent_gated_delta_rule` (one
sequence, token by token), `gated_delta_rule_step` (one token of N sequences) (torch)."""
