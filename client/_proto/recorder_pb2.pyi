from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    CODEC_RAW: _ClassVar[Codec]
    CODEC_ZSTD: _ClassVar[Codec]
    CODEC_ZSTD_U8: _ClassVar[Codec]
    CODEC_ZSTD_I8: _ClassVar[Codec]
    CODEC_ZSTD_U16: _ClassVar[Codec]
    CODEC_ZSTD_I16: _ClassVar[Codec]
    CODEC_ZSTD_U32: _ClassVar[Codec]
    CODEC_ZSTD_I32: _ClassVar[Codec]
CODEC_UNSPECIFIED: Codec
CODEC_RAW: Codec
CODEC_ZSTD: Codec
CODEC_ZSTD_U8: Codec
CODEC_ZSTD_I8: Codec
CODEC_ZSTD_U16: Codec
CODEC_ZSTD_I16: Codec
CODEC_ZSTD_U32: Codec
CODEC_ZSTD_I32: Codec

class ArrayData(_message.Message):
    __slots__ = ("dtype", "shape", "raw_size", "codec", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    RAW_SIZE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    raw_size: int
    codec: Codec
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., raw_size: _Optional[int] = ..., codec: _Optional[_Union[Codec, str]] = ..., data: _Optional[bytes] = ...) -> None: ...

class NamedArray(_message.Message):
    __slots__ = ("name", "array")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARRAY_FIELD_NUMBER: _ClassVar[int]
    name: str
    array: ArrayData
    def __init__(self, name: _Optional[str] = ..., array: _Optional[_Union[ArrayData, _Mapping]] = ...) -> None: ...

class SessionConfig(_message.Message):
    __slots__ = ("max_episodes", "record_states", "state_fields", "capture_config_json")
    MAX_EPISODES_FIELD_NUMBER: _ClassVar[int]
    RECORD_STATES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELDS_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    max_episodes: int
    record_states: bool
    state_fields: _containers.RepeatedScalarFieldContainer[str]
    capture_config_json: str
    def __init__(self, max_episodes: _Optional[int] = ..., record_states: _Optional[bool] = ..., state_fields: _Optional[_Iterable[str]] = ..., capture_config_json: _Optional[str] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("session", "config", "worker_id", "acked_sequence", "instance_id")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ACKED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    session: str
    config: SessionConfig
    worker_id: str
    acked_sequence: int
    instance_id: str
    def __init__(self, session: _Optional[str] = ..., config: _Optional[_Union[SessionConfig, _Mapping]] = ..., worker_id: _Optional[str] = ..., acked_sequence: _Optional[int] = ..., instance_id: _Optional[str] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("worker_index", "last_sequence", "status", "packed_codecs", "loss", "max_message_bytes", "max_chunk_env_steps", "max_chunk_bytes")
    WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PACKED_CODECS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_ENV_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    worker_index: int
    last_sequence: int
    status: StatusReply
    packed_codecs: bool
    loss: LossReport
    max_message_bytes: int
    max_chunk_env_steps: int
    max_chunk_bytes: int
    def __init__(self, worker_index: _Optional[int] = ..., last_sequence: _Optional[int] = ..., status: _Optional[_Union[StatusReply, _Mapping]] = ..., packed_codecs: _Optional[bool] = ..., loss: _Optional[_Union[LossReport, _Mapping]] = ..., max_message_bytes: _Optional[int] = ..., max_chunk_env_steps: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class LossReport(_message.Message):
    __slots__ = ("cause", "detail", "first_sequence", "last_sequence")
    class Cause(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        CAUSE_UNSPECIFIED: _ClassVar[LossReport.Cause]
        CAUSE_TORN_TAIL: _ClassVar[LossReport.Cause]
        CAUSE_CHECKPOINT_FALLBACK: _ClassVar[LossReport.Cause]
        CAUSE_DROP: _ClassVar[LossReport.Cause]
        CAUSE_UNSYNCED_TAIL: _ClassVar[LossReport.Cause]
    CAUSE_UNSPECIFIED: LossReport.Cause
    CAUSE_TORN_TAIL: LossReport.Cause
    CAUSE_CHECKPOINT_FALLBACK: LossReport.Cause
    CAUSE_DROP: LossReport.Cause
    CAUSE_UNSYNCED_TAIL: LossReport.Cause
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    cause: LossReport.Cause
    detail: str
    first_sequence: int
    last_sequence: int
    def __init__(self, cause: _Optional[_Union[LossReport.Cause, str]] = ..., detail: _Optional[str] = ..., first_sequence: _Optional[int] = ..., last_sequence: _Optional[int] = ...) -> None: ...

class RecordOpen(_message.Message):
    __slots__ = ("session", "worker_id", "instance_id")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    session: str
    worker_id: str
    instance_id: str
    def __init__(self, session: _Optional[str] = ..., worker_id: _Optional[str] = ..., instance_id: _Optional[str] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("sequence", "action", "reward", "done", "states", "outcome", "terminated", "truncated", "valid", "finals", "part_lengths", "cut_before", "fresh_start")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    TERMINATED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    VALID_FIELD_NUMBER: _ClassVar[int]
    FINALS_FIELD_NUMBER: _ClassVar[int]
    PART_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    CUT_BEFORE_FIELD_NUMBER: _ClassVar[int]
    FRESH_START_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    action: ArrayData
    reward: ArrayData
    done: ArrayData
    states: _containers.RepeatedCompositeFieldContainer[NamedArray]
    outcome: ArrayData
    terminated: ArrayData
    truncated: ArrayData
    valid: ArrayData
    finals: _containers.RepeatedCompositeFieldContainer[NamedArray]
    part_lengths: _containers.RepeatedScalarFieldContainer[int]
    cut_before: bool
    fresh_start: bool
    def __init__(self, sequence: _Optional[int] = ..., action: _Optional[_Union[ArrayData, _Mapping]] = ..., reward: _Optional[_Union[ArrayData, _Mapping]] = ..., done: _Optional[_Union[ArrayData, _Mapping]] = ..., states: _Optional[_Iterable[_Union[NamedArray, _Mapping]]] = ..., outcome: _Optional[_Union[ArrayData, _Mapping]] = ..., terminated: _Optional[_Union[ArrayData, _Mapping]] = ..., truncated: _Optional[_Union[ArrayData, _Mapping]] = ..., valid: _Optional[_Union[ArrayData, _Mapping]] = ..., finals: _Optional[_Iterable[_Union[NamedArray, _Mapping]]] = ..., part_lengths: _Optional[_Iterable[int]] = ..., cut_before: _Optional[bool] = ..., fresh_start: _Optional[bool] = ...) -> None: ...

class RecordRequest(_message.Message):
    __slots__ = ("open", "chunk")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    open: RecordOpen
    chunk: Chunk
    def __init__(self, open: _Optional[_Union[RecordOpen, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class RecordAck(_message.Message):
    __slots__ = ("sequence", "result", "error_code", "error_message", "is_full", "num_recorded_steps", "episodes_finished", "counters_version", "counted_through", "late_refusals")
    class Result(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        RESULT_UNSPECIFIED: _ClassVar[RecordAck.Result]
        STORED: _ClassVar[RecordAck.Result]
        DROPPED_FULL: _ClassVar[RecordAck.Result]
        DUPLICATE: _ClassVar[RecordAck.Result]
        REJECTED: _ClassVar[RecordAck.Result]
    RESULT_UNSPECIFIED: RecordAck.Result
    STORED: RecordAck.Result
    DROPPED_FULL: RecordAck.Result
    DUPLICATE: RecordAck.Result
    REJECTED: RecordAck.Result
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    IS_FULL_FIELD_NUMBER: _ClassVar[int]
    NUM_RECORDED_STEPS_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FINISHED_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_VERSION_FIELD_NUMBER: _ClassVar[int]
    COUNTED_THROUGH_FIELD_NUMBER: _ClassVar[int]
    LATE_REFUSALS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    result: RecordAck.Result
    error_code: str
    error_message: str
    is_full: bool
    num_recorded_steps: int
    episodes_finished: int
    counters_version: int
    counted_through: int
    late_refusals: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, sequence: _Optional[int] = ..., result: _Optional[_Union[RecordAck.Result, str]] = ..., error_code: _Optional[str] = ..., error_message: _Optional[str] = ..., is_full: _Optional[bool] = ..., num_recorded_steps: _Optional[int] = ..., episodes_finished: _Optional[int] = ..., counters_version: _Optional[int] = ..., counted_through: _Optional[int] = ..., late_refusals: _Optional[_Iterable[str]] = ...) -> None: ...

class FinishRequest(_message.Message):
    __slots__ = ("session", "pad_incomplete", "max_part_bytes", "chunk_frames", "include_partial")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PAD_INCOMPLETE_FIELD_NUMBER: _ClassVar[int]
    MAX_PART_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FRAMES_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_PARTIAL_FIELD_NUMBER: _ClassVar[int]
    session: str
    pad_incomplete: bool
    max_part_bytes: int
    chunk_frames: bool
    include_partial: bool
    def __init__(self, session: _Optional[str] = ..., pad_incomplete: _Optional[bool] = ..., max_part_bytes: _Optional[int] = ..., chunk_frames: _Optional[bool] = ..., include_partial: _Optional[bool] = ...) -> None: ...

class FieldSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class FinishHeader(_message.Message):
    __slots__ = ("num_episodes", "max_length", "fields", "lengths", "workers", "envs", "starts", "done", "worker_ids", "corrupt_chunks", "num_corrupt_chunks", "partial", "terminated", "truncated", "final_fields")
    NUM_EPISODES_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ENVS_FIELD_NUMBER: _ClassVar[int]
    STARTS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CORRUPT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    TERMINATED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELDS_FIELD_NUMBER: _ClassVar[int]
    num_episodes: int
    max_length: int
    fields: _containers.RepeatedCompositeFieldContainer[FieldSpec]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    workers: _containers.RepeatedScalarFieldContainer[int]
    envs: _containers.RepeatedScalarFieldContainer[int]
    starts: _containers.RepeatedScalarFieldContainer[int]
    done: _containers.RepeatedScalarFieldContainer[bool]
    worker_ids: _containers.RepeatedScalarFieldContainer[str]
    corrupt_chunks: _containers.RepeatedScalarFieldContainer[str]
    num_corrupt_chunks: int
    partial: _containers.RepeatedScalarFieldContainer[int]
    terminated: _containers.RepeatedScalarFieldContainer[bool]
    truncated: _containers.RepeatedScalarFieldContainer[bool]
    final_fields: _containers.RepeatedCompositeFieldContainer[FieldSpec]
    def __init__(self, num_episodes: _Optional[int] = ..., max_length: _Optional[int] = ..., fields: _Optional[_Iterable[_Union[FieldSpec, _Mapping]]] = ..., lengths: _Optional[_Iterable[int]] = ..., workers: _Optional[_Iterable[int]] = ..., envs: _Optional[_Iterable[int]] = ..., starts: _Optional[_Iterable[int]] = ..., done: _Optional[_Iterable[bool]] = ..., worker_ids: _Optional[_Iterable[str]] = ..., corrupt_chunks: _Optional[_Iterable[str]] = ..., num_corrupt_chunks: _Optional[int] = ..., partial: _Optional[_Iterable[int]] = ..., terminated: _Optional[_Iterable[bool]] = ..., truncated: _Optional[_Iterable[bool]] = ..., final_fields: _Optional[_Iterable[_Union[FieldSpec, _Mapping]]] = ...) -> None: ...

class ArrayPart(_message.Message):
    __slots__ = ("field", "row_start", "array", "row_count")
    FIELD_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    ARRAY_FIELD_NUMBER: _ClassVar[int]
    ROW_COUNT_FIELD_NUMBER: _ClassVar[int]
    field: int
    row_start: int
    array: ArrayData
    row_count: int
    def __init__(self, field: _Optional[int] = ..., row_start: _Optional[int] = ..., array: _Optional[_Union[ArrayData, _Mapping]] = ..., row_count: _Optional[int] = ...) -> None: ...

class ChunkFrames(_message.Message):
    __slots__ = ("worker", "t0", "length", "num_envs", "fields")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    T0_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_ENVS_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    worker: int
    t0: int
    length: int
    num_envs: int
    fields: _containers.RepeatedCompositeFieldContainer[ArrayData]
    def __init__(self, worker: _Optional[int] = ..., t0: _Optional[int] = ..., length: _Optional[int] = ..., num_envs: _Optional[int] = ..., fields: _Optional[_Iterable[_Union[ArrayData, _Mapping]]] = ...) -> None: ...

class FinishPart(_message.Message):
    __slots__ = ("header", "array", "chunk", "final")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    ARRAY_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    header: FinishHeader
    array: ArrayPart
    chunk: ChunkFrames
    final: ArrayPart
    def __init__(self, header: _Optional[_Union[FinishHeader, _Mapping]] = ..., array: _Optional[_Union[ArrayPart, _Mapping]] = ..., chunk: _Optional[_Union[ChunkFrames, _Mapping]] = ..., final: _Optional[_Union[ArrayPart, _Mapping]] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class ResetReply(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: StatusReply
    def __init__(self, status: _Optional[_Union[StatusReply, _Mapping]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("session", "counters_only")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_ONLY_FIELD_NUMBER: _ClassVar[int]
    session: str
    counters_only: bool
    def __init__(self, session: _Optional[str] = ..., counters_only: _Optional[bool] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "worker_index", "num_envs", "last_sequence", "chunks_stored", "chunks_dropped", "steps", "episodes_finished", "raw_bytes", "wire_bytes", "sequences_lost", "active", "idle_seconds", "joined_unix")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_ENVS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_STORED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FINISHED_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_LOST_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    JOINED_UNIX_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    worker_index: int
    num_envs: int
    last_sequence: int
    chunks_stored: int
    chunks_dropped: int
    steps: int
    episodes_finished: int
    raw_bytes: int
    wire_bytes: int
    sequences_lost: int
    active: bool
    idle_seconds: float
    joined_unix: float
    def __init__(self, worker_id: _Optional[str] = ..., worker_index: _Optional[int] = ..., num_envs: _Optional[int] = ..., last_sequence: _Optional[int] = ..., chunks_stored: _Optional[int] = ..., chunks_dropped: _Optional[int] = ..., steps: _Optional[int] = ..., episodes_finished: _Optional[int] = ..., raw_bytes: _Optional[int] = ..., wire_bytes: _Optional[int] = ..., sequences_lost: _Optional[int] = ..., active: _Optional[bool] = ..., idle_seconds: _Optional[float] = ..., joined_unix: _Optional[float] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("session", "config", "is_full", "num_recorded_steps", "episodes_finished", "chunks_stored", "chunks_dropped", "raw_bytes", "wire_bytes", "workers", "sequences_lost", "idle_seconds", "counters_version")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    IS_FULL_FIELD_NUMBER: _ClassVar[int]
    NUM_RECORDED_STEPS_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FINISHED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_STORED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_LOST_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_VERSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    config: SessionConfig
    is_full: bool
    num_recorded_steps: int
    episodes_finished: int
    chunks_stored: int
    chunks_dropped: int
    raw_bytes: int
    wire_bytes: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    sequences_lost: int
    idle_seconds: float
    counters_version: int
    def __init__(self, session: _Optional[str] = ..., config: _Optional[_Union[SessionConfig, _Mapping]] = ..., is_full: _Optional[bool] = ..., num_recorded_steps: _Optional[int] = ..., episodes_finished: _Optional[int] = ..., chunks_stored: _Optional[int] = ..., chunks_dropped: _Optional[int] = ..., raw_bytes: _Optional[int] = ..., wire_bytes: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., sequences_lost: _Optional[int] = ..., idle_seconds: _Optional[float] = ..., counters_version: _Optional[int] = ...) -> None: ...

class MetricsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MetricsReply(_message.Message):
    __slots__ = ("values", "sessions", "uptime_s")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    VALUES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    values: _containers.ScalarMap[str, float]
    sessions: _containers.RepeatedCompositeFieldContainer[StatusReply]
    uptime_s: float
    def __init__(self, values: _Optional[_Mapping[str, float]] = ..., sessions: _Optional[_Iterable[_Union[StatusReply, _Mapping]]] = ..., uptime_s: _Optional[float] = ...) -> None: ...

class SliceReference(_message.Message):
    __slots__ = ("trajectory_id", "step")
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: int
    step: int
    def __init__(self, trajectory_id: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class EpisodeArrays(_message.Message):
    __slots__ = ("actions", "rewards", "states")
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    actions: ArrayData
    rewards: ArrayData
    states: _containers.RepeatedCompositeFieldContainer[NamedArray]
    def __init__(self, actions: _Optional[_Union[ArrayData, _Mapping]] = ..., rewards: _Optional[_Union[ArrayData, _Mapping]] = ..., states: _Optional[_Iterable[_Union[NamedArray, _Mapping]]] = ...) -> None: ...

class SubmitEpisodeRequest(_message.Message):
    __slots__ = ("session", "episode", "episode_data", "step", "outcome", "start_reference")
    class EpisodeDataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SESSION_FIELD_NUMBER: _ClassVar[int]
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    EPISODE_DATA_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    START_REFERENCE_FIELD_NUMBER: _ClassVar[int]
    session: str
    episode: EpisodeArrays
    episode_data: _containers.ScalarMap[str, float]
    step: int
    outcome: int
    start_reference: SliceReference
    def __init__(self, session: _Optional[str] = ..., episode: _Optional[_Union[EpisodeArrays, _Mapping]] = ..., episode_data: _Optional[_Mapping[str, float]] = ..., step: _Optional[int] = ..., outcome: _Optional[int] = ..., start_reference: _Optional[_Union[SliceReference, _Mapping]] = ...) -> None: ...

class SubmitEpisodeReply(_message.Message):
    __slots__ = ("episodes_captured",)
    EPISODES_CAPTURED_FIELD_NUMBER: _ClassVar[int]
    episodes_captured: int
    def __init__(self, episodes_captured: _Optional[int] = ...) -> None: ...

class SampleStartRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class SampleStartReply(_message.Message):
    __slots__ = ("found", "reference", "prefix", "cell")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    CELL_FIELD_NUMBER: _ClassVar[int]
    found: bool
    reference: SliceReference
    prefix: EpisodeArrays
    cell: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, found: _Optional[bool] = ..., reference: _Optional[_Union[SliceReference, _Mapping]] = ..., prefix: _Optional[_Union[EpisodeArrays, _Mapping]] = ..., cell: _Optional[_Iterable[int]] = ...) -> None: ...

class SnapshotPotentialRequest(_message.Message):
    __slots__ = ("session", "utility_key", "field_names")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    UTILITY_KEY_FIELD_NUMBER: _ClassVar[int]
    FIELD_NAMES_FIELD_NUMBER: _ClassVar[int]
    session: str
    utility_key: str
    field_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session: _Optional[str] = ..., utility_key: _Optional[str] = ..., field_names: _Optional[_Iterable[str]] = ...) -> None: ...

class SnapshotPotentialReply(_message.Message):
    __slots__ = ("key_width", "keys", "values")
    KEY_WIDTH_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    key_width: int
    keys: _containers.RepeatedScalarFieldContainer[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, key_width: _Optional[int] = ..., keys: _Optional[_Iterable[int]] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class StoreCheckpointRequest(_message.Message):
    __slots__ = ("session", "compress", "checkpoint_step")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    session: str
    compress: bool
    checkpoint_step: int
    def __init__(self, session: _Optional[str] = ..., compress: _Optional[bool] = ..., checkpoint_step: _Optional[int] = ...) -> None: ...

class FilePart(_message.Message):
    __slots__ = ("session", "name", "size", "sha256", "data", "empty")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    EMPTY_FIELD_NUMBER: _ClassVar[int]
    session: str
    name: str
    size: int
    sha256: str
    data: bytes
    empty: bool
    def __init__(self, session: _Optional[str] = ..., name: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ..., data: _Optional[bytes] = ..., empty: _Optional[bool] = ...) -> None: ...

class LoadReply(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: StatusReply
    def __init__(self, status: _Optional[_Union[StatusReply, _Mapping]] = ...) -> None: ...

class RuntimeStateRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointReply(_message.Message):
    __slots__ = ("path", "wal_index")
    PATH_FIELD_NUMBER: _ClassVar[int]
    WAL_INDEX_FIELD_NUMBER: _ClassVar[int]
    path: str
    wal_index: int
    def __init__(self, path: _Optional[str] = ..., wal_index: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("session", "worker_id", "instance_id")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    session: str
    worker_id: str
    instance_id: str
    def __init__(self, session: _Optional[str] = ..., worker_id: _Optional[str] = ..., instance_id: _Optional[str] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionSummary(_message.Message):
    __slots__ = ("name", "workers", "episodes", "raw_bytes", "wire_bytes", "idle_seconds", "num_recorded_steps", "is_full")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_RECORDED_STEPS_FIELD_NUMBER: _ClassVar[int]
    IS_FULL_FIELD_NUMBER: _ClassVar[int]
    name: str
    workers: int
    episodes: int
    raw_bytes: int
    wire_bytes: int
    idle_seconds: float
    num_recorded_steps: int
    is_full: bool
    def __init__(self, name: _Optional[str] = ..., workers: _Optional[int] = ..., episodes: _Optional[int] = ..., raw_bytes: _Optional[int] = ..., wire_bytes: _Optional[int] = ..., idle_seconds: _Optional[float] = ..., num_recorded_steps: _Optional[int] = ..., is_full: _Optional[bool] = ...) -> None: ...

class ListSessionsReply(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionSummary]
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionSummary, _Mapping]]] = ...) -> None: ...

class DropSessionRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class DropSessionReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ArchiveRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class ArchiveReply(_message.Message):
    __slots__ = ("key_names", "utility_names", "columns")
    KEY_NAMES_FIELD_NUMBER: _ClassVar[int]
    UTILITY_NAMES_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    key_names: _containers.RepeatedScalarFieldContainer[str]
    utility_names: _containers.RepeatedScalarFieldContainer[str]
    columns: _containers.RepeatedCompositeFieldContainer[NamedArray]
    def __init__(self, key_names: _Optional[_Iterable[str]] = ..., utility_names: _Optional[_Iterable[str]] = ..., columns: _Optional[_Iterable[_Union[NamedArray, _Mapping]]] = ...) -> None: ...
