"""OpenAI's chat format over the engine: a list of messages becomes one prompt, and answers take the chat shapes.

A chat model is a completion model with a convention for turning messages into text: its chat template. A
checkpoint folder carries one in chat_template.jinja (where transformers saves it today) or in
tokenizer_config.json's "chat_template" (older folders): a Jinja template, rendered here the way Hugging Face's
`apply_chat_template` does (`messages`, `add_generation_prompt=True`, `bos_token`, `eos_token`). A folder with
no template gets no chat: rendering its conversations with another model's convention would serve wrong prompts
without a word, so chat requests are refused with a 400 that says why (`chat_template_for`). The book's own
models were never trained on conversations, so their documented template is the simplest honest one:

    BOOK TEMPLATE: the prompt is <bos> followed by the content of the LAST user message; system and earlier turns
    are not shown to the model (it has no notion of roles). `"messages": [{"role": "user", "content": "{"}]` is
    the chat form of `"prompt": "{"`. The book's character-level models know only their small alphabet
    (lower-case letters, digits, space and JSON punctuation), so the template fits the message to it: letters
    are lower-cased and accents dropped ("Café" -> "cafe"), and every other character outside the alphabet
    becomes one space ("Give me a record." -> "give me a record "); text already in the alphabet is unchanged. A chat
    client can send any text; `usage.prompt_tokens` counts the fitted prompt. (`/v1/completions` takes its
    prompt verbatim and refuses a character outside the alphabet: there the caller controls the exact text.)

Answers: a `chat.completion` with `choices[0].message = {"role": "assistant", "content": text}`; streamed, a
`chat.completion.chunk` whose first delta is the role, then one delta of content per step; the last step's delta
carries the finish_reason (an empty delta only when that step added no text, as when it sampled the eos token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatError(ValueError):
    """A messages list the server refuses (a 400); `param` names the offending field."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


def normalize_messages(messages: Any) -> list[dict[str, str]]:
    """[{"role", "content"}] with content as one string (a list of {"type": "text", "text"} parts is joined)."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("'messages' must be a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ChatError(f"'{where}' must be an object", where)
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ChatError(f"'{where}.role' must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ChatError(f"'{where}.content' parts must be {{\"type\": \"text\", \"text\": ...}} (this server "
                                f"reads text only)", f"{where}.content")
            content = "".join(p["text"] for p in content)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise ChatError(f"'{where}.content' must be a string or a list of text parts", f"{where}.content")
        out.append({"role": role, "content": content})
    return out


def render_book(messages: list[dict[str, str]], alphabet: str | None = None) -> str:
    """The book template: the last user message's content, fitted to `alphabet` when one is given (the caller
    adds <bos> when it encodes it)."""
    users = [m["content"] for m in messages if m["role"] == "user"]
    text = fit_to_alphabet(users[-1], alphabet) if users and alphabet is not None else (users or [""])[-1]
    if not text.strip():
        raise ChatError("the book's models are prompted with the last user message, and there is none (or it is "
                        "empty, or has no character the model knows)")
    return text


def fit_to_alphabet(text: str, alphabet: str) -> str:
    """`text` in a character model's alphabet: letters lower-cased and accents dropped (NFKD), any other
    character outside it one space. Text already in the alphabet comes back unchanged."""
    import unicodedata

    known = set(alphabet)
    out = []
    for ch in unicodedata.normalize("NFKD", text):
        if unicodedata.combining(ch):
            continue                       # the accent of a decomposed letter: é -> e + U+0301 -> e
        ch = ch.lower() if ch.lower() in known else ch
        out.append(ch if ch in known else " ")
    if all(ch in known for ch in text):
        return text
    return "".join(out) if " " in known else "".join(c for c in out if c != " ")


RENDER_TIME_LIMIT_S = 2.0  # a chat template that renders longer than this is stopped (a loop of 10**10 steps)
MAX_RENDER_CHARS = 1 << 22  # ... or that writes more than this, or asks a filter or method for a larger size


def render_template(template: str, messages: list[dict[str, str]], bos_token: str = "", eos_token: str = "",
                    time_limit: float | None = None) -> str:
    """A checkpoint's Jinja chat template, rendered as Hugging Face renders it (sandboxed), within limits.

    The template comes with the model folder, so it is code the server did not write. Jinja's sandbox keeps it
    from touching Python's internals; on top of that it is stopped (a ChatError, so a 400) when it runs longer
    than `time_limit`, writes more than MAX_RENDER_CHARS, or asks for a bigger string or number than that
    (`"x" * 10**10`, `2 ** 10**9`, `center(10**10)`: those would hold the thread inside one C call)."""
    from jinja2 import TemplateError

    def raise_exception(message: str) -> None:
        raise ChatError(f"the chat template refused these messages: {message}")

    out, size = [], 0
    time_limit = RENDER_TIME_LIMIT_S if time_limit is None else time_limit
    try:
        with _Deadline(time_limit):
            compiled = _environment().from_string(template)
            for chunk in compiled.generate(messages=messages, add_generation_prompt=True, bos_token=bos_token,
                                           eos_token=eos_token, raise_exception=raise_exception):
                size += len(chunk)
                if size > MAX_RENDER_CHARS:
                    raise ChatError(f"the chat template wrote more than {MAX_RENDER_CHARS} characters")
                out.append(chunk)
    except _RenderTimeout:
        raise ChatError(f"the chat template did not finish within {time_limit:g} s") from None
    except ChatError:
        raise
    except (TemplateError, TypeError, ValueError, LookupError, AttributeError, OverflowError,
            MemoryError, RecursionError) as err:  # whatever the messages make it do
        raise ChatError(f"the chat template failed on these messages: {err}") from None
    return "".join(out)


class _RenderTimeout(BaseException):  # not an Exception: the template's own error handling cannot swallow it
    pass


class _Deadline:
    """Raise _RenderTimeout in this thread if the block is still running after `seconds`.

    A thread cannot be killed from outside, but CPython can schedule an exception in it
    (PyThreadState_SetAsyncExc), raised between two bytecodes: a Python loop stops. A timer thread schedules
    it; leaving the block first cancels the timer, and withdraws an exception scheduled but not yet raised."""

    def __init__(self, seconds: float) -> None:
        import threading

        self.seconds, self.lock, self.done, self.fired = seconds, threading.Lock(), False, False
        self.timer = threading.Timer(seconds, self._fire)
        self.timer.daemon = True

    def __enter__(self) -> None:
        import threading

        self.thread_id = threading.get_ident()
        self.timer.start()

    def _fire(self) -> None:  # the timer thread
        with self.lock:
            if not self.done:
                self.fired = True
                _async_raise(self.thread_id, _RenderTimeout)

    def __exit__(self, kind: Any, *_: Any) -> None:
        with self.lock:
            self.done = True
            self.timer.cancel()
            if self.fired and kind is not _RenderTimeout:  # scheduled, not raised yet: withdraw, raise it here
                _async_raise(self.thread_id, None)
                raise _RenderTimeout


def _async_raise(thread_id: int, exc: type | None) -> None:
    import ctypes

    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                               ctypes.py_object(exc) if exc is not None else None)


_ENV = None


def _environment():
    """One sandboxed Jinja environment for every template (compiled templates are cached by it)."""
    global _ENV
    if _ENV is None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class _Limited(ImmutableSandboxedEnvironment):
            intercepted_binops = frozenset(["*", "**"])

            def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
                sized = [x for x in (left, right) if isinstance(x, (str, list, tuple))]
                counts = [x for x in (left, right) if isinstance(x, int)]
                if operator == "*" and sized and counts and len(sized[0]) * max(counts) > MAX_RENDER_CHARS:
                    raise ChatError("the chat template asked for a string or list beyond the size limit")
                if operator == "**" and isinstance(right, int) and isinstance(left, (int, float)) and \
                        abs(right) * max(1, abs(int(left)).bit_length()) > 4096:
                    raise ChatError("the chat template asked for a number beyond the size limit")
                return super().call_binop(context, operator, left, right)

            def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
                _check_sizes(args, kwargs)
                return super().call(__context, __obj, *args, **kwargs)

        env = _Limited(trim_blocks=True, lstrip_blocks=True)
        env.filters = {name: _sized(f) for name, f in env.filters.items()}
        _ENV = env
    return _ENV


def _check_sizes(args: tuple, kwargs: dict) -> None:
    if any(isinstance(x, int) and abs(x) > MAX_RENDER_CHARS for x in (*args, *kwargs.values())):
        raise ChatError("the chat template passed a size beyond the limit to a filter or method")


def _sized(f: Any) -> Any:
    """A Jinja filter that refuses integer arguments beyond MAX_RENDER_CHARS (a width, a count)."""
    import functools

    @functools.wraps(f)  # keeps jinja's pass_context/pass_environment marks
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _check_sizes(args[1:], kwargs)
        return f(*args, **kwargs)

    return guarded


def chat_body(request_id: str, model: str, created: int, text: str, finish_reason: str | None,
              usage: dict, logprobs: dict | None = None) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                         "finish_reason": finish_reason}],
            "usage": usage}


def chat_chunk(request_id: str, model: str, created: int, delta: dict | None, finish_reason: str | None = None,
               usage: dict | None = None, logprobs: dict | None = None, index: int = 0) -> dict:
    """One streamed chunk; delta None: the usage-only chunk (no choices), as OpenAI sends it last."""
    choices = [] if delta is None else [{"index": index, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish_reason}]
    body = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


@dataclass(frozen=True)
class NoChatTemplate:
    """What a server is given instead of a template for a model that must not be chatted with: `reason` is the
    400's message."""

    reason: str


def chat_template_for(model) -> str | NoChatTemplate | None:
    """The template chat requests use for `model`: a checkpoint folder's own (template_of), NoChatTemplate for
    a folder without one, None (the book's template) for the book's own models, which are not folders."""
    from pathlib import Path

    if not Path(model).is_dir():
        return None
    template = template_of(model)
    if template is not None:
        return template
    return NoChatTemplate(f"this model ({Path(model).name}) has no chat template (no chat_template.jinja, no "
                          f"chat_template in tokenizer_config.json), so chat requests are refused: send the prompt "
                          f"text to /v1/completions instead")


def template_of(folder) -> str | None:
    """The chat template a checkpoint folder ships: chat_template.jinja (transformers' file for it), else
    tokenizer_config.json's "chat_template" (the default one if it names several); None if neither."""
    import json
    from pathlib import Path

    try:
        return (Path(folder) / "chat_template.jinja").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        pass
    path = Path(folder) / "tokenizer_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
