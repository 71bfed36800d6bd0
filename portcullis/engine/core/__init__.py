"""The engine's core: what runs each step and what it holds.

`engine_core` (the step loop: schedule, run, update), `scheduler` (the only owner of each
`Request`, with its `waiting_queue`), `kv_cache` (the block pool and prefix cache), `request`,
`spec_decode` (proposals the scheduler makes), `structured_output` (grammars), and `output`:
the plain data the scheduler hands the runner. It imports the worker only in `engine_core`.
"""
