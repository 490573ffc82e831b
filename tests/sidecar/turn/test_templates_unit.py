"""Memory merged so that strict chat templates still render: a Mistral-style template (roles
must alternate; an optional system message first, or none at all) and a Gemma-style one (no
system role). The tokenizers are built locally (the tiny model's tokenizer with these
templates); the sidecar finds the model's folder through the upstream's ``/v1/models`` (``root``)
and probes the template itself."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from sidecar_helpers import chat, make_settings, runtime

from cwm_plugin.sidecar.app import create_app
from cwm_plugin.testing.fake_upstream import FakeUpstream
from cwm_plugin.testing.server_thread import ServerThread

pytestmark = pytest.mark.unit
ALTERNATE = ("{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
             "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
             "{% endif %}")
GEMMA = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
         "supported') }}{% endif %}{% for message in messages %}" + ALTERNATE +
         "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
         "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
         "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")
MISTRAL_V1 = ("{% for message in messages %}" + ALTERNATE +
              "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
              "{% elif message['role'] == 'assistant' %}{{ message['content'] + '</s>' }}"
              "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
              "{% endif %}{% endfor %}")
MISTRAL_V3 = ("{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
              "{% set loop_messages = messages[1:] %}{% else %}"
              "{% set loop_messages = messages %}{% endif %}"
              "{% for message in loop_messages %}" + ALTERNATE +
              "{% if message['role'] == 'user' %}{% if loop.last and system is defined %}"
              "{{ '[INST] ' + system + '\\n\\n' + message['content'] + '[/INST]' }}{% else %}"
              "{{ '[INST] ' + message['content'] + '[/INST]' }}{% endif %}"
              "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + '</s>' }}"
              "{% else %}{{ raise_exception('Only user and assistant roles are supported, with "
              "the exception of an initial optional system message!') }}{% endif %}"
              "{% endfor %}")
TALK = [{"role": "user", "content": "I keep bees."}, {"role": "assistant", "content": "Nice."},
        {"role": "user", "content": "What do I keep in the garden?"}]


def folder_with(tiny_model: Path, tmp: Path, template: str) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / name, tmp / name)
    (tmp / "chat_template.jinja").write_text(template)
    return tmp


def render(folder: Path, messages: list[dict]) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("name,template,client,merged_into", [
    ("gemma", GEMMA, TALK, "first_user"),
    ("mistral-v1", MISTRAL_V1, TALK, "first_user"),
    ("mistral-v3", MISTRAL_V3, [{"role": "system", "content": "Be brief."}, *TALK], "system"),
    ("mistral-v3-nosys", MISTRAL_V3, TALK, "new_system"),
])
def test_memory_is_merged_where_the_template_accepts_it(tiny_model, tmp_path, name, template,
                                                       client, merged_into):
    folder = folder_with(tiny_model, tmp_path / name, template)
    from jinja2 import TemplateError

    with pytest.raises(TemplateError):  # what the old layout sent: a second system message
        render(folder, [{"role": "system", "content": "a"}, {"role": "system", "content": "b"},
                        TALK[0]])
    fake = FakeUpstream(model="strict", root=str(folder))
    with ServerThread(fake.app) as up:
        settings = make_settings(up.url, tmp_path / "mem", "auto")
        with ServerThread(create_app(settings)) as srv:
            runtime(srv).memory.service.add_memory("acme", "The user keeps bees behind the "
                                                           "garden shed.", "fact", 0.9)
            r = chat(srv, "acme", client, session=name, model="strict")
            assert r.status_code == 200, r.text
    sent = fake.last()["messages"]
    render(folder, sent)  # renders: roles still alternate, no system role where there is none
    roles = [m["role"] for m in sent]
    if merged_into == "first_user":
        assert roles == [m["role"] for m in client]
        assert sent[0]["content"].endswith("\n\nI keep bees.") and "shed" in sent[0]["content"]
    elif merged_into == "system":
        assert roles == [m["role"] for m in client]
        assert sent[0]["content"].startswith("Be brief.\n\n") and "shed" in sent[0]["content"]
    else:
        assert roles == ["system", *[m["role"] for m in client]] and "shed" in sent[0]["content"]
    assert [m["content"] for m in sent[-2:]] == [m["content"] for m in client[-2:]]
