"""Scheduler: request queues, the paged KV block table and the engine loop.

The offline ``LLM``, which drives this scheduler and an executor in one process, is a frontend:
`gateway.llm`.
"""
