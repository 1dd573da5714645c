"""What a request is made of: its tokenizer and chat template (tokenizer.py), its TokenizedPrompt
(prompt.py), its SamplingParams (sampling_params.py), the logits processors they ask for (logits.py),
the batched sampler (sampling.py) and the grammar of structured output (grammar.py).

What this is not: the request's state while it runs (cairn/sequence.py), its scheduling or the engine
that steps it (cairn/engine/). It imports nothing of cairn but the leaves (errors). Nothing is
re-exported here: import the module that defines a name (`from cairn.request.sampling_params import
SamplingParams`).
"""
