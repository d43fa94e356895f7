from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProtocolVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROTOCOL_VERSION_UNSPECIFIED: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_1: _ClassVar[ProtocolVersion]
PROTOCOL_VERSION_UNSPECIFIED: ProtocolVersion
PROTOCOL_VERSION_1: ProtocolVersion

class PodRef(_message.Message):
    __slots__ = ("namespace", "name", "uid")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    name: str
    uid: str
    def __init__(self, namespace: _Optional[str] = ..., name: _Optional[str] = ..., uid: _Optional[str] = ...) -> None: ...

class PreFilterRequest(_message.Message):
    __slots__ = ("version", "pod", "pod_json", "candidate_nodes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    POD_JSON_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_NODES_FIELD_NUMBER: _ClassVar[int]
    version: ProtocolVersion
    pod: PodRef
    pod_json: bytes
    candidate_nodes: int
    def __init__(self, version: _Optional[_Union[ProtocolVersion, str]] = ..., pod: _Optional[_Union[PodRef, _Mapping]] = ..., pod_json: _Optional[bytes] = ..., candidate_nodes: _Optional[int] = ...) -> None: ...

class PreFilterResponse(_message.Message):
    __slots__ = ("code", "message", "feasible_nodes", "scores", "infeasible_message", "decision_id", "feasible_total", "preemptible_nodes")
    class Code(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        CODE_UNSPECIFIED: _ClassVar[PreFilterResponse.Code]
        OK: _ClassVar[PreFilterResponse.Code]
        SKIP: _ClassVar[PreFilterResponse.Code]
        UNSCHEDULABLE: _ClassVar[PreFilterResponse.Code]
        INVALID: _ClassVar[PreFilterResponse.Code]
    CODE_UNSPECIFIED: PreFilterResponse.Code
    OK: PreFilterResponse.Code
    SKIP: PreFilterResponse.Code
    UNSCHEDULABLE: PreFilterResponse.Code
    INVALID: PreFilterResponse.Code
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FEASIBLE_NODES_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    INFEASIBLE_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    FEASIBLE_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIBLE_NODES_FIELD_NUMBER: _ClassVar[int]
    code: PreFilterResponse.Code
    message: str
    feasible_nodes: _containers.RepeatedScalarFieldContainer[str]
    scores: _containers.RepeatedScalarFieldContainer[int]
    infeasible_message: str
    decision_id: int
    feasible_total: int
    preemptible_nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, code: _Optional[_Union[PreFilterResponse.Code, str]] = ..., message: _Optional[str] = ..., feasible_nodes: _Optional[_Iterable[str]] = ..., scores: _Optional[_Iterable[int]] = ..., infeasible_message: _Optional[str] = ..., decision_id: _Optional[int] = ..., feasible_total: _Optional[int] = ..., preemptible_nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("version", "pod", "node", "decision_id", "hand_over", "trial")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    HAND_OVER_FIELD_NUMBER: _ClassVar[int]
    TRIAL_FIELD_NUMBER: _ClassVar[int]
    version: ProtocolVersion
    pod: PodRef
    node: str
    decision_id: int
    hand_over: bool
    trial: bool
    def __init__(self, version: _Optional[_Union[ProtocolVersion, str]] = ..., pod: _Optional[_Union[PodRef, _Mapping]] = ..., node: _Optional[str] = ..., decision_id: _Optional[int] = ..., hand_over: _Optional[bool] = ..., trial: _Optional[bool] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("annotations", "labels")
    class AnnotationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    annotations: _containers.ScalarMap[str, str]
    labels: _containers.ScalarMap[str, str]
    def __init__(self, annotations: _Optional[_Mapping[str, str]] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class UnreserveRequest(_message.Message):
    __slots__ = ("version", "pod", "node", "gang_released")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    GANG_RELEASED_FIELD_NUMBER: _ClassVar[int]
    version: ProtocolVersion
    pod: PodRef
    node: str
    gang_released: bool
    def __init__(self, version: _Optional[_Union[ProtocolVersion, str]] = ..., pod: _Optional[_Union[PodRef, _Mapping]] = ..., node: _Optional[str] = ..., gang_released: _Optional[bool] = ...) -> None: ...

class UnreserveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PreBindRequest(_message.Message):
    __slots__ = ("version", "pod", "node", "hand_over")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    HAND_OVER_FIELD_NUMBER: _ClassVar[int]
    version: ProtocolVersion
    pod: PodRef
    node: str
    hand_over: bool
    def __init__(self, version: _Optional[_Union[ProtocolVersion, str]] = ..., pod: _Optional[_Union[PodRef, _Mapping]] = ..., node: _Optional[str] = ..., hand_over: _Optional[bool] = ...) -> None: ...

class PreBindResponse(_message.Message):
    __slots__ = ("annotations", "labels")
    class AnnotationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    annotations: _containers.ScalarMap[str, str]
    labels: _containers.ScalarMap[str, str]
    def __init__(self, annotations: _Optional[_Mapping[str, str]] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CycleRequest(_message.Message):
    __slots__ = ("id", "pre_filter", "reserve", "trace_context", "before")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    PRE_FILTER_FIELD_NUMBER: _ClassVar[int]
    RESERVE_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    BEFORE_FIELD_NUMBER: _ClassVar[int]
    id: int
    pre_filter: PreFilterRequest
    reserve: ReserveRequest
    trace_context: _containers.ScalarMap[str, str]
    before: _containers.RepeatedCompositeFieldContainer[CycleRequest]
    def __init__(self, id: _Optional[int] = ..., pre_filter: _Optional[_Union[PreFilterRequest, _Mapping]] = ..., reserve: _Optional[_Union[ReserveRequest, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., before: _Optional[_Iterable[_Union[CycleRequest, _Mapping]]] = ...) -> None: ...

class CycleResponse(_message.Message):
    __slots__ = ("id", "code", "message", "pre_filter", "reserve", "before", "handles_before")
    ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PRE_FILTER_FIELD_NUMBER: _ClassVar[int]
    RESERVE_FIELD_NUMBER: _ClassVar[int]
    BEFORE_FIELD_NUMBER: _ClassVar[int]
    HANDLES_BEFORE_FIELD_NUMBER: _ClassVar[int]
    id: int
    code: int
    message: str
    pre_filter: PreFilterResponse
    reserve: ReserveResponse
    before: _containers.RepeatedCompositeFieldContainer[CycleResponse]
    handles_before: bool
    def __init__(self, id: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., pre_filter: _Optional[_Union[PreFilterResponse, _Mapping]] = ..., reserve: _Optional[_Union[ReserveResponse, _Mapping]] = ..., before: _Optional[_Iterable[_Union[CycleResponse, _Mapping]]] = ..., handles_before: _Optional[bool] = ...) -> None: ...

class ExplainRequest(_message.Message):
    __slots__ = ("version", "pod", "decision_id")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    version: ProtocolVersion
    pod: PodRef
    decision_id: int
    def __init__(self, version: _Optional[_Union[ProtocolVersion, str]] = ..., pod: _Optional[_Union[PodRef, _Mapping]] = ..., decision_id: _Optional[int] = ...) -> None: ...

class ExplainResponse(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...

class FilterWhatIfRequest(_message.Message):
    __slots__ = ("version", "pod", "decision_id", "pod_json", "node", "removed_pod_uids", "added_pods_json")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    DECISION_ID_FIELD_NUMBER: _ClassVar[int]
    POD_JSON_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    REMOVED_POD_UIDS_FIELD_NUMBER: _ClassVar[int]
    ADDED_PODS_JSON_FIELD_NUMBER: _ClassVar[int]
    version: ProtocolVersion
    pod: PodRef
    decision_id: int
    pod_json: bytes
    node: str
    removed_pod_uids: _containers.RepeatedScalarFieldContainer[str]
    added_pods_json: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, version: _Optional[_Union[ProtocolVersion, str]] = ..., pod: _Optional[_Union[PodRef, _Mapping]] = ..., decision_id: _Optional[int] = ..., pod_json: _Optional[bytes] = ..., node: _Optional[str] = ..., removed_pod_uids: _Optional[_Iterable[str]] = ..., added_pods_json: _Optional[_Iterable[bytes]] = ...) -> None: ...

class FilterWhatIfResponse(_message.Message):
    __slots__ = ("fits", "message")
    FITS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    fits: bool
    message: str
    def __init__(self, fits: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...
