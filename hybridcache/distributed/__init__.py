"""Tensor parallelism: one model split over N processes and devices, the scheduler and cache run once.

- `process_group.py`: the torch.distributed group (gloo on the CPU, NCCL on CUDA) and each rank's device;
- `rank_runner.py`: one rank's model shard, memory plan and `ModelRunner` (also the engine's, at size 1);
- `messages.py`: what the driver and the workers send each other;
- `worker.py`: the loop of ranks 1..N-1; `executor.py`: rank 0, in the engine's process, as the engine's runner.

How weights are split lives with the layers (`hybridcache.layers.parallel`).
"""
