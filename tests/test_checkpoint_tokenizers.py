"""How a checkpoint's tokenizer files are read, beyond the tiny checkpoints' one layout (issue 11's fifth
coverage pass): the chat template in `chat_template.jinja` or as a list of named templates (rendered
as transformers renders them), an eos_token written as an AddedToken object, no chat template at all,
and templates that refuse or fail on a conversation. Each writes the files into a checkpoint directory
and loads it with HFTokenizer, the class the engine loads a checkpoint's tokenizer with.
"""

from __future__ import annotations

import json

import pytest

from cairn.errors import ChatTemplateError
from cairn.request.tokenizer import HFTokenizer
from tests.test_chat_templates import write_checkpoint_tokenizer

CHATML = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
OTHER = "{%- for m in messages %}{{- m['role'] + ': ' + m['content'] + '\\n' }}{%- endfor %}"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]


def set_config(path, **fields) -> None:
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(fields)
    (path / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))


def rendered_by_transformers(path) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    return tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)


def test_template_in_chat_template_jinja_is_used_as_transformers_uses_it(tmp_path):
    write_checkpoint_tokenizer(tmp_path, OTHER)  # the config's template: the file takes precedence
    (tmp_path / "chat_template.jinja").write_text(CHATML)
    rendered = HFTokenizer(tmp_path).render_chat(CHAT)
    assert rendered.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert rendered == rendered_by_transformers(tmp_path)


def test_named_templates_render_the_default_one_as_transformers_does(tmp_path):
    write_checkpoint_tokenizer(tmp_path, "")
    named = [{"name": "tool_use", "template": OTHER}, {"name": "default", "template": CHATML}]
    set_config(tmp_path, chat_template=named)
    assert HFTokenizer(tmp_path).render_chat(CHAT) == rendered_by_transformers(tmp_path)


def test_named_templates_without_a_default_use_the_first(tmp_path):
    write_checkpoint_tokenizer(tmp_path, "")
    set_config(tmp_path, chat_template=[{"name": "rag", "template": OTHER}])
    assert HFTokenizer(tmp_path).render_chat(CHAT) == "system: Be brief.\nuser: Hello\n"


def test_eos_token_written_as_an_added_token_object_is_the_stop_token(tmp_path):
    write_checkpoint_tokenizer(tmp_path, CHATML)
    set_config(tmp_path, eos_token={"__type": "AddedToken", "content": "<|im_end|>", "special": True})
    tok = HFTokenizer(tmp_path)
    assert tok.eos_token_ids == (tok.encode("<|im_end|>")[0],)


def test_checkpoint_without_a_chat_template_refuses_a_chat_saying_to_send_a_prompt(tmp_path):
    write_checkpoint_tokenizer(tmp_path, "")
    set_config(tmp_path, chat_template=None)
    with pytest.raises(ChatTemplateError, match="no chat template: send a plain prompt instead"):
        HFTokenizer(tmp_path).encode_chat(CHAT)


def test_template_that_raises_refuses_with_its_own_message(tmp_path):
    write_checkpoint_tokenizer(tmp_path, "{{ raise_exception('System role not supported') }}")
    with pytest.raises(ChatTemplateError, match="^System role not supported$"):
        HFTokenizer(tmp_path).encode_chat(CHAT)


def test_template_that_fails_on_a_message_is_a_chat_template_error_not_a_crash(tmp_path):
    write_checkpoint_tokenizer(tmp_path, "{%- for m in messages %}{{ m['content'].upper(1, 2, 3) }}{%- endfor %}")
    with pytest.raises(ChatTemplateError, match="chat template failed on these messages"):
        HFTokenizer(tmp_path).encode_chat(CHAT)


def test_message_starts_when_the_template_refuses_a_prefix_of_the_conversation(tmp_path):
    """A template with no loop over `messages` is rendered prefix by prefix for the message starts; a
    prefix it refuses (here: no user message yet) starts where the previous one did."""
    template = ("{%- if not (messages | selectattr('role', 'equalto', 'user') | list) %}"
                "{{ raise_exception('no user message') }}{%- endif %}"
                "{{ messages | map(attribute='content') | join('\\n') }}{{ '\\n>' if add_generation_prompt }}")
    write_checkpoint_tokenizer(tmp_path, template)
    tok = HFTokenizer(tmp_path)
    ids, starts = tok.encode_chat(CHAT)
    assert tok.decode(ids) == "Be brief.\nHello\n>"
    assert starts == [0, len(tok.encode("Be brief.\nHello"))]


THINKING_WITH_SYSTEM_ONLY = (
    "{%- if messages[0]['role'] != 'system' %}{{ raise_exception('a system message must come first') }}{%- endif %}"
    + CHATML.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'"))


def test_a_template_that_requires_a_system_message_is_still_seen_to_open_the_reasoning(tmp_path):
    """The chat plan renders a one-message probe to see whether the generation prompt opens <think>; a
    template that refuses a conversation without a system message is probed with one, so its requests'
    answers are parsed as starting inside the reasoning the prompt opened."""
    from cairn.server.chat.output import plan_chat

    write_checkpoint_tokenizer(tmp_path, THINKING_WITH_SYSTEM_ONLY)
    tok = HFTokenizer(tmp_path)
    assert tok.render_chat(CHAT, add_generation_prompt=True).endswith("<think>\n")
    assert plan_chat(tok, "qwen3", "none", {}, None, True).starts_in_reasoning


def test_a_template_that_refuses_every_probe_plans_no_open_reasoning(tmp_path):
    from cairn.server.chat.output import plan_chat

    write_checkpoint_tokenizer(tmp_path, "{{ raise_exception('System role not supported') }}")
    assert not plan_chat(HFTokenizer(tmp_path), "qwen3", "none", {}, None, True).starts_in_reasoning
