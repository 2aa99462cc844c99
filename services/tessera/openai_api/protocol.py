"""Request bodies of /v1/chat/completions and /v1/completions (pydantic, strict scalar types:
"5" is not a number here, as in OpenAI's API). Unknown fields are ignored, as vLLM does."""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Number = Union[StrictFloat, StrictInt]
Stop = Union[StrictStr, Annotated[list[StrictStr], Field(max_length=16)], None]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[StrictStr, list[TextPart], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class SamplingFields(BaseModel):
    """Fields both endpoints share, OpenAI's and the vLLM extensions."""

    model: StrictStr
    temperature: Number | None = None
    top_p: Number | None = None
    n: StrictInt = Field(1, ge=1, le=16)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)
    seed: StrictInt | None = None
    user: StrictStr | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(0, ge=0)
    include_stop_str_in_output: StrictBool = False
    logit_bias: dict[StrictStr, Number] | None = None   # token id (as a string) -> bias in [-100, 100]

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    response_format: dict | None = None
    tools: list[dict] | None = None


class CompletionRequest(SamplingFields):
    prompt: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    max_tokens: StrictInt | None = Field(16, ge=1)
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None
