"""Request bodies of /v1/chat/completions and /v1/completions (pydantic, strict scalar types:
"5" is not a number here, as in OpenAI's API). Unknown fields are ignored, as vLLM does.

Hostile values stop here as a 400 naming the field: a number must be finite (JSON's NaN and
Infinity, or an integer too large for a float, are refused), and a string must be valid
Unicode (a lone UTF-16 surrogate such as "\\ud800" cannot be encoded for the tokenizer or the
worker's gRPC request). Ranges are SamplingParams' (config.py); list caps are the gateway's
(params.RequestRules)."""
from __future__ import annotations

import math
from typing import Annotated, Literal, Union

from pydantic import (AfterValidator, BaseModel, Discriminator, Field, StrictBool, StrictFloat, StrictInt,
                      StrictStr, Tag)


def _finite(value: float | int) -> float:
    try:
        value = float(value)
    except OverflowError:
        raise ValueError("Input should be a finite number") from None
    if not math.isfinite(value):
        raise ValueError("Input should be a finite number")
    return value


def _unicode(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("Input should be valid Unicode (it holds a lone UTF-16 surrogate)") from None
    return value


Number = Annotated[Union[StrictFloat, StrictInt], AfterValidator(_finite)]
Text = Annotated[StrictStr, AfterValidator(_unicode)]
Stop = Union[Text, Annotated[list[Text], Field(max_length=16)], None]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class OtherPart(BaseModel):
    """A content part that is not text (image_url, input_audio, ...): refused by chat_messages.py,
    naming the message and the part type, since the models served take text only."""
    type: Text


def _part_kind(part) -> str:
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    return "text" if kind == "text" else "other"


# a part typed "text" is a TextPart or an error (a missing or non-Unicode text), never another part
ContentPart = Annotated[Union[Annotated[TextPart, Tag("text")], Annotated[OtherPart, Tag("other")]],
                        Discriminator(_part_kind)]


class FunctionCall(BaseModel):
    name: Text
    arguments: Text     # JSON text


class ToolCall(BaseModel):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[Text, list[ContentPart], None] = None
    name: Text | None = None
    tool_call_id: Text | None = None         # role "tool"
    tool_calls: list[ToolCall] | None = None  # role "assistant"


class FunctionDefinition(BaseModel):
    name: Text
    description: Text | None = None
    parameters: dict | None = None     # a JSON Schema


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: dict


class SamplingFields(BaseModel):
    """Fields both endpoints share, OpenAI's and the vLLM extensions."""

    model: Text
    temperature: Number | None = None
    top_p: Number | None = None
    n: StrictInt = Field(1, ge=1, le=16)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)
    seed: StrictInt | None = None
    user: Text | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(0, ge=0)
    include_stop_str_in_output: StrictBool = False
    logit_bias: dict[Text, Number] | None = None   # token id (as a string) -> bias in [-100, 100]
    # vLLM's: requests with different salts never share prefix-cache blocks (nor learn, from
    # usage.prompt_tokens_details.cached_tokens, what the other sent)
    cache_salt: Annotated[StrictStr, Field(min_length=1), AfterValidator(_unicode)] | None = None
    # vLLM's: exactly one of json (a schema), regex, choice, grammar (Lark), json_object
    structured_outputs: dict | None = None

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
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: StrictBool | None = None      # unset: true, as OpenAI


class CompletionRequest(SamplingFields):
    prompt: Union[Text, list[Text], list[StrictInt], list[list[StrictInt]]]
    max_tokens: StrictInt | None = Field(16, ge=1)
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool = False
    suffix: Text | None = None
    best_of: StrictInt | None = None
