"""The request bodies the server accepts (pydantic models) and `check_unicode`, the 400 for text in them that
is not valid Unicode."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from minimind.serving.errors import APIError

# ----------------------------------------------------------------------------------------------------------
# Requests (unknown OpenAI fields such as `user` or `presence_penalty` are accepted and ignored). Numbers and
# flags are strict: pydantic's lax mode reads `true` as 1, 2.0 as 2 and "yes" as true, so a client's type mistake
# would silently become another request. Floats still take integers, which JSON writers emit for whole numbers.
# ----------------------------------------------------------------------------------------------------------


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1, strict=True)
    max_completion_tokens: int | None = Field(default=None, ge=1, strict=True)  # the newer name of max_tokens
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, strict=True)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, strict=True)
    top_k: int = Field(default=0, ge=0, strict=True)  # not OpenAI's, but vLLM's and llama.cpp's; 0 = no top-k filter
    n: int = Field(default=1, ge=1, strict=True)  # the upper bound is the server's --max_n
    stop: str | list[str] | None = None
    stream: bool = Field(default=False, strict=True)
    stream_options: dict | None = None
    seed: int | None = Field(default=None, strict=True)

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def max_tokens_param(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None

    def as_template_message(self) -> dict:
        content = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        # "developer" is OpenAI's new name for the system role.
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ChatCompletionRequest(_Sampling):
    messages: list[_Message] = Field(min_length=1)


class CompletionRequest(_Sampling):
    prompt: str | list[str]


def _texts(value, path: str):
    """(field path, string) for every string a request holds, the path in the error's `param` form
    ("messages.0.content"). `stream_options` is a free-form dict nobody reads as text: not walked."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            if name != "stream_options":
                yield from _texts(getattr(value, name), f"{path}.{name}" if path else name)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _texts(item, f"{path}.{index}")


def check_unicode(request: BaseModel) -> None:
    """A 400 naming the field for text that is not valid Unicode: JSON's escape "\\ud800" (or the same three
    bytes raw) decodes to a lone surrogate, which neither the tokenizer nor a UTF-8 response can take."""
    for path, text in _texts(request, ""):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise APIError(
                400,
                f"Invalid value for '{path}': the text is not valid Unicode (a lone surrogate, "
                f"U+{ord(text[error.start]):04X}, at character {error.start}). Surrogate escapes "
                "(\\ud800-\\udfff) must come in high-low pairs.",
                param=path,
                code="invalid_value",
            ) from None
