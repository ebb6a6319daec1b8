"""Typed settings for every Flywheel service (torch-free, importable everywhere).

One `FlywheelSettings` holds a section per service. Values come, in increasing priority, from
the defaults below, a config file with one section per service (YAML `.yaml`/`.yml`, TOML, or
JSON `.json`; `flywheel up --config FILE`, or `FLYWHEEL_CONFIG`), and environment variables
`FLYWHEEL_<SECTION>__<FIELD>` (e.g. `FLYWHEEL_TRAINER__OPTIM__LR=1e-5`).
Settings are parsed at start-up by `load_settings()`, never at import time.

To add a setting: add a field with a docstring that names its unit and any sentinel value.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from flywheel.core.config_files import (  # noqa: F401  (re-exported for callers of settings)
    ConfigFileError,
    describe_validation_error,
    mask_secrets,
    read_config_file,
    single_underscore_settings,
    unknown_env_sections,
    unknown_env_variables,
    unknown_file_sections,
)
from flywheel.core.engine_settings import EngineSettings
from flywheel.core.fleet import FleetSettings
from flywheel.core.judge_settings import (  # noqa: F401  (re-exported for callers of settings)
    DEFAULT_MODEL_NAME,
    HintJudgeSettings,
    JudgeSettings,
    RubricJudgeSettings,
)
from flywheel.core.rewards import VERIFIER_NAMES
from flywheel.core.section import Section
from flywheel.core.trainer_settings import TrainerSettings


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and `localhost` (local mode); False for any other host."""
    import ipaddress  # noqa: PLC0415

    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class StreamSettings(Section):
    """Redis stream names and delivery policy (docs/streams.md)."""

    prefix: str = "flywheel"
    """Prefix of every stream key; one prefix per deployment."""
    rollouts: str = "rollouts"
    """Gateway -> reward: finished episodes/turns."""
    scored: str = "scored"
    """Reward -> teacher."""
    train: str = "train"
    """Teacher (or reward, when the teacher is disabled) -> trainer."""
    dead: str = "dead"
    """Poison samples after `max_deliveries` failed deliveries, with the error."""
    max_deliveries: int = Field(5, ge=1)
    """Deliveries of one entry before it is moved to the dead-letter stream."""
    min_idle_ms: int = Field(60_000, ge=0)
    """Milliseconds an entry stays pending under a consumer before others reclaim it."""
    block_ms: int = Field(1_000, ge=0)
    """Milliseconds XREADGROUP blocks waiting for new entries."""
    high_water: int = Field(10_000, ge=1)
    """Stream lag (entries) above which producers apply backpressure."""
    retention: str = "7d"
    """How long a consumed entry is kept: entries acked by every consumer group of their
    stream and older than this are trimmed by each gateway's retention task (never one still
    pending or undelivered in any group; docs/streams.md "Retention and trimming"). Seconds
    ("3600") or a number with a unit s, m, h, d, w ("12h", "7d"); "0" = keep everything."""
    retention_check_s: float = Field(60.0, gt=0)
    """Seconds between retention passes."""

    @field_validator("retention", mode="before")
    @classmethod
    def _retention(cls, v: object) -> str:
        from flywheel.core.retention import parse_duration  # noqa: PLC0415

        try:
            parse_duration(v)  # type: ignore[arg-type]
        except ValueError as exc:
            raise ValueError(f"streams.retention: {exc}") from None
        return str(v)

    @property
    def retention_s(self) -> float:
        """`retention` in seconds (0 = off)."""
        from flywheel.core.retention import parse_duration  # noqa: PLC0415

        return parse_duration(self.retention)

    def key(self, name: str) -> str:
        """Full Redis key of stream `name` (e.g. `flywheel:rollouts`)."""
        return f"{self.prefix}:{getattr(self, name)}"


class RedisSettings(Section):
    url: str = ""
    """Redis URL; empty = `flywheel up` starts a local server and fills this in."""
    port: int = Field(6379, ge=1, le=65535)
    """Port for the local server started by `flywheel up` (next free port if busy)."""

    @field_validator("url")
    @classmethod
    def _password_outside_loopback(cls, value: str) -> str:
        from urllib.parse import urlsplit  # noqa: PLC0415

        parts = urlsplit(value)
        if value and parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(
                f"{value!r} is not a Redis URL: use redis://host:6379/0, "
                "rediss://... (TLS) or unix:///path/to/redis.sock"
            )
        host = parts.hostname or ""
        if value and parts.scheme != "unix" and not is_loopback(host) and not parts.password:
            raise ValueError(
                f"Redis at {host!r} is not on loopback, so its URL must carry a password "
                "(redis://:PASSWORD@host:6379/0 or rediss://...)"
            )
        return value


class SecuritySettings(Section):
    """Gateway API keys, roles and request limits (flywheel.gateway.access.security,
    docs/security.md).

    Default (`auth = "auto"`): keys are required when the gateway binds a non-loopback host, or
    as soon as any agent/admin key exists in the key store (`flywheel keys create`); a gateway on
    loopback with no keys serves everyone as a local admin and logs that loudly.
    """

    auth: Literal["auto", "on", "off"] = "auto"
    """API-key authentication: auto (see above), on (always), off (never; logged as an error
    when the gateway binds a non-loopback host)."""
    key_cache_s: float = Field(5.0, ge=0)
    """Seconds a verified key (and the "any key exists" check) is cached; a revoked key stops
    working within this time."""
    metrics_require_admin: bool = False
    """True = /metrics needs an admin key (false: scraped without a key, as Prometheus does)."""
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    """Largest request body in bytes; larger ones get 413."""
    max_json_depth: int = Field(32, ge=4)
    """Deepest nesting of arrays/objects in a JSON body (content parts, tool schemas)."""
    max_messages: int = Field(1024, ge=1)
    """Messages per chat request."""
    max_tools: int = Field(128, ge=0)
    """Tool definitions per chat request."""
    max_tools_bytes: int = Field(256 * 1024, ge=0)
    """Bytes of all tool definitions of one request, as compact JSON."""
    rate_per_minute: float = Field(0.0, ge=0)
    """Requests per minute per API key (token bucket in Redis, shared by every gateway
    replica); 0 = unlimited."""
    rate_burst: int = Field(20, ge=1)
    """Requests a key may send at once before the per-minute rate applies."""
    max_concurrent: int = Field(0, ge=0)
    """Requests in flight per API key, counted across every gateway replica (leased slots in
    Redis); 0 = unlimited."""
    concurrency_lease_s: float = Field(30.0, gt=0)
    """Seconds an in-flight slot lives without renewal (a running request renews it every third
    of that): how long a killed replica's slots keep counting against their keys."""
    request_timeout_s: float = Field(900.0, ge=0)
    """Seconds a whole request may take before 504; 0 = no limit (engine calls also have
    `gateway.request_timeout_s`)."""


class GatewaySettings(Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    engine_urls: list[str] = Field(default_factory=list)
    """Engines (or one SGLang router); empty = the local engine's URL."""
    tokenizer_path: str = ""
    """Tokenizer/chat-template folder; empty = the engine's model folder."""
    model_name: str = DEFAULT_MODEL_NAME
    """Model id reported by `/v1/models` and accepted in requests."""
    default_max_tokens: int = Field(256, ge=1)
    """Completion tokens when the request sets neither max_tokens nor max_completion_tokens
    (lowered to what the context window leaves after the prompt)."""
    request_timeout_s: float = Field(300.0, gt=0)
    """Seconds to wait for one engine call (past it: a 504 naming this setting). At most
    `gateway.security.request_timeout_s`, the whole-request limit (refused at start
    otherwise: raise both together)."""
    engine_health_interval_s: float = Field(2.0, ge=0)
    """Seconds between `/health` probes of an engine taken out after a failed call (it is put
    back once healthy); 0 = no probes."""
    redis_timeout_s: float = Field(5.0, gt=0)
    """Seconds the gateway waits for one Redis reply; a Redis that stops answering (hung, not
    down) fails the request with a 503 after this long. Not retried: a timed-out save may
    have run."""
    session_ttl_s: int = Field(86_400, ge=60)
    """Seconds an idle session lives in Redis."""
    prefix_cache_mb: float = Field(32.0, ge=0)
    """Megabytes a gateway keeps for the ids of recent prompt prefixes (cut after an end-of-turn
    token, with their text), so a fresh prompt that starts like an earlier one (the same system
    prompt and tools, or a conversation sent again without a session) tokenizes only the rest;
    0 = off. The ids are exactly the tokenizer's for the whole prompt."""
    record_cache_mb: float = Field(16.0, ge=0)
    """Megabytes of stored session-record JSON whose records a gateway keeps in memory after
    saving them (their Python objects take 1 to 7 times that), so a session's next turn on the
    same replica reads no record from Redis while the stored one is still that version; least
    recently saved dropped first, finished sessions not kept; 0 = off."""
    session_idle_finish_s: float = Field(3_600.0, gt=0)
    """Seconds after its last request that a gateway finishes an open session itself, so that
    nothing it holds is lost when its Redis key expires (`session_ttl_s`, which must be
    longer): a background sweep on every gateway replica (each session taken under its lock,
    so only one replica finishes it) publishes the live turns still waiting for their next
    state (with an empty `next_state`), the n > 1 choices never sent back and the episode's
    segments, as a finish without a reward would. Counted in
    `flywheel_gateway_sessions_finished_total{reason="idle"}` and logged; a later request to
    the session is a 409 (start a new session)."""
    stream_interval: int = Field(1, ge=1)
    """Sampled tokens per engine stream chunk of a chat answer streamed as sampled (SGLang's
    `stream_interval`): 1 sends every token as it comes; k sends deltas of k tokens and costs
    the gateway about 1/k of the CPU per streamed token (`bench/gateway_stream.py`)."""
    max_held_samples: int = Field(1024, ge=1)
    """Samples an episode session may set aside for its finish (segments closed by a fork,
    n > 1 choices not continued). A request that would set aside more is a 409
    `too_many_held_samples` before any generation (finish the session and start a new one);
    what the session holds stays as it is."""
    live_backpressure: Literal["refuse", "serve_unrecorded"] = "refuse"
    """What a live-session turn gets while the train stream is at its high-water mark and the
    turn would add Samples to it, decided before the engine is called: `refuse` = a 429 with
    Retry-After in the API's own error JSON (nothing generated); `serve_unrecorded` = answered
    but not recorded, counted in `flywheel_gateway_live_turns_unrecorded_total
    {reason="backpressure"}` and logged (docs/sessions.md "Backpressure")."""
    served_model_names: list[str] = Field(default_factory=list)
    """Model names a request may ask for, listed by `GET /v1/models`; another name is a 404
    `model_not_found`. Empty = any name is accepted (and `model_name` is listed)."""
    tool_parser: Literal["hermes", "json"] = "hermes"
    """How tool calls are parsed out of sampled text (the model family's format)."""
    session_headers: list[str] = Field(default_factory=list)
    """Request headers whose value names a request's live session when it has no
    `X-Session-Id` (the first present, in this order), so a harness's own conversation id
    header keys its session, e.g. ["x-conversation-id"]; empty = none (docs/sessions.md).
    Credential headers (authorization, x-api-key, cookie) are refused."""
    session_from_prompt_cache_key: bool = True
    """A Responses request's `prompt_cache_key` names its live session when no header does."""
    response_ttl_s: int = Field(86_400, ge=60)
    """Seconds a stored Responses response (`store`, for `previous_response_id`) is kept."""
    security: SecuritySettings = Field(default_factory=lambda: SecuritySettings())
    """API keys, roles and limits (`[gateway.security]`)."""

    @field_validator("session_headers")
    @classmethod
    def _session_headers(cls, v: list[str]) -> list[str]:
        for name in v:
            if not re.fullmatch(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+", name):
                raise ValueError(f"gateway.session_headers: {name!r} is not an HTTP header name")
            if name.lower() in ("authorization", "proxy-authorization", "x-api-key", "cookie"):
                raise ValueError(
                    f"gateway.session_headers: {name!r} carries a credential; a session id is "
                    "stored and logged in clear"
                )
        return [name.lower() for name in v]

    @model_validator(mode="after")
    def _idle_finish_before_expiry(self) -> GatewaySettings:
        if self.session_idle_finish_s >= self.session_ttl_s:
            raise ValueError(
                f"gateway.session_idle_finish_s ({self.session_idle_finish_s}) must be below "
                f"gateway.session_ttl_s ({self.session_ttl_s}): an idle session is finished "
                "(its turns published) before its Redis key expires"
            )
        return self

    @model_validator(mode="after")
    def _engine_call_within_request_limit(self) -> GatewaySettings:
        """A `request_timeout_s` the user set above the whole-request limit is refused (it
        would never take effect); the default engine timeout under a lower whole-request
        limit is fine: the whole-request limit ends the request first, as asked."""
        whole = self.security.request_timeout_s
        chosen = "request_timeout_s" in self.model_fields_set
        if chosen and whole and self.request_timeout_s > whole:
            raise ValueError(
                f"gateway.request_timeout_s ({self.request_timeout_s} s, one engine call) is "
                f"above gateway.security.request_timeout_s ({whole} s, the whole request), "
                "which would end the request first; raise gateway.security.request_timeout_s "
                f"to at least {self.request_timeout_s} (or 0 = no whole-request limit), or "
                "lower gateway.request_timeout_s"
            )
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class RewardSettings(Section):
    host: str = "127.0.0.1"
    port: int = Field(50051, ge=1, le=65535)
    """gRPC port."""
    metrics_port: int = Field(9101, ge=0, le=65535)
    """Prometheus /metrics port; 0 = disabled."""
    default_verifier: str = "last_integer"
    """Verifier used when a session's task metadata names none: a built-in one ("last_integer",
    "exact", "math", "numeric", "regex", "json_schema", "code_tests"), "none", or a reward
    registered by a module in `plugins` (checked when the reward service has imported them)."""
    plugins: list[str] = Field(default_factory=list)
    """Python modules of user-defined rewards (flywheel.core.rewards), imported by the reward
    service at start; each `@reward("name", inputs=..., range=...)` in them is a verifier
    selectable by name. A module that fails to import, or a refused registration, stops the
    service at start."""
    components: list[str] = Field(default_factory=list)
    """User-defined rewards (from `plugins`) run on every Sample as components of their own name
    in `Sample.rewards`, weighted by `weights[name]` (missing = 1.0); one that fails leaves the
    Sample unscored. A name no plugin registers stops the reward service at start."""
    consumer_name: str = ""
    """Consumer name in the group; empty = host-pid."""
    weights: dict[str, float] = Field(default_factory=dict)
    """Weight per reward component ("verifier", "outcome", "judge", "step", "rubric");
    missing = 1.0."""
    judge: JudgeSettings = Field(default_factory=lambda: JudgeSettings())
    """Next-state PRM judge on live turns (flywheel.reward.judge); disabled by default."""
    step_judge: JudgeSettings = Field(default_factory=lambda: JudgeSettings())
    """Per-turn PRM on episodes ("step/<k>" segment rewards, "step" = their mean); off."""
    rubric_judge: RubricJudgeSettings = Field(default_factory=lambda: RubricJudgeSettings())
    """Rubric outcome judge on the final reply of tasks with a "rubric"; off."""
    max_in_flight: int = Field(16, ge=1)
    """Samples the stream worker scores concurrently (one slow judge never blocks the rest)."""
    sample_timeout_s: float = Field(600.0, gt=0)
    """Seconds to score one Sample; past it the attempt fails and the entry is retried."""
    max_failures: int = Field(3, ge=1)
    """Failed scoring attempts (scorer exception or deadline) before an entry is dead-lettered."""
    max_batch: int = Field(256, ge=1)
    """Most Samples in one gRPC ScoreBatch request."""
    breaker_samples: int = Field(5, ge=0)
    """Consecutive samples unjudged for infrastructure (judge down) after which the stream
    worker stops taking new entries for `breaker_pause_s` (they wait in the stream instead of
    being forwarded unjudged), then probes with one; 0 = never pause."""
    breaker_pause_s: float = Field(10.0, gt=0)
    """Seconds the worker pauses new reads while the judge is down, doubled per failed probe up
    to 8x."""

    @model_validator(mode="after")
    def _known_verifier(self) -> RewardSettings:
        if self.default_verifier not in VERIFIER_NAMES and not self.plugins:
            raise ValueError(
                f"reward.default_verifier {self.default_verifier!r} is not a verifier: use one "
                f"of {', '.join(VERIFIER_NAMES)}, or name the module defining it in reward.plugins"
            )
        if self.components and not self.plugins:
            raise ValueError(
                f"reward.components {self.components} name user-defined rewards, but "
                "reward.plugins names no module to import them from"
            )
        return self


class TeacherSettings(Section):
    """On-policy distillation teacher (flywheel.teacher): `scored` stream -> `train` stream."""

    enabled: bool = False
    """On = the reward service writes `scored`, the teacher reads it and writes `train`;
    `flywheel up` starts the teacher (and its engine). Off = reward writes `train` directly."""
    host: str = "127.0.0.1"
    port: int = Field(50052, ge=1, le=65535)
    """gRPC port (TeacherService, health, reflection)."""
    metrics_port: int = Field(9102, ge=0, le=65535)
    """Prometheus /metrics port; 0 = disabled."""
    engine_urls: list[str] = Field(default_factory=list)
    """Teacher engines (SGLang protocol). Empty = the local stack's own teacher engine (or the
    policy engines when `self_teacher`). Keep them out of `trainer.push.engine_urls`: a teacher
    engine never receives the trainer's weight pushes unless it is a self-teacher."""
    self_teacher: bool = False
    """Score on the policy engines, so the teacher follows the policy's weights (on-policy
    self-distillation with privileged context). Off = a separate, frozen teacher engine."""
    model_path: str = ""
    """Model the local stack's teacher engine serves; empty = the engine's model, i.e. a frozen
    copy of the base policy that never receives weight pushes."""
    engine_port: int = Field(30100, ge=1, le=65535)
    """Port of the local stack's teacher engine (next free port if busy)."""
    model_name: str = ""
    """Recorded as `teacher_model` on each Sample; empty = the teacher model folder's name."""
    tokenizer_path: str = ""
    """The teacher's tokenizer and chat template; empty = `model_path`, else the engine's."""
    student_tokenizer_path: str = ""
    """The student's tokenizer, for the vocabulary check; empty = the gateway's tokenizer."""
    top_k: int = Field(0, ge=0, le=64)
    """Top-k teacher logprobs stored per token; 0 = none."""
    hint_placement: Literal["last_user", "system_note"] = "last_user"
    """Where the hint goes in the teacher context: appended to the last user message, or as a
    system note."""
    require_hint: bool = True
    """No valid hint -> no teacher logprobs (status "no_hint", counted). Off = such turns are
    scored under the unhinted context (plain OPD with an external teacher)."""
    hint_judge: HintJudgeSettings = Field(default_factory=lambda: HintJudgeSettings())
    """The hint judge; off = hints only from task metadata (`hint`, `privileged_context`)."""
    max_batch: int = Field(16, ge=1)
    """Scoring requests coalesced into one /generate call; 1 = one by one."""
    batch_wait_ms: float = Field(10.0, ge=0)
    """Milliseconds to wait for more scoring requests after the first of a batch."""
    max_concurrency: int = Field(2, ge=1)
    """/generate calls in flight per teacher engine."""
    concurrency: int = Field(8, ge=1)
    """Samples the stream stage processes at once."""
    timeout_s: float = Field(120.0, gt=0)
    """Seconds per teacher /generate call."""
    max_attempts: int = Field(3, ge=1)
    """Tries per /generate call on transport errors, 429 and 5xx."""
    consumer_name: str = ""
    """Consumer name in the `teacher` group; empty = host-pid."""


class SuperviseSettings(Section):
    """`[supervise]`: how `flywheel up` restarts a service of the local stack whose process
    exited (gateway, reward, teacher, trainer, engines; its own Redis always comes back)."""

    max_restarts: int = Field(3, ge=0)
    """Restarts of one service within `window_s`; one more exit stops the stack with the end
    of that service's log (0 = never restart: the first exit stops the stack)."""
    window_s: float = Field(600.0, gt=0)
    """Seconds over which `max_restarts` counts a service's restarts."""


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")  # logging's, uvicorn knows them


class FlywheelSettings(BaseSettings):
    """All settings of one deployment. Sections are read by the service they name."""

    model_config = SettingsConfigDict(
        env_prefix="FLYWHEEL_",
        env_nested_delimiter="__",
        extra="forbid",
    )

    redis: RedisSettings = Field(default_factory=RedisSettings)
    streams: StreamSettings = Field(default_factory=StreamSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    fleet: FleetSettings = Field(default_factory=FleetSettings)
    """Where the engine list comes from; shared in Redis by every gateway and the trainer."""
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    reward: RewardSettings = Field(default_factory=RewardSettings)
    teacher: TeacherSettings = Field(default_factory=TeacherSettings)
    trainer: TrainerSettings = Field(default_factory=TrainerSettings)
    supervise: SuperviseSettings = Field(default_factory=SuperviseSettings)
    """How `flywheel up` restarts a crashed service of the local stack."""
    log_level: str = "INFO"
    """DEBUG, INFO, WARNING, ERROR or CRITICAL, in any case (read as upper case)."""
    state_dir: str = ".flywheel"
    """Local state (Redis data, checkpoints, logs) of `flywheel up`."""

    @field_validator("log_level", mode="before")
    @classmethod
    def _known_log_level(cls, value: Any) -> str:
        if (level := str(value).strip().upper()) not in LOG_LEVELS:
            raise ValueError(f"not a log level; use one of {', '.join(LOG_LEVELS)}")
        return level

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (env_settings, init_settings)

    @model_validator(mode="after")
    def _teacher_engine_when_attached(self) -> FlywheelSettings:
        t = self.teacher
        attached = self.engine.backend == "external"
        if attached and t.enabled and not t.engine_urls and not t.self_teacher:
            raise ValueError(
                'engine.backend = "external" starts no engine, also none for the teacher: '
                "list its engines in teacher.engine_urls, or set teacher.self_teacher"
            )
        return self

    def redis_url(self) -> str:
        return self.redis.url or f"redis://127.0.0.1:{self.redis.port}/0"

    def engine_urls(self) -> list[str]:
        """The policy engines: `gateway.engine_urls`, else `engine.urls` (backend "external"),
        else the local engine's URL."""
        return self.gateway.engine_urls or self.engine.urls or [self.engine.url]

    def trainer_engine_urls(self) -> list[str]:
        return self.trainer.push.engine_urls or self.engine_urls()

    def next_stream_after_reward(self) -> str:
        return self.streams.key("scored" if self.teacher.enabled else "train")

    def dump(self) -> str:
        """Resolved settings as JSON with secrets masked (logged at start-up)."""
        return json.dumps(mask_secrets(self.model_dump(mode="json")), sort_keys=True)


def load_settings(
    config_file: str | os.PathLike[str] | None = None, **overrides: Any
) -> FlywheelSettings:
    """Parse settings from a config file (optional), then environment overrides.

    Args:
        config_file: YAML (`.yaml`/`.yml`), JSON (`.json`) or TOML file with one section per
            service; None = `$FLYWHEEL_CONFIG` if set.
        overrides: section dicts that take priority below the environment (used by tests).

    Raises:
        FileNotFoundError: the config file does not exist.
        ConfigFileError: the file is not valid YAML/JSON/TOML or not a mapping of sections, has
            a top-level key that is no setting, a `FLYWHEEL_<SECTION>__...` variable names no
            known section, or a `FLYWHEEL_<SECTION>_<FIELD>` variable (one underscore) names a
            setting.
        pydantic.ValidationError: a value is invalid or a key is unknown (its `loc` names the
            field; `describe_settings_error` formats it).
    """
    misspelled = single_underscore_settings(FlywheelSettings)
    if misspelled:
        raise ConfigFileError(
            "FLYWHEEL_ variables with one underscore after the section are not settings (a "
            f"misspelling would otherwise be ignored); rename or unset these:\n{misspelled}"
        )
    unknown = unknown_env_sections(FlywheelSettings)
    if unknown:
        raise ConfigFileError(
            "FLYWHEEL_<SECTION>__<FIELD> variables name no known settings section (a "
            f"misspelling would otherwise be ignored); fix or unset these:\n{unknown}"
        )
    not_read = unknown_env_variables(FlywheelSettings)
    if not_read:
        raise ConfigFileError(
            "FLYWHEEL_ variables that name no setting are not read (a misspelling would "
            f"otherwise be ignored); rename or unset these:\n{not_read}"
        )
    path = config_file or os.environ.get("FLYWHEEL_CONFIG") or None
    data: dict[str, Any] = {}
    if path:
        data = read_config_file(path)
        unknown_in_file = unknown_file_sections(FlywheelSettings, data, str(path))
        if unknown_in_file:
            raise ConfigFileError(unknown_in_file)
    for section, values in overrides.items():
        if isinstance(values, dict):
            data.setdefault(section, {}).update(values)
        else:
            data[section] = values
    return FlywheelSettings(**data)


def load_settings_or_exit(
    config_file: str | os.PathLike[str] | None = None, prog: str = "flywheel", **overrides: Any
) -> FlywheelSettings:
    """`load_settings` for a command or service entry point: a bad config file or setting ends
    the process with one message naming it and what to write instead (exit code 1), never a
    traceback.

    Raises:
        SystemExit: the settings cannot be loaded.
    """
    import sys  # noqa: PLC0415

    from pydantic import ValidationError  # noqa: PLC0415
    from pydantic_settings import SettingsError  # noqa: PLC0415

    from flywheel.core.config_files import (  # noqa: PLC0415
        describe_env_parse_error,
        describe_settings_error,
    )
    from flywheel.core.errors import ConfigurationError  # noqa: PLC0415

    try:
        return load_settings(config_file, **overrides)
    except FileNotFoundError as exc:
        sys.exit(
            f"{prog}: config file not found: {exc.filename}. Pass an existing TOML, YAML "
            "or JSON file."
        )
    except (ConfigFileError, ConfigurationError) as exc:
        sys.exit(f"{prog}: {exc}")
    except SettingsError as exc:  # an environment value of a list/dict setting that is not JSON
        culprits = describe_env_parse_error(FlywheelSettings)
        sys.exit(
            f"{prog}: cannot parse FLYWHEEL_<SECTION>__<FIELD> variables; fix these:\n{culprits}"
            if culprits
            else f"{prog}: {exc} ({exc.__cause__}); list, dict and section settings set in "
            "FLYWHEEL_<SECTION>__<FIELD> variables take JSON values, e.g. '[\"a\"]' or "
            "'{\"key\": 1.0}'."
        )
    except ValidationError as exc:
        lines = describe_settings_error(exc, FlywheelSettings, config_file)
        sys.exit(f"{prog}: invalid settings; fix these:\n{lines}")
