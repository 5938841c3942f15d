"""`pykv chat` driven through a pseudo-terminal, as a person at a terminal would use it."""
import os
import pty
import re
import select
import signal
import sys
import time

import pytest

ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]|\r")
PROMPT = b"> "


class Terminal:
    """A child process on a pty (its controlling terminal, so Ctrl-C sends SIGINT as in a shell)."""

    def __init__(self, argv, env):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:                                  # the child
            try:
                os.execvpe(argv[0], argv, env)
            finally:
                os._exit(127)
        self.buf = b""

    def _read(self, timeout):
        r, _, _ = select.select([self.fd], [], [], timeout)
        if not r:
            return b""
        try:
            data = os.read(self.fd, 65536)
        except OSError:
            raise EOFError("the chat process closed its terminal") from None
        if not data:
            raise EOFError("the chat process closed its terminal")
        if b"\x1b[6n" in data:                             # answer prompt_toolkit's cursor position query
            os.write(self.fd, b"\x1b[1;1R")
        return data

    def expect(self, pattern: bytes, timeout=120.0):
        """Read until `pattern` appears in the plain text (escape codes removed) after what was consumed.
        Returns (the text before it, the number of reads that brought printable text)."""
        end, reads = time.time() + timeout, 0
        while True:
            plain = ANSI.sub(b"", self.buf)
            i = plain.find(pattern)
            if i >= 0:
                self.buf = plain[i + len(pattern):]
                return plain[:i].decode("utf-8", "replace"), reads
            if time.time() > end:
                raise AssertionError(f"timed out waiting for {pattern!r}; got {plain[-800:]!r}")
            data = self._read(0.5)
            if ANSI.sub(b"", data).strip():
                reads += 1
            self.buf += data

    def send(self, s: str):
        os.write(self.fd, s.encode())

    def close(self):
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        os.close(self.fd)


@pytest.fixture
def chat(smollm2_path):
    env = dict(os.environ, TERM="xterm", COLUMNS="200", LINES="50")
    t = Terminal([sys.executable, "-m", "pykv", "chat", smollm2_path, "--system", "You are a terse assistant.",
                  "-n", "48", "--temp", "0", "-c", "1024"], env)
    yield t
    t.close()


def test_chat_through_a_pty(chat, tmp_path):
    t = chat
    t.expect(b"/help for commands", timeout=300)
    t.expect(PROMPT)
    t.send("What is the capital of France?\r")
    t.expect(b"France?")                                   # the echoed line
    reply, reads = t.expect(PROMPT)
    assert "Paris" in reply
    assert reads >= 2, reply                               # the reply came in pieces, not at the end
    t.send("/kv\r")
    kv, _ = t.expect(PROMPT)
    cached = int(re.search(r"kv: (\d+) tokens cached", kv).group(1))
    assert cached > 20 and "bytes in use" in kv
    state = tmp_path / "chat.state"
    t.send(f"/save {state}\r")
    out, _ = t.expect(PROMPT)
    assert "saved" in out and state.exists()
    t.send("/reset\r")
    t.expect(PROMPT)
    t.send("/kv\r")
    kv, _ = t.expect(PROMPT)
    assert "kv: 0 tokens cached" in kv
    t.send(f"/load {state}\r")
    out, _ = t.expect(PROMPT)
    assert "loaded" in out and "3 messages" in out         # system, user, assistant
    t.send("/kv\r")
    kv, _ = t.expect(PROMPT)
    assert f"kv: {cached} tokens cached" in kv
    t.send(f"/load {tmp_path / 'missing.state'}\r")
    out, _ = t.expect(PROMPT)
    assert "error: cannot read state file" in out
    # Ctrl-C during a reply stops the reply, not the program
    t.send("Tell me a long story about a dragon who learns to paint.\r")
    t.expect(b"paint.")
    t.expect(b" ", timeout=120)                            # the reply has started
    t.send("\x03")
    out, _ = t.expect(PROMPT)
    assert "[stopped]" in out
    t.send("/kv\r")
    kv, _ = t.expect(PROMPT)
    assert int(re.search(r"kv: (\d+) tokens cached", kv).group(1)) > cached
    t.send("/quit\r")
    _, status = os.waitpid(t.pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
