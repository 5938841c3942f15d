"""The library's model: the decoder plus text generation, sessions, chat templates and OpenAI-shaped
completions.  pykv.load returns one."""
from __future__ import annotations

from pykv.decoder.model import Decoder


class Model(Decoder):
    """A loaded model (pykv.load): Decoder's keywords, and generate / session / chat / completions."""

    def generate(self, prompt, max_tokens: int = 128, temperature: float = 0.8, top_k: int = 40,
                 top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0, seed=None, stop=()):
        from pykv.api.generate import generate
        return generate(self, prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        min_p=min_p, repeat_penalty=repeat_penalty, seed=seed, stop=stop)

    def session(self):
        """A new Session: one sequence in this model's shared KV page pool that keeps its cache
        between calls (prefix reuse, fork, save/load). Close it (or let it be collected) to free its pages."""
        from pykv.api.session import Session
        return Session(self)

    def _default_session(self):
        """The session behind Model.chat / create_completion / create_chat_completion: consecutive calls
        that share a prefix (a growing conversation) run only the new tokens, as in llama-cpp-python."""
        s = getattr(self, "_session", None)
        if s is None or s.cache is not self.cache:
            s = self._session = self.session()
        return s

    @property
    def chat_template(self) -> str:
        """The GGUF's tokenizer.chat_template, or pykv.api.chat.CHATML_TEMPLATE when the file has none."""
        from pykv.api.chat import CHATML_TEMPLATE
        t = self.gguf.metadata.get("tokenizer.chat_template")
        return t if isinstance(t, str) and t.strip() else CHATML_TEMPLATE

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tools=None, **kwargs) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the model's chat template, as
        transformers' apply_chat_template(..., tokenize=False) renders it (sandboxed Jinja2; bos_token,
        eos_token, raise_exception and `tools` available to the template)."""
        from pykv.api.chat import render, special_tokens
        return render(self.chat_template, messages, add_generation_prompt, tools,
                      special_tokens(self.tokenizer, self.gguf.metadata), **kwargs)

    def chat(self, messages, **sampling):
        """Stream the assistant's reply to `messages` (text pieces). Takes Session.chat's arguments:
        max_tokens (None: up to the context size), temperature, top_k, top_p, min_p, repeat_penalty,
        seed, stop, tools, drop_oldest."""
        return self._default_session().chat(messages, **sampling)

    def create_completion(self, prompt, **kw):
        """An OpenAI-shaped text completion dict (or, with stream=True, an iterator of chunks), as
        llama-cpp-python's Llama.create_completion; see Session.create_completion for the arguments."""
        return self._default_session().create_completion(prompt, **kw)

    def create_chat_completion(self, messages, **kw):
        """An OpenAI-shaped chat completion dict (or, with stream=True, an iterator of chunks), as
        llama-cpp-python's Llama.create_chat_completion; see Session.create_chat_completion."""
        return self._default_session().create_chat_completion(messages, **kw)

    def fingerprint(self) -> str:
        """sha256 (hex) of the GGUF's metadata and tensor table: a state file records it, and only the
        same model loads it."""
        fp = getattr(self, "_fingerprint", None)
        if fp is None:
            from pykv.api.session import gguf_fingerprint
            fp = self._fingerprint = gguf_fingerprint(self.gguf)
        return fp


def load(path=None, *, n_ctx: int = 2048, kv_type_k="f16", kv_type_v="f16", threads=None, **kw) -> Model:
    return Model(path, n_ctx=n_ctx, kv_type_k=kv_type_k, kv_type_v=kv_type_v, threads=threads, **kw)
