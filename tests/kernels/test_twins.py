"""The CPU kernels and their CUDA twins have the same public functions, but for the names that
pykv.kernels.backend declares one-sided with a reason; and every kernel the decoder and the KV cache call
through the backend exists on both sides."""
import ast
import re
from pathlib import Path

import pytest

from pykv.kernels.backend import CPU_ONLY, GPU_ONLY, KERNEL_MODULES

PKG = Path(__file__).resolve().parents[2] / "pykv"


def public(path: Path) -> set:
    """Functions and classes a module defines, and names it assigns that are not CONSTANTS nor aliases
    (`f32 = np.float32`), without a leading underscore."""
    names = set()
    for n in ast.parse(path.read_text()).body:
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.Assign) and not isinstance(n.value, ast.Attribute):
            names |= {t.id for t in n.targets if isinstance(t, ast.Name) and not t.id.isupper()}
    return {x for x in names if not x.startswith("_")}


@pytest.mark.parametrize("mod", KERNEL_MODULES)
def test_twins_have_the_same_public_names(mod):
    cpu, gpu = public(PKG / "kernels" / f"{mod}.py"), public(PKG / "kernels" / "cuda" / f"{mod}.py")
    cpu_only, gpu_only = set(CPU_ONLY.get(mod, {})), set(GPU_ONLY.get(mod, {}))
    assert cpu_only <= cpu and gpu_only <= gpu, "a declared one-sided name no longer exists"
    assert cpu - cpu_only == gpu - gpu_only, (sorted((cpu - cpu_only) - gpu), sorted((gpu - gpu_only) - cpu))


def test_declared_reasons_are_given():
    for table in (CPU_ONLY, GPU_ONLY):
        for mod, names in table.items():
            assert mod in KERNEL_MODULES
            assert all(isinstance(r, str) and len(r) > 10 for r in names.values())


def _backend_calls() -> set:
    """(module, function) pairs called through the backend in the decoder and the KV cache:
    `be.ops.rmsnorm(...)`, and `ops.key_xform(...)` after `ops = self.be.ops` (or `ops, mm = ...`)."""
    calls = set()
    for f in (PKG / "decoder" / "model.py", PKG / "kv" / "cache.py"):
        src = f.read_text()
        calls |= set(re.findall(r"\bbe\.(\w+)\.(\w+)\(", src))
        for lhs, rhs in re.findall(r"^\s*([\w, ]+?)\s*=\s*((?:self\.)?be\.\w+(?:,\s*(?:self\.)?be\.\w+)*)\s*$", src,
                                   re.M):
            for var, mod in zip([v.strip() for v in lhs.split(",")], re.findall(r"be\.(\w+)", rhs)):
                calls |= {(mod, fn) for fn in re.findall(rf"\b{var}\.(\w+)\(", src)}
    return {(m, f) for m, f in calls if m in KERNEL_MODULES}


def test_every_backend_call_has_both_twins():
    calls = _backend_calls()
    assert ("ops", "key_xform") in calls and ("attention", "attend") in calls     # the scan sees them
    for mod, fn in sorted(calls):
        assert fn in public(PKG / "kernels" / f"{mod}.py"), (mod, fn)
        assert fn in public(PKG / "kernels" / "cuda" / f"{mod}.py"), (mod, fn)
