"""Short depthwise causal convolution kernels with a carried state (the last K-1 inputs per channel).

`reference.py`: `causal_conv1d` (one sequence), `causal_conv1d_step` (one token of N sequences) (torch)."""
