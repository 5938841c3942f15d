"""`pykv quantize` against llama-quantize on the shipped model (not run by CI).

For each target: llama-quantize --allow-requantize (with --pure for pykv's plain types) and
`pykv quantize` on the same input, then per tensor: the type each chose (must match), the RMS error
of each against the f32 dequantized input, and whether the bytes are identical; then perplexity of
both files with `pykv perplexity` on the first 1024 tokens of the reference text.

    python tools/kquant_compare.py [--imatrix] [--no-ppl] [--write-fixtures] [--only q4_k_m,q6_k]

--imatrix first runs llama-imatrix on the reference text and quantizes with it (both tools).
--write-fixtures records what the tests compare against (all made by llama.cpp's tools):
    tests/data/kquant_llama.npz        a few rows of a real tensor and llama-quantize's bytes for them
    tests/data/kquant_llama_types.json the tensor list and llama-quantize's type per tensor per target
    tests/data/imatrix-smollm2-blk0.gguf  llama-imatrix's file cut to its metadata + layer 0 entries
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import gguf  # noqa: E402
from gguf import GGMLQuantizationType as QT  # noqa: E402

from pykv.models import resolve_model  # noqa: E402

BIN = Path(os.environ.get("LLAMA_BIN", "/work/llama.cpp/build/bin"))
TEXT = ROOT / "tests" / "data" / "eval-gpl3.txt"
DATA = ROOT / "tests" / "data"
# pykv target -> llama-quantize arguments that make the same thing
TARGETS = {
    "q4_k_m": ["Q4_K_M"], "q5_k_m": ["Q5_K_M"], "q6_k": ["Q6_K"], "q3_k_m": ["Q3_K_M"],
    "q4_k_s": ["Q4_K_S"], "q2_k": ["--pure", "Q2_K"], "q3_k": ["--pure", "Q3_K_S"],
    "q4_k": ["--pure", "Q4_K_S"], "q5_k": ["--pure", "Q5_K_S"],
}
FIXTURE_TENSOR = "blk.0.ffn_down.weight"      # 1536 columns: every K type fits
FIXTURE_ROWS = 6


def run(cmd, **kw):
    t = time.time()
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(map(str, cmd))}\n{p.stderr[-3000:]}")
    return p, time.time() - t


def f32(t) -> np.ndarray:
    rows = int(t.shape[1]) if len(t.shape) > 1 else 1
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(rows, -1)


def rms(a, b) -> float:
    return float(np.sqrt(np.mean((a.astype(np.float64) - b) ** 2)))


def ppl(path: Path) -> float:
    p, _ = run([sys.executable, "-m", "pykv", "perplexity", path, TEXT, "-c", "1024", "--chunks", "1", "--json"],
               cwd=ROOT)
    return float(json.loads(p.stdout.strip().splitlines()[-1])["ppl"])


def compare(src: Path, target: str, work: Path, imatrix: Path | None, do_ppl: bool) -> dict:
    tag = target + ("-imat" if imatrix else "")
    ll, pk = work / f"llama-{tag}.gguf", work / f"pykv-{tag}.gguf"
    la = ["--imatrix", imatrix] if imatrix else []
    _, t_ll = run([BIN / "llama-quantize", "--allow-requantize", *la, *TARGETS[target][:-1], src, ll,
                   TARGETS[target][-1], "2"])
    _, t_pk = run([sys.executable, "-m", "pykv", "quantize", src, pk, target, "--force",
                   *(["--imatrix", imatrix] if imatrix else [])], cwd=ROOT)
    rs = {t.name: t for t in gguf.GGUFReader(src).tensors}
    rl = {t.name: t for t in gguf.GGUFReader(ll).tensors}
    rp = {t.name: t for t in gguf.GGUFReader(pk).tensors}
    rows, n_same, n_type_diff, worse = [], 0, 0, []
    print(f"\n## {tag}: llama-quantize {t_ll:.1f} s, pykv quantize {t_pk:.1f} s")
    print("| tensor | llama type | pykv type | RMS llama | RMS pykv | bytes |")
    print("|---|---|---|---:|---:|---|")
    for name, ts in rs.items():
        tl, tp = rl[name], rp[name]
        same_type = tl.tensor_type == tp.tensor_type
        same = same_type and np.array_equal(np.asarray(tl.data), np.asarray(tp.data))
        x = f32(ts)
        el, ep = rms(f32(tl), x), rms(f32(tp), x)
        n_same += same
        n_type_diff += not same_type
        if ep > el:
            worse.append(name)
        rows.append((name, tl.tensor_type.name, tp.tensor_type.name, el, ep, same))
        if len(ts.shape) > 1:
            print(f"| {name} | {tl.tensor_type.name} | {tp.tensor_type.name} | {el:.6g} | {ep:.6g} | "
                  f"{'identical' if same else 'DIFFERENT'} |")
    res = {"target": tag, "tensors": len(rs), "identical": n_same, "type_mismatch": n_type_diff,
           "pykv_rms_worse": worse, "llama_s": t_ll, "pykv_s": t_pk,
           "types": {n: r[1] for n, r in zip(rs, rows)}, "files": (ll, pk)}
    if do_ppl:
        res["ppl_pykv"] = ppl(pk)
        # identical tensor bytes give identical logits: the llama-quantize file is scored only when some
        # tensor differs (or for q4_k_m, the criterion, always)
        both = n_same < len(rs) or target == "q4_k_m"
        res["ppl_llama"] = ppl(ll) if both else res["ppl_pykv"]
        res["ppl_note"] = "" if both else " (same tensors: scored once)"
    print(f"{tag}: {n_same}/{len(rs)} tensors byte-identical, {n_type_diff} type mismatches, "
          f"pykv RMS worse on {len(worse)}" + (f"; ppl llama {res['ppl_llama']:.4f} pykv {res['ppl_pykv']:.4f} "
                                              f"({100 * (res['ppl_pykv'] / res['ppl_llama'] - 1):+.3f} %){res['ppl_note']}"
                                              if do_ppl else ""))
    return res


def make_imatrix(src: Path, work: Path) -> Path:
    out = work / "imatrix.gguf"
    _, t = run([BIN / "llama-imatrix", "-m", src, "-f", TEXT, "-o", out, "-c", "512", "--chunks", "8",
                "-t", "2", "--no-ppl"])
    run([BIN / "llama-imatrix", "-m", src, "-f", TEXT, "-o", work / "imatrix.dat", "-c", "512", "--chunks", "8",
         "-t", "2", "--no-ppl", "--output-format", "dat"])
    from pykv.tools.quant_plan import read_imatrix
    a, b = read_imatrix(out), read_imatrix(work / "imatrix.dat")
    same = sorted(a) == sorted(b) and all(np.allclose(a[k], b[k], rtol=1e-6) for k in a)
    print(f"llama-imatrix: {t:.1f} s, {len(a)} entries; GGUF and legacy .dat read alike: {same}")
    return out


def write_fixtures(src: Path, results: dict, imatrix: Path | None) -> None:
    rs = {t.name: t for t in gguf.GGUFReader(src).tensors}
    x = f32(rs[FIXTURE_TENSOR])[:FIXTURE_ROWS]
    arrays = {"x": x}
    for res in results.values():
        ll = res["files"][0]
        t = {t.name: t for t in gguf.GGUFReader(ll).tensors}[FIXTURE_TENSOR]
        key = f"{t.tensor_type.name}{'-imat' if res['target'].endswith('-imat') else ''}"
        arrays.setdefault(key, np.asarray(t.data)[:FIXTURE_ROWS].copy())
    if imatrix is not None:
        from pykv.tools.quant_plan import read_imatrix
        arrays["qw"] = read_imatrix(imatrix)[FIXTURE_TENSOR]
        cut = DATA / "imatrix-smollm2-blk0.gguf"
        r = gguf.GGUFReader(imatrix)
        w = gguf.GGUFWriter(cut, "imatrix")   # adds general.architecture = imatrix; the rest is copied
        from pykv.tools.common import _copy_field
        for k, f in r.fields.items():
            if not k.startswith("GGUF.") and k != "general.architecture":
                _copy_field(w, k, f)
        for t in r.tensors:
            if t.name.startswith("blk.0."):
                w.add_tensor(t.name, np.asarray(t.data, np.float32).reshape([int(v) for v in reversed(t.shape)]))
        w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
        print(f"wrote {cut} ({cut.stat().st_size} bytes)")
    np.savez_compressed(DATA / "kquant_llama.npz", **arrays)
    print(f"wrote {DATA / 'kquant_llama.npz'}: {sorted(arrays)}")
    n_layer = int(gguf.GGUFReader(src).fields["llama.block_count"].parts[-1][0])
    tensors = [[n, [int(v) for v in reversed(t.shape)]] for n, t in rs.items()]
    types = {r["target"]: r["types"] for r in results.values() if not r["target"].endswith("-imat")}
    (DATA / "kquant_llama_types.json").write_text(json.dumps(
        {"model": src.name, "n_layer": n_layer, "tensors": tensors, "llama_quantize_types": types}, indent=0))
    print(f"wrote {DATA / 'kquant_llama_types.json'}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--work", default="/tmp/kquant_compare")
    ap.add_argument("--only", default=None, help="comma list of targets")
    ap.add_argument("--imatrix", action="store_true", help="also quantize with an imatrix from llama-imatrix")
    ap.add_argument("--imatrix-targets", default="q2_k,q3_k,q4_k,q5_k,q6_k,q4_k_m",
                    help="targets quantized with the imatrix too (default: every K type once, and q4_k_m)")
    ap.add_argument("--no-ppl", action="store_true")
    ap.add_argument("--write-fixtures", action="store_true")
    a = ap.parse_args()
    src = Path(resolve_model(a.model))
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    targets = a.only.split(",") if a.only else list(TARGETS)
    results = {}
    for tg in targets:
        results[tg] = compare(src, tg, work, None, not a.no_ppl)
    imat = None
    if a.imatrix:
        imat = make_imatrix(src, work)
        for tg in a.imatrix_targets.split(","):
            results[tg + "-imat"] = compare(src, tg, work, imat, not a.no_ppl)
    print("\n| target | identical tensors | type mismatches | pykv RMS worse | ppl llama | ppl pykv | diff |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results.values():
        p = (f"{r['ppl_llama']:.4f} | {r['ppl_pykv']:.4f} | {100 * (r['ppl_pykv'] / r['ppl_llama'] - 1):+.3f} %"
             f"{r['ppl_note']}"
             if "ppl_llama" in r else "- | - | -")
        print(f"| {r['target']} | {r['identical']}/{r['tensors']} | {r['type_mismatch']} | "
              f"{len(r['pykv_rms_worse'])} | {p} |")
    if a.write_fixtures:
        write_fixtures(src, results, imat)


if __name__ == "__main__":
    main()
