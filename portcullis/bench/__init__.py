"""`portcullis bench serve`: a serving benchmark with `vllm bench serve`'s flags and metrics.

Owns: the workloads (`datasets`: random, ShareGPT, prefix-repetition prompts built with a
local tokenizer), the streaming OpenAI client that times each request (`client`), the
metrics and the result table and JSON under vLLM's names (`metrics`), the PNG plots
(`plots`, matplotlib from the `bench` extra) and the command itself (`serve`, `cli`).

It talks to servers only over HTTP, as any client of the gateway or the engine would, and
imports nothing of ours except `portcullis.engine.assets`, to find the demo model's tokenizer.

    portcullis bench serve --base-url http://127.0.0.1:8000 --api-key ptc_... \\
        --num-prompts 200 --request-rate 1,2,4 --save-result --plot
"""
