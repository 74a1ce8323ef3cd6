"""Local tiers as pure data: replica placement, the restore's choice, retention, the part record."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpuckpt
from gpuckpt.api import save_with_options
from gpuckpt.errors import InvalidOptionError, MetadataError
from gpuckpt.format.parts import PART_KEY, PartRecord, parse_part_name, part_name
from gpuckpt.options import SaveOptions
from gpuckpt.planning.tiers import CopySeen, choose, nodes_of, replica_holders, tier_retention
from gpuckpt.tiers import copy_values_back, layout_of, part_view, sharded_from_part
from gpuckpt.tiers.parts import LayoutMemo, layout_and_bytes, part_bytes

node_layouts = st.lists(st.integers(1, 4), min_size=2, max_size=5)  # ranks per node


def _names(sizes: list[int]) -> list[str]:
    return [f"n{k}" for k, size in enumerate(sizes) for _ in range(size)]


@given(node_layouts, st.integers(1, 3), st.randoms())
def test_replicas_go_to_other_nodes_one_per_node(sizes: list[int], replicas: int, rnd: Any) -> None:
    names = _names(sizes)
    rnd.shuffle(names)  # ranks of a node need not be contiguous
    if replicas + 1 > len(sizes):
        with pytest.raises(InvalidOptionError, match=f"replicas={replicas} needs {replicas + 1} nodes"):
            replica_holders(0, names, replicas)
        return
    for rank in range(len(names)):
        holders = replica_holders(rank, names, replicas)
        nodes = [names[h] for h in holders]
        assert len(holders) == replicas and names[rank] not in nodes and len(set(nodes)) == replicas


def test_replicas_pair_local_indexes_across_nodes() -> None:
    names = ["a", "a", "b", "b"]
    assert [replica_holders(r, names, 1) for r in range(4)] == [[2], [3], [0], [1]]
    assert nodes_of(["b", "a", "b", "a"]) == [[0, 2], [1, 3]]


def _copies(
    step: int, save_id: str, ranks: list[int], holders: dict[int, list[int]], n: int = 4
) -> list[CopySeen]:
    return [CopySeen(step, save_id, r, n, f"L{r}", h) for r in ranks for h in holders.get(r, [r])]


NAMES = ["n0", "n0", "n1", "n1"]
LAYOUTS = [f"L{r}" for r in range(4)]


def test_the_newest_complete_step_is_chosen_with_local_copies_first() -> None:
    copies = _copies(4, "a", [0, 1, 2, 3], {}) + _copies(5, "a", [0, 1, 2], {})  # 5 lacks rank 3
    choice = choose(copies, LAYOUTS, NAMES, None)
    assert (choice.source, choice.step, choice.save_id) == ("tiers", 4, "a")
    assert choice.senders == {0: 0, 1: 1, 2: 2, 3: 3}


def test_a_part_missing_on_its_node_comes_from_a_holder() -> None:
    copies = _copies(5, "a", [0, 1], {}) + _copies(5, "a", [2, 3], {2: [0, 1], 3: [0, 1]})
    choice = choose(copies, LAYOUTS, NAMES, 4)
    assert choice.step == 5 and choice.senders == {0: 0, 1: 1, 2: 0, 3: 1}


def test_the_root_wins_when_newer_and_nothing_is_none() -> None:
    assert choose(_copies(4, "a", [0, 1, 2, 3], {}), LAYOUTS, NAMES, 6).source == "root"
    assert choose([], LAYOUTS, NAMES, None).source == "none"
    # another world size or layout makes a part unusable
    other = [CopySeen(5, "a", r, 3, f"L{r}", r) for r in range(3)]
    assert choose(other, LAYOUTS, NAMES, 2).source == "root"
    assert choose(_copies(5, "a", [0, 1, 2, 3], {}), ["x"] * 4, NAMES, None).source == "none"


@settings(max_examples=200)
@given(st.lists(st.tuples(st.integers(0, 6), st.sampled_from("ab"), st.integers(0, 3), st.integers(0, 3))))
def test_the_choice_never_mixes_saves(seen: list[tuple[int, str, int, int]]) -> None:
    copies = [CopySeen(s, sid, r, 4, f"L{r}", h) for s, sid, r, h in seen]
    choice = choose(copies, LAYOUTS, NAMES, None)
    if choice.source != "tiers":
        return
    assert choice.step not in choice.ambiguous
    for r, h in choice.senders.items():  # every rank's copy is of the chosen save, held by its sender
        assert any(
            c.step == choice.step and c.save_id == choice.save_id and c.rank == r and c.holder == h
            for c in copies
        )
    assert sorted(choice.senders) == [0, 1, 2, 3]


def test_a_step_complete_under_two_saves_is_never_taken() -> None:
    copies = (
        _copies(5, "a", [0, 1, 2, 3], {})
        + _copies(5, "b", [0, 1, 2, 3], {})
        + _copies(4, "a", [0, 1, 2, 3], {})
    )
    choice = choose(copies, LAYOUTS, NAMES, None)
    assert choice.step == 4 and choice.ambiguous == (5,)


def test_retention_keeps_the_newest_and_the_pinned_and_never_a_later_step() -> None:
    assert tier_retention([1, 2, 3, 4], 2, 4) == [1, 2]
    # a step being drained is held besides the newest ones, not in the place of one of them
    assert tier_retention([1, 2, 3, 4], 2, 4, pinned=[2]) == [1]
    assert tier_retention([2, 8, 9], 2, 10, pinned=[2, 10]) == []  # (10 about to be written)
    assert tier_retention([2, 8, 9, 10], 2, 10, pinned=[2, 10]) == [8]
    assert tier_retention([1, 2, 3, 4], 1, 4, pinned=[4]) == [1, 2, 3]
    assert tier_retention([1, 2, 3, 4, 5, 6], 2, 3) == [1]  # 4..6 were written after 3: not counted


def test_part_names_and_records_round_trip_and_malformed_records_are_refused() -> None:
    assert parse_part_name(part_name(120, 3)) == (120, 3)
    assert parse_part_name("step_00000120") is None and parse_part_name("step_x.rank_1") is None
    # only the canonical name: a restore opens parts by part_name, so no other spelling counts
    assert parse_part_name(part_name(10**9, 1 << 20)) == (10**9, 1 << 20)
    for odd in (
        "step_120.rank_00003",
        "step_00000120.rank_3",
        "step_000000120.rank_00003",
        "step_+0000120.rank_00003",
    ):
        assert parse_part_name(odd) is None, odd
    rec = PartRecord(120, "id", 3, 4, "n1", "L", {"w": (((0, 2), (4, 6)),)})
    assert PartRecord.from_planner_data({PART_KEY: rec.to_json()}) == rec
    assert PartRecord.from_planner_data({"structure": {}}) is None
    for bad in (
        {**rec.to_json(), "rank": 4},
        {**rec.to_json(), "step": -1},
        {**rec.to_json(), "boxes": {"w": [[[0], [4, 6]]]}},
        {**rec.to_json(), "format": 2},
    ):
        with pytest.raises(MetadataError, match=PART_KEY):
            PartRecord.from_planner_data({PART_KEY: bad})


def test_a_part_record_is_read_from_the_root_document_alone(tmp_path: Any) -> None:
    """What a restore's inventory reads of each part: the record, from the root document with
    its checksum checked, the same as from the whole metadata; a damaged document is refused."""
    rec = PartRecord(7, "abc", 0, 2, "n0", "L", {"w": (((0, 0), (4, 3)),)})
    path = tmp_path / part_name(7, 0)
    options = SaveOptions(planner_extra={PART_KEY: rec.to_json()})
    save_with_options({"w": np.ones((2, 3), np.float32)}, path, options)
    root = path / "zarr.json"
    raw = root.read_bytes()
    assert PartRecord.from_root_document(raw, str(root)) == rec
    assert PartRecord.from_planner_data(gpuckpt.read_metadata(path).planner_data) == rec
    plain = tmp_path / "plain"
    gpuckpt.save({"w": np.ones(2)}, plain)
    assert PartRecord.from_root_document((plain / "zarr.json").read_bytes(), "plain") is None
    damaged = raw.replace(b'"abc"', b'"abd"')
    assert damaged != raw
    with pytest.raises(MetadataError):
        PartRecord.from_root_document(damaged, str(root))


def test_a_part_record_as_written_is_read_without_parsing_the_rest(tmp_path: Any, monkeypatch: Any) -> None:
    """A part's root document as gpuckpt writes it: its record is the metadata's first entry,
    read with the document's checksum checked on its bytes and the rest not parsed (the
    whole-document path is not called); a byte changed after the record (in a tensor's
    entry) fails that checksum and the whole-document path refuses it; a document written
    another way (keys reordered, spaced) takes the whole-document path and gives the same record."""
    import json

    import gpuckpt.format.parts as parts_module

    rec = PartRecord(9, "xyz", 1, 2, "n0", "L", {"w": (((0, 0), (4, 3)),)})
    path = tmp_path / part_name(9, 1)
    save_with_options(
        {"w": np.ones((2, 3), np.float32)}, path, SaveOptions(planner_extra={PART_KEY: rec.to_json()})
    )
    raw = (path / "zarr.json").read_bytes()
    whole = parts_module.metadata_json
    calls: list[str] = []

    def counted(data: Any, where: str) -> Any:
        calls.append(where)
        return whole(data, where)

    monkeypatch.setattr(parts_module, "metadata_json", counted)
    assert PartRecord.from_root_document(raw, "as-written") == rec
    assert calls == []
    tail = raw.index(b'"state_dict_metadata"')
    damaged = raw[:tail] + raw[tail:].replace(b'"w"', b'"v"', 1)
    assert damaged != raw
    with pytest.raises(MetadataError, match="checksum"):
        PartRecord.from_root_document(damaged, "damaged")
    assert calls == ["damaged"]
    doc = json.loads(raw)
    respaced = json.dumps({k: doc[k] for k in reversed(list(doc))}, indent=1).encode()
    assert PartRecord.from_root_document(respaced, "respaced") == rec
    assert calls == ["damaged", "respaced"]


def test_a_part_view_shares_arrays_and_round_trips() -> None:
    w = np.arange(12.0).reshape(3, 4)
    state = {
        "m": {
            "w": gpuckpt.ShardedArray(w, (3, 0), (6, 4)),
            "u": [gpuckpt.ShardedArray(w[:1], (0, 0), (6, 4))],
        },
        "opt": [np.ones(2), {"lr": 0.1}],
        "betas": (0.9, 0.99),
        "step": 7,
    }
    view, boxes = part_view(state)
    assert view["m"]["w"] is w and view["opt"][0] is state["opt"][0]
    assert boxes == {"m.w": (((3, 0), (6, 4)),), "m.u": (((0, 0), (6, 4)),)}
    again = sharded_from_part(view, boxes)
    assert again["m"]["w"].offsets == (3, 0) and isinstance(again["m"]["u"], list)
    assert layout_of(view, boxes) == layout_of(*part_view(state))
    assert layout_of(view, boxes) != layout_of(*part_view({**state, "x": np.zeros(1)}))
    # one pass for both, as a save asks: the bytes of every array of the part (w, w[:1], ones(2))
    assert layout_and_bytes(view, boxes) == (layout_of(view, boxes), w.nbytes + w[:1].nbytes + 16)
    assert part_bytes(view) == w.nbytes + w[:1].nbytes + 16
    loaded = {
        "m": {"w": w, "u": [w[:1]]},
        "opt": [state["opt"][0], {"lr": 0.5}],
        "betas": (0.8, 0.9),
        "step": 9,
    }
    copy_values_back(state, loaded)
    assert state["step"] == 9 and state["opt"][1] == {"lr": 0.5} and state["betas"] == (0.8, 0.9)
    assert isinstance(state["m"]["w"], gpuckpt.ShardedArray)


def test_the_layout_digest_is_its_documented_text_for_every_dtype() -> None:
    """A part's layout digest is stored in its record and compared by later processes (the
    restore after an upgrade): it stays the BLAKE2b of the JSON of every array's FQN, shape
    and ``str(dtype)`` and of the boxes, whatever remembers dtype texts on the way. Two dtypes
    that compare unequal only by byte order print apart, and digest apart."""
    import hashlib
    import json

    import ml_dtypes

    dtypes = [np.float32, np.dtype(">f4"), np.dtype("<f4"), np.int8, np.uint64, np.bool_, ml_dtypes.bfloat16]
    for _ in range(2):  # (the second pass through the remembered texts)
        state = {f"t{i}": np.zeros((2, 3), dtype=dt) for i, dt in enumerate(dtypes)}
        state["s"] = gpuckpt.ShardedArray(np.zeros((1, 4), np.float16), (1, 0), (2, 4))
        view, boxes = part_view(state)
        arrays = sorted([k, list(v.shape), str(v.dtype)] for k, v in view.items())
        text = json.dumps([arrays, [["s", [[[1, 0], [2, 4]]]]]])
        assert layout_of(view, boxes) == hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
    big = part_view({"a": np.zeros(2, np.dtype(">f4"))})
    little = part_view({"a": np.zeros(2, np.dtype("<f4"))})
    assert layout_of(*big) != layout_of(*little)


@pytest.mark.parametrize("tensor_memo", [False, True])
def test_a_layout_memo_digests_a_save_description_as_layout_of_and_never_stale(tensor_memo: bool) -> None:
    """A tier's save digests its part's layout from the description its save is made from
    (:class:`LayoutMemo`), remembering the last digest: the same digest and bytes as
    :func:`layout_and_bytes` of the view, for every dtype and for boxes, and a new one
    whenever a name, shape, dtype or box changes (then the old one again when it comes back).
    With a TensorMemo (as a tier describes) the same tensors come back as the same objects,
    and a box that moves while its array stays the same still changes the digest."""
    import ml_dtypes

    from gpuckpt.saving.sources import TensorMemo, describe_state

    tensors = TensorMemo() if tensor_memo else None

    def state_with(**changes: Any) -> dict[str, Any]:
        base: dict[str, Any] = {
            "m": {
                "w": np.zeros((3, 4), np.float32),
                "b": np.zeros(4, ml_dtypes.bfloat16),
                "s": gpuckpt.ShardedArray(np.zeros((1, 4), np.float16), (1, 0), (2, 4)),
                "two": [
                    gpuckpt.ShardedArray(np.zeros((1, 2), np.int8), (0, 0), (2, 2)),
                    gpuckpt.ShardedArray(np.zeros((1, 2), np.int8), (1, 0), (2, 2)),
                ],
            },
            "big": np.zeros(3, np.dtype(">f4")),
            "step": 3,
        }
        base["m"].update(changes)
        return base

    memo = LayoutMemo()

    def both(state: dict[str, Any]) -> tuple[tuple[str, int], tuple[str, int]]:
        view, boxes = part_view(state)
        local, sources = describe_state(view, allow_pickle=False, memo=tensors)
        return memo.layout_and_bytes(local.tensors, sources, boxes), layout_and_bytes(view, boxes)

    first, expected = both(state_with())
    assert first == expected
    assert both(state_with())[0] == first  # (remembered)
    variants = [
        state_with(w=np.zeros((4, 3), np.float32)),  # a shape
        state_with(w=np.zeros((3, 4), np.float64)),  # a dtype
        state_with(b=np.zeros(4, np.float16)),  # bfloat16 -> float16 (same itemsize)
        state_with(s=gpuckpt.ShardedArray(np.zeros((1, 4), np.float16), (0, 0), (2, 4))),  # a box
        state_with(extra=np.zeros(1, np.float32)),  # a name
    ]
    seen = {first[0]}
    for variant in variants:
        got, want = both(variant)
        assert got == want
        assert got[0] not in seen
        seen.add(got[0])
        assert both(state_with())[0] == first  # and back


def test_a_tensor_memo_gives_the_description_made_without_it_and_holds_no_array() -> None:
    """describe_state with a TensorMemo (a tier's saves, step after step) describes every state
    as it does without one: arrays reshaped, of another dtype or byte order, transposed
    (another memory format), renamed, added, removed, replaced by values or by ShardedArray
    boxes, and subclasses of ndarray. The memo keeps descriptions, never an array alive."""
    import gc
    import weakref

    from gpuckpt.saving.sources import TensorMemo, describe_state

    class Sub(np.ndarray):
        pass

    memo = TensorMemo()
    w = np.zeros((4, 6), np.float32)
    states: list[dict[str, Any]] = [
        {"w": w, "b": np.ones(3, np.float16), "step": 1},
        {"w": w, "b": np.ones(3, np.float16), "step": 2},  # (the same again: remembered)
        {"w": w.reshape(6, 4), "b": np.ones(3, np.float16), "step": 3},
        {"w": w.T, "b": np.ones(3, np.float16), "step": 3},  # strides: not C order
        {"w": np.zeros((4, 6), np.float64), "b": np.ones(3, np.float16)},
        {"w": np.zeros((4, 6), np.dtype(">f4")), "b": np.ones(3, np.float16)},
        {"w": np.zeros((2, 2, 3, 2), np.float32).transpose(0, 3, 1, 2), "c": np.ones(3, np.int8)},
        {"w": np.zeros((4, 6), np.float32), "b": 7},
        {
            "w": gpuckpt.ShardedArray(np.zeros((2, 6), np.float32), (2, 0), (4, 6)),
            "b": np.ones(3, np.float16),
        },
        {"w": w.view(Sub), "z": w},
        {"w": w, "b": np.ones(3, np.float16), "step": 9},
    ]
    for state in states:
        with_memo = describe_state(state, allow_pickle=False, memo=memo)
        without = describe_state(state, allow_pickle=False)
        assert with_memo[0] == without[0]
        assert {
            k: [(s.array.shape, s.array.dtype, s.offsets) for s in v] for k, v in with_memo[1].items()
        } == {k: [(s.array.shape, s.array.dtype, s.offsets) for s in v] for k, v in without[1].items()}
        for k, held in with_memo[1].items():  # the sources are the state's own arrays
            assert all(a.array.array is b.array.array for a, b in zip(held, without[1][k], strict=True))
    gone = np.zeros(5, np.float32)
    ref = weakref.ref(gone)
    described = describe_state({"gone": gone}, allow_pickle=False, memo=memo)
    del gone, described
    gc.collect()
    assert ref() is None
