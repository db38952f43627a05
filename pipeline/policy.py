"""The secrets policy of model configs: which environment variables a config may name as its key,
and where a provider's conventional key may be sent. Checked when a config is registered and again
on the workers before a model is built, so that a config stored by an older client cannot leak a
worker's key either."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from .errors import InvalidRequest

# only annotations here: `workers/settings.py` (every CLI command) imports this module, and the
# config models load pydantic (`bench/cli.py`)
if TYPE_CHECKING:
    from .config import AgentConfig, ModelSpec, Provider

#: The variables each provider reads its key from when a config names no `api_key_env`, in order of
#: preference (Gemini: GEMINI_API_KEY when GOOGLE_API_KEY is unset; Bedrock: a Bedrock API key, or an
#: access key pair with an optional session token). OpenAI-compatible servers have none: they are
#: called without a key unless a config names one.
CONVENTIONAL_KEYS: Mapping[Provider, tuple[str, ...]] = {
    "openai": ("OPENAI_API_KEY",),
    "anthropic": ("ANTHROPIC_API_KEY",),
    "google": ("GOOGLE_API_KEY", "GEMINI_API_KEY"),
    "bedrock": ("AWS_BEARER_TOKEN_BEDROCK", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"),
    "groq": ("GROQ_API_KEY",),
    "mistral": ("MISTRAL_API_KEY",),
}
#: Every conventional key variable: the default of `TL_KEY_ENV_ALLOW`.
CONVENTIONAL_KEY_NAMES: frozenset[str] = frozenset(name for names in CONVENTIONAL_KEYS.values() for name in names)
#: Not secrets, but read by the builders (Bedrock's region) whatever the allow list says.
REGION_VARIABLES: frozenset[str] = frozenset({"AWS_REGION", "AWS_DEFAULT_REGION"})


@dataclass(frozen=True, slots=True)
class ModelPolicy:
    """`TL_KEY_ENV_ALLOW` and `TL_BASE_URL_ALLOW`, as read by `workers/settings.py`."""

    key_env_allow: frozenset[str] = CONVENTIONAL_KEY_NAMES
    base_url_allow: tuple[str, ...] = ()

    def check(self, spec: ModelSpec) -> None:
        check_model_policy(spec, key_env_allow=self.key_env_allow, base_url_allow=self.base_url_allow)

    def check_agent(self, config: AgentConfig) -> None:
        """Every model an agent config may call: its model (and fallbacks) and its summariser."""
        for spec in agent_models(config):
            self.check(spec)
            check_model_exists(spec)

    def readable_env(self, env: Mapping[str, str]) -> dict[str, str]:
        """The part of a worker's environment model builders may read: the allowed key variables
        and the region, so that no config can reach any other variable."""
        return {k: v for k, v in env.items() if k in self.key_env_allow or k in REGION_VARIABLES}


def check_model_exists(spec: ModelSpec) -> None:
    """Refuse (`InvalidRequest`) a model of a provider Threadline owns (`offline`) that does not
    exist, now rather than as a `failed` turn later; other providers' model names are theirs to know."""
    from .config import OFFLINE_MODELS

    for model in spec.chain():
        if model.provider == "offline" and model.name not in OFFLINE_MODELS:
            raise InvalidRequest(f"model offline:{model.name} does not exist; the offline models are "
                                 f"{', '.join(sorted(OFFLINE_MODELS))}")


def check_model_policy(spec: ModelSpec, *, key_env_allow: Collection[str], base_url_allow: Collection[str]) -> None:
    """Refuse (`InvalidRequest`) a model, or any model of its fallback chain, that names a key variable
    outside `key_env_allow` (or, naming none, whose provider's key variables are all outside it: it
    could never have a key), or that would send a provider's conventional key to a `base_url` no
    prefix in `base_url_allow` allows. Keyless configs may point anywhere: they send no key."""
    for model in spec.chain():
        if model.api_key_env is not None and model.api_key_env not in key_env_allow:
            raise InvalidRequest(
                f"model {model.provider}:{model.name}: api_key_env {model.api_key_env!r} is not a variable "
                "configs may name on these workers; add it to TL_KEY_ENV_ALLOW to allow it"
            )
        names = key_variables(model)
        if names and not any(name in key_env_allow for name in names):
            raise InvalidRequest(
                f"model {model.provider}:{model.name}: its key is read from {' / '.join(names)}, and "
                "TL_KEY_ENV_ALLOW on these workers allows none of them; add one to it, or name an allowed "
                "variable in api_key_env"
            )
        if model.base_url is not None and sends_conventional_key(model) and not url_allowed(
            model.base_url, base_url_allow
        ):
            raise InvalidRequest(
                f"model {model.provider}:{model.name}: base_url {model.base_url!r} would receive the "
                f"workers' {' / '.join(key_variables(model))} key; add a prefix of it to TL_BASE_URL_ALLOW "
                "to allow it, or name a key of its own in api_key_env"
            )


def agent_models(config: AgentConfig) -> list[ModelSpec]:
    """The model specs an agent config builds: its model, and its compaction summariser if any."""
    compaction = config.memory.compaction
    return [config.model, *([compaction.summariser] if compaction is not None else [])]


def key_variables(spec: ModelSpec) -> tuple[str, ...]:
    """The variables a model's key is read from: the one its config names, else its provider's own."""
    if spec.api_key_env is not None:
        return (spec.api_key_env,)
    return CONVENTIONAL_KEYS.get(spec.provider, ())


def sends_conventional_key(spec: ModelSpec) -> bool:
    """Whether a model sends a key the operator set for a provider (not one its config's own variable
    holds): configs without `api_key_env` on a hosted provider, or naming a conventional variable."""
    return any(name in CONVENTIONAL_KEY_NAMES for name in key_variables(spec))


def url_allowed(url: str, prefixes: Collection[str]) -> bool:
    """Whether `url` starts with one of `prefixes` at a boundary (`https://api.example.com` allows
    `https://api.example.com/v1`, not `https://api.example.com.evil.net`); a URL with a user part is
    never allowed (the host after the `@` is where it goes, whatever the prefix says)."""
    try:
        if urlsplit(url).username is not None:
            return False
    except ValueError:
        return False
    return any(_at_boundary(url, prefix) for prefix in prefixes if prefix)


def _at_boundary(url: str, prefix: str) -> bool:
    if not url.startswith(prefix):
        return False
    rest = url[len(prefix):]
    return not rest or prefix[-1] in "/:?#" or rest[0] in "/:?#"
