"""Write tests/data/chat_template_ref.json: chat templates rendered by transformers' apply_chat_template.

Not run by CI (needs transformers; made with transformers 5.24.0, jinja2 3.1.6):
    python tools/make_chat_fixtures.py [--model PATH.gguf] [--out tests/data/chat_template_ref.json]

The tokenizer comes from the GGUF itself (transformers' GGUF loading: AutoTokenizer.from_pretrained(dir,
gguf_file=...)), so its chat_template and special tokens (bos/eos/unk/pad) are the file's. Rendered:
  "gguf"    the model's own tokenizer.chat_template (SmolLM2-135M-Instruct's ChatML with a default system turn)
  "chatml"  pykv's fallback for files without a template (pykv.api.chat.CHATML_TEMPLATE)
  "tools"   a test template using bos_token, eos_token, tools | tojson, namespace, loop controls,
            raise_exception and indented block tags (trim_blocks / lstrip_blocks)
each on multi-turn conversations with and without a system message, with and without
add_generation_prompt; the "tools" template also with tools, and on inputs its raise_exception refuses
(the expected message is stored instead of a text).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TOOLS_TEMPLATE = """{{ bos_token }}
{%- if tools %}
<tools>
{% for t in tools %}
    {{ t | tojson }}
{% endfor %}
</tools>
{% endif %}
{% set ns = namespace(turns=0) %}
{% for m in messages %}
    {% if m['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('Unknown role: ' + m['role']) }}
    {% endif %}
    {% if m['role'] == 'system' %}
        {% if not loop.first %}{{ raise_exception('The system message must come first') }}{% endif %}
<<SYS>> {{ m['content'] | trim }} <</SYS>>
        {% continue %}
    {% endif %}
    {% set ns.turns = ns.turns + 1 %}
[{{ ns.turns }}:{{ m['role'] | upper }}] {{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}

{% endfor %}
{% if add_generation_prompt %}[{{ ns.turns + 1 }}:ASSISTANT]{% endif %}"""

CONVERSATIONS = {
    "one_turn": [{"role": "user", "content": "What is the capital of France?"}],
    "multi_no_system": [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Name three primes.\nJust the numbers."},
    ],
    "multi_system": [
        {"role": "system", "content": "You are a terse assistant. "},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Und auf Deutsch? ¿Y en español? 日本語でも"},
        {"role": "assistant", "content": "vier / cuatro / 四"},
    ],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
REFUSED = {
    "unknown_role": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}],
    "late_system": [{"role": "user", "content": "hi"}, {"role": "system", "content": "be nice"}],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF (default: the registry's default model)")
    ap.add_argument("--out", default=str(ROOT / "tests" / "data" / "chat_template_ref.json"))
    args = ap.parse_args()
    import jinja2
    import transformers
    from transformers import AutoTokenizer

    from pykv.api.chat import CHATML_TEMPLATE
    path = args.model
    if path is None:
        from pykv.models import resolve_model
        path = str(resolve_model(None))
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    templates = {"gguf": tok.chat_template, "chatml": CHATML_TEMPLATE, "tools": TOOLS_TEMPLATE}
    cases = []
    for tname, template in templates.items():
        for cname, msgs in CONVERSATIONS.items():
            for agp in (True, False):
                for tools in ([None, TOOLS] if tname == "tools" else [None]):
                    text = tok.apply_chat_template(msgs, chat_template=template, tools=tools, tokenize=False,
                                                   add_generation_prompt=agp)
                    cases.append({"template": tname, "conversation": cname, "add_generation_prompt": agp,
                                  "tools": tools is not None, "text": text})
    for cname, msgs in REFUSED.items():
        try:
            tok.apply_chat_template(msgs, chat_template=TOOLS_TEMPLATE, tokenize=False, add_generation_prompt=True)
        except jinja2.TemplateError as e:
            cases.append({"template": "tools", "conversation": cname, "add_generation_prompt": True, "tools": False,
                          "error": str(e)})
        else:
            raise SystemExit(f"{cname}: transformers rendered it; expected raise_exception")
    out = {"made_with": f"transformers {transformers.__version__}, jinja2 {jinja2.__version__}",
           "model": os.path.basename(path), "special_tokens": tok.special_tokens_map, "templates": templates,
           "conversations": {**CONVERSATIONS, **REFUSED}, "tools": TOOLS, "cases": cases}
    Path(args.out).write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{args.out}: {len(cases)} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
