"""Chat templates against transformers' apply_chat_template (tests/data/chat_template_ref.json, made by
tools/make_chat_fixtures.py from the GGUF's own tokenizer), and the OpenAI-shaped results."""
import json

import pytest

import pykv
from pykv.api.chat import CHATML_TEMPLATE, completion_result, fit_messages, render, special_tokens
from tests.conftest import DATA

REF = json.loads((DATA / "chat_template_ref.json").read_text(encoding="utf-8"))


def _case_id(c):
    return f"{c['template']}-{c['conversation']}-gen{int(c['add_generation_prompt'])}-tools{int(c['tools'])}"


@pytest.fixture(scope="module")
def model_tokens(smollm2):
    return special_tokens(smollm2.tokenizer, smollm2.gguf.metadata)


def test_fixture_is_this_model_and_fallback():
    assert REF["templates"]["chatml"] == CHATML_TEMPLATE      # the fixture rendered pykv's fallback


def test_special_tokens_are_hf(model_tokens):
    assert model_tokens == REF["special_tokens"]


@pytest.mark.parametrize("case", REF["cases"], ids=_case_id)
def test_template_renders_as_hf(smollm2, model_tokens, case):
    msgs = REF["conversations"][case["conversation"]]
    tools = REF["tools"] if case["tools"] else None
    source = REF["templates"][case["template"]]
    if case["template"] == "gguf":
        assert smollm2.chat_template == source
        got = lambda: smollm2.apply_chat_template(msgs, add_generation_prompt=case["add_generation_prompt"],  # noqa: E731
                                                  tools=tools)
    else:
        got = lambda: render(source, msgs, case["add_generation_prompt"], tools, model_tokens)  # noqa: E731
    if "error" in case:
        with pytest.raises(pykv.PykvError) as e:
            got()
        assert case["error"] in str(e.value) and "\n" not in str(e.value)
    else:
        assert got() == case["text"]


def test_template_is_sandboxed():
    # the sandbox refuses attribute access to Python internals: a one-line PykvError, not an escape
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(pykv.PykvError, match="chat template"):
        render(evil, [{"role": "user", "content": "x"}])
    with pytest.raises(pykv.PykvError, match="messages must be a list"):
        render(CHATML_TEMPLATE, "hello")


def test_fit_messages_drops_oldest_turns():
    msgs = [{"role": "system", "content": "S"}] + [
        {"role": r, "content": f"{r}{i}"} for i in range(3) for r in ("user", "assistant")] + [
        {"role": "user", "content": "last"}]

    def ids(m):          # one "token" per character of the contents
        return list(range(sum(len(x["content"]) for x in m)))

    full = len(ids(msgs))
    got, used = fit_messages(ids, msgs, n_ctx=full + 4, max_tokens=4, drop_oldest=False)
    assert used == msgs and len(got) == full
    with pytest.raises(pykv.PykvError, match="context full.*drop_oldest"):
        fit_messages(ids, msgs, n_ctx=full + 3, max_tokens=4, drop_oldest=False)
    got, used = fit_messages(ids, msgs, n_ctx=full + 3, max_tokens=4, drop_oldest=True)
    # the system message stays; the first user turn and its reply went
    assert used[0]["role"] == "system" and used[1:] == msgs[3:]
    with pytest.raises(pykv.PykvError, match="context full"):
        fit_messages(ids, msgs, n_ctx=5, max_tokens=4, drop_oldest=True)


def test_completion_dict_shapes():
    stats = {"prompt_tokens": 7, "gen_tokens": 2, "finish_reason": "length"}
    r = completion_result(iter(["a", "b"]), stats, "m.gguf", chat=False, stream=False)
    assert r["object"] == "text_completion" and r["choices"][0]["text"] == "ab"
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"] == {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
    chunks = list(completion_result(iter(["a", "b"]), stats, "m.gguf", chat=True, stream=True))
    assert [c["object"] for c in chunks] == ["chat.completion.chunk"] * 4
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "ab"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["total_tokens"] == 9
    assert len({c["id"] for c in chunks}) == 1
