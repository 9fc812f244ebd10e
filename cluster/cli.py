"""The `kvrelay` console command.

Each subcommand lives in the module that owns the feature and exposes two functions:
`add_arguments(parser)` and `run(args) -> int` (the exit status). Keeping them there, rather than here,
lets `kvrelay generate` stay next to the engine it drives and keeps this file a plain table.
Modules are imported lazily so `kvrelay config check` does not pay for torch or Ray.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

# (name, module, one-line help). A command is listed here only once it works end to end.
COMMANDS: list[tuple[str, str, str]] = [
    ("config", "kvrelay.cluster.config_cmd", "check a topology YAML and print the resolved topology"),
    ("convert", "kvrelay.engine.convert", "convert a gpt-oss checkpoint to kvrelay's fp8-block128 or bf16 layout"),
    ("generate", "kvrelay.engine.generate", "generate tokens from a prompt with the model in this process"),
    ("serve", "kvrelay.cluster.serve", "start Ray, the prefill/decode workers and the router for a topology"),
    ("status", "kvrelay.cluster.status", "show each worker of a running cluster: role, pid, node, health, KV pages"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvrelay",
        description="kvrelay: disaggregated prefill/decode serving for gpt-oss.",
    )
    parser.add_argument("--version", action="version", version=f"kvrelay {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module_name, help_text in COMMANDS:
        # Every option's default in its --help line, as vLLM's CLI shows them.
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=_Help)
        p.set_defaults(_module=module_name)
        importlib.import_module(module_name).add_arguments(p)
    return parser


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default where there is one to show (not None/False, not already in the text)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action)


def _version() -> str:
    """The installed distribution's version; a checkout linked without installing reads pyproject.toml."""
    from importlib import metadata
    from pathlib import Path

    try:
        return metadata.version("kvrelay")
    except metadata.PackageNotFoundError:
        import tomllib

        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        return tomllib.loads(pyproject.read_text())["project"]["version"] if pyproject.is_file() else "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    module = importlib.import_module(args._module)
    try:
        status = int(module.run(args) or 0)
        sys.stdout.flush()  # here, not in the interpreter's exit, where a closed pipe could not be handled
        return status
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        if not _stdout_closed():
            raise
        return 128 + signal.SIGPIPE


def _stdout_closed() -> bool:
    """Whether stdout's reader went away (`kvrelay config check X --json | head -1`). Then stdout points at
    /dev/null, so the interpreter's own flush at exit does not fail again, and the command exits quietly
    with the status of a tool killed by SIGPIPE, as `cat` would. (SIGPIPE itself stays ignored, as Python
    sets it: `kvrelay serve` and the Ray processes it starts write to sockets that may close.)"""
    import select

    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    poller = select.poll()
    poller.register(fd, 0)  # POLLERR is reported whatever the mask: a pipe's write end with no reader
    if not any(ev & select.POLLERR for _, ev in poller.poll(0)):
        return False
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
    return True


if __name__ == "__main__":
    sys.exit(main())
