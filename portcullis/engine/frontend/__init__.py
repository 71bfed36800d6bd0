"""The engine's front ends: the offline `LLM` API (`llm`) and the server's `AsyncEngine`
(`async_engine`), which share how a step's outputs become a user's (`output_processor`: n
samples, stop strings) and incremental detokenization (`detokenizer`).
"""
