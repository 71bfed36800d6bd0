"""`portcullis serve`: one command that runs engines and the gateway as programs and watches them.

Owns the process tree of a single-host deployment: `serve` (one model: the engine on a private
Unix socket, then the gateway in front, the starter policy and first key), `fleet` (several
models or replicas behind one gateway) and `children` (starting, restarting with backoff and
stopping each child's whole process group; nothing outlives the supervisor).

It may import the gateway's torch-free flag helpers (`gateway.tls`, `gateway.telemetry`) and
nothing of the engine: engines are started as `python -m portcullis.engine`, never imported.
"""
