from flywheel._proto import sample_pb2 as _sample_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreRequest(_message.Message):
    __slots__ = ("sample",)
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    sample: _sample_pb2.Sample
    def __init__(self, sample: _Optional[_Union[_sample_pb2.Sample, _Mapping]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("reward", "has_reward", "rewards", "votes", "error", "sample_id")
    class RewardsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    REWARD_FIELD_NUMBER: _ClassVar[int]
    HAS_REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    VOTES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    reward: float
    has_reward: bool
    rewards: _containers.ScalarMap[str, float]
    votes: _containers.RepeatedCompositeFieldContainer[_sample_pb2.Vote]
    error: str
    sample_id: str
    def __init__(self, reward: _Optional[float] = ..., has_reward: _Optional[bool] = ..., rewards: _Optional[_Mapping[str, float]] = ..., votes: _Optional[_Iterable[_Union[_sample_pb2.Vote, _Mapping]]] = ..., error: _Optional[str] = ..., sample_id: _Optional[str] = ...) -> None: ...

class ScoreBatchRequest(_message.Message):
    __slots__ = ("samples",)
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[_sample_pb2.Sample]
    def __init__(self, samples: _Optional[_Iterable[_Union[_sample_pb2.Sample, _Mapping]]] = ...) -> None: ...

class ScoreBatchResponse(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[ScoreResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[ScoreResponse, _Mapping]]] = ...) -> None: ...
