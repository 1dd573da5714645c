"""What a request is made of: its tokenizer and chat template (tokenizer.py), its TokenizedPrompt
(prompt.py), its SamplingParams and the batched sampler (sampling.py), the logits processors its
parameters ask for (logits.py) and the grammar of structured output (grammar.py).

What this is not: the request's state while it runs (cairn/sequence.py), its scheduling or the engine
that steps it (cairn/engine/). It imports nothing of cairn but the leaves (errors). Nothing is
re-exported here: import the module that defines a name (`from cairn.request.sampling import
SamplingParams`).
"""
