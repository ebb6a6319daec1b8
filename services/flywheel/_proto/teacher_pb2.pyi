from flywheel._proto import sample_pb2 as _sample_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreTokensRequest(_message.Message):
    __slots__ = ("messages", "tools_json", "context_ids", "response_ids", "hint", "top_k", "vocab_fingerprint")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    HINT_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_sample_pb2.Message]
    tools_json: str
    context_ids: _containers.RepeatedScalarFieldContainer[int]
    response_ids: _containers.RepeatedScalarFieldContainer[int]
    hint: str
    top_k: int
    vocab_fingerprint: str
    def __init__(self, messages: _Optional[_Iterable[_Union[_sample_pb2.Message, _Mapping]]] = ..., tools_json: _Optional[str] = ..., context_ids: _Optional[_Iterable[int]] = ..., response_ids: _Optional[_Iterable[int]] = ..., hint: _Optional[str] = ..., top_k: _Optional[int] = ..., vocab_fingerprint: _Optional[str] = ...) -> None: ...

class ScoreTokensResponse(_message.Message):
    __slots__ = ("logprobs", "top_k", "topk_ids", "topk_logprobs", "teacher_model", "teacher_weight_version", "prompt_tokens", "temperature")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOPK_IDS_FIELD_NUMBER: _ClassVar[int]
    TOPK_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEACHER_MODEL_FIELD_NUMBER: _ClassVar[int]
    TEACHER_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_k: int
    topk_ids: _containers.RepeatedScalarFieldContainer[int]
    topk_logprobs: _containers.RepeatedScalarFieldContainer[float]
    teacher_model: str
    teacher_weight_version: str
    prompt_tokens: int
    temperature: float
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., top_k: _Optional[int] = ..., topk_ids: _Optional[_Iterable[int]] = ..., topk_logprobs: _Optional[_Iterable[float]] = ..., teacher_model: _Optional[str] = ..., teacher_weight_version: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., temperature: _Optional[float] = ...) -> None: ...

class ExtractHintRequest(_message.Message):
    __slots__ = ("sample",)
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    sample: _sample_pb2.Sample
    def __init__(self, sample: _Optional[_Union[_sample_pb2.Sample, _Mapping]] = ...) -> None: ...

class ExtractHintResponse(_message.Message):
    __slots__ = ("hint", "has_hint", "votes", "status")
    HINT_FIELD_NUMBER: _ClassVar[int]
    HAS_HINT_FIELD_NUMBER: _ClassVar[int]
    VOTES_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    hint: str
    has_hint: bool
    votes: _containers.RepeatedCompositeFieldContainer[_sample_pb2.Vote]
    status: str
    def __init__(self, hint: _Optional[str] = ..., has_hint: _Optional[bool] = ..., votes: _Optional[_Iterable[_Union[_sample_pb2.Vote, _Mapping]]] = ..., status: _Optional[str] = ...) -> None: ...

class ScoreSampleRequest(_message.Message):
    __slots__ = ("sample",)
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    sample: _sample_pb2.Sample
    def __init__(self, sample: _Optional[_Union[_sample_pb2.Sample, _Mapping]] = ...) -> None: ...

class ScoreSampleResponse(_message.Message):
    __slots__ = ("sample",)
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    sample: _sample_pb2.Sample
    def __init__(self, sample: _Optional[_Union[_sample_pb2.Sample, _Mapping]] = ...) -> None: ...
