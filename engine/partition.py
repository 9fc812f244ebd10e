"""Which rank of a TP/EP group holds which attention heads, KV heads, experts and vocabulary rows, and
whether a model can be split over a group at all: pure integer math, torch-free, so the topology check
(cluster/topology.py), the engine (engine/parallel.py, the attention layer, the KV cache) and the KV
handoff plan (transfer/sharding.py) ask the same functions and cannot disagree on a split.
"""

from __future__ import annotations

from dataclasses import dataclass


class ParallelConfigError(ValueError):
    """The model cannot be partitioned over the requested ranks (an uneven head/expert split)."""


def shard_range(total: int, rank: int, world: int, what: str = "items") -> tuple[int, int]:
    """The contiguous [start, stop) of `total` items that `rank` owns; `total` must split evenly, since
    an uneven split of heads or experts would leave ranks with different shapes (and different work)."""
    if world < 1 or not 0 <= rank < world:
        raise ParallelConfigError(f"rank {rank} is outside a group of {world}")
    if total % world:
        raise ParallelConfigError(f"{what}={total} is not divisible by {world} ranks")
    per = total // world
    return rank * per, (rank + 1) * per


def padded_range(total: int, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) with ceil(total/world) per rank, the last ranks short (possibly empty). Used for the
    vocabulary: a vocab size need not divide the rank count, and padding each shard to the same width is
    what lets the logits be all-gathered into one tensor."""
    per = -(-total // world)
    return min(rank * per, total), min((rank + 1) * per, total)


@dataclass(frozen=True)
class HeadRange:
    """The query heads [q0, q1) a rank computes and the KV heads [kv0, kv1) they attend over."""

    q0: int
    q1: int
    kv0: int
    kv1: int

    @property
    def num_q(self) -> int:
        return self.q1 - self.q0

    @property
    def num_kv(self) -> int:
        return self.kv1 - self.kv0


def head_range(num_q_heads: int, num_kv_heads: int, rank: int, world: int) -> HeadRange:
    """Query heads split evenly; each rank keeps the KV heads its query heads read. With more ranks than
    KV heads (TP8 over 4 KV heads, say) a KV head is replicated on the ranks sharing its GQA group, which
    works as long as no rank straddles two groups unevenly."""
    q0, q1 = shard_range(num_q_heads, rank, world, "num_attention_heads")
    if num_q_heads % num_kv_heads:
        raise ParallelConfigError(f"{num_q_heads} query heads do not form whole groups over {num_kv_heads} KV heads")
    group = num_q_heads // num_kv_heads
    if num_kv_heads % world and world % num_kv_heads:
        raise ParallelConfigError(f"num_key_value_heads={num_kv_heads} is not divisible by {world} ranks "
                                  f"(nor {world} by {num_kv_heads}, which would replicate KV heads)")
    kv0, kv1 = q0 // group, (q1 - 1) // group + 1
    return HeadRange(q0, q1, kv0, kv1)


def expert_range(num_experts: int, rank: int, world: int) -> tuple[int, int]:
    return shard_range(num_experts, rank, world, "num_experts")


def check_partition(cfg, world: int, *, expert_parallel: bool = True) -> None:
    """Raise ParallelConfigError (naming every problem) if `cfg` cannot run on `world` ranks. Called
    before any weight is read so a bad --tp fails in a second, not after loading."""
    problems = []
    for rank in range(world):
        try:
            head_range(cfg.num_attention_heads, cfg.num_key_value_heads, rank, world)
        except ParallelConfigError as e:
            problems.append(f"attention: {e}")
            break
    if expert_parallel and cfg.num_experts % world:
        problems.append(f"experts: num_experts={cfg.num_experts} is not divisible by {world} ranks "
                        f"(EP{world} needs a whole number of experts per rank)")
    if not expert_parallel and cfg.intermediate_size % world:
        problems.append(f"experts: intermediate_size={cfg.intermediate_size} is not divisible by {world} "
                        f"ranks (EP1 splits every expert's intermediate dimension)")
    if problems:
        raise ParallelConfigError(f"{cfg.name} cannot be sharded over {world} ranks: " + "; ".join(problems))


def valid_tp_sizes(cfg, *, expert_parallel: bool = True) -> tuple[int, ...]:
    """Every group size `cfg` can be sharded over (what an error suggests instead of a bad one)."""
    out = []
    for world in range(1, cfg.num_attention_heads + 1):
        try:
            check_partition(cfg, world, expert_parallel=expert_parallel)
        except ParallelConfigError:
            continue
        out.append(world)
    return tuple(out)
