"""The checkpoint's tokenizer, its chat template, and streaming detokenization with stop strings."""

from __future__ import annotations

import datetime
import json
import os

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21
    DecodeStream = None

from o3edge.engine.checkpoint import read_json
from o3edge.errors import CheckpointError, InvalidRequest


def _token_text(value) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...} maps."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Text <-> token ids, as the checkpoint's own tokenizer.json and tokenizer_config.json say."""

    def __init__(self, model_dir: str):
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.exists(path):
            raise CheckpointError(f"{path} not found (a fast tokenizer.json is required)")
        try:
            self.hf = HFTokenizer.from_file(path)
        except Exception as exc:
            raise CheckpointError(f"{path} is not a readable tokenizer: {exc}") from None
        cfg = read_json(os.path.join(model_dir, "tokenizer_config.json"), missing_ok=True)
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.chat_template = _chat_template(model_dir, cfg)
        self.vocab_size = self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL (encode does not: 1 MiB held every other thread for 1.6 s)
        return self.hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_request(self, prompt: str | None = None, messages: list | None = None) -> list[int]:
        """Token ids for a request: a plain prompt, or a chat rendered with the template."""
        if messages is not None:
            return self.encode_chat(messages)
        if not isinstance(prompt, str) or not prompt:
            raise InvalidRequest("a non-empty prompt or messages is required")
        return self.encode(prompt)

    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token can stand for (its longest vocabulary entry)."""
        return max((len(piece.encode()) for piece in self.hf.get_vocab(with_added_tokens=True)), default=1)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self.hf.token_to_id(text)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for a chat, rendered with the checkpoint's own template."""
        if not self.chat_template:
            raise InvalidRequest("this model has no chat template; send a plain prompt instead")
        _check_messages(messages)
        try:
            return _compile(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except jinja2.TemplateError as exc:
            raise InvalidRequest(f"chat template failed: {exc}") from None

    def encode_chat(self, messages: list[dict]) -> list[int]:
        # the template writes BOS itself when the model wants one, as transformers assumes
        return self.encode(self.render_chat(messages), add_special_tokens=False)


def _chat_template(model_dir: str, cfg: dict) -> str | None:
    jinja_path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.exists(jinja_path):
        with open(jinja_path, encoding="utf-8") as fh:
            return fh.read()
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):  # named templates: take the default one
        tpl = next((t.get("template") for t in tpl if t.get("name") == "default"), None)
    return tpl


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {role, content} maps")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InvalidRequest("each message must be a map with string 'role' and 'content'")


def _raise(message):
    raise jinja2.TemplateError(message)


_templates: dict[str, jinja2.Template] = {}


def _compile(source: str) -> jinja2.Template:
    """Compile a chat template the way transformers does (sandboxed, trimmed, loop controls)."""
    if source not in _templates:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        _templates[source] = env.from_string(source)
    return _templates[source]


class Detokenizer:
    """Turns a stream of token ids into text deltas; holds back partial UTF-8 and partial stop strings.

    The text comes from the tokenizers library's incremental decoder (DecodeStream, tokenizers >= 0.21:
    one call a token, a host cost every decoding sequence pays every step: 16 sequences' decode step took
    0.291-0.300 ms of host time against 0.310-0.322 with two window decodes a token on the CPU machine,
    tools/bench_host_step.py [--window-detok]); with an older library, from decoding a window of ids
    twice (the text up to the last complete character, then with the new token)."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        # the text decoded and not yet returned, after the last `hold` characters returned (where a stop string
        # may start); what was returned before those is dropped, so that a token's cost does not grow with the
        # text (tools/bench_detok.py, 16,000 tokens: 1.11 -> 1.38 us a token over the output when all of it was
        # kept, 0.96-1.03 throughout now; docs/results/cpu-detok-2026-12-05/)
        self.text = ""
        self.emitted = 0  # characters of self.text already returned
        self._prefix, self._read = 0, 0
        self.hold = max((len(s) for s in stop), default=1) - 1
        self._stream = DecodeStream(skip_special_tokens=True) if DecodeStream is not None else None

    def add(self, token_id: int) -> tuple[str, bool]:
        """Append a token; return (new text to show, whether a stop string was hit)."""
        if self._stream is not None:
            self.text += self._stream.step(self.tokenizer.hf, token_id) or ""
        else:
            self._add_window(token_id)
        if self.stop:
            start = max(0, self.emitted - self.hold)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                return self.flush(), True
        upto = max(self.emitted, len(self.text) - self.hold)
        delta, keep = self.text[self.emitted:upto], max(0, upto - self.hold)
        self.text, self.emitted = self.text[keep:], upto - keep
        return delta, False

    def _add_window(self, token_id: int) -> None:
        self.ids.append(token_id)
        prefix_text = self.tokenizer.decode(self.ids[self._prefix:self._read])
        new_text = self.tokenizer.decode(self.ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self.ids)

    def flush(self) -> str:
        """Everything not yet shown (at the end of the sequence)."""
        delta, self.emitted = self.text[self.emitted:], len(self.text)
        return delta
