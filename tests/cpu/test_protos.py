"""The committed protoc output must be exactly what the committed .proto files generate."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrelay import protos

# The only line allowed to differ: it records the protobuf release of whoever generated the files.
_VERSION_HEADER = "# Protobuf Python Version:"


def _normalised(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if not line.startswith(_VERSION_HEADER)]


def test_proto_files_present() -> None:
    names = [p.name for p in protos.proto_files()]
    assert "router.proto" in names


@pytest.mark.parametrize("proto", protos.proto_files(), ids=lambda p: p.name)
def test_committed_stubs_match_fresh_generation(proto: Path, tmp_path: Path) -> None:
    written = protos.generate(tmp_path, [proto])
    assert len(written) == 3
    for fresh in written:
        committed = protos.PROTO_ROOT / fresh.relative_to(tmp_path)
        assert committed.is_file(), f"{committed} is missing; run kvrelay.protos.generate()"
        assert _normalised(committed) == _normalised(fresh), (
            f"{committed.name} is stale; regenerate with `python -c 'from kvrelay.protos import generate; generate()'`"
        )


def test_generated_router_service_surface() -> None:
    from kvrelay.v1 import router_pb2, router_pb2_grpc

    service = router_pb2.DESCRIPTOR.services_by_name["Router"]
    methods = {m.name: (m.client_streaming, m.server_streaming) for m in service.methods}
    assert methods == {
        "Generate": (False, True),
        "Chat": (False, True),
        "Health": (False, False),
        "ListModels": (False, False),
        "Tokenize": (False, False),
        "Detokenize": (False, False),
        "Version": (False, False),
    }
    assert hasattr(router_pb2_grpc, "RouterStub")
    # Optional sampling fields distinguish "unset" from an explicit 0 (greedy temperature).
    params = router_pb2.SamplingParams(temperature=0.0)
    assert params.HasField("temperature") and not params.HasField("top_p")

