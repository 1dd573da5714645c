"""The engine: Engine (engine.py), which builds the model, the memory pools, the prefix cache, the scheduler
and the runner at start-up and steps them, with what it resolves at start-up (memory budgets: sizing.py; the
cache's compatibility digest: compat.py; the built-in demo model: demo.py); LLM (llm.py), the offline facade
over it; and what the engine keeps per request and hands back: its n choices (choices.py), the per-step
outputs and the detokenizer (outputs.py), the finished-request and stats log lines (activity.py).

What this is not: the scheduler, the runner or the cache the engine drives (cairn/scheduler.py,
cairn/runner.py, cairn/cache/), nor what a request is made of (its tokenizer, prompt and sampling
parameters). Nothing is re-exported here: import the module that defines a name
(`from cairn.engine.engine import Engine`).
"""
