"""What the gateway and the engine must agree on, written once: both import it, neither copies it.

Torch-free and dependency-free (the standard library only), so the gateway's base install
carries it. It holds the rules by which both halves read a request (`requests`); a rule kept
twice can drift, and a drift between the half that charges a request and the half that runs
it is a request that costs more than it paid for. It imports nothing else of ours but `portcullis.envs`
(the variables' names).
"""
