"""Run llama.cpp's own convert_hf_to_gguf.py on the HF fixtures and write the metadata it produces to
tests/data/llama_cpp_convert_metadata.json (the expectation tests/files/test_hf_fixtures.py checks pykv's GGUFs
against, without running llama.cpp in CI). Not run by CI; needs torch and llama.cpp's sources:
    python tools/llama_cpp_metadata.py [--llama-cpp /work/llama.cpp]

llama.cpp identifies a BPE pre-tokenizer by the hash of a test string's token ids; the fixtures' tiny
tokenizer is not in its table, so get_vocab_base_pre is patched to answer "smollm" (the pre-tokenizer
pykv detects from the same tokenizer.json's Digits + ByteLevel split). Everything else is llama.cpp's code.
Recorded: rope_freqs.weight's values (as "_rope_freqs"), the tensor names ("_tensors"), every key except the general.* naming metadata llama.cpp derives from the folder name
(general.name, basename, size_label, ...), with the values as gguf-py reads them.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ("tf4_default_untied", "tf5_default_tied_mha", "tf4_linear", "tf5_llama3", "tf5_yarn", "tf4_yarn_attn")
SKIP_GENERAL = ("general.name", "general.basename", "general.size_label", "general.finetune", "general.version")

RUNNER = r"""
import sys, runpy
sys.path.insert(0, {lcpp!r})
import conversion.base as B
B.TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
sys.argv = ["convert_hf_to_gguf.py", {src!r}, "--outtype", "f32", "--outfile", {out!r}]
runpy.run_path({lcpp!r} + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def metadata(path: Path) -> dict:
    sys.path.insert(0, str(ROOT))
    from pykv.tools.common import gguf_metadata
    import gguf
    r = gguf.GGUFReader(path)
    md = {k: v for k, v in gguf_metadata(r).items() if k not in SKIP_GENERAL}
    md["_tensors"] = sorted(t.name for t in r.tensors)
    for t in r.tensors:
        if t.name == "rope_freqs.weight":
            md["_rope_freqs"] = [float(x) for x in t.data]
    return md


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", default="/work/llama.cpp")
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "llama_cpp_convert_metadata.json")
    a = ap.parse_args()
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in FIXTURES:
            out = Path(tmp) / f"{name}.gguf"
            code = RUNNER.format(lcpp=a.llama_cpp, src=str(ROOT / "tests" / "data" / "hf_fixtures" / name),
                                 out=str(out))
            p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            if p.returncode:
                sys.exit(f"{name}: llama.cpp's converter failed:\n{p.stderr[-2000:]}")
            res[name] = metadata(out)
            print(f"{name}: {len(res[name]) - 1} keys, {len(res[name]['_tensors'])} tensors")
    a.out.write_text(json.dumps(res, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
