"""Structured outputs on the engine side: a per-request state machine over harmony, masks, sampling.

A constrained request carries a `StructuredOutput` in its SamplingParams: which assistant messages may
follow the prompt's `<|start|>assistant` and what their bodies must match. The model's reply is
harmony (OpenAI's harmony response format, as openai-harmony renders it): zero or more analysis messages, then the constrained one:

    <|channel|>analysis<|message|> ...free... <|end|><|start|>assistant      (allowed when allow_analysis)
    <|channel|>final<|message|> {JSON matching the schema} <|return|>          (response_format)
    <|channel|>commentary to=functions.NAME <|constrain|>json<|message|> {args} <|call|>   (tool_choice)

`Constraint` follows one request's tokens: in a header only the tokens that continue one of the allowed
headers are allowed (the structure is fixed there), the analysis body is free but for the special tokens
that would break the structure (`<|end|>` closes it, or is forced once `max_reasoning_tokens` are spent),
a constrained body is masked by its grammar (engine/grammar.py) and may end only where the grammar
accepts, with the body's terminator. A Constraint is rebuilt anywhere from the tokens generated so far
(`open_constraint`), so the prefill worker (first token), a decode worker after the handoff, and a retry
all continue the same state.

`ConstraintBatch` fills the masks of a batch's constrained rows into one int32 bitmask; the decode step
submits it to its thread before the forward and collects it after, so the mask costs the step nothing
while the forward is longer. The job first feeds each constraint the tokens sampled since the last job
(the forward needs only the tokens, not the grammar state, and stopping reads only the token), so the
state machine is off the step's critical path too; on a GPU it writes into pinned buffers that reach
the device with a non-blocking copy. Greedy constrained batches also take the overlapped step path
(decode_worker/scheduler.py): forward N+1 is queued first (it consumes token N from the device), then
token N is read back, fed, the mask of N+1 filled while that forward runs, and the masked argmax queued
behind it. `sample_constrained` applies the bitmask on the logits' device and samples;
logprobs stay those of the model's distribution (the raw logits), as for every other request.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvrelay.engine import grammar
# what a request asks for is torch-free (the router builds it): engine/sampling_params.py
from kvrelay.engine.sampling_params import Body, StructuredOutput

log = logging.getLogger(__name__)

END = 200007  # <|end|>: closes an analysis message
FIRST_SPECIAL = grammar.FIRST_SPECIAL


class ConstraintError(RuntimeError):
    """Tokens that the constraint never allowed (a replayed history that does not fit it)."""


_HEADER, _FREE, _RESTART, _BODY, _DONE = range(5)
_ANALYSIS = -1  # option index of the analysis header


class Constraint:
    """One request's position in the harmony structure (see the module docstring)."""

    def __init__(self, spec: StructuredOutput) -> None:
        self.spec = spec
        self.state = _HEADER
        self.prefix: list[int] = []  # header tokens so far / restart tokens so far
        self.reasoning = 0  # analysis body tokens so far
        self.body: Body | None = None
        self.matcher = None
        self.broken = False  # the grammar engine failed: only the terminator is allowed from here

    # ---- the structure ---------------------------------------------------------------------
    def _options(self) -> list[tuple[tuple[int, ...], int]]:
        opts = [(b.header, i) for i, b in enumerate(self.spec.bodies)]
        if self.spec.allow_analysis and not self._budget_spent():
            opts.append((self.spec.analysis_header, _ANALYSIS))
        return opts

    def _budget_spent(self) -> bool:
        cap = self.spec.max_reasoning_tokens
        return cap is not None and self.reasoning >= cap

    def advance(self, token: int) -> None:
        """The request generated `token` (which the last mask allowed)."""
        if self.state == _HEADER:
            self.prefix.append(token)
            n = len(self.prefix)
            live = [(seq, i) for seq, i in self._options() if tuple(self.prefix) == seq[:n]]
            if not live:
                raise ConstraintError(f"token {token} does not continue any allowed header")
            done = [i for seq, i in live if len(seq) == n]
            if done:
                self._enter(done[0])
        elif self.state == _FREE:
            if token == END:
                self.state, self.prefix = _RESTART, []
            elif token >= FIRST_SPECIAL:
                raise ConstraintError(f"special token {token} inside an analysis message")
            else:
                self.reasoning += 1
        elif self.state == _RESTART:
            if token != self.spec.restart[len(self.prefix)]:
                raise ConstraintError(f"token {token} where {self.spec.restart[len(self.prefix)]} is forced")
            self.prefix.append(token)
            if len(self.prefix) == len(self.spec.restart):
                self.state, self.prefix = _HEADER, []
        elif self.state == _BODY:
            if token == self.body.end:
                self.state = _DONE
            elif not self.broken and not self.matcher.consume_token(token):
                raise ConstraintError(f"token {token} does not continue the JSON body: {self.matcher.get_error()}")
        else:
            raise ConstraintError(f"token {token} after the constrained message ended")

    def _enter(self, option: int) -> None:
        self.prefix = []
        if option == _ANALYSIS:
            self.state = _FREE
            return
        self.body = self.spec.bodies[option]
        self.state = _BODY
        try:
            self.matcher = grammar.matcher(self.body.schema)
        except grammar.SchemaError as exc:  # the router checked it; never expected here
            log.error("structured output: schema failed to compile on the worker: %s", exc)
            self.broken = True

    # ---- the mask --------------------------------------------------------------------------
    def mask_kind(self):
        """("allow", ids) | ("ban", ids) | ("grammar", matcher, end) for the next token."""
        if self.state == _HEADER:
            n = len(self.prefix)
            return "allow", sorted({seq[n] for seq, _ in self._options() if tuple(self.prefix) == seq[:n]})
        if self.state == _FREE:
            if self._budget_spent():
                return "allow", [END]
            return "ban", None  # every special token but <|end|>
        if self.state == _RESTART:
            return "allow", [self.spec.restart[len(self.prefix)]]
        if self.state == _BODY:
            if self.broken or self.matcher.is_error():
                return "allow", [self.body.end]
            return "grammar", self.matcher, self.body.end
        return "allow", [(self.body or self.spec.bodies[0]).end]

    def feed(self, token: int) -> None:
        """`advance` for a live request: a token the constraint cannot follow (never expected: the mask
        allowed it) ends the constrained message instead of failing the whole decode step."""
        try:
            self.advance(token)
        except ConstraintError as exc:
            log.error("structured output: %s; ending the message", exc)
            self.state = _DONE

    @property
    def done(self) -> bool:
        return self.state == _DONE


def open_constraint(spec: StructuredOutput, generated: Sequence[int] = ()) -> Constraint:
    """A Constraint at the position after `generated` (the request's tokens so far)."""
    c = Constraint(spec)
    for t in generated:
        c.advance(int(t))
    return c


def _bits(ids) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(list(ids), dtype=np.int64)
    return ids // 32, (np.uint32(1) << (ids % 32).astype(np.uint32))


def _free_row() -> np.ndarray:
    """All tokens allowed but the special ones (ids >= 199998) other than <|end|>; ids past the
    vocabulary in the last word stay clear."""
    row = np.zeros(grammar.MASK_WORDS, dtype=np.uint32)
    row[: FIRST_SPECIAL // 32] = 0xFFFFFFFF
    words, bits = _bits(range(FIRST_SPECIAL // 32 * 32, FIRST_SPECIAL))
    np.bitwise_or.at(row, words, bits)
    words, bits = _bits([END])
    row[words] |= bits
    return row


_FREE_ROW: np.ndarray | None = None


def compute_masks(constraints: Sequence[Constraint | None], out: torch.Tensor | None = None):
    """(rows, bitmask int32 [len(rows), MASK_WORDS] on the CPU) for the rows that have a constraint, or
    None. Bit t of a row allows token t (llguidance's layout). `out`: an int32 CPU tensor of at least
    len(rows) rows to fill (a pinned buffer); the bitmask returned is a view of it."""
    global _FREE_ROW
    rows = [i for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return None
    if out is None:
        mask = np.zeros((len(rows), grammar.MASK_WORDS), dtype=np.uint32)
    else:
        out = out[: len(rows)]
        mask = out.numpy().view(np.uint32)
        mask.fill(0)
    par, ends = [], []
    for k, i in enumerate(rows):
        kind = constraints[i].mask_kind()
        if kind[0] == "allow":
            words, bits = _bits(kind[1])
            np.bitwise_or.at(mask[k], words, bits)
        elif kind[0] == "ban":
            if _FREE_ROW is None:
                _FREE_ROW = _free_row()
            mask[k] = _FREE_ROW
        else:
            par.append((kind[1], k))
            ends.append((k, kind[2]))
    if par:
        grammar.executor().unsafe_compute_mask_ptr(par, mask.ctypes.data, grammar.MASK_WORDS * 4, len(rows))
        rw, rb = divmod(grammar.RETURN, 32)
        for k, end in ends:
            # The grammar's end-of-text is <|return|>; a tool call's body ends with <|call|> instead.
            if end != grammar.RETURN and mask[k, rw] >> np.uint32(rb) & np.uint32(1):
                mask[k, rw] &= ~np.uint32(1 << rb)
                ew, eb = divmod(end, 32)
                mask[k, ew] |= np.uint32(1 << eb)
            if not mask[k].any():  # nothing allowed (an engine error): end the message
                ew, eb = divmod(end, 32)
                mask[k, ew] |= np.uint32(1 << eb)
    return rows, (torch.from_numpy(mask.view(np.int32)) if out is None else out)


def masks_for(params: Sequence, histories: Sequence[Sequence[int]]):
    """Masks for a first-token sample (prefill, colocated prompt ends, the in-process engine): each
    structured request's constraint rebuilt from its tokens so far. None when no row is structured."""
    if all(p.structured is None for p in params):
        return None
    return compute_masks([open_constraint(p.structured, h) if p.structured is not None else None
                          for p, h in zip(params, histories)])


class ConstraintBatch:
    """Masks for the constrained rows of a decode batch, computed on one thread of its own. `pin`: fill
    pinned host buffers (a GPU runner), two used in turn: the copy of one may still be queued while the
    next job fills the other (each step reads its tokens back, after its copy, before the job after next)."""

    def __init__(self, pin: bool = False) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvrelay-grammar")
        self._pin = pin
        self._buffers: list[torch.Tensor] = []
        self._turn = 0

    compute = staticmethod(compute_masks)

    def submit(self, constraints: Sequence[Constraint | None],
               feeds: Sequence[Sequence[int]] = ()) -> "concurrent.futures.Future | None":
        """`compute` on the batch's thread (start it before the forward, `result()` after); `feeds[i]`:
        the tokens row i sampled since its last job, fed to its constraint first (the job's first half)."""
        if all(c is None for c in constraints):
            return None
        out = None
        if self._pin:
            n = sum(c is not None for c in constraints)
            if len(self._buffers) < 2 or self._buffers[0].shape[0] < n:
                self._buffers = [torch.empty((n, grammar.MASK_WORDS), dtype=torch.int32, pin_memory=True)
                                 for _ in range(2)]
            out, self._turn = self._buffers[self._turn], 1 - self._turn
        return self._pool.submit(self._job, list(constraints), [list(f) for f in feeds], out)

    def _job(self, constraints: list, feeds: list[list[int]], out):
        for c, tokens in zip(constraints, feeds):
            if c is not None:
                for t in tokens:
                    c.feed(t)
        return self.compute(constraints) if out is None else self.compute(constraints, out)

    def close(self) -> None:
        self._pool.shutdown(wait=False)


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def allowed_rows(mask: torch.Tensor, device: torch.device, vocab: int) -> torch.Tensor:
    """The bitmask [n, MASK_WORDS] as bool [n, vocab] on `device`: unpacked there on a GPU (1/32 of the
    bytes cross the bus), by numpy on the CPU (30x faster than torch's shifts there)."""
    if device.type == "cpu":
        bits = torch.from_numpy(np.unpackbits(mask.numpy().view(np.uint8), axis=1, bitorder="little")).bool()
    else:
        bits = unpack_on(mask, device)
    if bits.shape[1] < vocab:  # a wider model: ids past the tokenizer are never allowed
        bits = torch.nn.functional.pad(bits, (0, vocab - bits.shape[1]), value=False)
    return bits[:, :vocab]


def unpack_on(mask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The bitmask unpacked by shifts on `device` (the GPU path of `allowed_rows`)."""
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(8, dtype=torch.uint8, device=device)
    # Pinned (ConstraintBatch's buffers): queued behind the forward without blocking the host. A
    # pageable copy would wait for the stream, i.e. for the forward, before the host could go on.
    bm = mask.to(device, non_blocking=mask.is_pinned())
    # Bytes, not words: bit t of the little-endian words is bit t % 8 of byte t // 8, and the unpacked
    # intermediate is 1 byte a token instead of 4 (12.9 MB at batch 64 rather than 51 MB).
    return ((bm.view(torch.uint8).unsqueeze(-1) >> shifts) & 1).view(torch.bool).view(mask.shape[0], -1)


def apply_bitmask(logits: torch.Tensor, rows: Sequence[int], mask: torch.Tensor) -> torch.Tensor:
    """A copy of `logits` [B, V] with the disallowed tokens of `rows` at -inf; `mask` is the bitmask of
    those rows. A model narrower than the tokenizer (the tiny test model) uses the first V bits."""
    allowed = allowed_rows(mask, logits.device, logits.shape[-1])
    rows = list(rows)
    if rows == list(range(logits.shape[0])):  # every row constrained: one pass, no copy of the rest
        return torch.where(allowed, logits, float("-inf"))
    idx = torch.as_tensor(rows, device=logits.device)
    out = logits.clone()
    out[idx] = torch.where(allowed, logits[idx], float("-inf"))
    return out


def sample_constrained(sample_fn: Callable, logits: torch.Tensor, params, *args, masks=None):
    """`sample_fn(logits, params, *args)` (Runner.sample: steps, history, prompt tokens) with `masks`
    ((rows, bitmask) or None) applied; the logprob of a masked row is the model's (raw logits), as
    `sampling.sample` reports for the others."""
    if masks is None:
        return sample_fn(logits, params, *args)
    if logits.dim() == 1:
        logits = logits[None]
    rows, mask = masks
    out = list(sample_fn(apply_bitmask(logits.float(), rows, mask), params, *args))
    want = [b for b in rows if params[b].logprobs]
    if want:
        raw = torch.log_softmax(logits[want].float(), dim=-1)
        for k, b in enumerate(want):
            out[b] = (out[b][0], float(raw[k, out[b][0]]))
    return out
