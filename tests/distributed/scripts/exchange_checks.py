"""Point-to-point exchanges and duplicates of a Coordinator, as run by each rank; ``expected`` says what each sees.

Run under a launcher (``mpiexec -n N python exchange_checks.py mpi``, or N
processes with ``torch``), or in-process through ``run_checks`` with
``ThreadCoordinator`` ranks. Every buffer a rank receives is compared with the
bytes its sender made, and reported by its SHA-256, so that the three runs
are checked byte for byte against the same ``expected(rank, n)``.
:data:`~gpuckpt.distributed.coordinator.PIECE_BYTES` is set to
:data:`SMALL_PIECE` (by ``main``, or by the in-process test) so that a few MiB
travel in several pieces.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import sys
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _rank_io import finish, jsonable, make_coordinator, process_rank, run_rank

from gpuckpt.distributed import Coordinator, CoordinatorError, DistributedError
from gpuckpt.distributed import coordinator as coordinator_module

SMALL_PIECE = 1 << 20
BIG = 3 * SMALL_PIECE + 12345  # three whole pieces and a part of one
ROUNDS = 60  # rounds of the concurrent check, on each thread
#: many small buffers (as a tier's part has: documents, checksum trailers) between large ones and
#: an empty one, more small bytes in all than a piece (SMALL_PIECE)
MIXED_SIZES = [5, 70_000, 1, 65_535, 0, 65_536, 300, *([60_000] * 20), 2 * SMALL_PIECE + 7, 64]


def pattern(tag: str, src: int, dest: int, index: int, nbytes: int) -> bytes:
    """The bytes rank ``src`` sends to ``dest`` as its buffer ``index`` of exchange ``tag``."""
    seed = zlib.crc32(f"{tag}/{src}/{dest}/{index}/{nbytes}".encode())
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def digest(data: Any) -> str:
    return hashlib.sha256(memoryview(data).cast("B")).hexdigest()[:16]


def _received(tag: str, got: dict[int, list[Any]], dest: int) -> dict[int, list[str]]:
    """The digests of what ``dest`` received, after checking each buffer against its sender's bytes."""
    out = {}
    for src, bufs in got.items():
        for i, buf in enumerate(bufs):
            data = memoryview(buf).cast("B").tobytes()
            assert data == pattern(tag, src, dest, i, len(data)), f"{tag}: buffer {i} from {src} differs"
        out[src] = [digest(b) for b in bufs]
    return out


def _expected_received(tag: str, sizes: dict[int, list[int]], dest: int) -> dict[str, list[str]]:
    return {
        str(src): [digest(pattern(tag, src, dest, i, s)) for i, s in enumerate(ss)]
        for src, ss in sizes.items()
    }


def _error(call: Callable[[], Any]) -> str:
    """``"CoordinatorError: ..."`` if ``call`` raised it, else ``"no error"`` (other exceptions propagate)."""
    try:
        call()
    except CoordinatorError as exc:
        return f"CoordinatorError: {exc}"
    return "no error"


# what each check sends: rank -> sizes of the buffers it sends to each rank


def ring_sizes(src: int) -> list[int]:
    return [0, 1000 + src, 70_000]


def _ring(r: int, n: int) -> tuple[int, int]:
    return (r + 1) % n, (r - 1) % n


def _check_objects(c: Coordinator) -> dict[str, Any]:
    r, n = c.rank, c.world_size
    nxt, prev = _ring(r, n)
    last = n - 1
    seen: dict[str, Any] = {}
    sent = {"from": r, "to": nxt, "array": np.arange(r + 2), "list": [r] * r}
    got = c.exchange_objects({nxt: sent}, [prev])
    seen["ring"] = {
        "from": got[prev]["from"],
        "to": got[prev]["to"],
        "array": got[prev]["array"],
        "list": got[prev]["list"],
        "copied": got[prev] is not sent,
    }
    # a pickle larger than any default receive buffer (mpi4py's irecv takes 32 KiB)
    big = pattern("big-object", r, nxt, 0, 300_000)
    got = c.exchange_objects({nxt: big}, [prev])
    seen["big_object"] = {str(k): digest(v) for k, v in got.items()}
    seen["to_root"] = c.exchange_objects({0: ("to-root", r)}, range(n) if r == 0 else [])
    seen["from_last"] = c.exchange_objects(
        {d: {"from-last-to": d} for d in range(n)} if r == last else {}, [last]
    )
    evens = list(range(0, n, 2))
    if r % 2 == 0:
        i = evens.index(r)
        seen["evens_only"] = c.exchange_objects(
            {evens[(i + 1) % len(evens)]: f"even {r}"}, [evens[(i - 1) % len(evens)]]
        )
    else:
        seen["evens_only"] = c.exchange_objects({}, [])
    mine = {"self": [r, "x" * 10]}
    got = c.exchange_objects({r: mine}, [r])
    seen["self"] = {"value": got[r], "copied": got[r] is not mine}
    return seen


def _expected_objects(rank: int, n: int) -> dict[str, Any]:
    prev = (rank - 1) % n
    last = n - 1
    evens = list(range(0, n, 2))
    if rank % 2 == 0:
        i = evens.index(rank)
        src = evens[(i - 1) % len(evens)]
        evens_only = {str(src): f"even {src}"}
    else:
        evens_only = {}
    return {
        "ring": {
            "from": prev,
            "to": rank,
            "array": list(range(prev + 2)),
            "list": [prev] * prev,
            "copied": True,
        },
        "big_object": {str(prev): digest(pattern("big-object", prev, rank, 0, 300_000))},
        "to_root": {str(s): ["to-root", s] for s in range(n)} if rank == 0 else {},
        "from_last": {str(last): {"from-last-to": rank}},
        "evens_only": evens_only,
        "self": {"value": {"self": [rank, "x" * 10]}, "copied": True},
    }


def _send_buffers(tag: str, src: int, dest: int, sizes: list[int]) -> list[Any]:
    """The buffers ``src`` sends: of every kind a sender may pass (read-only bytes, bytearray, arrays)."""
    out: list[Any] = []
    for i, size in enumerate(sizes):
        data = pattern(tag, src, dest, i, size)
        kind = i % 3
        if kind == 0:
            out.append(data)  # read-only
        elif kind == 1:
            out.append(bytearray(data))
        elif size % 8 == 0:  # a 2-D float array: sent as its bytes, bit for bit
            out.append(np.frombuffer(data, np.float32).reshape(-1, 2).copy())
        else:
            out.append(np.frombuffer(data, np.uint8).copy())
    return out


def _recv_buffers(sizes: list[int]) -> list[Any]:
    return [np.full(s, 0xA5, np.uint8) if i % 2 else bytearray(s) for i, s in enumerate(sizes)]


def _exchange(c: Coordinator, tag: str, plan: dict[int, dict[int, list[int]]]) -> dict[int, list[str]]:
    """One exchange_buffers of ``plan`` (src -> dest -> sizes); return what this rank received, checked."""
    r = c.rank
    sends = {dest: _send_buffers(tag, r, dest, sizes) for dest, sizes in plan.get(r, {}).items()}
    recvs = {src: _recv_buffers(dests[r]) for src, dests in plan.items() if r in dests}
    c.exchange_buffers(sends, recvs)
    return _received(tag, recvs, r)


def _buffer_plans(n: int) -> dict[str, dict[int, dict[int, list[int]]]]:
    """Each check's buffers: src -> dest -> sizes."""
    last = n - 1
    evens = list(range(0, n, 2))
    return {
        "ring": {s: {(s + 1) % n: ring_sizes(s)} for s in range(n)},
        "to_root": {s: {0: [5000 + s, 12]} for s in range(n)},
        "from_last": {last: {d: [3000 + d] for d in range(n)}},
        "evens_only": {e: {evens[(i + 1) % len(evens)]: [777, 1]} for i, e in enumerate(evens)},
        "empty_lists": {s: {(s + 1) % n: []} for s in range(n)},
        "self": {s: {s: [4096, 0, 5]} for s in range(n)},
        "piece_edges": {s: {(s + 1) % n: [SMALL_PIECE, SMALL_PIECE + 1, SMALL_PIECE - 1]} for s in range(n)},
        "small_and_large": {s: {(s + 1) % n: MIXED_SIZES} for s in range(n)},
        "one_small_among_large": {s: {(s + 1) % n: [SMALL_PIECE + 5, 17, 2 * SMALL_PIECE]} for s in range(n)},
    }


def _check_buffers(c: Coordinator, workdir: Path) -> dict[str, Any]:
    r, n = c.rank, c.world_size
    nxt, prev = _ring(r, n)
    seen: dict[str, Any] = {"piece_bytes": coordinator_module.PIECE_BYTES}
    for name, plan in _buffer_plans(n).items():
        seen[name] = _exchange(c, name, plan)

    # larger than a piece, sent from read-only memory (a memoryview of an mmap of a file, bytes) and from
    # a bytearray; the mmap closes as soon as the call returned (no view of it outlives the call)
    path = workdir / f"big-{r}-of-{n}.bin"
    path.write_bytes(pattern("big", r, nxt, 0, BIG))
    sent = bytearray(pattern("big", r, nxt, 2, SMALL_PIECE + 3))
    targets = [np.empty(BIG, np.uint8), bytearray(2 * SMALL_PIECE + 1), bytearray(SMALL_PIECE + 3)]
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            c.exchange_buffers(
                {nxt: [view, pattern("big", r, nxt, 1, 2 * SMALL_PIECE + 1), sent]}, {prev: targets}
            )
        finally:
            view.release()
    seen["big"] = _received("big", {prev: targets}, r)
    # nor does a view of a bytearray, sent or received: one with a view could not be resized
    sent.extend(b"more")
    targets[1].extend(b"more")
    seen["bytearrays_released"] = len(sent) == SMALL_PIECE + 7 and len(targets[1]) == 2 * SMALL_PIECE + 5
    return seen


def _expected_buffers(rank: int, n: int) -> dict[str, Any]:
    prev = (rank - 1) % n
    out: dict[str, Any] = {"piece_bytes": SMALL_PIECE}
    for name, plan in _buffer_plans(n).items():
        out[name] = _expected_received(name, {s: d[rank] for s, d in plan.items() if rank in d}, rank)
    out["big"] = _expected_received("big", {prev: [BIG, 2 * SMALL_PIECE + 1, SMALL_PIECE + 3]}, rank)
    out["bytearrays_released"] = True
    return out


def _check_mismatches(c: Coordinator) -> dict[str, Any]:
    """Receive buffers of the wrong size or number: the receiver raises, nothing is written past them."""
    r, n = c.rank, c.world_size
    nxt, prev = _ring(r, n)
    seen: dict[str, Any] = {}
    short = bytearray(999)
    seen["smaller"] = _error(
        lambda: c.exchange_buffers({nxt: [pattern("m", r, nxt, 0, 1000)]}, {prev: [short]})
    )
    seen["smaller_untouched"] = bytes(short) == bytes(999)
    long = np.zeros(1001, np.uint8)
    seen["larger"] = _error(
        lambda: c.exchange_buffers({nxt: [pattern("m", r, nxt, 0, 1000)]}, {prev: [long]})
    )
    seen["larger_untouched"] = not long.any()
    one = bytearray(100)
    seen["fewer"] = _error(
        lambda: c.exchange_buffers(
            {nxt: [pattern("f", r, nxt, 0, 100), pattern("f", r, nxt, 1, 2 * SMALL_PIECE)]}, {prev: [one]}
        )
    )
    seen["fewer_first_received"] = bytes(one) == pattern("f", prev, r, 0, 100)
    seen["more"] = _error(lambda: c.exchange_buffers({nxt: [b"abc"]}, {prev: [bytearray(3), bytearray(4)]}))
    # one of three small buffers has a receive buffer of another size: the others are received,
    # that one is left untouched
    three = [bytearray(10), bytearray(19), bytearray(30)]
    seen["one_small_of_another_size"] = _error(
        lambda: c.exchange_buffers(
            {nxt: [pattern("p", r, nxt, i, size) for i, size in enumerate([10, 20, 30])]}, {prev: three}
        )
    )
    seen["small_others_received"] = [
        bytes(three[0]) == pattern("p", prev, r, 0, 10),
        bytes(three[1]) == bytes(19),
        bytes(three[2]) == pattern("p", prev, r, 2, 30),
    ]
    # only rank 0 gives a wrong size: it raises, the others return
    target = bytearray(10 if r == 0 else 11)
    seen["only_rank_0"] = _error(lambda: c.exchange_buffers({nxt: [b"x" * 11]}, {prev: [target]}))
    seen["after"] = _exchange(c, "after-mismatch", {s: {(s + 1) % n: [2048]} for s in range(n)})
    return seen


def _expected_mismatches(rank: int, n: int) -> dict[str, Any]:
    prev = (rank - 1) % n

    def size(sent: int, got: int) -> str:
        return (
            f"CoordinatorError: exchange_buffers: buffer 0 from rank {prev} to rank {rank} holds {sent} bytes, "
            f"its receive buffer {got}; {_CONTRACT}"
        )

    def count(sent: int, got: int) -> str:
        return (
            f"CoordinatorError: exchange_buffers: rank {prev} sent {sent} buffers to rank {rank}, which receives "
            f"{got} from it; {_CONTRACT}"
        )

    return {
        "smaller": size(1000, 999),
        "smaller_untouched": True,
        "larger": size(1000, 1001),
        "larger_untouched": True,
        "fewer": count(2, 1),
        "fewer_first_received": True,
        "more": count(1, 2),
        "one_small_of_another_size": (
            f"CoordinatorError: exchange_buffers: buffer 1 from rank {prev} to rank {rank} holds 20 bytes, "
            f"its receive buffer 19; {_CONTRACT}"
        ),
        "small_others_received": [True, True, True],
        "only_rank_0": size(11, 10) if rank == 0 else "no error",
        "after": _expected_received("after-mismatch", {prev: [2048]}, rank),
    }


_CONTRACT = (
    "every rank's sends must match its receivers' (same pairs, same number of buffers of the same sizes, "
    "in the same order)"
)


def _check_refusals(c: Coordinator) -> dict[str, Any]:
    """Bad arguments are refused on the calling rank before anything is sent (every rank here passes them)."""
    r, n = c.rank, c.world_size
    nxt, prev = _ring(r, n)
    calls: dict[str, Callable[[], Any]] = {
        "dest_too_large": lambda: c.exchange_objects({n: 1}, []),
        "dest_negative": lambda: c.exchange_objects({-1: 1}, []),
        "dest_bool": lambda: c.exchange_objects({True: 1}, []),
        "source_too_large": lambda: c.exchange_objects({}, [n]),
        "source_str": lambda: c.exchange_objects({}, ["0"]),
        "source_twice": lambda: c.exchange_objects({}, [prev, prev]),
        "self_send_unreceived": lambda: c.exchange_objects({r: 1}, []),
        "self_receive_unsent": lambda: c.exchange_objects({}, [r]),
        "sends_not_a_mapping": lambda: c.exchange_objects([1], []),
        "buffer_dest_too_large": lambda: c.exchange_buffers({n + 1: [b"x"]}, {}),
        "buffer_source_negative": lambda: c.exchange_buffers({}, {-1: [bytearray(1)]}),
        "buffer_source_float": lambda: c.exchange_buffers({}, {0.0: [bytearray(1)]}),
        "read_only_receive": lambda: c.exchange_buffers({nxt: [b"x"]}, {prev: [b"x"]}),
        "not_contiguous": lambda: c.exchange_buffers(
            {nxt: [np.zeros((4, 4))[:, ::2]]}, {prev: [bytearray(64)]}
        ),
        "not_a_buffer": lambda: c.exchange_buffers({nxt: ["text"]}, {prev: [bytearray(4)]}),
        "bare_buffer": lambda: c.exchange_buffers({nxt: b"x"}, {prev: [bytearray(1)]}),
        "self_buffer_unreceived": lambda: c.exchange_buffers({r: [b"x"]}, {}),
    }
    seen: dict[str, Any] = {
        name: _error(call).startswith("CoordinatorError: ") for name, call in calls.items()
    }
    seen["messages_name_rank"] = all(
        f"rank {bad!r} is not a rank of this group" in _error(call)
        for bad, call in (
            (n, calls["dest_too_large"]),
            (-1, calls["buffer_source_negative"]),
            ("0", calls["source_str"]),
        )
    )
    seen["after"] = c.all_gather(r)  # no rank sent anything: the group is still aligned
    return seen


def _expected_refusals(rank: int, n: int) -> dict[str, Any]:
    names = [
        "dest_too_large", "dest_negative", "dest_bool", "source_too_large", "source_str", "source_twice",
        "self_send_unreceived", "self_receive_unsent", "sends_not_a_mapping", "buffer_dest_too_large",
        "buffer_source_negative", "buffer_source_float", "read_only_receive", "not_contiguous", "not_a_buffer",
        "bare_buffer", "self_buffer_unreceived",
    ]  # fmt: skip
    return {**dict.fromkeys(names, True), "messages_name_rank": True, "after": list(range(n))}


def _check_duplicates(c: Coordinator) -> dict[str, Any]:
    """The k-th duplicate of every rank forms one group; the ranks are those of the original."""
    r = c.rank
    first, second = c.duplicate(), c.duplicate()
    seen: dict[str, Any] = {
        "same_class": type(first) is type(c) and type(second) is type(c),
        "ranks": [first.rank, first.world_size, second.rank, second.world_size],
    }
    # used in another order than made: a first duplicate paired with a second one would mix the two
    seen["second"] = second.all_gather(("second", r))
    seen["first"] = first.all_gather(("first", r))
    seen["original"] = c.all_gather(("original", r))
    seen["second_objects"] = second.exchange_objects(
        {(r + 1) % c.world_size: f"second {r}"}, [(r - 1) % c.world_size]
    )
    return seen


def _expected_duplicates(rank: int, n: int) -> dict[str, Any]:
    prev = (rank - 1) % n
    return {
        "same_class": True,
        "ranks": [rank, n, rank, n],
        "second": [["second", i] for i in range(n)],
        "first": [["first", i] for i in range(n)],
        "original": [["original", i] for i in range(n)],
        "second_objects": {str(prev): f"second {prev}"},
    }


def _check_concurrent(c: Coordinator) -> dict[str, Any]:
    """A duplicate used by a second thread for many collectives while this thread uses the original."""
    r, n = c.rank, c.world_size
    nxt, prev = _ring(r, n)
    background = c.duplicate()
    outcome: dict[str, Any] = {}

    def background_rounds() -> None:
        done = 0
        try:
            for i in range(ROUNDS):
                assert background.all_gather(("bg", i, r)) == [("bg", i, k) for k in range(n)]
                sizes = [1 + (i * 997 + r) % 50_000, (i % 3) * SMALL_PIECE // 2]
                sends = {nxt: [pattern("bg", r, nxt, i * 10 + k, s) for k, s in enumerate(sizes)]}
                prev_sizes = [1 + (i * 997 + prev) % 50_000, (i % 3) * SMALL_PIECE // 2]
                targets = [np.empty(s, np.uint8) for s in prev_sizes]
                background.exchange_buffers(sends, {prev: targets})
                for k, (t, s) in enumerate(zip(targets, prev_sizes, strict=True)):
                    assert t.tobytes() == pattern("bg", prev, r, i * 10 + k, s), (i, k)
                done += 1
        except BaseException as exc:
            outcome["background_error"] = f"{type(exc).__name__}: {exc}"
        outcome["background"] = done

    thread = threading.Thread(target=background_rounds, name=f"background-{r}")
    thread.start()
    done = 0
    try:
        for i in range(ROUNDS):
            assert c.all_gather(("fg", i, r)) == [("fg", i, k) for k in range(n)]
            got = c.exchange_objects({nxt: ("fg", i, r)}, [prev])
            assert got == {prev: ("fg", i, prev)}, got
            assert c.broadcast(("root", i) if r == i % n else None, root=i % n) == ("root", i)
            done += 1
    finally:
        thread.join()
    outcome["foreground"] = done
    outcome["after"] = [c.all_gather(r), background.all_gather(-r)]
    return outcome


def _expected_concurrent(rank: int, n: int) -> dict[str, Any]:
    return {"background": ROUNDS, "foreground": ROUNDS, "after": [list(range(n)), [-i for i in range(n)]]}


def run_checks(c: Coordinator, workdir: Path, *, duplicates: bool = True) -> dict[str, Any]:
    """Run every check on rank ``c.rank``; return what it saw (JSON-ready).

    ``duplicates=False`` leaves out the checks of :meth:`Coordinator.duplicate`
    (for a coordinator that has only the base class's exchanges).
    """
    seen: dict[str, Any] = {"rank": c.rank, "world_size": c.world_size}
    seen["objects"] = _check_objects(c)
    seen["buffers"] = _check_buffers(c, workdir)
    seen["mismatches"] = _check_mismatches(c)
    seen["refusals"] = _check_refusals(c)
    if duplicates:
        seen["duplicates"] = _check_duplicates(c)
        seen["concurrent"] = _check_concurrent(c)
    return jsonable(seen)


def expected(rank: int, n: int, *, duplicates: bool = True) -> dict[str, Any]:
    """What ``run_checks`` must return on ``rank`` of ``n``."""
    out: dict[str, Any] = {
        "rank": rank,
        "world_size": n,
        "objects": _expected_objects(rank, n),
        "buffers": _expected_buffers(rank, n),
        "mismatches": _expected_mismatches(rank, n),
        "refusals": _expected_refusals(rank, n),
    }
    if duplicates:
        out["duplicates"] = _expected_duplicates(rank, n)
        out["concurrent"] = _expected_concurrent(rank, n)
    return jsonable(out)


def check_thread_level_refusal(c: Coordinator) -> dict[str, Any]:
    """``duplicate()`` where one rank's MPI lacks MPI_THREAD_MULTIPLE: every rank refuses alike."""
    return {"refused": _error(c.duplicate), "after": c.all_gather(c.rank)}


def check_reversed_group() -> dict[str, Any]:
    """A duplicate of a torch group that lists the ranks in reverse keeps their order (so their numbers)."""
    import torch.distributed as dist

    from gpuckpt.distributed import TorchCoordinator

    n, me = dist.get_world_size(), dist.get_rank()
    c = TorchCoordinator(dist.new_group(ranks=list(range(n))[::-1], sort_ranks=False))
    d = c.duplicate()
    r = d.rank
    return jsonable(
        {
            "ranks": [c.rank, d.rank],
            "objects": d.exchange_objects({(r + 1) % n: ("from", r, me)}, [(r - 1) % n]),
            "gathered": d.all_gather(me),
        }
    )


def expected_reversed(global_rank: int, n: int) -> dict[str, Any]:
    r = n - 1 - global_rank
    prev = (r - 1) % n
    return {
        "ranks": [r, r],
        "objects": {str(prev): ["from", prev, n - 1 - prev]},
        "gathered": [n - 1 - k for k in range(n)],
    }


def _errors_reduced(c: Coordinator) -> dict[str, Any]:
    """``all_reduce_errors`` with no error anywhere, then with one on the last rank."""
    seen: dict[str, Any] = {}
    c.all_reduce_errors(None)
    seen["none"] = "no error"
    own = ValueError(f"rank {c.rank} failed") if c.rank == c.world_size - 1 else None
    try:
        c.all_reduce_errors(own)
        seen["last"] = "no error"
    except DistributedError as exc:
        seen["last"] = {
            "failures": {str(r): m for r, m in exc.failures.items()},
            "cause_is_own": exc.__cause__ is own,
        }
    return seen


def _expected_errors(n: int) -> dict[str, Any]:
    last = n - 1
    return {
        "none": "no error",
        "last": {"failures": {str(last): f"ValueError: rank {last} failed"}, "cause_is_own": True},
    }


def check_waits(c: Any) -> dict[str, Any]:
    """MPICoordinator's two kinds of waits (blocking ones, and tests or probes with sleeps where
    the node's ranks share cores), each over the ring and piece-edge exchanges of
    ``exchange_buffers``, the object exchanges and ``all_reduce_errors``, and the choice it
    made for this job."""
    from gpuckpt.distributed.mpi import shares_cores

    chosen = c._waits_idle
    seen: dict[str, Any] = {
        "chosen": chosen,
        "expected_choice": int(os.environ["MPI_LOCALNRANKS"]) > len(os.sched_getaffinity(0)),
        "agrees": shares_cores() == chosen,
    }
    plans = _buffer_plans(c.world_size)
    for idle in (False, True):
        c._waits_idle = idle
        seen[f"idle={idle}"] = {name: _exchange(c, name, plans[name]) for name in ("ring", "piece_edges")}
        seen[f"idle={idle}"]["objects"] = _check_objects(c)
        seen[f"idle={idle}"]["errors"] = _errors_reduced(c)
    c._waits_idle = chosen
    return seen


def expected_waits(rank: int, n: int) -> dict[str, Any]:
    plans = _buffer_plans(n)
    received = {
        name: _expected_received(name, {s: d[rank] for s, d in plans[name].items() if rank in d}, rank)
        for name in ("ring", "piece_edges")
    }
    received = {**received, "objects": _expected_objects(rank, n), "errors": _expected_errors(n)}
    return {"agrees": True, "idle=False": received, "idle=True": received}


def main(backend: str) -> None:
    coordinator_module.PIECE_BYTES = SMALL_PIECE
    if backend == "mpi-thread-level":  # rank 1 initialises MPI without MPI_THREAD_MULTIPLE
        import mpi4py

        if os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK")) == "1":
            mpi4py.rc.thread_level = "serialized"
    rank = process_rank(backend)

    def work() -> dict[str, Any]:
        if backend == "mpi-thread-level":
            return check_thread_level_refusal(make_coordinator("mpi"))
        if backend == "mpi-waits":
            return jsonable(check_waits(make_coordinator("mpi")))
        c = make_coordinator(backend)
        workdir = Path(os.environ["GPUCKPT_TEST_OUT"]) / f"work-{rank}"
        workdir.mkdir()
        seen = run_checks(c, workdir)
        if backend == "torch":
            seen["reversed"] = check_reversed_group()
        finish(backend)
        return seen

    run_rank(rank, work, backend)


if __name__ == "__main__":
    main(sys.argv[1])
