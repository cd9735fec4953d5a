"""Turn a validated OpenAI request into the internal :class:`GenerateRequest`: tokenize once and
fill in sampling defaults (the context window is :mod:`cluster.policy.context`'s). Pure (the tokenizer
is passed in), so the gateway can call it off its event loop.
"""

from __future__ import annotations

import json
import time

from cluster.config import ClusterConfig, FimTemplate, ModelConfig, ToolCallsConfig
from cluster.json_types import JSONObject
from cluster.tokens import HFTokenizer, Tokenizer
from cluster.wire import fim as fim_prompt
from cluster.wire import logprobs
from cluster.wire.errors import InvalidRequest, NotFound
from cluster.wire.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest, Sampling
from cluster.wire.tool_schema import plan as tool_plan

ApiRequest = ChatCompletionRequest | CompletionRequest


def lookup_model(cfg: ClusterConfig, name: str) -> ModelConfig:
    model = cfg.model(name)
    if model is None:
        raise NotFound(f"The model '{name}' does not exist or you do not have access to it.", param="model")
    return model


def prompt_ids(
    req: ApiRequest,
    tok: Tokenizer,
    fim: FimTemplate | None = None,
    tool_calls: ToolCallsConfig | None = None,
) -> tuple[list[int], list[JSONObject] | None, str | None]:
    """The prompt's token ids, plus what providers need: the messages (chat) or the text.

    A completion with ``suffix`` on a model with a FIM template is tokenized as the engine will
    see it (:mod:`cluster.wire.fim`); the text providers get stays the client's own prompt. A chat on a
    model with a tool-call format is rendered with the tools by its tool-aware template, as the
    engine will see it (:mod:`cluster.wire.tool_schema` says when the tools are shown)."""
    if isinstance(req, ChatCompletionRequest):
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        if tool_calls is not None and isinstance(tok, HFTokenizer):
            plan = tool_plan(req)
            shown = (
                [t.model_dump(exclude_none=True) for t in req.tools or []]
                if plan and plan.render_tools
                else None
            )
            return tok.tool_chat_ids(messages, shown, tool_calls.chat_template), messages, None
        return tok.chat_ids(messages) + _tool_ids(req, messages, tok), messages, None
    if req.suffix is not None and fim is not None:
        if isinstance(req.prompt, list):
            raise InvalidRequest("'suffix' needs a text prompt, not token ids", param="prompt")
        return tok.encode(fim_prompt.render(fim, req.prompt, req.suffix)), None, req.prompt
    if isinstance(req.prompt, list):
        if not tok.exact:
            raise InvalidRequest("token-id prompts need a model with an exact tokenizer", param="prompt")
        return list(req.prompt), None, None
    return tok.encode(req.prompt), None, req.prompt


def _tool_ids(req: ChatCompletionRequest, messages: list[JSONObject], tok: Tokenizer) -> list[int]:
    """Tool definitions and earlier calls count against the window and the budgets too. Without a
    tool-aware template only providers serve tools (cluster.policy.capabilities), and each renders them
    its own way: the JSON's tokens are the estimate (OpenAI and Anthropic both put the schemas
    into the prompt)."""
    calls = [m["tool_calls"] for m in messages if m.get("tool_calls")]
    if not req.tools and not calls:
        return []
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    return tok.encode(json.dumps({"tools": tools, "calls": calls}, separators=(",", ":")))


def build_generate_request(
    req: ApiRequest,
    model: ModelConfig,
    ids: list[int],
    messages: list[JSONObject] | None,
    text: str | None,
    *,
    request_id: str,
    surface: str,
    session_id: str | None,
    timeout_s: float,
    max_tokens: int,
    priority: int = 0,
    max_tokens_asked: bool = True,
) -> GenerateRequest:
    chat = isinstance(req, ChatCompletionRequest)
    tools = (
        tool_plan(req) if isinstance(req, ChatCompletionRequest) and model.tool_calls is not None else None
    )
    top = logprobs.asked("chat" if chat else "completion", req.logprobs, getattr(req, "top_logprobs", None))
    _refuse(req, top, bool(tools and tools.parse))
    return GenerateRequest(
        request_id=request_id,
        model=model.name,
        kind="chat" if isinstance(req, ChatCompletionRequest) else "completion",
        prompt_token_ids=ids,
        sampling=Sampling(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            stop=req.stop_list(),
            seed=req.seed,
            ignore_eos=req.ignore_eos,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            structured=(tools.structured if tools and tools.structured else None) or structured(req),
            logprobs=top,
            n=req.n or 1,
            prompt_logprobs=req.prompt_logprobs,
        ),
        options=options(req),
        tool_parse=tools.parse if tools else None,
        max_tokens_asked=max_tokens_asked,
        messages=messages,
        prompt_text=text,
        surface=surface,
        priority=priority,
        session_id=session_id,
        deadline=time.time() + timeout_s,
    )


def _refuse(req: ApiRequest, top: int | None, parsed: bool) -> None:
    """What an engine cannot serve together (``parsed``: a tool-call parser reads its text)."""
    if top is not None and parsed:  # its tool-call parser frames none
        raise InvalidRequest("'logprobs' with tools is not served on this model", param="logprobs")
    if (req.n or 1) > 1 and parsed:  # one parser per stream, not per choice
        raise InvalidRequest("'n' above 1 with tools is not served on this model", param="n")
    if req.prompt_logprobs is not None and req.stream:  # vLLM's own rule and words
        raise InvalidRequest(
            "`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs"
        )


# Fields every backend reads from Sampling or the prompt; the rest travel in GenerateRequest.options.
_CORE = frozenset(
    {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
     "stop", "seed", "stream", "stream_options", "user", "presence_penalty", "frequency_penalty",
     "ignore_eos"}
)  # fmt: skip


def options(req: ApiRequest) -> JSONObject:
    """The client's other fields, as sent (JSON), for provider adapters to pass or translate."""
    sent = req.model_fields_set - _CORE
    return req.model_dump(include=sent, by_alias=True, exclude_none=True, mode="json") if sent else {}


def structured(req: ApiRequest) -> JSONObject | None:
    """``response_format`` as a self-hosted engine's structured decoding (vLLM's fields)."""
    rf = getattr(req, "response_format", None)
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return {"json_object": True}
    return {"json": rf.json_schema.schema_ or {}}


def requested_max_tokens(req: ApiRequest) -> int | None:
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return req.max_tokens
