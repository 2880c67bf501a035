"""Chat records rendered the way their model was trained to see them: the tokenizer's own chat template.

A Hugging Face tokenizer_config.json carries `chat_template`, a Jinja template over `messages` (each a
{"role", "content"}). It is rendered as transformers' `apply_chat_template` renders it (a sandboxed
environment with trim_blocks and lstrip_blocks, loop controls, `raise_exception`, a `tojson` that keeps
non-ASCII text, `strftime_now`, and the special tokens as variables), so the ids are the ones
transformers gives the same conversation.

For fine-tuning only the assistant's turns are scored. Each assistant turn's characters are found by
rendering the conversation up to it twice: with the generation prompt (where the assistant starts) and
with the turn (where it ends, its end-of-turn marker included). A template whose earlier turns change
once a later one is added (one that drops past reasoning, say) has no such spans and is refused.
"""

import datetime
import json
from pathlib import Path

import numpy as np

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplate:
  """The chat template of the tokenizer in `folder` (its tokenizer_config.json)."""

  def __init__(self, folder: Path):
    try:
      import jinja2  # optional dependency (pyproject's `hf` extra)
      from jinja2 import ext, sandbox
    except ImportError as error:
      raise ValueError("--messages_field renders chat templates with the `jinja2` package: "
                       "pip install -e '.[hf]'.") from error
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    source = config.get("chat_template")
    if isinstance(source, list):  # several named templates: the default one is what transformers uses
      source = next((t["template"] for t in source if t.get("name") == "default"), None)
    if not isinstance(source, str):
      raise ValueError(f"{config_file} has no chat_template; --messages_field needs the tokenizer of a chat "
                       "model, or give prompt and completion fields (--text_field, --completion_field).")

    def raise_exception(message):
      raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
      return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                        extensions=[ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda form: datetime.datetime.now().strftime(form)
    try:
      self._template = environment.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as error:
      raise ValueError(f"{config_file}'s chat_template does not compile ({error}); meshlm renders templates "
                       "without transformers' {% generation %} tag.") from None
    special = {name: config.get(name) for name in SPECIAL_TOKENS}
    self._special = {name: value.get("content") if isinstance(value, dict) else value
                     for name, value in special.items() if value}
    self._errors = (jinja2.exceptions.TemplateError,)

  def render(self, messages: list, add_generation_prompt: bool = False) -> str:
    return self._template.render(messages=messages, tools=None, documents=None,
                                 add_generation_prompt=add_generation_prompt, **self._special)

  def assistant_spans(self, messages: list) -> tuple[str, list]:
    """(the whole conversation rendered, the (start, stop) characters of each assistant turn)."""
    try:
      text = self.render(messages)
      spans = []
      for i, message in enumerate(messages):
        if message["role"] != "assistant":
          continue
        before, through = self.render(messages[:i], add_generation_prompt=True), self.render(messages[:i + 1])
        if not (text.startswith(before) and text.startswith(through)):
          raise ValueError("its chat template renders earlier turns differently once later ones follow, so "
                           "the assistant's turns have no place of their own to score; give prompt and "
                           "completion fields instead (--text_field, --completion_field).")
        spans.append((len(before), len(through)))
    except self._errors as error:
      raise ValueError(f"its chat template refuses it ({error}).") from None
    return text, spans


def scored_tokens(offsets: list, spans: list) -> np.ndarray:
  """1 for each token (its (start, stop) characters) that overlaps an assistant span, else 0."""
  mask = np.zeros(len(offsets), np.uint8)
  for i, (start, stop) in enumerate(offsets):
    mask[i] = any(start < span_stop and stop > span_start for span_start, span_stop in spans)
  return mask
