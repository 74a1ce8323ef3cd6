"""gpuckpt.dcp across real processes: gloo on loopback, saved on 4 ranks, loaded on 2 and on 1.

The 4-rank job (``scripts/dcp_ranks.py save``) runs every saving scenario in
one process group; the checkpoints it leaves are then loaded by a 2-rank job
and by this test process itself.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.checkpoint")

import torch.distributed.checkpoint as dcp  # noqa: E402 - after the skip

import gpuckpt  # noqa: E402
import gpuckpt.dcp  # noqa: E402

pytestmark = pytest.mark.torch

NRANKS = 4


Results = dict[int, dict[str, Any]]


@pytest.fixture(scope="module")
def saved(
    tmp_path_factory: pytest.TempPathFactory, run_ranks: Callable[..., Results]
) -> tuple[Path, Results]:
    out = tmp_path_factory.mktemp("dcp-dist")
    return out, run_ranks(NRANKS, "save", out)


def _script() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "dcp_ranks", Path(__file__).parent / "scripts" / "dcp_ranks.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dtensor_shards_from_4_ranks_form_one_checkpoint(saved: tuple[Path, Results]) -> None:
    """Shard(0) and Shard(1) uneven, Shard(0) even, Replicate: read back whole by gpuckpt itself."""
    out, results = saved
    r0 = results[0]
    assert r0["dtensors_native"] is True
    assert r0["rep_chunks"] == 1  # the replicated tensor was written once
    assert r0["meta_is_bytes"] is True  # DCP's pickled values stay opaque bytes
    md = gpuckpt.read_metadata(out / "dtensors")
    # uneven Shard(1) boxes of 3, 3, 3 and 1 columns: a rectilinear grid along axis 1
    cols = md.state_dict_metadata["cols"]
    assert sorted({c.sizes[1] for c in cols.chunks}) == [1, 3]  # type: ignore[union-attr]


def test_fsdp2_model_and_optimizer_state(saved: tuple[Path, Results]) -> None:
    out, results = saved
    assert all(r["fsdp_dtensors"] == 4 for r in results.values())  # two weights, two biases
    assert (out / "fsdp" / "zarr.json").is_file()


def test_rank_failing_in_write_data_fails_everywhere_and_publishes_nothing(
    saved: tuple[Path, Results],
) -> None:
    _, results = saved
    for r in results.values():
        # the error of rank 2 reaches every rank through DCP
        assert r["fail_failed"] == "CheckpointException+injected"
        assert r["fail_failed_exists"] is False
        assert r["fail_dtensors"] == "CheckpointException+injected"
        assert r["fail_dtensors_exists"] is True  # the checkpoint it would have replaced
        assert r["fail_failed_temporaries"] == [] and r["fail_dtensors_temporaries"] == []
    # the coordinator's temporary existed (unpublished) until its Writer went away
    assert len(results[0]["fail_failed_temporaries_before"]) == 1
    assert results[0]["overwritten_intact"] is True


def test_each_rank_stores_its_rows_of_a_large_chunk_table(saved: tuple[Path, Results]) -> None:
    """4,400 chunks of FSDP-like row shards: each rank stores its block of the chunk table
    itself, and its write results carry the block's checksums to the coordinator, not a
    record per chunk; the checkpoint reads back through gpuckpt and through DCP."""
    _, results = saved
    r0 = results[0]
    received = r0["blocked_received"]
    assert received["chunks"] == 0  # no chunk's record came through DCP's gather
    assert received["blocks"] == [0, 1, 2, 3]
    assert received["tail_rows"] == 1  # the replicated tensor, stored whole by one rank
    assert received["bytes"] < 8_000  # 2 KB; with a record per chunk, 118 KB (measured 2026-12-03)
    assert r0["blocked_version"] == "5"
    assert r0["blocked_table"]["rows"] > 4096 and "blocks" in r0["blocked_table"]
    assert r0["blocked_native"] is True and r0["blocked_verified"] is True
    assert all(r["blocked_dcp_load"] is True for r in results.values())


def test_async_save_with_stager_snapshots_dtensors(saved: tuple[Path, Results]) -> None:
    _, results = saved
    assert results[0]["async_snapshot"] is True


def test_load_on_2_ranks_reshards_and_reads_only_overlapping_chunks(
    saved: tuple[Path, Results], run_ranks: Callable[..., Results]
) -> None:
    out, _ = saved
    results = run_ranks(2, "load", out)
    for r in results.values():
        assert r["dtensors"] is True and r["resharded_placement"] is True
        assert r["plain"] == list(range(7)) and r["meta"] == {"step": 11, "tags": ["a", "b"]}
        # a damaged chunk that only rank 1's box overlaps: rank 0 never read it
        assert list(r["damaged"]) == ["1"]
        assert "ChecksumError" in r["damaged"]["1"] and "'even'" in r["damaged"]["1"]
    assert results[0]["fsdp_equal"] is True


def test_load_in_one_process(saved: tuple[Path, Results]) -> None:
    """No process group: whole tensors from 4 ranks' shards, and the FSDP2 state into a plain model."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    out, _ = saved
    ranks = _script()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole: dict[str, Any] = {n: torch.zeros(s) for n, s in ranks.SHAPES.items()}
        dcp.load(whole, storage_reader=gpuckpt.dcp.Reader(out / "dtensors"))
        assert all(torch.equal(whole[n], ranks.global_tensor(n)) for n in ranks.SHAPES)

        model = ranks.small_model()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, storage_reader=gpuckpt.dcp.Reader(out / "fsdp"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        reference = torch.load(out / "fsdp-reference.pt", weights_only=True)
        assert ranks.same(ranks.full_state(model, opt), reference)


def test_checkpoints_of_4_ranks_convert_to_torch_as_dcp_to_torch_save_does(
    saved: tuple[Path, Results],
) -> None:
    """DTensor shards and the FSDP2 model and optimizer state, saved on 4 ranks through the Writer:
    ``convert --to torch`` writes what DCP's dcp_to_torch_save writes of the same state saved
    with FileSystemWriter (whole tensors, bit for bit; plain values equal)."""
    from test_dcp_to_torch_save import same
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from gpuckpt.convert import convert

    out, _ = saved
    for name in ("dtensors", "fsdp"):
        dcp_to_torch_save(out / f"{name}-fs", out / f"{name}-reference.pt")
        convert(out / name, out / f"{name}.pt", target_format="torch")
        want = torch.load(out / f"{name}-reference.pt", weights_only=True)
        same(torch.load(out / f"{name}.pt", weights_only=True), want, name)
    ranks = _script()
    whole = torch.load(out / "dtensors.pt", weights_only=True)
    assert all(torch.equal(whole[n], ranks.global_tensor(n)) for n in ranks.SHAPES)


def test_cooperative_load_on_4_ranks_reads_each_chunk_once(
    tmp_path: Path, run_ranks: Callable[..., Results]
) -> None:
    """DCP's default planner (torch has no cooperative load planner of its own here): the Reader
    reads each stored chunk once for the job, bit-exact against cooperative=False; a damaged
    chunk fails every rank with its checksum error, and nothing of its round reaches another rank."""
    results = run_ranks(4, "coop", tmp_path)
    for rank, r in results.items():
        stored = r["stored"]
        for layout in ("replicated", "hsdp"):
            coop, solo = r[f"{layout}-coop"], r[f"{layout}-solo"]
            assert coop["exact"] and solo["exact"], (rank, layout)
            assert coop["bytes"] == stored, (rank, layout, coop, stored)
        # alone, every replica reads its shard (and chunks across the shard edge twice)
        assert r["replicated-solo"]["bytes"] == 4 * stored and r["hsdp-solo"]["bytes"] >= 2 * stored
        assert sorted(r["damaged"]) == ["0", "1", "2", "3"], r["damaged"]
        for report in r["damaged"].values():
            assert "ChecksumError" in report and "chunk c.1.0 of tensor 'w'" in report, report
        assert r["damaged_received_some_chunks"] and r["damaged_received_nothing"], rank


def _nested(state: Any) -> Any:
    """Tensors and NumPy arrays as lists, bytes as what torch.save holds, for comparison."""
    import io

    if isinstance(state, dict):
        return {k: _nested(v) for k, v in state.items()}
    if isinstance(state, bytes):
        return torch.load(io.BytesIO(state), weights_only=True)
    return state.tolist() if hasattr(state, "tolist") else state


def test_a_key_held_as_a_dict_and_as_a_leaf_keeps_both_whichever_rank_holds_which(
    tmp_path: Path, run_ranks: Callable[..., Results]
) -> None:
    """Rank 0 holds ``{"k": {"a": t}}``, rank 1 ``{"k": t2}`` (or ``{"k": 5}``), and the other way
    round: as with FileSystemWriter, the checkpoint holds both ``k.a`` and ``k`` (it used to keep
    only ``k.a`` when the dict was on rank 0); their structure is the same in either rank order,
    and a dict no other rank holds stays nested."""
    from torch.distributed.checkpoint import FileSystemReader

    run_ranks(2, "clash", tmp_path)
    ranks = _script()
    structures = {}
    for name, (_, leaf) in ranks.CLASH.items():
        path = tmp_path / name
        want = sorted(FileSystemReader(tmp_path / f"{name}-fs").read_metadata().state_dict_metadata)
        assert want == ["k", "k.a", "z.y"]
        md = gpuckpt.dcp.Reader(path).read_metadata()
        assert sorted(md.state_dict_metadata) == want, name
        k: Any = torch.zeros(2) if leaf == "tensor" else 0
        state: dict[str, Any] = {"k": k, "k.a": torch.zeros(1), "z": {"y": torch.zeros(3)}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, storage_reader=gpuckpt.dcp.Reader(path))
        assert _nested(state) == {
            "k": [7.0, 7.0] if leaf == "tensor" else 5,
            "k.a": [1.0],
            "z": {"y": [2.0, 2.0, 2.0]},
        }, name
        structures[name] = _nested(gpuckpt.load_state_dict(path))
        assert structures[name] == _nested(state), name
    assert structures["tensor-dict-first"] == structures["tensor-dict-last"]
    assert structures["value-dict-first"] == structures["value-dict-last"]


def test_the_structure_of_dcp_paths_does_not_depend_on_their_order() -> None:
    """The skeleton made from DCP's paths, as pure data: every order of the same paths gives the
    same keys; a path that another runs through stays flat, the rest nest."""
    from itertools import permutations

    from gpuckpt.dcp.convert import skeleton_from_paths

    paths = {"k.a": ("k", "a"), "k": ("k",), "z.y": ("z", "y"), "m.x.y": ("m", "x", "y"), "m.x": ("m", "x")}
    paths["m.w"] = ("m", "w")
    shapes = set()
    for order in permutations(paths):
        skeleton = skeleton_from_paths(paths, order)
        shapes.add(repr(sorted(map(repr, skeleton["d"]))))
    assert len(shapes) == 1
    top = {k: child for _, k, child in skeleton["d"]}
    assert sorted(top) == ["k", "k.a", "m", "m.x", "m.x.y", "z"]
    assert top["z"] == {"d": [["s", "y", {"v": "z.y"}]]}
    assert top["m"] == {"d": [["s", "w", {"v": "m.w"}]]}
