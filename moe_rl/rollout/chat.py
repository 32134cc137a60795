"""A conversation's tokens at turn boundaries, as the tokenizer's chat template renders them.

    chat = ChatTokens(tokenizer, eos)
    ids = chat.prompt_ids(messages, tools)                  # the opening: rendered whole, generation prompt
    ids += sampled                                          # the model's own tokens, never re-encoded
    ids += chat.after_turn_ids(new_messages, closed, tools)  # what follows the model's turn

Only what follows a model turn is ever rendered after the opening: the end of the turn (its end-of-turn
token unless the model sampled it: `closed`), the new messages (observations, tool results) and the next
assistant header. It is read off the template's output for a stand-in conversation, since a template may
render an earlier assistant turn differently from what was sampled (e.g. Qwen3's empty thinking block).
"""

from __future__ import annotations

_USER, _MODEL = "\x00u", "\x00a"  # stand-in contents no real conversation has


class ChatTokens:
    def __init__(self, tokenizer, eos: int):
        self.tok, self.eos = tokenizer, eos

    def _render(self, messages: list[dict], tools: list | None) -> str:
        kw = {"tools": tools} if tools else {}
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)

    def prompt_ids(self, messages: list[dict], tools: list | None = None) -> list[int]:
        return list(self.tok.encode(self._render(messages, tools), add_special_tokens=False))

    def after_turn_text(self, messages: list[dict], tools: list | None = None) -> str:
        """What follows a model turn's content when `messages` come after it: ValueError if the template
        cannot render them after an assistant turn."""
        probe = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _MODEL}]
        after = self._render(probe + list(messages), tools)
        if after.count(_MODEL) != 1 or after.count(_USER) != 1:
            roles = ", ".join(repr(m.get("role")) for m in messages)
            what = f"a {roles} message" if len(messages) == 1 else f"{roles} messages"
            raise ValueError(f"the tokenizer's chat template does not render {what} after an assistant turn "
                             "(a stand-in conversation came out wrong); they cannot be appended")
        return after[after.index(_MODEL) + len(_MODEL):]

    def after_turn_ids(self, messages: list[dict], closed: bool, tools: list | None = None) -> list[int]:
        """The tokens after a model turn (all template / environment tokens: response mask 0): its
        end-of-turn token only if the model did not sample it (`closed`), then `messages` and the next
        assistant header."""
        tail, end = self.after_turn_text(messages, tools), self.tok.decode([self.eos])
        if closed and tail.startswith(end):
            tail = tail[len(end):]
        return self.tok.encode(tail, add_special_tokens=False)
