"""The engine's worker: tensors in, tokens out.

`model_runner` (one forward and sample per step), `input_batch` (the runner's own state of each
request, kept from `core.output`'s plans), `step_batch` (a step's flattened inputs), `sampler`,
`tp_worker` (the tensor-parallel ranks past the first) and `distributed` (their collectives).
It reads the scheduler's plans from `core.output` and never imports the scheduler.
"""
