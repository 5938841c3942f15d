"""README.md cannot drift from the code: every fenced code block in it is checked here.

* ```bash / ```sh blocks run line by line (bash, a scratch folder as the working directory, `pykv` on
  PATH as `python -m pykv` of this interpreter, stdin a short chat ending in /quit). A line's
  `pip install ...` parts are checked by parsing (extras named in pyproject.toml), its
  `python -m pytest ...` part must be the command `.ci/run` runs (CI runs "the README's test command");
  every other part must be a `pykv` command, and the line must exit 0.
* ```python blocks run as scripts in the same folder and must exit 0.
* A block whose info string says `no-run` (the GPU commands) is not run: each of its commands is
  either an install line or a `pykv` command that pykv's own argument parser accepts.
* Any other block fails the test: a new block has to be runnable or marked.

Besides the blocks: at most 300 lines, the two commands up front, every CLI command and option named
in the command table, every `pykv.load` keyword and default, every KV type and its bits per value, and
every relative link (with its #anchor) resolve against the code and the docs.
"""
import inspect
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES = 300
TIMEOUT = 900           # a block's command on a cold kernel cache compiles for minutes
CHAT_INPUT = "What is 2 + 2?\n/kv\n/quit\n"
NO_RUN = "no-run"


def _text():
    return README.read_text(encoding="utf-8")


def code_blocks(text=None):
    """[(line number, language, tags, body)] of every ``` fenced block."""
    lines = (text if text is not None else _text()).splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^(`{3,})(.*)$", lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group(1), m.group(2).split()
        j = i + 1
        while j < len(lines) and not lines[j].startswith(fence):
            j += 1
        assert j < len(lines), f"README.md:{i + 1}: unclosed code block"
        out.append((i + 1, info[0] if info else "", set(info[1:]), "\n".join(lines[i + 1:j]) + "\n"))
        i = j + 1
    return out


def command_lines(body):
    """A shell block's commands: [(line, [(tokens, text), ...])], one per line (backslash continuations
    joined, comments dropped), split on `&&`; tokens for checking, the text as written for bash."""
    joined = re.sub(r"\\\n", " ", body)
    cmds = []
    for line in joined.splitlines():
        toks = shlex.split(line, comments=True)
        if not toks:
            continue
        parts, cur = [], []
        for t in toks:
            if t == "&&":
                parts.append(cur)
                cur = []
            else:
                cur.append(t)
        parts.append(cur)
        assert all(parts), f"empty command in {line!r}"
        for p in parts:
            assert not {"|", ";", "||", ">", "<"} & set(p), f"{line!r}: keep README commands plain (no pipes)"
        code = line.split(" #", 1)[0]                   # the text as written (bash runs it), less a comment
        raw = [r.strip() for r in code.split("&&")]
        assert len(raw) == len(parts), f"{line!r}: '&&' or ' #' inside quotes"
        cmds.append((line, list(zip(parts, raw))))
    return cmds


def ci_commands():
    """The install and test commands of .ci/run, as token lists."""
    cmds = [shlex.split(l) for l in (ROOT / ".ci" / "run").read_text().splitlines()
            if l.startswith("python -m ")]
    install = [c for c in cmds if c[:4] == ["python", "-m", "pip", "install"]]
    test = [c for c in cmds if c[:3] == ["python", "-m", "pytest"]]
    assert len(install) == 1 and len(test) == 1, cmds
    return install[0], test[0]


def pyproject_extras():
    text = (ROOT / "pyproject.toml").read_text()
    sec = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([A-Za-z0-9_-]+)\s*=", sec, re.M))


def check_install(tokens):
    """`pip install` / `python -m pip install` with -e / -q and this project or its extras only."""
    rest = tokens[2:] if tokens[0] == "pip" else tokens[4:]
    assert rest, tokens
    for t in rest:
        if t in ("-e", "-q", "--upgrade"):
            continue
        m = re.fullmatch(r"(\.|pykv)(?:\[([a-z0-9_,-]+)\])?", t)
        assert m, f"install line installs something else: {t!r} in {tokens}"
        for extra in (m.group(2) or "").split(","):
            assert not extra or extra in pyproject_extras(), f"no extra {extra!r} in pyproject.toml"


def kind(tokens):
    if tokens[0] == "pip" and tokens[1:2] == ["install"] or tokens[:4] == ["python", "-m", "pip", "install"]:
        return "install"
    if tokens[:3] == ["python", "-m", "pytest"]:
        return "test"
    if tokens[0] == "pykv":
        return "pykv"
    return "other"


def _module(*names):
    """The first of these modules that imports (the package's layout has moved; old names warn)."""
    import importlib
    import warnings
    for n in names:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                return importlib.import_module(n)
        except ImportError:
            continue
    raise ImportError(f"none of {names}")


def subparsers():
    build_parser = _module("pykv.cli").build_parser
    ap = build_parser()
    (sub,) = [a for a in ap._actions if hasattr(a, "choices") and isinstance(a.choices, dict)]
    return ap, sub.choices


def check_parses(tokens):
    ap, _ = subparsers()
    try:
        ap.parse_args(tokens[1:])
    except SystemExit as e:
        raise AssertionError(f"pykv's parser refuses {shlex.join(tokens)} (exit {e.code})") from None


# ---- the blocks ---------------------------------------------------------------------------------

BLOCKS = code_blocks()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A scratch folder for the blocks' outputs (plan.json, chat.state, tiny.gguf, ...) where the
    checkout's tests/ folder is visible, so README paths such as tests/data/eval-gpl3.txt resolve; a
    bin/ with `pykv` = `python -m pykv` of this interpreter and this tree."""
    d = tmp_path_factory.mktemp("readme")
    (d / "tests").symlink_to(ROOT / "tests", target_is_directory=True)
    b = d / ".bin"
    b.mkdir()
    exe = b / "pykv"
    exe.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m pykv "$@"\n')
    exe.chmod(0o755)
    env = dict(os.environ)
    env["PATH"] = f"{b}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return d, env


def _run(args, cwd, env, what):
    r = subprocess.run(args, cwd=cwd, env=env, input=CHAT_INPUT, capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == 0 and "Traceback" not in r.stderr, \
        f"{what}\nexit {r.returncode}\nstdout: {r.stdout[-2000:]}\nstderr: {r.stderr[-3000:]}"
    return r


@pytest.mark.parametrize("lineno,lang,tags,body", BLOCKS, ids=[f"line{b[0]}-{b[1] or 'none'}" for b in BLOCKS])
def test_readme_block(lineno, lang, tags, body, request):
    where = f"README.md:{lineno}"
    if NO_RUN in tags:
        assert lang in ("bash", "sh", "python"), f"{where}: a no-run block must still be bash or python"
        if lang == "python":
            compile(body, where, "exec")
            return
        for line, parts in command_lines(body):
            for p, _ in parts:
                k = kind(p)
                assert k in ("install", "pykv"), f"{where}: {line!r}: not an install line or a pykv command"
                check_install(p) if k == "install" else check_parses(p)
        return
    assert lang in ("bash", "sh", "python"), \
        f"{where}: ```{lang} block: make it bash or python, or mark it `{NO_RUN}` with a reason"
    request.getfixturevalue("smollm2_path")       # the default model fetched (sha256-checked) once, here
    cwd, env = request.getfixturevalue("workdir")
    if lang == "python":
        script = cwd / f"readme_{lineno}.py"
        script.write_text(body, encoding="utf-8")
        _run([sys.executable, str(script)], cwd, env, f"{where}: python block")
        return
    ci_install, ci_test = ci_commands()
    ran = 0
    for line, parts in command_lines(body):
        run = []
        for p, text in parts:
            k = kind(p)
            if k == "install":
                check_install(p)
            elif k == "test":
                assert p == ci_test, f"{where}: the test command {shlex.join(p)!r} is not .ci/run's {shlex.join(ci_test)!r}"
            elif k == "pykv":
                check_parses(p)
                run.append(text)
            else:
                raise AssertionError(f"{where}: {line!r}: only pip install, the test command and pykv commands run "
                                     f"here; mark the block `{NO_RUN}` if it must not run")
        if run:
            _run(["bash", "-c", " && ".join(run)], cwd, env, f"{where}: {line}")
            ran += 1
    assert ran, f"{where}: a runnable shell block with no pykv command: mark it `{NO_RUN}`"


# ---- the rest of the README against the code ---------------------------------------------------

def test_readme_is_short():
    n = len(_text().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines; at most {MAX_LINES} (history and figures go to docs/)"


def test_two_commands_up_front():
    """The first block is the quick start: install + run, then exactly .ci/run's install and test."""
    lineno, lang, tags, body = BLOCKS[0]
    cmds = command_lines(body)
    assert lang == "bash" and NO_RUN not in tags and len(cmds) == 2, body
    first, second = ([p for p, _ in parts] for _, parts in cmds)
    assert [kind(p) for p in first] == ["install", "pykv"] and first[1][1] == "run", first
    ci_install, ci_test = ci_commands()
    assert [kind(p) for p in second] == ["install", "test"], second
    quiet = [t for t in ci_install if t != "-q"]
    assert second[0] == quiet and second[1] == ci_test, (second, ci_install, ci_test)


def _section(title):
    text = _text()
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"README.md has no '## {title}' section"
    return m.group(1)


def _table_rows(sec, first_cell):
    return [[c.strip() for c in l.strip().strip("|").split("|")] for l in sec.splitlines()
            if re.match(rf"^\|\s*{first_cell}", l)]


def test_cli_table_names_every_command_and_real_options():
    _, subs = subparsers()
    sec = _section("Command line")
    rows = _table_rows(sec, r"`pykv ")
    named = {}
    for cells in rows:
        cmd = re.match(r"`pykv ([a-z-]+)", cells[0]).group(1)
        assert cmd in subs, f"README names `pykv {cmd}`, which pykv does not have"
        named[cmd] = cells
        opts = re.findall(r"`(-[-\w]+)`", cells[-1])
        known = subs[cmd]._option_string_actions
        for o in opts:
            assert o in known, f"`pykv {cmd}` has no option {o}"
    assert set(named) == set(subs), f"commands missing from the README table: {sorted(set(subs) - set(named))}"
    kv = re.search(r"KV options \(([^)]*)\): (.*?)\. ", sec, re.S)
    assert kv, "the KV options sentence is gone"
    kv_cmds = re.findall(r"`([a-z-]+)`", kv.group(1))
    kv_opts = re.findall(r"`(-[-\w]+)`", kv.group(2))
    assert kv_cmds and len(kv_opts) >= 10
    for c in kv_cmds:
        for o in kv_opts:
            assert o in subs[c]._option_string_actions, f"`pykv {c}` has no KV option {o}"
        assert "KV options" in named[c][-1], f"`pykv {c}`'s row does not say it takes the KV options"


def test_load_keywords_table_matches_the_code():
    load_planned = _module("pykv.api.kv_plan", "pykv.kv_plan").load_planned
    Model = _module("pykv.api.model", "pykv.model").Model
    params = {}
    for fn in (Model.__init__, load_planned):
        for name, p in inspect.signature(fn).parameters.items():
            if p.kind == p.KEYWORD_ONLY or (p.kind == p.POSITIONAL_OR_KEYWORD and p.default is not p.empty):
                params[name] = p.default
    params.pop("path", None)
    rows = _table_rows(_section("Library"), r"`[a-z0-9_]+`")
    seen = {}
    for cells in rows:
        names = re.findall(r"`([a-z_0-9]+)`", cells[0])
        defaults = [d.strip() for d in cells[1].split(",")]
        assert len(defaults) in (1, len(names)), cells
        for i, n in enumerate(names):
            seen[n] = defaults[i] if len(defaults) > 1 else defaults[0]
    assert set(seen) == set(params), (f"pykv.load keywords not in the README: {sorted(set(params) - set(seen))}; "
                                      f"in the README but not in the code: {sorted(set(seen) - set(params))}")
    for n, d in seen.items():
        assert d == f"`{params[n]!r}`", f"`{n}`: README says default {d}, the code {params[n]!r}"


def test_kv_types_table_matches_the_formats():
    formats = _module("pykv.files.formats", "pykv.formats")
    KV_FORMATS, bits_per_value = formats.KV_FORMATS, formats.bits_per_value
    rows = _table_rows(_section("KV cache types"), r"`[a-z0-9_]+`")
    seen = {}
    for cells in rows:
        names = re.findall(r"`([a-z0-9_]+)`", cells[0])
        bits = [float(b) for b in cells[1].split(",")]
        assert len(bits) in (1, len(names)), cells
        for i, n in enumerate(names):
            seen[n] = bits[i] if len(bits) > 1 else bits[0]
    assert set(seen) == set(KV_FORMATS), (sorted(set(KV_FORMATS) - set(seen)), sorted(set(seen) - set(KV_FORMATS)))
    for n, b in seen.items():
        assert abs(b - bits_per_value(n, 64)) < 1e-9, f"{n}: README {b} bits/value, pykv.formats {bits_per_value(n, 64)}"


def _slug(heading):
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _bad_links(md: Path):
    """md's relative links whose file or #anchor (a GitHub heading slug) does not exist."""
    bad = []
    text = re.sub(r"`[^`\n]*`", "", re.sub(r"^```.*?^```", "", md.read_text(encoding="utf-8"), flags=re.M | re.S))
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        f = (md.parent / path).resolve() if path else md
        if not f.exists():
            bad.append(target)
        elif anchor and f.suffix == ".md":
            heads = {_slug(h) for h in re.findall(r"^#+ (.*)$", f.read_text(encoding="utf-8"), re.M)}
            if anchor not in heads:
                bad.append(target)
    return bad


def test_links_resolve():
    """README's links, and those of the docs/ pages it links to, name files and headings that exist."""
    bad = {"README.md": _bad_links(README)}
    for target in re.findall(r"\]\((docs/[^)#\s]+\.md)", _text()):
        bad[target] = _bad_links(ROOT / target)
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"links that do not resolve: {bad}"
