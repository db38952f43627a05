"""Models and tools by config, built in the shell: keys come from the worker's environment (by the
name a config gives, never from the config), providers are constructed here, and `python:` plugins
are imported here, where workers allow them. What the offline models answer is pure logic in
`pipeline/llm.py`; here they get their pace."""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic_ai import Tool
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart
from pydantic_ai.models import Model
from pydantic_ai.models.fallback import FallbackModel
from pydantic_ai.models.function import AgentInfo, FunctionModel

from threadline.pipeline.caching import PromptCacheModel, cache_plan
from threadline.pipeline.config import ModelSpec, Provider
from threadline.pipeline.errors import InvalidRequest, ModelKeyMissing, ProviderNotInstalled
from threadline.pipeline.invoke import BUILTIN_TOOLS, TurnDeps, falls_back
from threadline.pipeline.llm import (
    StrictSystemModel,
    chat_answer,
    echo,
    echo_stream,
    profile_for,
    summary_answer,
    words,
)
from threadline.pipeline.policy import key_variables
from threadline.workers.worker.tokenizers import load_tokenizer

if TYPE_CHECKING:
    from openai import AsyncOpenAI


def build_model(spec: ModelSpec, *, env: Mapping[str, str], allow_python: bool = False) -> Model:
    """The pydantic-ai model a config names, wrapped in its provider profile; with `fallback`, a
    `FallbackModel` over the chain, each model in its own profile."""
    if spec.fallback:
        return _fallback_chain(spec, env=env, allow_python=allow_python)
    return StrictSystemModel(_cached(_base_model(spec, env=env, allow_python=allow_python), spec), profile_for(spec))


def _cached(model: Model, spec: ModelSpec) -> Model:
    """`model` with its own `model.cache` plan (`pipeline/caching.py`): each model of a chain its own.
    The prefix worth a breakpoint is measured with the model's local tokenizer (its provider's
    count endpoint is not asked for that)."""
    if spec.provider == "offline":
        return model
    tokenizer = load_tokenizer(None if spec.counts_with_provider() else spec.tokenizer, spec.provider)
    plan = cache_plan(spec, tokenizer)
    return PromptCacheModel(model, plan) if plan is not None else model


def build_counting_model(spec: ModelSpec, *, env: Mapping[str, str], allow_python: bool = False) -> Model:
    """The bare model of `spec` alone (no fallback, no profile wrapper), for its count endpoint."""
    return _base_model(spec, env=env, allow_python=allow_python)


def _fallback_chain(spec: ModelSpec, *, env: Mapping[str, str], allow_python: bool) -> Model:
    # Every model of the chain is built (and its key checked) up front: a broken fallback fails the turn
    # now rather than on the day the primary is down. The chain moves on exactly where Threadline would
    # try again (429, 5xx, connection errors) and on an exhausted quota, never on a bad request (`falls_back`).
    members = [build_model(m.model_copy(update={"fallback": []}), env=env, allow_python=allow_python)
               for m in spec.chain()]
    return FallbackModel(*members, fallback_on=falls_back)


def model_secrets(spec: ModelSpec, env: Mapping[str, str]) -> list[str]:
    """The key values a model (and every model of its fallback chain) may send: every variable its
    builder may read, scrubbed from anything its errors say."""
    names = dict.fromkeys(name for model in spec.chain() for name in key_variables(model))
    return [env[name] for name in names if env.get(name)]


def build_tools(names: Sequence[str], *, allow_python: bool) -> list[Tool[TurnDeps]]:
    """The tools a config names: built-ins, or `python:module:function` where workers allow plugins."""
    tools: list[Tool[TurnDeps]] = []
    for name in names:
        if name in BUILTIN_TOOLS:
            tools.append(BUILTIN_TOOLS[name])
        elif allow_python:
            tools.append(Tool(import_object(name.removeprefix("python:"))))
        else:
            raise InvalidRequest(f"tool {name!r}: python plugins are disabled on these workers")
    return tools


def _base_model(spec: ModelSpec, *, env: Mapping[str, str], allow_python: bool) -> Model:
    """The pydantic-ai model of ONE spec (no fallback, no profile wrapper)."""
    if spec.provider == "offline":
        return offline_model(spec.name, spec.options)
    if spec.provider == "python":
        if not allow_python:
            raise InvalidRequest("python model factories are disabled on these workers (TL_ALLOW_PYTHON_PLUGINS)")
        factory: Callable[[dict[str, Any]], Model] = import_object(spec.name)
        return factory(dict(spec.options))
    entry = PROVIDERS[spec.provider]
    try:
        importlib.import_module(entry.sdk_module)
    except ImportError:
        raise ProviderNotInstalled(f"the {spec.provider} provider is not installed on these workers: "
                                   f"pip install 'threadline[{entry.extra}]'") from None
    base_url = spec.base_url or entry.default_base_url
    if entry.needs_base_url and base_url is None:
        raise InvalidRequest(f"provider {spec.provider!r} needs a base_url")
    return entry.build(spec, base_url, env)


# --- hosted providers -----------------------------------------------------------------------------
# Threadline's invoke retry (`retry_delay_s`, TL_MAX_INVOKE_ATTEMPTS) is the only retry layer: every
# SDK client is built to make exactly one HTTP request per model call.


def _api_key(spec: ModelSpec, env: Mapping[str, str]) -> str | None:
    """The key a model sends: from the variable its config names, else its provider's conventional
    ones (the first that is set). None: a keyless OpenAI-compatible config. Never a placeholder."""
    names = key_variables(spec)
    if not names:
        return None
    for name in names:
        if value := env.get(name):
            return value
    raise ModelKeyMissing(_no_key(names))


def _hosted_key(spec: ModelSpec, env: Mapping[str, str]) -> str:
    key = _api_key(spec, env)
    if key is None:  # a hosted provider always has conventional key variables
        raise ModelKeyMissing(f"no API key: provider {spec.provider!r} has no key variable")
    return key


def _no_key(names: Sequence[str]) -> str:
    if len(names) == 1:
        return f"no API key: the worker's environment variable {names[0]!r} is unset or empty"
    listed = ", ".join(repr(n) for n in names[:-1]) + f" and {names[-1]!r}"
    return f"no API key: the worker's environment variables {listed} are unset or empty"


def _keyless_openai(base_url: str | None) -> AsyncOpenAI:
    """An OpenAI client that sends no credentials at all, for an OpenAI-compatible server configured
    without a key: the SDK would otherwise fall back to OPENAI_API_KEY (sending the workers' OpenAI
    key to any server a config names) or insist on a placeholder."""
    from openai import AsyncOpenAI
    from openai._types import Headers

    class _Keyless(AsyncOpenAI):
        def __init__(self, **options: Any) -> None:
            super().__init__(**{**options, "api_key": "", "_enforce_credentials": False})

        def _validate_headers(self, headers: Headers, custom_headers: Headers) -> None:
            return None  # no Authorization header is what we want

    return _Keyless(base_url=base_url, max_retries=0)


def _openai_chat(provider_class: str) -> Builder:
    """A builder of chat-completions models through `provider_class`, pydantic-ai's provider whose
    profiles know the server (vLLM's and Ollama's differ from OpenAI's: system messages, schemas)."""

    def build(spec: ModelSpec, base_url: str | None, env: Mapping[str, str]) -> Model:
        from openai import AsyncOpenAI
        from pydantic_ai.models.openai import OpenAIChatModel

        key = _api_key(spec, env)
        client = AsyncOpenAI(api_key=key, base_url=base_url, max_retries=0) if key else _keyless_openai(base_url)
        return OpenAIChatModel(spec.name, provider=import_object(provider_class)(openai_client=client))

    return build


def _anthropic(spec: ModelSpec, base_url: str | None, env: Mapping[str, str]) -> Model:
    from anthropic import AsyncAnthropic
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.providers.anthropic import AnthropicProvider

    client = AsyncAnthropic(api_key=_hosted_key(spec, env), base_url=base_url, max_retries=0)
    return AnthropicModel(spec.name, provider=AnthropicProvider(anthropic_client=client))


def _google(spec: ModelSpec, base_url: str | None, env: Mapping[str, str]) -> Model:
    from google.genai.types import HttpRetryOptions
    from pydantic_ai.models.google import GoogleModel
    from pydantic_ai.providers.google import GoogleProvider

    provider = GoogleProvider(api_key=_hosted_key(spec, env), base_url=base_url,
                              retry_options=HttpRetryOptions(attempts=1))
    return GoogleModel(spec.name, provider=provider)


def _groq(spec: ModelSpec, base_url: str | None, env: Mapping[str, str]) -> Model:
    from groq import AsyncGroq
    from pydantic_ai.models.groq import GroqModel
    from pydantic_ai.providers.groq import GroqProvider

    client = AsyncGroq(api_key=_hosted_key(spec, env), base_url=base_url, max_retries=0)
    return GroqModel(spec.name, provider=GroqProvider(groq_client=client))


def _mistral(spec: ModelSpec, base_url: str | None, env: Mapping[str, str]) -> Model:
    from pydantic_ai.models.mistral import MistralModel
    from pydantic_ai.providers.mistral import MistralProvider

    # the Mistral SDK retries only with a `retry_config`, and none is given
    return MistralModel(spec.name, provider=MistralProvider(api_key=_hosted_key(spec, env), base_url=base_url))


def _bedrock(spec: ModelSpec, base_url: str | None, env: Mapping[str, str]) -> Model:
    import boto3
    from botocore.config import Config
    from pydantic_ai.models.bedrock import BedrockConverseModel
    from pydantic_ai.providers.bedrock import BedrockProvider, _BearerTokenSession

    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
    config = Config(read_timeout=300, connect_timeout=60, retries={"total_max_attempts": 1})
    token = _bedrock_token(spec, env)
    if token is not None:
        session = boto3.Session(botocore_session=_BearerTokenSession(token), region_name=region)
        config = config.merge(Config(signature_version="bearer"))
    else:
        key_id, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
        if not (key_id and secret):
            raise ModelKeyMissing(_no_key(("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"))
                                  + " (or set 'AWS_BEARER_TOKEN_BEDROCK')")
        session = boto3.Session(aws_access_key_id=key_id, aws_secret_access_key=secret,
                                aws_session_token=env.get("AWS_SESSION_TOKEN") or None, region_name=region)
    client = session.client("bedrock-runtime", config=config, endpoint_url=base_url)
    return BedrockConverseModel(spec.name, provider=BedrockProvider(bedrock_client=client))


def _bedrock_token(spec: ModelSpec, env: Mapping[str, str]) -> str | None:
    """A Bedrock API key (bearer token): from the config's `api_key_env`, which must be set, else
    AWS_BEARER_TOKEN_BEDROCK when set; None: sign with the access key pair."""
    if spec.api_key_env is not None:
        return _hosted_key(spec, env)
    return env.get("AWS_BEARER_TOKEN_BEDROCK") or None


#: A provider's builder: the spec, its endpoint (None: the SDK's default), the readable environment.
Builder = Callable[[ModelSpec, str | None, Mapping[str, str]], Model]


@dataclass(frozen=True, slots=True)
class ProviderBuild:
    """How one provider's models are built: the extra that installs its SDK (imported first, so that
    a missing one fails with `provider_not_installed`), the builder, and its endpoint defaults."""

    extra: str
    sdk_module: str
    build: Builder
    default_base_url: str | None = None
    #: OpenAI-compatible servers have no endpoint of their own.
    needs_base_url: bool = False


PROVIDERS: Mapping[Provider, ProviderBuild] = {
    "openai": ProviderBuild("openai", "openai", _openai_chat("pydantic_ai.providers.openai:OpenAIProvider")),
    "openai-compatible": ProviderBuild(
        "openai", "openai", _openai_chat("pydantic_ai.providers.openai:OpenAIProvider"), needs_base_url=True),
    "vllm": ProviderBuild("openai", "openai", _openai_chat("pydantic_ai.providers.vllm:VLLMProvider"),
                          needs_base_url=True),
    "ollama": ProviderBuild("openai", "openai", _openai_chat("pydantic_ai.providers.ollama:OllamaProvider"),
                            default_base_url="http://127.0.0.1:11434/v1"),
    "anthropic": ProviderBuild("anthropic", "anthropic", _anthropic),
    "google": ProviderBuild("google", "google.genai", _google),
    "bedrock": ProviderBuild("bedrock", "boto3", _bedrock),
    "groq": ProviderBuild("groq", "groq", _groq),
    "mistral": ProviderBuild("mistral", "mistralai", _mistral),
}


def import_object(path: str) -> Any:
    """`module:attribute` → the attribute (python plugins: test models and tools)."""
    module_name, _, attr = path.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise InvalidRequest(f"cannot load {path!r}: {e}") from None
    if not callable(found):
        raise InvalidRequest(f"{path!r} is not callable")
    return found


def offline_model(name: str, options: Mapping[str, Any]) -> Model:
    """Threadline's offline models: no key, deterministic answers (`pipeline/llm.py`)."""
    if name == "echo":
        return FunctionModel(echo, stream_function=echo_stream, model_name="offline:echo")
    if name == "chat":
        delay = float(options.get("delay_ms", 0)) / 1000
        repeat = int(options.get("repeat", 1))

        async def chat_stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str]:
            for word in words(chat_answer(messages, repeat=repeat)):
                if delay:
                    await asyncio.sleep(delay)
                yield word

        def chat(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
            return ModelResponse(parts=[TextPart(chat_answer(messages, repeat=repeat))])

        return FunctionModel(chat, stream_function=chat_stream, model_name="offline:chat")
    if name == "summary":

        def summary(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
            return ModelResponse(parts=[TextPart(summary_answer(messages))])

        async def summary_stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str]:
            yield summary_answer(messages)

        return FunctionModel(summary, stream_function=summary_stream, model_name="offline:summary")
    raise InvalidRequest(f"unknown offline model {name!r}; available: echo, chat, summary")
