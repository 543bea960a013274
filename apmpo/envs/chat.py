"""One episode's conversation as token ids, grown turn by turn without re-tokenising what the policy sampled.

    chat = Transcript(tokenizer, [{"role": "user", "content": "start"}])   # chat.ids: the first prompt
    chat.add_sampled(sampled_ids, stop_token_ids)                         # the policy's turn, ids as sampled
    env_ids = chat.add_message({"role": "user", "content": "385"})        # the next prompt is chat.ids

The environment's message becomes the ids of what the chat template renders after the conversation so far: the
template is rendered over the messages (the policy's turns as their decoded text) with the new message and the
generation prompt, and the part after the text of the ids so far is tokenised. The ids so far stay as they are.
Two checks guard this, and a failure raises TemplateError naming the template:

- append-only: the conversation rendered without the new message must be a prefix of it rendered with it (not so
  for templates that rewrite earlier turns, e.g. drop the reasoning of earlier assistant messages);
- the text so far (the rendered prompts and environment messages, and the decoded sampled ids) must be a prefix
  of that rendering: the template must put a turn's end where the policy's stop token put it.
"""
from __future__ import annotations

from typing import Any, Sequence


class TemplateError(RuntimeError):
    """The model's chat template cannot extend a conversation by appending tokens."""


class Transcript:
    def __init__(self, tokenizer: Any, messages: Sequence[dict]):
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(f"{getattr(tokenizer, 'name_or_path', 'the tokenizer')} has no chat template: "
                                "multi-turn episodes need one to render the environment's messages")
        self.tokenizer = tokenizer
        self.messages = [dict(m) for m in messages]
        self.text = self._render(self.messages, generation_prompt=True)  # what self.ids encode, so far
        self.ids: list[int] = self._encode(self.text)
        self.prompt_length = len(self.ids)

    def add_sampled(self, ids: Sequence[int], stop_token_ids: Sequence[int]) -> str:
        """Appends a policy turn; returns its text (without a final stop token) as the environment reads it."""
        ids = list(ids)
        content = ids[:-1] if ids and ids[-1] in stop_token_ids else ids
        self.messages.append({"role": "assistant", "content": self._decode(content)})
        self.text += self._decode(ids)
        self.ids += ids
        return self.tokenizer.decode(content, skip_special_tokens=True)

    def add_message(self, message: dict) -> list[int]:
        """Appends an environment message and the generation prompt; returns their ids."""
        without = self._render(self.messages, generation_prompt=False)
        messages = self.messages + [dict(message)]
        rendered = self._render(messages, generation_prompt=True)
        if not rendered.startswith(without):
            at = max(_first_difference(without, rendered) - 12, 0)
            raise TemplateError(
                f"the chat template of {self._name} is not append-only: adding a {message.get('role')!r} message "
                f"changes how the earlier ones render (e.g. it drops earlier reasoning), so the next prompt would not "
                f"extend the sampled tokens. From character {at}, before: {without[at:at + 40]!r}, after: "
                f"{rendered[at:at + 52]!r}. Use a template that renders earlier turns unchanged")
        if not rendered.startswith(self.text):
            at = max(_first_difference(self.text, rendered) - 12, 0)  # with some context before
            raise TemplateError(
                f"the chat template of {self._name} renders the conversation differently from its tokens so far, "
                f"from character {at}: tokens {self.text[at:at + 52]!r}, template {rendered[at:at + 52]!r} (a turn "
                "must end with the stop token where the template ends it; training would use tokens nobody sampled)")
        suffix = rendered[len(self.text):]
        ids = self._encode(suffix)
        self.messages, self.text = messages, rendered
        self.ids += ids
        return ids

    @property
    def _name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
