"""Each family's chat template, as its checkpoint ships it (chat_template.jinja), drives
/v1/chat/completions: the engine's chat path renders the same prompt ids as transformers'
apply_chat_template and generates the HF model's greedy tokens; over HTTP (one real server on
a Gemma 2 checkpoint) the answer equals the offline one, a message the template refuses is a
400 naming the template's reason, and adapters made for another architecture or shape are a
4xx naming the problem while the server keeps serving.

The templates are written here in each family's style (bos/eos variables, raise_exception,
trim, role renames), not downloaded."""

from __future__ import annotations

import pytest
from adapter_factory import load_base_model, make_peft_adapter
from model_factory import make_tiny_family
from server_utils import ServerProcess, assert_error
from test_model_families import argmax_loop

from loraserve import LLM, SamplingParams

_ALTERNATE = ("{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
              "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
              "{% endif %}")
TEMPLATES = {
    "llama": (
        "{{- bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role']"
        " + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
        "{% endif %}"),
    "mistral": (
        "{{ bos_token }}{% for message in messages %}" + _ALTERNATE +
        "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
        "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"),
    "gemma2": (
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for message in messages %}" + _ALTERNATE +
        "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}"
        "{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + "
        "message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"),
    "phi3": (
        "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] "
        "+ '<|end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}"
        "{% else %}{{ eos_token }}{% endif %}"),
    "granite": (
        "{%- for message in messages %}{{- '<|start_of_role|>' + message['role'] + "
        "'<|end_of_role|>' + message['content'] + '<|end_of_text|>\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}"
        "{%- endif %}"),
    "olmo2": (
        "{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + "
        "message['content'] + '\n' }}{% if loop.last and add_generation_prompt %}"
        "{{ '<|assistant|>\n' }}{% endif %}{% endfor %}"),
    "qwen3": None,  # the factory's chatml template
}
FIELDS = {"gemma2": dict(head_dim=16, sliding_window=8)}
CONVERSATION = [{"role": "user", "content": "hello world"},
                {"role": "assistant", "content": " the cat reads"},
                {"role": "user", "content": "what is the capital of France?"}]
N = 6


def family_dir(root, model_type: str):
    path = make_tiny_family(root / model_type, model_type, **FIELDS.get(model_type, {}))
    if TEMPLATES[model_type] is not None:
        (path / "chat_template.jinja").write_text(TEMPLATES[model_type])
    return path


def hf_chat_ids(path, messages) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"])


@pytest.mark.parametrize("model_type", list(TEMPLATES))
def test_family_chat_template_renders_and_generates_as_transformers(model_type, tmp_path):
    path = family_dir(tmp_path, model_type)
    ids = hf_chat_ids(path, CONVERSATION)
    out = LLM(str(path)).chat(CONVERSATION, SamplingParams(max_tokens=N, temperature=0.0,
                                                           ignore_eos=True))[0]
    assert out.error is None, out.error
    assert out.prompt_token_ids == ids
    assert out.token_ids == argmax_loop(load_base_model(path), ids, N)


@pytest.fixture(scope="module")
def gemma_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma_http")
    path = family_dir(root, "gemma2")
    s = ServerProcess(path, "--allow-runtime-lora-updates", log_dir=root)
    try:
        yield s.wait_ready(), root, path
    finally:
        s.stop()


def test_chat_over_http_with_the_family_template(gemma_server):
    server, _, path = gemma_server
    body = {"model": str(path), "messages": CONVERSATION, "max_tokens": N, "temperature": 0,
            "ignore_eos": True}
    r = server.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    ref = LLM(str(path)).chat(CONVERSATION, SamplingParams(max_tokens=N, temperature=0.0,
                                                           ignore_eos=True))[0]
    assert r.json()["choices"][0]["message"]["content"] == ref.text
    assert r.json()["usage"]["prompt_tokens"] == len(hf_chat_ids(path, CONVERSATION))
    system = [{"role": "system", "content": "be brief"}, *CONVERSATION]
    assert_error(server.post("/v1/chat/completions", {**body, "messages": system}), 400,
                 "System role not supported")


def test_adapters_for_another_model_are_a_4xx_and_serving_goes_on(gemma_server):
    server, root, path = gemma_server
    phi3 = make_tiny_family(root / "phi3", "phi3")
    wide = make_tiny_family(root / "wide", "gemma2", hidden_size=96, head_dim=16)
    cases = [  # (adapter, what the error names)
        (make_peft_adapter(phi3, root / "phi3-lora", target_modules=["qkv_proj"]),
         "'qkv_proj'"),
        (make_peft_adapter(wide, root / "wide-lora", target_modules=["q_proj"]), "shape"),
    ]
    for i, (adapter, named) in enumerate(cases):
        r = server.post("/v1/load_lora_adapter", {"lora_name": f"x{i}",
                                                  "lora_path": str(adapter)})
        assert_error(r, (400, 422), named)
    r = server.post("/v1/completions", {"model": str(path), "prompt": [5, 6, 7],
                                        "max_tokens": 3})
    assert r.status_code == 200, r.text
    ids = [m["id"] for m in server.get("/v1/models").json()["data"]]
    assert not any(i.startswith("x") for i in ids)
    good = make_peft_adapter(path, root / "good", target_modules=["q_proj", "gate_proj"])
    r = server.post("/v1/load_lora_adapter", {"lora_name": "good", "lora_path": str(good)})
    assert r.status_code == 200, r.text
