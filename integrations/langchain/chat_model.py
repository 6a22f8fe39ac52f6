"""`ChatFreeToken`: a LangChain chat model over the FreeToken engine."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Sequence
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.exceptions import ContextOverflowError
from langchain_core.language_models import LanguageModelInput
from langchain_core.language_models.chat_models import BaseChatModel, LangSmithParams
from langchain_core.language_models.model_profile import ModelProfile
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import ConfigDict, Field

from freetoken_agents import conversation_sources, user_sources
from freetoken_agents.engine import Engine, EngineOptions, MemoryBudget, Placement
from freetoken_agents.sync_bridge import aiterate_on, iterate_on

from .engines import EngineHandle, shared_engine
from .messages import to_chat_dicts
from .tool_choice import normalize_tool_choice
from .turn import TurnOptions, TurnState, run_turn

SAMPLING_FIELDS = ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
"""Sampling settings passed to the engine unchanged (a call's keyword overrides the field)."""

logger = logging.getLogger(__name__)


class ChatFreeToken(BaseChatModel):
    """A FreeToken model (Hugging Face checkpoint folder, .ftw file or Hub id) as a LangChain chat model.

    Construction is cheap: the engine loads on the first call and is shared by every instance
    with the same path and load options. Prompts are rendered with the checkpoint's chat
    template; repeated history prefixes are reused from the engine's KV cache (anchors), and the
    reused tokens are reported as `usage_metadata["input_token_details"]["cache_read"]`.

    Example::

        llm = ChatFreeToken(model="/models/qwen3-moe", max_tokens=256)
        llm.bind_tools([get_weather], tool_choice="any").invoke("Weather in Paris?")
    """

    model_config = ConfigDict(populate_by_name=True, extra="ignore", arbitrary_types_allowed=True)

    model: str = Field(alias="model_name")
    """Path of a Hugging Face checkpoint folder or an .ftw file, or a Hugging Face Hub id
    ``org/name[@revision]`` (fetched into the huggingface_hub cache on the first call; a local path
    of the same spelling wins); also accepted as `model_name`."""
    temperature: float = 0.0
    """Sampling temperature; 0 is greedy."""
    max_tokens: int | None = 256
    """Most tokens of free text per turn (tool-call arguments have `max_call_tokens`)."""
    max_call_tokens: int = 192
    """Most tokens the model samples in one tool call's (or one structured output's) JSON (text the
    schema forces is not counted); near the end of it the decoder picks only tokens that close
    values, so the JSON is complete and schema-valid. A forced call whose schema cannot fit in it
    raises `freetoken_agents.TokenLimitTooSmall`."""
    stop: list[str] | None = None
    """Stop strings: the text ends before the first one (not applied inside tool calls)."""
    ground_arguments: bool | None = None
    """Decode every plain string argument of a tool call as a span of the user's and the tools'
    messages, and every number argument as a number written there
    (`freetoken_agents.GenerateRequest.argument_sources`): a small model then cannot misspell what
    it copies. None: the model's default (on for the embedded model only)."""
    relevant_calls: bool | None = None
    """With tool_choice "auto", call only the tools the user's messages are about (a content word in
    common with a tool's name or description) or that the model was trained to call; with none,
    answer without a call (`freetoken_agents.GenerateRequest.call_sources`). None: the model's
    default (on for the embedded model only)."""
    streaming: bool = False
    """Use `_stream` for `invoke` (callbacks get tokens as they are decoded)."""
    seed: int | None = None
    """Sampling seed (temperature > 0)."""
    top_p: float | None = None
    """Nucleus sampling: keep the most likely tokens up to this probability mass (temperature > 0)."""
    top_k: int | None = None
    """Sample among the k most likely tokens only (temperature > 0; None or 0: all)."""
    min_p: float | None = None
    """Drop tokens less likely than min_p x the most likely one's probability (temperature > 0)."""
    repetition_penalty: float = 1.0
    """vLLM's: logits of tokens already in the prompt or the reply divided (or, if negative,
    multiplied) by it; 1.0: off. Applies to greedy decoding too."""
    presence_penalty: float = 0.0
    """OpenAI's: subtracted from the logit of every token the reply already holds (-2..2)."""
    frequency_penalty: float = 0.0
    """OpenAI's: subtracted once per earlier occurrence of the token in the reply (-2..2)."""
    prefix_cache: bool = True
    """Reuse the longest cached prefix of each prompt; False prefills every prompt from scratch."""
    dtype: str = "float32"
    """torch dtype name the engine loads weights in."""
    device: str = "cpu"
    """'cpu' or 'cuda[:N]'."""
    memory: MemoryBudget | dict[str, Any] | None = None
    """Byte budgets: a `freetoken_agents.engine.MemoryBudget` or a dict of its fields, sizes as
    ints or strings (e.g. {"fast_bytes": "8GiB", "host_bytes": "32GiB"}). A fast or host budget
    tiers the experts (q*), as `Engine.from_pretrained(memory=...)` does."""
    placement: Placement = "auto"
    """'auto' | 'resident' | 'qstar' | 'stream': where the experts go (see `Engine.from_pretrained`)."""
    expert_quant: str = "auto"
    """'auto' | 'int8' | 'compact' | 'none': which expert projections the engine keeps compact (int8,
    MXFP4) and computes from that form (resident or tiered; see `Engine.from_pretrained`)."""
    record_routing: str | None = None
    """A file the engine writes the routing of every token it runs to (JSON lines; see
    `Engine.from_pretrained`); None: no trace."""
    routing_profile: str | None = None
    """A routing trace of this model (as `record_routing` writes) that tiered experts start from:
    frequencies seeded, fast memory filled with its most used experts at load; None: cold."""
    tool_format: str | None = None
    """Tool-call family (a `freetoken_agents.parsers.PARSERS` key: 'hermes', 'mistral', 'mistral_v11',
    'deepseek', 'deepseek_v31', 'harmony', 'qwen3_coder'); None: from the template."""
    timeout: float | None = None
    """Accepted for drop-in compatibility with hosted chat models; unused (local engine)."""
    max_retries: int | None = None
    """Accepted for drop-in compatibility; unused."""
    api_key: Any = None
    """Accepted for drop-in compatibility; unused."""

    # ---- LangChain metadata -----------------------------------------------------------------------
    @property
    def _llm_type(self) -> str:
        return "freetoken"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "dtype": self.dtype,
            "device": self.device,
            "placement": self.placement,
            "expert_quant": self.expert_quant,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="freetoken",
            ls_model_name=kwargs.get("model") or self.model,
            ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
        )
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        stops = stop or kwargs.get("stop") or self.stop
        if stops:
            params["ls_stop"] = list(stops)
        return params

    def _resolve_model_profile(self) -> ModelProfile | None:
        return ModelProfile(
            open_weights=True,
            text_inputs=True,
            text_outputs=True,
            image_inputs=False,
            audio_inputs=False,
            pdf_inputs=False,
            video_inputs=False,
            tool_calling=True,
            tool_choice=True,
            tool_call_streaming=True,
            structured_output=True,
        )

    # ---- serialization (langchain_core.load.dumpd / load) ---------------------------------------------
    @classmethod
    def is_lc_serializable(cls) -> bool:
        return True

    @classmethod
    def get_lc_namespace(cls) -> list[str]:
        """Where `langchain_core.load.load` imports the class from: the public module, so a saved
        chain loads with `load(data, valid_namespaces=["freetoken_agents"],
        allowed_objects=[ChatFreeToken, ...])`."""
        return ["freetoken_agents", "integrations", "langchain"]

    @property
    def lc_secrets(self) -> dict[str, str]:
        # never written into a dump (unused here, but a drop-in user may pass a real key)
        return {"api_key": "FREETOKEN_API_KEY"}

    @property
    def lc_attributes(self) -> dict[str, Any]:
        # a MemoryBudget object is not JSON; its fields (bytes) load back as the same budget
        if isinstance(self.memory, MemoryBudget):
            return {"memory": self.memory.model_dump(exclude_none=True)}
        return {}

    # ---- tools and structured output ---------------------------------------------------------------
    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: dict | str | bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools. `tool_choice`: "auto" (default), "none", "any"/"required" (some tool must
        be called), a tool name, or a dict naming one; forced choices are enforced by
        grammar-constrained decoding, so the call always parses and matches the tool's schema."""
        formatted = [convert_to_openai_tool(t) for t in tools]
        names = [t["function"]["name"] for t in formatted]
        choice = normalize_tool_choice(tool_choice, names)
        return super().bind(tools=formatted, tool_choice=choice, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type,
        *,
        include_raw: bool = False,
        method: Literal["function_calling", "json_schema", "json_mode"] = "function_calling",
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | Any]:
        """Structured output. "function_calling": a forced, constrained tool call; "json_schema"
        and "json_mode": the whole reply is decoded under the schema's grammar (so json_mode is
        as strict as json_schema here). `strict` is accepted; output is always schema-valid."""
        if method == "function_calling":
            return super().with_structured_output(schema, include_raw=include_raw, **kwargs)
        if kwargs:
            raise ValueError(f"unsupported arguments {kwargs}")
        json_schema = convert_to_json_schema(schema)
        llm = self.bind(
            response_format={"type": "json_schema", "schema": json_schema},
            ls_structured_output_format={"kwargs": {"method": method}, "schema": json_schema},
        )
        is_model = isinstance(schema, type) and is_basemodel_subclass(schema)
        parser: Runnable = PydanticOutputParser(pydantic_object=schema) if is_model else JsonOutputParser()
        if not include_raw:
            return llm | parser
        assign = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | assign.with_fallbacks([fallback], exception_key="parsing_error")

    # ---- generation ------------------------------------------------------------------------------
    def engine_options(self) -> EngineOptions:
        """The options the engine is loaded with (EngineError, one line, for bad ones)."""
        return EngineOptions.parse(
            device=self.device,
            dtype=self.dtype,
            memory=self.memory,
            placement=self.placement,
            expert_quant=self.expert_quant,
            record_routing=self.record_routing,
            routing_profile=self.routing_profile,
        )

    @property
    def engine(self) -> Engine:
        """The loaded engine (loaded on first use; shared by every instance with the same model,
        options and tool format). `engine.stats()` shows its placement and tiers."""
        return self._handle().engine

    def _handle(self) -> EngineHandle:
        return shared_engine(self.model, self.engine_options(), family=self.tool_format)

    def _turn(
        self,
        handle: EngineHandle,
        chat: list[dict[str, Any]],
        stop: list[str] | None,
        kwargs: dict[str, Any],
        state: TurnState,
    ) -> Generator[AIMessageChunk, None, None]:
        """The call's steps (rendering the prompt included), each run on the engine's step worker.
        `chat`: the messages as chat-template dicts (`to_chat_dicts`, made before the engine loads:
        a message the model cannot read is refused without loading the weights)."""
        tools = list(kwargs.get("tools") or [])
        fmt = kwargs.get("response_format")
        schema = None
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            schema = fmt.get("schema") or (fmt.get("json_schema") or {}).get("schema")
        ids = handle.backend.render(chat, tools or None)
        budget = handle.engine.max_context
        if len(ids) >= budget:
            raise ContextOverflowError(
                f"the prompt is {len(ids)} tokens; {self.model} has a context of {budget} tokens"
            )
        room = budget - len(ids)
        call_budget = min(self.max_call_tokens, max(1, room // 2))
        max_tokens = kwargs.get("max_tokens", self.max_tokens) or 256
        opts = TurnOptions(
            model_name=kwargs.get("model") or self.model,
            tools=tools,
            tool_choice=kwargs.get("tool_choice") or "auto",
            json_schema=schema,
            stop=tuple(stop or self.stop or ()),
            max_tokens=max(1, min(max_tokens, room - call_budget - 1)),
            max_call_tokens=call_budget,
            temperature=kwargs.get("temperature", self.temperature),
            seed=kwargs.get("seed", self.seed),
            sampling={name: kwargs.get(name, getattr(self, name)) for name in SAMPLING_FIELDS},
            reuse=self.prefix_cache,
            argument_sources=tuple(conversation_sources(chat)) if self._grounds(handle) else None,
            call_sources=tuple(user_sources(chat)) if self._gates_calls(handle) else None,
        )
        yield from run_turn(handle, ids, opts, state)

    def _grounds(self, handle: EngineHandle) -> bool:
        if self.ground_arguments is not None:
            return self.ground_arguments
        return handle.backend.ground_arguments

    def _gates_calls(self, handle: EngineHandle) -> bool:
        if self.relevant_calls is not None:
            return self.relevant_calls
        return handle.backend.relevant_calls

    @staticmethod
    def _result(state: TurnState) -> ChatResult:
        message = AIMessage(
            content=state.content,
            additional_kwargs={"reasoning_content": state.reasoning} if state.reasoning else {},
            tool_calls=state.tool_calls,
            invalid_tool_calls=state.invalid_tool_calls,
            usage_metadata=state.usage,  # type: ignore[arg-type]
            response_metadata=state.response_metadata,
        )
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        chat = to_chat_dicts(messages)
        state, handle = TurnState(), self._handle()
        for _ in iterate_on(handle.worker, self._turn(handle, chat, stop, kwargs, state)):
            pass
        return self._result(state)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        chat = to_chat_dicts(messages)
        handle = self._handle()
        for chunk in iterate_on(handle.worker, self._turn(handle, chat, stop, kwargs, TurnState())):
            out = ChatGenerationChunk(message=chunk)
            if run_manager and isinstance(chunk.content, str) and chunk.content:
                run_manager.on_llm_new_token(chunk.content, chunk=out)
            yield out

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        async for chunk in self._aturn(messages, stop, kwargs, TurnState()):
            out = ChatGenerationChunk(message=chunk)
            if run_manager and isinstance(chunk.content, str) and chunk.content:
                await run_manager.on_llm_new_token(chunk.content, chunk=out)
            yield out

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        state = TurnState()
        async for _ in self._aturn(messages, stop, kwargs, state):
            pass
        return self._result(state)

    async def _aturn(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any], state: TurnState
    ) -> AsyncIterator[AIMessageChunk]:
        """The turn's steps on the engine's step worker, the event loop free between them: no
        thread waits for the steps of another call (each call has its own context), so any number
        of concurrent calls proceed, interleaved. A consumer that stops early (cancelled, closed)
        stops the turn after its current step."""
        chat = to_chat_dicts(messages)
        handle = await asyncio.to_thread(self._handle)  # the first call loads the weights
        async for chunk in aiterate_on(handle.worker, self._turn(handle, chat, stop, kwargs, state)):
            yield chunk
