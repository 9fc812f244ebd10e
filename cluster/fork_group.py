"""The first attempt of the n choices of one prompt (OpenAI's `n`): one prefill, its KV forked for n decodes.

`DisaggregatedEngineClient.fork_batches` gives one token stream per choice; each is an ordinary
`generate_batches` whose first attempt is `ForkGroup.stream(j)` instead of `_attempt`. The group's task
runs what the choices share, once: the reservation of all n on one decode worker (all or none), the
prefill, which samples every choice's first token from its one forward (workers/forks.py), and the
decode worker's `start_group`, which pulls the KV once (or adopts it in place, colocated) and forks it
into one sequence per choice that goes on. From then on each choice streams from its own queue of the
decode worker's channel, as a single request does; a choice that fails later (a worker died) is
re-prefilled on its own with its prompt + its tokens so far, by `generate_batches`' retry loop.

A choice whose consumer goes away (a stop string, a client disconnect) ends only itself: its decode row
is aborted and its reservation returned; when every choice has gone, the group's task is cancelled and
its cleanup frees what it holds (the prefill lease, the reservations, the forked sequences).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence

from kvrelay.engine.sampling_params import SamplingParams, TokenOutput, token_set
from kvrelay.router.engine_client import EngineUnavailable

async def _quietly(ref) -> None:
    """A cleanup call whose failure changes nothing (the worker may be gone; the request is ending)."""
    try:
        await ref
    except Exception:
        pass


class ForkGroup:
    def __init__(self, client,  # the DisaggregatedEngineClient (cluster/engine_client.py imports this module)
                 request_ids: list[str], prompt: list[int],
                 params: Sequence[SamplingParams]) -> None:
        if len(request_ids) != len(params) or len(set(request_ids)) != len(request_ids):
            raise ValueError("a fork group needs one distinct request id per choice's params")
        self.client = client
        self.ids = request_ids
        self.prompt = prompt
        self.params = list(params)
        n = len(request_ids)
        # Per choice, what the group's task hands it: (first token, metrics), then (decode worker, token
        # queue, pull metrics or None), or an exception (the choice retries alone or fails).
        self.feeds: list[asyncio.Queue] = [asyncio.Queue() for _ in range(n)]
        self.gone = [False] * n  # the choice's stream has ended (finished, failed, or its consumer left)
        self.handed = [False] * n  # decoding on its own: its stream cleans up after itself
        self.task: asyncio.Future | None = None
        self.settling = False  # the task is past its last wait on a worker: cleanup only, never cancelled

    def stream(self, j: int, acc) -> AsyncIterator[list[TokenOutput]]:
        """Choice j's first attempt; the group's task starts with the first choice that asks."""
        if self.task is None:
            self.task = asyncio.ensure_future(self._run())
        return self._choice(j, acc)

    async def _choice(self, j: int, acc) -> AsyncIterator[list[TokenOutput]]:
        c, rid = self.client, self.ids[j]
        decode = None
        finished = False
        try:
            item = await self.feeds[j].get()
            if isinstance(item, BaseException):
                raise item
            first, info = item
            acc.queue_s += info["queue_s"]
            acc.prefill_s += info["prefill_s"]
            acc.cached_tokens = info["cached_tokens"]
            acc.prefill_worker, acc.decode_worker = info["prefill_worker"], info["decode_worker"]
            finished = first.finish_reason is not None
            yield [first]
            if finished or rid in c._aborted:
                return
            item = await self.feeds[j].get()
            if isinstance(item, BaseException):
                raise item
            decode, queue, pull = item
            if pull is None:  # released during the pull (the group was aborted)
                return
            acc.kv_bytes += pull.kv_bytes
            acc.kv_transfer_s += pull.kv_transfer_s
            async with contextlib.aclosing(c._relay(queue, decode, rid)) as relayed:
                async for outs in relayed:
                    finished = outs[-1].finish_reason is not None
                    yield outs
        except c.Aborted:
            return
        finally:
            self.gone[j] = True
            if self.handed[j]:
                if c._active.get(rid, (None, None))[1] == rid:
                    c._active.pop(rid, None)
                ch = c._channels.get(decode.rank) if decode is not None else None
                if ch is not None:
                    ch.queues.pop(rid, None)
                if decode is not None and not decode.dead:
                    if not finished:
                        await _quietly(decode.actor.abort.remote(rid))
                    await _quietly(decode.actor.unreserve.remote(rid))
            if all(self.gone) and self.task is not None and not self.task.done() and not self.settling:
                self.task.cancel()  # nobody is left to decode for: its cleanup frees the rest

    async def _run(self) -> None:
        """What the choices share: reserve all on one decode worker, prefill once, start the forks."""
        from kvrelay.cluster.routing import block_hashes

        c, ids, prompt, params = self.client, self.ids, self.prompt, self.params
        n = len(ids)
        decode = prefill = None  # the client's _Worker entries, once picked
        handle = None
        channel = None
        try:
            hashes = block_hashes(prompt, c.prefix_index.page_size) if c.prefix_index is not None else ()
            t_q = time.perf_counter()
            decode = await c._reserve(ids[0], len(prompt), max(p.max_tokens for p in params), hashes,
                                      siblings=ids[1:])
            queue_s = time.perf_counter() - t_q
            prefill = c.prefill[decode.rank] if c.colocated else c._pick_prefill(hashes, len(prompt))
            prefill.queued_tokens += len(prompt)
            try:
                res = await c._prefill_once(prefill, ids[0], prompt, params[0], 0, tuple(params[1:]))
            finally:
                prefill.queued_tokens -= len(prompt)
            handle = res.handle
            firsts = [res.first, *res.forks]
            if len(firsts) != n:
                raise RuntimeError(f"request {ids[0]}: the prefill sampled {len(firsts)} first tokens for {n} choices")
            info = {"queue_s": queue_s + res.queue_s, "prefill_s": res.prefill_s, "cached_tokens": res.cached_tokens,
                    "prefill_worker": prefill.rank, "decode_worker": decode.rank}
            for j in range(n):
                self.feeds[j].put_nowait((firsts[j], info))
            live = [j for j in range(n) if firsts[j].finish_reason is None and ids[j] not in c._aborted]
            if not live:
                return
            if handle is None:  # its choices would wait for a decode start that never comes
                raise RuntimeError(f"request {ids[0]}: the prefill kept no KV, but {len(live)} choices go on")
            channel = c._channel(decode)
            for j in live:
                channel.queues[ids[j]] = asyncio.Queue()
            kids = tuple((ids[j], firsts[j].token_id, params[j]) for j in live)
            prompt_tokens = token_set(prompt) if any(p.needs_prompt_tokens for p in params) else ()
            pull = await c._start(decode, ids[0], handle, None, 1, params[0], prefill, channel.id, (), prompt_tokens,
                                  children=kids)
            if pull is not None:
                handle = None  # decode owns the lease now (it released it after the pull)
                c._record_pull(pull)
            for j in live:
                rid = ids[j]
                self.handed[j] = pull is not None and not self.gone[j]
                if self.handed[j]:
                    c._active[rid] = (decode, rid)
                    self.feeds[j].put_nowait((decode, channel.queues[rid], pull))
                    if rid in c._aborted:  # asked for while the group started: abort it now
                        await _quietly(decode.actor.abort.remote(rid))
                else:
                    self.feeds[j].put_nowait((decode, channel.queues[rid], None))
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            err = e if isinstance(e, Exception) else EngineUnavailable(f"request {ids[0]}: {e!r}")
            for j in range(n):
                if not self.gone[j]:
                    self.feeds[j].put_nowait(err)  # a _Retry: each choice re-prefills on its own
            if handle is not None and prefill is not None:
                await c._alive(prefill)  # the KV was never confirmed pulled: is its prefill worker gone?
        finally:
            self.settling = True
            # Whatever no choice took over goes back: the lease, and every reservation and sequence on
            # the decode side (abort and unreserve are idempotent there).
            if handle is not None and prefill is not None and not prefill.dead:
                await _quietly(prefill.actor.release.remote(handle.lease_id))
            if decode is not None and not decode.dead:
                for j, rid in enumerate(ids):
                    if not self.handed[j]:
                        if channel is not None:
                            channel.queues.pop(rid, None)
                        await _quietly(decode.actor.abort.remote(rid))
                        await _quietly(decode.actor.unreserve.remote(rid))
