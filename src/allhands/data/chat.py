"""Chat conversations as text, and which of its characters are the assistant's: the spans that
carry loss when fine-tuning.

A conversation is rendered with the tokenizer directory's Jinja chat template, in the
environment transformers renders it in (``transformers.utils.chat_template_utils``: sandboxed,
``trim_blocks``, ``lstrip_blocks``, loop controls, ``tojson``, ``raise_exception``,
``strftime_now``), or with :data:`DEFAULT_CHAT_TEMPLATE` when the tokenizer has none.

Where the template marks the assistant's text with ``{% generation %}...{% endgeneration %}``,
those blocks are the spans, as transformers' ``return_assistant_tokens_mask`` takes them.
Otherwise assistant message ``i`` spans from the end of the render of ``messages[:i]`` with the
generation prompt to the end of the render of ``messages[:i+1]``: its content and the end-of-turn
text the template writes after it, so the model learns to stop. Both renders must then be
prefixes of the whole conversation's render; a template for which they are not (one that
rewrites earlier turns, as Qwen3's drops their reasoning) is refused for that row.
"""

from __future__ import annotations

import json
from datetime import datetime

from allhands.errors import DataError

# Zephyr's template (HuggingFaceH4/zephyr-7b-beta): a role line, the content, the
# end-of-document token. Used only when the tokenizer directory has no chat template.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")
ROLES = ("system", "user", "assistant", "tool")


class TemplateError(Exception):
    """The template itself refused a conversation (its ``raise_exception``)."""


def _raise(message: str):
    raise TemplateError(message)


def _compile(template: str, spans: dict):
    """The template, its ``{% generation %}`` blocks recording their spans into ``spans``
    (``blocks``: the output so far, ``found``: the spans) while a render fills them."""
    try:
        import jinja2  # optional dependency: the `data` extra
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise DataError("chat templates need jinja2; install the data extra: "
                        "pip install 'allhands[data]'") from None

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask markers):
        its body, whose place in the output is recorded (transformers' AssistantTracker)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            text = caller()
            if spans["blocks"] is not None:  # jinja yields output in order: all before is out
                start = sum(map(len, spans["blocks"]))
                spans["found"].append((start, start + len(text)))
            return text

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise DataError(f"the tokenizer's chat template does not parse ({e.message}, template "
                        f"line {e.lineno}); fix chat_template in tokenizer_config.json") from None


class ChatRenderer:
    """``render(messages)`` -> (text, assistant spans), for one template and special tokens."""

    def __init__(self, template: str | None, special_tokens: dict[str, str]):
        self.spans: dict = {"blocks": None, "found": []}
        self.template = _compile(template or DEFAULT_CHAT_TEMPLATE, self.spans)
        self.special = special_tokens
        self.is_default = template is None

    def _text(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.template.render(messages=messages, add_generation_prompt=generation_prompt,
                                    tools=None, documents=None, **self.special)

    def _marked(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The whole conversation's text and its ``{% generation %}`` spans."""
        self.spans["blocks"], self.spans["found"] = [], []
        try:
            for block in self.template.generate(messages=messages, add_generation_prompt=False,
                                                tools=None, documents=None, **self.special):
                self.spans["blocks"].append(block)
            return "".join(self.spans["blocks"]), list(self.spans["found"])
        finally:
            self.spans["blocks"] = None

    def render(self, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the character spans of its assistant messages."""
        try:
            full, spans = self._marked(messages)
            if spans:
                return full, spans
            for i, m in enumerate(messages):
                if m["role"] != "assistant":
                    continue
                before = self._text(messages[:i], True)
                through = self._text(messages[:i + 1], False)
                if not (full.startswith(before) and full.startswith(through) and len(before) <= len(through)):
                    raise DataError(f"{where}: the chat template does not render this conversation "
                                    f"turn by turn (message {i}'s text is not a prefix of the "
                                    f"whole), so the assistant's tokens cannot be told apart; use a "
                                    f"template that renders earlier turns unchanged")
                spans.append((len(before), len(through)))
        except TemplateError as e:
            raise DataError(f"{where}: the chat template refused this conversation: {e}") from None
        except DataError:
            raise
        except Exception as e:  # a template's own runtime error: undefined names, bad filters
            raise DataError(f"{where}: the chat template failed on this conversation "
                            f"({type(e).__name__}: {e})") from None
        return full, spans
