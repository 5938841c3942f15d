"""Requantize the shipped model to other GGUF weight types with llama.cpp's llama-quantize (benchmarks only;
llama.cpp is never a pykv dependency).

    python tools/requantize.py [--model PATH] [--types Q4_K_M,Q5_K_M,Q6_K,Q8_0,Q4_0] [--out DIR]
                               [--quantize PATH/llama-quantize] [--threads N] [--force]

Writes DIR/<model stem>.<TYPE>.gguf (default DIR: ~/.cache/pykv/requant), each through a temporary file
renamed when llama-quantize succeeds; existing files are kept unless --force.  Prints one line per file
with the ggml types of its 2-D tensors (llama.cpp falls back to other types where a row is not a whole
number of 256-blocks: SmolLM2's 576 columns).
"""
import argparse
import collections
import os
import shutil
import subprocess
import sys

DEFAULT_MODEL = os.path.expanduser("~/.cache/pykv/models/SmolLM2-135M-Instruct.Q4_1.gguf")
DEFAULT_OUT = os.path.expanduser("~/.cache/pykv/requant")
DEFAULT_QUANTIZE = "/work/llama.cpp/build/bin/llama-quantize"
TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0")


def out_path(model: str, out_dir: str, qtype: str) -> str:
    stem = os.path.basename(model)
    for suffix in (".gguf",):
        stem = stem[:-len(suffix)] if stem.endswith(suffix) else stem
    base, _, last = stem.rpartition(".")
    if base and (last.upper().startswith(("Q", "F", "BF", "IQ"))):      # drop the source's type tag
        stem = base
    return os.path.join(out_dir, f"{stem}.{qtype}.gguf")


def tensor_types(path: str) -> str:
    from gguf import GGUFReader
    c = collections.Counter(t.tensor_type.name for t in GGUFReader(path).tensors if len(t.shape) == 2)
    return ", ".join(f"{n} x{k}" for n, k in c.most_common())


def requantize(model, qtype, out_dir, quantize, threads, force=False):
    dst = out_path(model, out_dir, qtype)
    if os.path.exists(dst) and not force:
        return dst, False
    os.makedirs(out_dir, exist_ok=True)
    tmp = dst + ".tmp"
    cmd = [quantize, "--allow-requantize", model, tmp, qtype, str(threads)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 or not os.path.exists(tmp):
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        raise SystemExit(f"requantize: {' '.join(cmd)} failed (exit {r.returncode}): {tail[0]}")
    os.replace(tmp, dst)
    return dst, True


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--quantize", default=os.environ.get("LLAMA_QUANTIZE", DEFAULT_QUANTIZE))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--force", action="store_true")
    a = ap.parse_args(argv)
    if not os.path.exists(a.model):
        raise SystemExit(f"requantize: no model at {a.model}")
    if not (os.path.exists(a.quantize) or shutil.which(a.quantize)):
        raise SystemExit(f"requantize: no llama-quantize at {a.quantize} (build it: tools/build_llama_bench.py)")
    for qt in [t.strip() for t in a.types.split(",") if t.strip()]:
        dst, made = requantize(a.model, qt, a.out, a.quantize, a.threads, a.force)
        print(f"{qt:8s} {'made' if made else 'kept'} {dst}  [{tensor_types(dst)}]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
