"""Hypothesis over the protobuf messages themselves: for every RPC of kvrelay.v1.Router (read from the
service descriptor, so a new RPC or field is fuzzed without touching this file), requests whose every
field takes any value of its type (NaN and infinities, the whole integer ranges, unknown enum values,
any text, nested messages, one member of each oneof), sent over a socket to a real router on 127.0.0.1.
No call may end INTERNAL or UNKNOWN; a refusal is INVALID_ARGUMENT (or RESOURCE_EXHAUSTED) whose
details start with the field it is about."""

from __future__ import annotations

import re

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay.router import harmony
from kvrelay.v1 import router_pb2 as pb

from scripted_router import scripted_router_fixtures

SERVICE = pb.DESCRIPTOR.services_by_name["Router"]
METHODS = [m.name for m in SERVICE.methods]
EXAMPLES = 40
# "field: problem", "field[3].sub: problem": the field a refusal names comes first.
NAMED = re.compile(r"^[a-z_][a-z0-9_]*(\[\d+\])?(\.[a-z_][a-z0-9_]*(\[\d+\])?)*: ")

_SCALARS = {
    F.TYPE_INT32: st.integers(-2**31, 2**31 - 1), F.TYPE_SINT32: st.integers(-2**31, 2**31 - 1),
    F.TYPE_SFIXED32: st.integers(-2**31, 2**31 - 1), F.TYPE_INT64: st.integers(-2**63, 2**63 - 1),
    F.TYPE_SINT64: st.integers(-2**63, 2**63 - 1), F.TYPE_SFIXED64: st.integers(-2**63, 2**63 - 1),
    F.TYPE_UINT32: st.integers(0, 2**32 - 1), F.TYPE_FIXED32: st.integers(0, 2**32 - 1),
    F.TYPE_UINT64: st.integers(0, 2**64 - 1), F.TYPE_FIXED64: st.integers(0, 2**64 - 1),
    F.TYPE_BOOL: st.booleans(), F.TYPE_DOUBLE: st.floats(), F.TYPE_FLOAT: st.floats(width=32),
    F.TYPE_BYTES: st.binary(max_size=40),
    # Small ints too: token ids and counts in range exercise the paths past validation.
    F.TYPE_STRING: st.one_of(st.text(max_size=40), st.sampled_from(["user", "assistant", "final", "{}", ""])),
}


def _value(field, depth: int):
    if field.type == F.TYPE_MESSAGE:
        return message(field.message_type, depth + 1)
    if field.type == F.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), st.integers(-3, 100))
    base = _SCALARS[field.type]
    if field.type in (F.TYPE_UINT32, F.TYPE_UINT64, F.TYPE_INT32, F.TYPE_INT64):
        base = st.one_of(st.integers(0, 300), base)
    return base


def message(desc, depth: int = 0):
    """Any message of type `desc`: each field set or not; at most one member of each oneof."""
    cls = message_factory.GetMessageClass(desc)
    if depth > 3:
        return st.just(cls())
    plain, oneofs = {}, []
    for o in desc.oneofs:
        if not o.name.startswith("_"):  # proto3 `optional` fields are synthetic oneofs of one member
            oneofs.append(o)
    in_oneof = {f.name for o in oneofs for f in o.fields}
    for f in desc.fields:
        if f.name in in_oneof:
            continue
        v = _value(f, depth)
        plain[f.name] = st.lists(v, max_size=4) if f.is_repeated else v
    choices = [st.one_of(st.none(), st.sampled_from(list(o.fields)).flatmap(
        lambda f: st.tuples(st.just(f.name), _value(f, depth)))) for o in oneofs]
    return st.tuples(st.fixed_dictionaries({}, optional=plain), st.tuples(*choices)).map(
        lambda parts: cls(**parts[0], **dict(c for c in parts[1] if c is not None)))


REPLY = harmony.load_encoding().encode("<|channel|>final<|message|>fuzzed<|return|>", allowed_special="all")
engine, server = scripted_router_fixtures([REPLY], model_name="gpt-oss-fuzz", max_context=4096)


@pytest.mark.parametrize("name", METHODS)
def test_every_rpc_with_any_field_values(server, name) -> None:
    method = SERVICE.methods_by_name[name]
    response = message_factory.GetMessageClass(method.output_type)
    path = f"/{SERVICE.full_name}/{name}"
    outcomes: dict[str, int] = {}

    @given(req=message(method.input_type))
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(req) -> None:
        with grpc.insecure_channel(server.grpc_target) as ch:
            make = ch.unary_stream if method.server_streaming else ch.unary_unary
            call = make(path, request_serializer=lambda m: m.SerializeToString(),
                        response_deserializer=response.FromString)
            try:
                out = call(req, timeout=30)
                list(out) if method.server_streaming else out
                outcomes["OK"] = outcomes.get("OK", 0) + 1
            except grpc.RpcError as e:
                outcomes[e.code().name] = outcomes.get(e.code().name, 0) + 1
                assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), (
                    req, e.code(), e.details())
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    assert NAMED.match(e.details() or ""), (req, e.details())

    run()
    print(f"\n{name}: {outcomes}")
    # Some requests get past validation and are served. (A chat message has a dozen fields that must all
    # be plausible at once; test_fuzz_api.py drives served chats with mostly-valid mixes.)
    assert outcomes.get("OK") or name == "Chat", outcomes
