"""Test doubles that ship with the package, for this project's tests and benchmarks and for a
team's own: `stub_engine`, an engine that answers the engine's HTTP contract instantly and
deterministically (`python -m portcullis.testing.stub_engine --uds SOCKET --token-file FILE`).
Torch-free, as the gateway; it imports nothing of ours but `portcullis.envs` (its token's variable)."""
