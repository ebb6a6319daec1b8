from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Message(_message.Message):
    __slots__ = ("role", "content_json", "extra_json")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_JSON_FIELD_NUMBER: _ClassVar[int]
    EXTRA_JSON_FIELD_NUMBER: _ClassVar[int]
    role: str
    content_json: str
    extra_json: str
    def __init__(self, role: _Optional[str] = ..., content_json: _Optional[str] = ..., extra_json: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "max_new_tokens", "stop", "has_seed", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    max_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    has_seed: bool
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., max_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ...) -> None: ...

class Vote(_message.Message):
    __slots__ = ("judge", "has_value", "value", "explanation")
    JUDGE_FIELD_NUMBER: _ClassVar[int]
    HAS_VALUE_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    EXPLANATION_FIELD_NUMBER: _ClassVar[int]
    judge: str
    has_value: bool
    value: float
    explanation: str
    def __init__(self, judge: _Optional[str] = ..., has_value: _Optional[bool] = ..., value: _Optional[float] = ..., explanation: _Optional[str] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("schema_version", "sample_id", "session_id", "turn_index", "group_id", "tenant", "created_at", "mode", "segment_index", "token_ids", "loss_mask", "rollout_logprobs", "weight_versions", "prompt_length", "sampling", "messages", "tools_json", "next_state", "task_json", "finish_reason", "rewards", "reward", "has_reward", "votes", "hint", "teacher_logprobs", "teacher_mask", "teacher_topk", "teacher_topk_ids", "teacher_topk_logprobs", "error", "teacher_model", "teacher_weight_version", "teacher_status", "wrong_hint", "wrong_hint_logprobs", "logprob_renormalized")
    class RewardsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_INDEX_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    NEXT_STATE_FIELD_NUMBER: _ClassVar[int]
    TASK_JSON_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    HAS_REWARD_FIELD_NUMBER: _ClassVar[int]
    VOTES_FIELD_NUMBER: _ClassVar[int]
    HINT_FIELD_NUMBER: _ClassVar[int]
    TEACHER_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEACHER_MASK_FIELD_NUMBER: _ClassVar[int]
    TEACHER_TOPK_FIELD_NUMBER: _ClassVar[int]
    TEACHER_TOPK_IDS_FIELD_NUMBER: _ClassVar[int]
    TEACHER_TOPK_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TEACHER_MODEL_FIELD_NUMBER: _ClassVar[int]
    TEACHER_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TEACHER_STATUS_FIELD_NUMBER: _ClassVar[int]
    WRONG_HINT_FIELD_NUMBER: _ClassVar[int]
    WRONG_HINT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_RENORMALIZED_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    sample_id: str
    session_id: str
    turn_index: int
    group_id: str
    tenant: str
    created_at: float
    mode: str
    segment_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    rollout_logprobs: _containers.RepeatedScalarFieldContainer[float]
    weight_versions: _containers.RepeatedScalarFieldContainer[int]
    prompt_length: int
    sampling: SamplingParams
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    tools_json: str
    next_state: Message
    task_json: str
    finish_reason: str
    rewards: _containers.ScalarMap[str, float]
    reward: float
    has_reward: bool
    votes: _containers.RepeatedCompositeFieldContainer[Vote]
    hint: str
    teacher_logprobs: _containers.RepeatedScalarFieldContainer[float]
    teacher_mask: _containers.RepeatedScalarFieldContainer[int]
    teacher_topk: int
    teacher_topk_ids: _containers.RepeatedScalarFieldContainer[int]
    teacher_topk_logprobs: _containers.RepeatedScalarFieldContainer[float]
    error: str
    teacher_model: str
    teacher_weight_version: str
    teacher_status: str
    wrong_hint: str
    wrong_hint_logprobs: _containers.RepeatedScalarFieldContainer[float]
    logprob_renormalized: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, schema_version: _Optional[int] = ..., sample_id: _Optional[str] = ..., session_id: _Optional[str] = ..., turn_index: _Optional[int] = ..., group_id: _Optional[str] = ..., tenant: _Optional[str] = ..., created_at: _Optional[float] = ..., mode: _Optional[str] = ..., segment_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., loss_mask: _Optional[_Iterable[int]] = ..., rollout_logprobs: _Optional[_Iterable[float]] = ..., weight_versions: _Optional[_Iterable[int]] = ..., prompt_length: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., tools_json: _Optional[str] = ..., next_state: _Optional[_Union[Message, _Mapping]] = ..., task_json: _Optional[str] = ..., finish_reason: _Optional[str] = ..., rewards: _Optional[_Mapping[str, float]] = ..., reward: _Optional[float] = ..., has_reward: _Optional[bool] = ..., votes: _Optional[_Iterable[_Union[Vote, _Mapping]]] = ..., hint: _Optional[str] = ..., teacher_logprobs: _Optional[_Iterable[float]] = ..., teacher_mask: _Optional[_Iterable[int]] = ..., teacher_topk: _Optional[int] = ..., teacher_topk_ids: _Optional[_Iterable[int]] = ..., teacher_topk_logprobs: _Optional[_Iterable[float]] = ..., error: _Optional[str] = ..., teacher_model: _Optional[str] = ..., teacher_weight_version: _Optional[str] = ..., teacher_status: _Optional[str] = ..., wrong_hint: _Optional[str] = ..., wrong_hint_logprobs: _Optional[_Iterable[float]] = ..., logprob_renormalized: _Optional[_Iterable[int]] = ...) -> None: ...
