"""Tensor parallelism: one model split over N processes and devices, the scheduler and cache run once.

- `process_group.py`: the torch.distributed group (gloo on the CPU, NCCL on CUDA) and each rank's device;
- `messages.py`: what the driver and the workers send each other;
- `worker.py`: the loop of ranks 1..N-1; `executor.py`: rank 0, in the engine's process, as the engine's
  `Executor` (`hybridcache.engine.executor`).

Each rank builds its model shard, memory plan and `ModelRunner` with `hybridcache.engine.rank_runner.build_runner`
(the engine's own path at size 1). This package imports the engine; the engine never imports it (it names the
executor in `hybridcache.engine.executor.EXECUTOR_BACKENDS`).

How weights are split lives with the layers (`hybridcache.layers.parallel`).
"""
