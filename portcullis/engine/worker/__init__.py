"""The engine's worker: tensors in, tokens out.

`model_runner` (one forward and sample per step, or with pipeline stages a submit and a collect),
`input_batch` (the runner's own state of each request, kept from `core.output`'s plans),
`step_batch` (a step's flattened inputs, and their wire form), `sampler`, `pooler` (embeddings),
`tp_worker` (the ranks past the first, on the pipeline-stages x tensor-parallel grid of
`engine.distributed`, on this host or --headless on others) and `rendezvous` (where the ranks meet,
kept on a private network).
It reads the scheduler's plans from `core.output` and never imports the scheduler.
"""
