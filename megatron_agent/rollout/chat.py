"""Chat-template pieces as token ids, so that turns are appended without re-tokenizing.

The agent loop never decodes and re-encodes a trajectory. It needs, as ids: the prompt; the
token that closes an assistant turn; the tool-response turn, with the template's tokens told
apart from the tool output's; and the next generation prompt. `ChatFormat` gets them from the
model's own chat template by rendering a conversation whose assistant and tool contents are
unique placeholders and splitting the text around them:

    ...<|im_start|>assistant\n@@A@@ | <|im_end|> | \n<|im_start|>user\n<tool_response>\n | @@T0@@ |
    \n</tool_response><|im_end|>\n<|im_start|>assistant\n

Why this method: it follows whatever the template does (Qwen2.5, Hermes, Llama-style) without
hand-written strings; the template text between placeholders does not depend on the contents,
so its ids are computed once per number of tool results and cached; and each tool output is
tokenized on its own, so its ids are exactly the `tool` tokens. Tokenizing the pieces separately
may split differently than tokenizing the whole text would at piece boundaries; that is harmless,
because the trainer sees exactly the ids the engine consumed (token-in, token-out), never a
re-tokenization. Tool output is tokenized with `split_special_tokens=True`, so a tool cannot
inject an end-of-turn or other special token by printing its text (non-special added tokens
such as `</tool_response>` are still matched; the tool tags are not special in Qwen tokenizers).
"""

from __future__ import annotations

from dataclasses import dataclass

_ASSISTANT_PH = "@@MA_ASSISTANT@@"
_TOOL_PH = "@@MA_TOOL_{}@@"


@dataclass
class ToolTurnIds:
    """Template ids around `num_results` tool outputs: parts[0] + out0 + parts[1] + ... + parts[n]."""

    parts: list[list[int]]
    """num_results + 1 template id lists; the last one ends with the generation prompt."""


class ChatFormat:
    """Token-id pieces of a model's chat template (prompt, turn closing, tool turns)."""

    def __init__(self, tokenizer, tool_call_start: str = "<tool_call>", tool_call_end: str = "</tool_call>"):
        """`tokenizer` is the model's HF tokenizer with a chat template."""
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template; the agent loop needs one to render turns")
        self.tokenizer = tokenizer
        self.eos_id = int(tokenizer.eos_token_id)
        self.eos_text = tokenizer.convert_ids_to_tokens(self.eos_id)
        self.tool_call_start = tool_call_start
        self.tool_call_end = tool_call_end
        end_ids = self.encode(tool_call_end)
        self.tool_call_end_id = end_ids[0] if len(end_ids) == 1 else None
        """Id of the tool-call end tag when it is a single token (then the engine stops on the id)."""
        self._tool_turn_cache: dict[int, ToolTurnIds] = {}
        self.closing_ids, self._check_closing = self._find_closing()

    def encode(self, text: str, *, plain: bool = False) -> list[int]:
        """Token ids of `text` with no BOS/EOS added; `plain=True` does not parse special tokens."""
        if plain:
            return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        """Text of `ids` (for parsing tool calls and rewards; never re-encoded)."""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def render(
        self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True
    ) -> str:
        """The chat template's text for `messages` (and tool schemas)."""
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Ids of the prompt: the rendered messages plus the assistant generation prompt."""
        return self.encode(self.render(messages, tools))

    def _render_tool_turn(self, num_results: int) -> tuple[str, list[str]]:
        messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _ASSISTANT_PH}]
        messages += [{"role": "tool", "content": _TOOL_PH.format(i)} for i in range(num_results)]
        text = self.render(messages)
        if text.count(_ASSISTANT_PH) != 1:
            raise ValueError("the chat template does not render assistant content verbatim")
        rest = text.split(_ASSISTANT_PH, 1)[1]
        parts = []
        for i in range(num_results):
            ph = _TOOL_PH.format(i)
            if rest.count(ph) != 1:
                raise ValueError("the chat template does not render tool message contents verbatim")
            before, rest = rest.split(ph, 1)
            parts.append(before)
        parts.append(rest)
        return text, parts

    def _find_closing(self) -> tuple[list[int], str]:
        _, parts = self._render_tool_turn(1)
        if not parts[0].startswith(self.eos_text):
            raise ValueError(
                f"the chat template does not close an assistant turn with the EOS token {self.eos_text!r}"
            )
        return [self.eos_id], self.eos_text

    def tool_turn(self, num_results: int) -> ToolTurnIds:
        """Template ids around `num_results` tool outputs, after the closing EOS of the assistant turn."""
        if num_results < 1:
            raise ValueError(f"a tool turn needs at least one result, got {num_results}")
        if num_results not in self._tool_turn_cache:
            _, parts = self._render_tool_turn(num_results)
            parts[0] = parts[0][len(self._check_closing) :]
            self._tool_turn_cache[num_results] = ToolTurnIds([self.encode(p) for p in parts])
        return self._tool_turn_cache[num_results]
