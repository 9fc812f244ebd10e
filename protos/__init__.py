"""The wire contract: `kvrelay/v1/*.proto` and their committed protoc output.

The generated `*_pb2.py`, `*_pb2_grpc.py` and `*.pyi` files are committed so that installing kvrelay
needs no protoc. `generate()` reproduces them; a test regenerates into a temporary folder and compares,
so an edited `.proto` without fresh stubs fails CI.
"""

from __future__ import annotations

from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
"""The `-I` root: files live at `kvrelay/v1/x.proto` so generated imports read `from kvrelay.v1 import`."""

PROTO_DIR = PROTO_ROOT / "kvrelay" / "v1"


def proto_files() -> list[Path]:
    """Every committed `.proto`, sorted so generation order (and any error) is deterministic."""
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_dir: Path | str | None = None, protos: list[Path] | None = None) -> list[Path]:
    """Run protoc (from grpcio-tools) on `protos` and return the files written.

    `out_dir=None` writes next to the sources, i.e. refreshes the committed stubs. grpcio-tools is a
    test/dev dependency, hence the import inside the function.
    """
    import subprocess
    import sys
    from importlib.util import find_spec

    out = Path(out_dir) if out_dir is not None else PROTO_ROOT
    out.mkdir(parents=True, exist_ok=True)
    sources = protos if protos is not None else proto_files()
    if not sources:
        raise FileNotFoundError(f"no .proto files under {PROTO_DIR}")
    # protoc's own include dir provides google/protobuf/*.proto for any well-known-type imports.
    spec = find_spec("grpc_tools")  # grpcio-tools; absent in a runtime-only install
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("generating stubs needs grpcio-tools (pip install 'kvrelay[test]')")
    wkt_include = Path(spec.origin).resolve().parent / "_proto"
    relative = [str(Path(p).resolve().relative_to(PROTO_ROOT)) for p in sources]
    # protoc runs in a child process: loading grpc_tools' bundled C++ protobuf into a process that already
    # holds torch and the upb protobuf runtime was seen to segfault.
    args = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{wkt_include}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--pyi_out={out}",
        *relative,
    ]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"protoc failed with exit code {done.returncode} for {relative}: {done.stderr.strip()}")
    written: list[Path] = []
    for rel in relative:
        stem = Path(rel).with_suffix("")
        for suffix in ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"):
            written.append(out / f"{stem}{suffix}")
    return written
