"""A real `cairn serve --model` on a tiny checkpoint with a generation_config.json: its sampling
defaults are logged at start-up and used for the fields a request leaves out, and structured output
works with the checkpoint's own tokenizer.json."""

from __future__ import annotations

import json

import jsonschema

from tests.checkpoints import write_checkpoint
from tests.server_process import served_fixture

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


def checkpoint_with_defaults(path) -> None:
    write_checkpoint("qwen3_5_text", path)
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 20, "do_sample": True}))


served = served_fixture("--max-model-len", "512", "--log-level", "INFO", checkpoint=checkpoint_with_defaults,
                        client_timeout_s=120)


def test_generation_config_defaults_are_logged_at_start_up(server):
    assert "sampling defaults from generation_config.json" in server.log()
    assert "temperature=0.0" in server.log() and "top_k=20" in server.log()


def test_omitted_temperature_takes_the_checkpoint_default(client):
    ask = dict(model=client.models.list().data[0].id, prompt="defaults", max_tokens=8,
               extra_body={"ignore_eos": True})
    greedy = {client.completions.create(**ask, seed=s).choices[0].text for s in (1, 2, 3)}
    assert len(greedy) == 1  # temperature 0 from generation_config.json: the seed does not matter
    sampled = {client.completions.create(**ask, seed=s, temperature=1.0).choices[0].text for s in (1, 2, 3)}
    assert len(sampled) > 1  # the request's own value wins


def test_json_schema_with_the_checkpoint_tokenizer(client):
    r = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=40, temperature=1.0,
                                       seed=3, messages=[{"role": "user", "content": "json please"}],
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": SCHEMA}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
