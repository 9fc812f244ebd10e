"""What a worker is told about its job: frozen per-role specs that cluster/ builds from the topology, so
a worker reads its own settings and nothing of the rest of the topology; and the limits a role checks.
"""

from __future__ import annotations


def check_prompt_limits(request_id: str, n: int, generated: int, max_prompt_tokens: int, max_context: int) -> None:
    """The prefill role's limits (a prefill worker's and a colocated worker's): a retried request may
    carry the tokens it already streamed on top of a full-size prompt."""
    if n == 0:
        raise ValueError(f"request {request_id}: empty prompt")
    if n > max_prompt_tokens + generated or n >= max_context:
        raise ValueError(f"request {request_id}: prompt of {n} tokens exceeds this worker's limit "
                         f"({max_prompt_tokens} prompt tokens, {max_context} context)")
