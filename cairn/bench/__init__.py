"""`cairn bench`: cache policies compared on the divergence workloads that hurt users of other engines.

What it is: named workloads (compaction replay, an agentic session, interleaved conversations, an
edit and a regenerate, many users on one system prompt, a restart), generated deterministically
from a seed; runners that send them one request at a time through a fresh in-process Engine per
cache policy, or through a running server over HTTP; an oracle (what an unlimited cache could have
reused, computed from the token ids the engine actually saw); and a report (JSON record, markdown
tables, PNG plots).

    conversation.py              what a workload is made of: sizes, requests, replies, chat helpers
    workloads.py / sessions.py   the request streams (chat messages, replies fed back)
    checkpoint.py                random-weight checkpoints at a named size (--size tiny / 0.8b)
    text.py                      deterministic filler text sized in tokens
    oracle.py                    the unlimited-cache oracle (longest common prefixes)
    policies.py                  baseline cache policies as engine configs
    engine_runner.py / http_runner.py   one request at a time, time to first token, cache report
    run.py                       drives a workload through a runner into a WorkloadResult
    record.py                    the JSON record's dataclasses and the targets
    report.py / plots.py         markdown tables and PNGs
    cli.py                       `cairn bench` / `python -m cairn.bench`

What it is not: a test (it asserts nothing; tests/test_bench.py checks a smoke run's sanity) nor a
throughput benchmark (see benchmarks/engine_throughput.py).
"""
