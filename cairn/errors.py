"""The exceptions that cross layers: raised deep in the engine, mapped to a response at the top.

Each is a user's request the engine refuses, not a fault of the engine. They live here, a leaf that
imports nothing, so the server's error mapping (cairn.server.errors) and the modules that raise them
need not import each other.

| exception          | raised by                                      | the server answers            |
|--------------------|------------------------------------------------|-------------------------------|
| RequestTooLarge    | the scheduler (context, memory), the engine    | 400 context_length_exceeded / invalid_value |
| QueueFull          | the scheduler (more than --max-waiting queued) | 429 queue_full                |
| PromptTooLong      | cairn.request.prompt, before encoding the text | 400 (as RequestTooLarge)      |
| SamplingError      | SamplingParams, the sampler, grammars          | 400 invalid_value             |
| ChatTemplateError  | the tokenizer's chat template                  | 400 invalid_value             |

What is not here: exceptions one module raises and its caller handles (the scheduler's
SequenceFailed, the engine's StepFailed, the disk store's errors), and the server's own
(cairn.server.errors).
"""


class RequestTooLarge(ValueError):
    """A request that could never fit in the engine's memory or context."""


class QueueFull(RuntimeError):
    """Too many requests are waiting; retry later."""


class PromptTooLong(ValueError):
    """The prompt's text has more characters than the context's tokens could cover (found before
    encoding it). The engine reports it as RequestTooLarge."""


class SamplingError(ValueError):
    """A sampling parameter is out of range (the message starts with the parameter's name), or a row
    cannot be sampled."""


class ChatTemplateError(ValueError):
    """The messages cannot be rendered by the model's chat template."""
