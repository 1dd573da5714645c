"""A chat request's parts and its output, whatever API sent it: the strict base of every request body (`strict`),
tools, tool calls and messages as the chat template sees them (`schema`), the JSON Schema keywords a constrained
output may use (`schema_keywords`), the plan and shaping of the generated text into reasoning, content and tool
calls (`output`, with the template formats' parsers in `parsers`), and the grammars that force calls
(`call_grammar`, `string_regex`).

What this package is not: any API's request bodies or responses (`openai/`, `anthropic/`; `output` gives them
the message and deltas they are built from) or the engine: it never submits a request.
"""
