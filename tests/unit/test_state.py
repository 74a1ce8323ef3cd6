from __future__ import annotations

import numpy as np
import pytest

from gpuckpt.device.arrays import is_array
from gpuckpt.errors import MetadataError, MissingKeyError, UnsupportedValueError
from gpuckpt.state import flatten_state_dict, select_fqns, unflatten_state_dict


def flat(sd: dict) -> dict:
    leaves, _ = flatten_state_dict(sd, is_array)
    return {k: v.value for k, v in leaves.items()}


def test_fqns_of_nested_dicts_and_lists() -> None:
    w = np.zeros(2)
    sd = {"model": {"layers": [{"weight": w}, {"weight": w}]}, "step": 3, "betas": (0.9, 0.99)}
    f = flat(sd)
    assert list(f) == ["model.layers.0.weight", "model.layers.1.weight", "step", "betas"]
    assert f["betas"] == (0.9, 0.99)  # a tuple of plain values stays one value


def test_round_trip_preserves_containers_and_key_types() -> None:
    sd = {
        "opt": {"state": {0: {"m": np.ones(1)}, 1: {"m": np.ones(1)}}},
        "t": (np.ones(1), {"a": 1}),
        "l": [1, 2],
    }
    leaves, skel = flatten_state_dict(sd, is_array)
    back = unflatten_state_dict(skel, {k: v.value for k, v in leaves.items()})
    assert list(back["opt"]["state"]) == [0, 1]
    assert isinstance(back["t"], tuple) and back["t"][1] == {"a": 1}
    assert back["l"] == [1, 2]


def test_replacing_a_leaf_inside_tuples_puts_new_tuples_in_their_places(tmp_path) -> None:
    import gpuckpt

    w, v = np.zeros(2), np.zeros(3)
    sd = {
        "t": ("old", w, ("deep", v, [1, ("x", np.zeros(1))])),
        "d": {"pair": (np.zeros(1), 7)},
        "l": [("a", np.zeros(1))],
    }
    leaves, _ = flatten_state_dict(sd, is_array)
    leaves["t.0"].replace("new")
    leaves["t.2.0"].replace("DEEP")
    leaves["t.2.2.1.0"].replace("y")
    leaves["d.pair.1"].replace(8)
    leaves["l.0.0"].replace("b")
    assert sd["t"][0] == "new" and sd["t"][1] is w  # the arrays are the same objects
    assert sd["t"][2][0] == "DEEP" and sd["t"][2][1] is v and sd["t"][2][2][1][0] == "y"
    assert isinstance(sd["t"], tuple) and isinstance(sd["t"][2], tuple) and isinstance(sd["t"][2][2], list)
    assert sd["d"]["pair"][1] == 8 and sd["l"][0] == ("b", sd["l"][0][1])
    # a load in place: plain values inside tuples are the stored ones, not left as they were
    saved = {"t": ("new", np.ones(2)), "n": {"p": (3, (4.5, np.arange(2)))}}
    gpuckpt.save(saved, tmp_path / "c")
    target = {"t": ("old", np.zeros(2)), "n": {"p": (0, (0.0, np.zeros(2, np.int64)))}}
    arr = target["t"][1]
    gpuckpt.load(target, tmp_path / "c")
    assert target["t"][0] == "new" and target["t"][1] is arr and arr.tolist() == [1.0, 1.0]
    assert target["n"]["p"][0] == 3 and target["n"]["p"][1][0] == 4.5
    assert target["n"]["p"][1][1].tolist() == [0, 1]


def test_partial_unflatten_drops_unselected_containers_and_keys_partial_sequences_by_position() -> None:
    sd = {"a": {"x": np.ones(1), "y": np.ones(1)}, "b": {"z": np.ones(1)}, "s": [np.ones(1), np.ones(1)]}
    _, skel = flatten_state_dict(sd, is_array)
    back = unflatten_state_dict(skel, {"a.x": 1, "s.0": 2}, ["a.x", "s.0"])
    assert back == {"a": {"x": 1}, "s": {0: 2}}
    back = unflatten_state_dict(skel, {"s.0": 2, "s.1": 3}, ["s"])
    assert back == {"s": [2, 3]}


def test_collision_is_an_error() -> None:
    with pytest.raises(UnsupportedValueError, match="same name 'a.b'"):
        flatten_state_dict({"a.b": 1, "a": {"b": 2}}, is_array)


def test_empty_key_at_root_does_not_collide() -> None:
    f = flat({"": {"x": 1}, "x": 2})
    assert f == {".x": 1, "x": 2}


@pytest.mark.parametrize("key", [1.5, (1, 2), None, True])
def test_bad_key_types(key: object) -> None:
    with pytest.raises(UnsupportedValueError, match="only str and int keys"):
        flatten_state_dict({"a": {key: 1}}, is_array)


def test_cycle_is_an_error() -> None:
    d: dict = {"x": np.ones(1)}
    d["self"] = d
    with pytest.raises(UnsupportedValueError, match="cycle"):
        flatten_state_dict(d, is_array)


def test_top_level_must_be_dict() -> None:
    with pytest.raises(UnsupportedValueError, match="must be a dict"):
        flatten_state_dict([1], is_array)  # type: ignore[arg-type]


def test_leaves_replace_in_their_container() -> None:
    sd = {"a": [1, {"b": 2}]}
    leaves, _ = flatten_state_dict(sd, is_array)
    leaves["a.1.b"].replace(5)
    assert sd == {"a": [1, {"b": 5}]}


def test_select_fqns() -> None:
    avail = ["model.w", "model.b", "model2.w", "step"]
    assert select_fqns(avail, None) == avail
    assert select_fqns(avail, ["model"]) == ["model.w", "model.b"]
    assert select_fqns(avail, "step") == ["step"]
    # a prefix may be written with its dot (as strip_prefix is): children only
    assert select_fqns(avail, ["model."]) == ["model.w", "model.b"]
    assert select_fqns([*avail, "model"], ["model."]) == ["model.w", "model.b"]
    with pytest.raises(MissingKeyError):
        select_fqns(avail, ["step."])
    with pytest.raises(MissingKeyError, match="'mod' is not in the checkpoint"):
        select_fqns(avail, ["mod"])


@pytest.mark.parametrize(
    "skel", [[], {"d": [["x", "k", {"v": "a"}]]}, {"q": []}, {"d": [["i", "k", {"v": "a"}]]}, {"v": 1}]
)
def test_malformed_skeleton(skel: object) -> None:
    with pytest.raises(MetadataError):
        unflatten_state_dict(skel, {"a": 1})


def test_a_loaded_state_is_freed_when_its_caller_drops_it(tmp_path) -> None:
    # the rebuilding of nested containers once kept the loaded arrays in a reference cycle (a
    # recursive closure holding them), freed only by a collection, which arrays do not prompt
    import gc
    import weakref

    import gpuckpt

    gpuckpt.save({"m": {"a": np.ones(1000), "l": [np.zeros(3)]}, "s": 1}, tmp_path / "c")
    gc.disable()
    try:
        back = gpuckpt.load_state_dict(tmp_path / "c")
        arrays = [weakref.ref(back["m"]["a"]), weakref.ref(back["m"]["l"][0])]
        part = gpuckpt.load_state_dict(tmp_path / "c", keys=["m.l"])
        arrays.append(weakref.ref(part["m"]["l"][0]))
        state = {"m": {"a": np.ones(1000), "l": [np.zeros(3)]}, "s": 1}
        saved = [weakref.ref(state["m"]["a"])]
        gpuckpt.save(state, tmp_path / "d")
        del back, part, state
        assert [r() for r in arrays + saved] == [None] * 4
    finally:
        gc.enable()
