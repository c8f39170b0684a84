"""Chat templates of the model families used at the edge's size, rendered as the engine renders them.

The fixtures in chat_templates/ are the families' published templates (SOURCES.md says where
each comes from). Each renders a system + user + assistant + user conversation with and
without the generation prompt; the structure (role markers in order, the assistant turn opened
at the end, the turn-closing token) is checked. Stop tokens and start-up errors are checked on
the bundled SmolLM2 GGUF, loaded vocabulary-only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_engine import EdgeEngine, EdgeSettings, bundled_model_path
from edge_engine.chat_template import PROBE, ChatTemplate, ChatTemplateError, stop_tokens
from edge_engine.errors import InvalidInput
from edge_engine.llama_model import LlamaModel

TEMPLATES = Path(__file__).parent / "chat_templates"

# family: (bos text, eos text, the markers opening system/user/assistant turns, the turn-closing text,
#          the generation prompt); bos/eos as the family's GGUF metadata names them
FAMILIES = {
    "qwen2.5": ("", "<|im_end|>", ("<|im_start|>system\n", "<|im_start|>user\n", "<|im_start|>assistant\n"),
                "<|im_end|>", "<|im_start|>assistant\n"),
    "qwen3": ("", "<|im_end|>", ("<|im_start|>system\n", "<|im_start|>user\n", "<|im_start|>assistant\n"),
              "<|im_end|>", "<|im_start|>assistant\n"),
    "gemma3": ("<bos>", "<eos>", (None, "<start_of_turn>user\n", "<start_of_turn>model\n"),
               "<end_of_turn>", "<start_of_turn>model\n"),
    "llama3.2": ("<|begin_of_text|>", "<|eot_id|>",
                 ("<|start_header_id|>system<|end_header_id|>\n\n", "<|start_header_id|>user<|end_header_id|>\n\n",
                  "<|start_header_id|>assistant<|end_header_id|>\n\n"),
                 "<|eot_id|>", "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "granite4": ("<|end_of_text|>", "<|end_of_text|>",
                 ("<|start_of_role|>system<|end_of_role|>", "<|start_of_role|>user<|end_of_role|>",
                  "<|start_of_role|>assistant<|end_of_role|>"),
                 "<|end_of_text|>", "<|start_of_role|>assistant<|end_of_role|>"),
    "lfm2": ("<|startoftext|>", "<|im_end|>", ("<|im_start|>system\n", "<|im_start|>user\n", "<|im_start|>assistant\n"),
             "<|im_end|>", "<|im_start|>assistant\n"),
}


# what a prompt starts with where it is not the BOS text (Granite 4's template writes none)
PROMPT_START = {"granite4": ""}


def _template(family: str) -> ChatTemplate:
    bos, eos = FAMILIES[family][:2]
    return ChatTemplate.from_text((TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8"),
                                  bos_token=bos, eos_token=eos, source=f"{family}.jinja")


def test_every_fixture_has_a_family_row() -> None:
    assert sorted(p.stem for p in TEMPLATES.glob("*.jinja")) == sorted([*FAMILIES, "gemma2"])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_template_renders_the_conversation_in_order(family: str) -> None:
    bos, _, (system, user, assistant), end, generation = FAMILIES[family]
    t = _template(family)
    prompt = t.render(PROBE)
    assert prompt.startswith(PROMPT_START.get(family, bos))
    # every message's text appears once, in the conversation's order
    positions = [prompt.index(m["content"]) for m in PROBE]
    assert positions == sorted(positions)
    # role markers: two user turns and one closed assistant turn before the open one
    assert prompt.count(user) == 2
    assert prompt.count(assistant) == 2
    if system is not None:
        assert prompt.index(system) < prompt.index(PROBE[0]["content"]) < prompt.index(user)
    else:  # Gemma puts the system text at the start of the first user turn
        assert prompt.index(user) < prompt.index(PROBE[0]["content"]) < prompt.index(PROBE[1]["content"])
    # the generation prompt opens the assistant's turn at the very end
    assert prompt.endswith(generation)
    assert t.generation_prompt == generation
    assert t.end_of_turn == end
    assert prompt.index("4" + end) < prompt.rindex(user)
    without = t.render(PROBE, add_generation_prompt=False)
    assert prompt == without + generation
    assert without.rstrip().endswith(end)
    assert not t.folds_system


def test_gemma_rejects_a_conversation_out_of_order() -> None:
    with pytest.raises(InvalidInput, match="alternate"):
        _template("gemma3").render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_a_template_refusing_the_system_role_gets_it_in_the_first_user_turn() -> None:
    # Gemma 2's template refuses the system role outright
    gemma2 = (TEMPLATES / "gemma2.jinja").read_text(encoding="utf-8")
    t = ChatTemplate.from_text(gemma2, bos_token="<bos>", eos_token="<eos>", source="gemma-2.gguf")
    assert t.folds_system
    prompt = t.render(PROBE)
    assert prompt.startswith("<bos><start_of_turn>user\nYou answer briefly.\n\nWhat is 2 + 2?<end_of_turn>\n")
    assert prompt.endswith("<start_of_turn>model\n")


@pytest.mark.parametrize(
    ("template", "what"),
    [
        ("{% for m in messages %}{{ m.content }}", "does not compile"),
        ("{{ raise_exception('no chat here') }}", "cannot render a user/assistant conversation: ValueError: no chat here"),
        ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}", "ignores add_generation_prompt"),
    ],
)
def test_an_unusable_template_is_refused_naming_the_file(template: str, what: str) -> None:
    with pytest.raises(ChatTemplateError, match=f"^broken.gguf: .*{what}"):
        ChatTemplate.from_text(template, bos_token="", eos_token="", source="broken.gguf")


@pytest.fixture(scope="module")
def vocab() -> Iterator[LlamaModel]:
    model = LlamaModel(bundled_model_path(), vocab_only=True)
    yield model
    model.close()


def test_stop_tokens_of_the_bundled_model_include_its_turn_end(vocab: LlamaModel) -> None:
    t = ChatTemplate(vocab)
    assert t.end_of_turn == "<|im_end|>"
    (im_end,) = vocab.tokenize("<|im_end|>", add_special=False, parse_special=True)
    stops = stop_tokens(vocab, t)
    assert im_end in stops
    assert stops == vocab.end_of_generation_tokens()
    assert all(vocab.is_special(s) for s in stops)


def test_a_special_turn_end_outside_the_eog_set_is_added(vocab: LlamaModel) -> None:
    template = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}<|im_start|>{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    (im_start,) = vocab.tokenize("<|im_start|>", add_special=False, parse_special=True)
    assert im_start not in vocab.end_of_generation_tokens()
    stops = stop_tokens(vocab, ChatTemplate(vocab, template))
    assert stops == vocab.end_of_generation_tokens() | {im_start}


def test_a_template_of_another_family_is_refused_for_this_vocabulary(vocab: LlamaModel) -> None:
    gemma = (TEMPLATES / "gemma3.jinja").read_text(encoding="utf-8")
    with pytest.raises(ChatTemplateError, match=r"SmolLM2-135M-Instruct\.Q4_1\.gguf: .*'<end_of_turn>'.*not a token"):
        stop_tokens(vocab, ChatTemplate(vocab, gemma))


def test_a_gguf_without_a_template_is_refused_naming_it(vocab: LlamaModel) -> None:
    with pytest.raises(ChatTemplateError, match=r"^SmolLM2-135M-Instruct\.Q4_1\.gguf has no tokenizer\.chat_template"):
        ChatTemplate(vocab, "")


def test_engine_start_refuses_a_template_it_cannot_render() -> None:
    engine = EdgeEngine(EdgeSettings(n_threads=1, n_ctx=256, slots=1), chat_template="{% if %}")
    with pytest.raises(ChatTemplateError, match=r"^SmolLM2-135M-Instruct\.Q4_1\.gguf: its chat template does not compile"):
        asyncio.run(engine.start())
    assert not engine.available
