"""Record llama.cpp's token ids for tokenizer edge cases into tests/data/tokenizer_edge_ref.json.

Runs llama.cpp's `llama-tokenize` (a peer for measurements, never a test dependency) on the shipped
model, one string at a time, read verbatim from a file (no escape processing, no BOS, special tokens
not parsed: tests compare with Tokenizer.encode(s, add_special=False, parse_special=False)).

    python tools/record_tokenizer_refs.py [--bin /work/llama.cpp/build/bin/llama-tokenize] [--model PATH]
"""
import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "tokenizer_edge_ref.json"

# (name, text): each a class of input the pre-tokenizer regex or the byte-level BPE can get wrong
CASES = [
    ("empty", ""),
    ("nul", "a\x00b"),
    ("nul_alone", "\x00"),
    ("controls", "x\x01\x07\x08\x0b\x0c\x1b[0m\x7f y"),
    ("c1_controls", "\x85next\x9fline"),
    ("cr_lf_runs", "a\r\r\n\n\nb \n \t\t c"),
    ("nfd_combining", "cafe\u0301 nai\u0308ve e\u0301e\u0300"),
    ("nfc_precomposed", "café naïve éè"),
    ("combining_alone", "\u0301\u0308 x\u0338"),
    ("zwj_family", "\U0001F468\u200D\U0001F469\u200D\U0001F467\u200D\U0001F466 ok"),
    ("zwj_profession", "\U0001F469\U0001F3FD\u200D\U0001F4BB!"),
    ("variation_selectors", "\u2764\uFE0F \u2764\uFE0E \u263A\uFE0F1"),
    ("flags", "\U0001F1EB\U0001F1F7\U0001F1EF\U0001F1F5"),
    ("keycap", "1\uFE0F\u20E3 #\uFE0F\u20E3"),
    ("rtl_hebrew", "שלום עולם 123"),
    ("rtl_arabic", "مرحبا بالعالم، كيف حالك؟"),
    ("bidi_marks", "a\u200Fb\u200Ec \u202Bx\u202C"),
    ("arabic_indic_digits", "\u0661\u0662\u0663 \u06F4\u06F5\u06F6"),
    ("devanagari_digits", "\u0967\u0968\u0969\u096A"),
    ("fullwidth_digits", "\uFF11\uFF12\uFF13abc"),
    ("mixed_digits", "12\u0663\uFF14 5"),
    ("nbsp", "a\u00A0b \u00A0 c\u00A0\u00A0d"),
    ("ideographic_space", "日本\u3000語\u3000\u3000x"),
    ("thin_spaces", "a\u2009b\u202Fc\u2002d"),
    ("zero_width", "a\u200Bb\uFEFFc"),
    ("line_separators", "a\u2028b\u2029c"),
    ("lone_ideographic_space", "\u3000"),
    ("contractions_unicode", "don\u2019t I\u2019LL we'VE"),
]


def llama_ids(binary, model, text):
    with tempfile.NamedTemporaryFile("wb", suffix=".txt", delete=False) as f:
        f.write(text.encode("utf-8"))
        path = f.name
    try:
        r = subprocess.run([binary, "-m", model, "-f", path, "--no-escape", "--ids", "--no-bos",
                            "--no-parse-special", "--log-disable"], capture_output=True, timeout=120)
    finally:
        os.unlink(path)
    if r.returncode != 0:
        raise SystemExit(f"llama-tokenize failed on {text!r}: {r.stderr.decode(errors='replace')[-500:]}")
    out = r.stdout.decode().strip().splitlines()[-1]
    return json.loads(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="/work/llama.cpp/build/bin/llama-tokenize")
    ap.add_argument("--model", default=None, help="GGUF (default: the registry's default model)")
    a = ap.parse_args()
    if a.model is None:
        from pykv.models import resolve_model
        a.model = str(resolve_model(None))
    cases = [{"name": n, "text": t, "ids": llama_ids(a.bin, a.model, t)} for n, t in CASES]
    doc = {"source": f"llama.cpp llama-tokenize (vendor copy of llama-cpp-python 0.3.36) on {Path(a.model).name}, "
                     "no BOS, special tokens not parsed; tools/record_tokenizer_refs.py",
           "cases": cases}
    body = ",\n".join("  " + json.dumps(c, ensure_ascii=True) for c in cases)   # one case a line
    text = f'{{"source": {json.dumps(doc["source"])},\n "cases": [\n{body}\n]}}\n'
    assert json.loads(text) == doc
    tmp = OUT.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, OUT)
    print(f"{len(cases)} cases -> {OUT}")


if __name__ == "__main__":
    main()
