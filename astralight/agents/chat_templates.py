"""Chat templates a workflow renders with in place of the tokenizer's own.

Some chat models ship a template with no tools section (SmolLM2's ChatML ignores ``tools``), so
a tool-calling workflow's schemas would never reach the model. A workflow's ``chat_template``
names one of the templates shipped here, a ``.jinja`` file, or gives the template text;
:func:`load_chat_template` reads it once. Shipped:

* ``chatml_tools``: ChatML (``<|im_start|>role ... <|im_end|>``) with a Hermes-style tools
  section in the system turn, ``<tool_call>`` JSON from the model and tool results in
  ``<tool_response>`` blocks of a user turn -- the format
  :func:`astralight.agents.tools.parse_tool_calls` reads.
"""

from __future__ import annotations

from pathlib import Path

TEMPLATES_DIR = Path(__file__).resolve().parents[1] / "templates"
#: the shipped templates, by name
SHIPPED = {"chatml_tools": TEMPLATES_DIR / "chatml_tools.jinja"}


def load_chat_template(spec: str | None) -> str | None:
    """The template text for ``spec``: None (the tokenizer's own), a shipped name, a path to
    a file, or Jinja text (anything holding ``{%`` or ``{{``)."""
    if spec is None:
        return None
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"chat_template: a shipped name ({', '.join(SHIPPED)}), a .jinja path "
                         f"or template text, got {spec!r}")
    if spec in SHIPPED:
        return SHIPPED[spec].read_text()
    if "{%" in spec or "{{" in spec:
        return spec
    path = Path(spec).expanduser()
    if path.is_file():
        return path.read_text()
    raise ValueError(f"chat_template: {spec!r} is not a shipped template ({', '.join(SHIPPED)}), "
                     "an existing file, or template text")


def renders_tools(tokenizer, tools: list, chat_template: str | None = None) -> bool:
    """Whether the template puts ``tools`` in the prompt at all (a one-message conversation
    rendered with and without them differs)."""
    kwargs = {"chat_template": chat_template} if chat_template else {}
    probe = [{"role": "user", "content": "?"}]
    with_tools = tokenizer.apply_chat_template(probe, tools=tools, tokenize=False,
                                               add_generation_prompt=True, **kwargs)
    without = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True,
                                            **kwargs)
    return with_tools != without


__all__ = ["load_chat_template", "renders_tools", "SHIPPED"]
