"""One rank of the distributed gpuckpt.dcp tests: ``python dcp_ranks.py JOB DIR``.

Started by ``tests/dcp/conftest.py`` with ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR=127.0.0.1`` and ``MASTER_PORT``; the ranks join one gloo
process group and run every scenario of ``JOB`` in it. Rank R writes what it
found to ``DIR/rank<R>.json`` (``{"error": traceback}`` if it raised).

Jobs: ``save`` (4 ranks) writes the checkpoints that ``load`` (2 ranks) and
the test process itself (1 rank) read back; ``clash`` (2 ranks) saves states
whose ranks hold one key as a dict and as a leaf, read back by the test process.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import gpuckpt
import gpuckpt.dcp

warnings.filterwarnings("ignore")

#: the global tensors of the DTensor state dict, and how the saving ranks place them
SHAPES = {"rows": (10, 6), "cols": (8, 10), "even": (8, 4), "rep": (5, 3)}
PLACE = {"rows": Shard(0), "cols": Shard(1), "even": Shard(0), "rep": Replicate()}


def global_tensor(name: str) -> torch.Tensor:
    shape = SHAPES[name]
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=torch.float32).reshape(shape) * 0.5 + len(name)


def dtensor_state(mesh: Any) -> dict[str, Any]:
    sd: dict[str, Any] = {n: distribute_tensor(global_tensor(n), mesh, [PLACE[n]]) for n in SHAPES}
    sd["plain"] = torch.arange(7, dtype=torch.int64)  # the same on every rank: written once
    sd["meta"] = {"step": 11, "tags": ["a", "b"]}
    return sd


def small_model() -> nn.Module:
    torch.manual_seed(0)
    # 5 output rows over 4 ranks: shards of 2, 2, 1 and 0 rows (uneven, one empty)
    return nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 5))


def trained(model: nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    torch.manual_seed(1)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    return opt


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": msd, "optim": osd}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def temporaries(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}.gpuckpt-tmp-"))


class FailOnRank(DefaultSavePlanner):
    """A planner whose data lookup fails on one rank, i.e. inside that rank's write_data."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.failing = rank

    def resolve_data(self, write_item: Any) -> Any:
        if dist.get_rank() == self.failing:
            raise OSError(28, "No space left on device (injected)")
        return super().resolve_data(write_item)


class ReportingWriter(gpuckpt.dcp.Writer):
    """A Writer whose coordinator records what the ranks' write results carried to it."""

    def finish(self, metadata: Any, results: list[list[Any]]) -> None:
        import pickle

        data = [r.storage_data for rank in results for r in rank]
        self.received = {
            "bytes": len(pickle.dumps(data)),
            "chunks": sum(len(d.chunks) for d in data),
            "blocks": sorted(d.block.block for d in data if d.block is not None),
            "tail_rows": sum(len(d.block.tail_rows) for d in data if d.block is not None),
        }
        super().finish(metadata, results)


#: the sharded tensors of the save whose chunk table is stored in blocks (275 chunks of 16
#: elements per rank each: 4,400 chunks, more than a root document lists)
BLOCKED = {f"b{i}": 4 * 4400 for i in range(4)}


def blocked_tensor(name: str) -> torch.Tensor:
    return torch.arange(BLOCKED[name], dtype=torch.float32) * 0.25 + int(name[1:])


def blocked_state(mesh: Any) -> dict[str, Any]:
    sd: dict[str, Any] = {n: distribute_tensor(blocked_tensor(n), mesh, [Shard(0)]) for n in BLOCKED}
    sd["rep"] = distribute_tensor(global_tensor("rep"), mesh, [Replicate()])  # in the tail
    sd["step"] = 7
    return sd


def job_save(out: Path) -> dict[str, Any]:
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    found: dict[str, Any] = {}

    # DTensors: Shard(0) and Shard(1) uneven, Shard(0) even, Replicate; a plain tensor; plain values
    sd = dtensor_state(mesh)
    dcp.save(sd, storage_writer=gpuckpt.dcp.Writer(out / "dtensors", chunk_bytes=64))
    # the same state through DCP's own writer: the reference of convert --to torch
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(out / "dtensors-fs"))
    dist.barrier()
    if rank == 0:
        back = gpuckpt.load_state_dict(out / "dtensors")
        found["dtensors_native"] = all(
            bool((torch.from_numpy(back[n]) == global_tensor(n)).all()) for n in SHAPES
        ) and bool((torch.from_numpy(back["plain"]) == sd["plain"]).all())
        md = gpuckpt.read_metadata(out / "dtensors")
        found["rep_chunks"] = len(md.state_dict_metadata["rep"].chunks)  # type: ignore[union-attr]
        found["meta_is_bytes"] = isinstance(back["meta"]["step"], bytes)

    # FSDP2 over the 4 ranks: model and Adam state from get_state_dict
    model = small_model()
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=mesh)
    opt = trained(model)
    msd, osd = get_state_dict(model, opt)
    found["fsdp_dtensors"] = sum(type(v).__name__ == "DTensor" for v in msd.values())
    dcp.save({"model": msd, "optim": osd}, storage_writer=gpuckpt.dcp.Writer(out / "fsdp"))
    dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(out / "fsdp-fs"))
    ref = full_state(model, opt)
    if rank == 0:
        torch.save(ref, out / "fsdp-reference.pt")

    # a rank failing inside write_data: the save fails on every rank and publishes nothing,
    # neither a new checkpoint nor a change to one it would have replaced
    for target, overwrite in ((out / "failed", False), (out / "dtensors", True)):
        writer = gpuckpt.dcp.Writer(target, overwrite=overwrite)
        try:
            dcp.save(dtensor_state(mesh), storage_writer=writer, planner=FailOnRank(2))
            found[f"fail_{target.name}"] = "no error"
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            found[f"fail_{target.name}"] = type(exc).__name__ + (
                "+injected" if "injected" in str(exc) else ""
            )
        dist.barrier()
        found[f"fail_{target.name}_exists"] = target.exists()
        found[f"fail_{target.name}_temporaries_before"] = temporaries(target)
        del writer
        gc.collect()  # the coordinator's Writer removes its temporary when it goes
        dist.barrier()
        found[f"fail_{target.name}_temporaries"] = temporaries(target)
    if rank == 0:
        back = gpuckpt.load_state_dict(out / "dtensors")
        found["overwritten_intact"] = all(
            bool((torch.from_numpy(back[n]) == global_tensor(n)).all()) for n in SHAPES
        )

    # async_save with the Stager: changes right after it returns do not reach the checkpoint
    stager = gpuckpt.dcp.Stager()
    live = dtensor_state(mesh)
    fut = dcp.async_save(live, storage_writer=gpuckpt.dcp.Writer(out / "async"), async_stager=stager)
    for n in SHAPES:
        live[n].to_local().add_(1000.0)
    fut.result()
    dist.barrier()
    if rank == 0:
        back = gpuckpt.load_state_dict(out / "async")
        found["async_snapshot"] = all(
            bool((torch.from_numpy(back[n]) == global_tensor(n)).all()) for n in SHAPES
        )
    stager.close()

    # a chunk table in blocks: each rank stores its rows, the coordinator receives checksums
    writer = ReportingWriter(out / "blocked", chunk_bytes=64)
    dcp.save(blocked_state(mesh), storage_writer=writer)
    if rank == 0:
        found["blocked_received"] = writer.received
        md = gpuckpt.read_metadata(out / "blocked")
        found["blocked_version"] = md.version
        found["blocked_table"] = {k: v for k, v in md.storage_data["chunk_table"].items() if k != "columns"}
        back = gpuckpt.load_state_dict(out / "blocked")
        found["blocked_native"] = all(
            bool((torch.from_numpy(back[n]) == blocked_tensor(n)).all()) for n in BLOCKED
        ) and bool((torch.from_numpy(back["rep"]) == global_tensor("rep")).all())
        from gpuckpt.verify import verify_checkpoint

        found["blocked_verified"] = verify_checkpoint(out / "blocked").ok
    mine = blocked_state(mesh)
    for n in BLOCKED:
        mine[n].to_local().zero_()
    mine["step"] = 0
    dcp.load(mine, storage_reader=gpuckpt.dcp.Reader(out / "blocked"))
    found["blocked_dcp_load"] = (
        all(bool((mine[n].full_tensor() == blocked_tensor(n)).all()) for n in BLOCKED) and mine["step"] == 7
    )
    return found


def job_load(out: Path) -> dict[str, Any]:
    """Load what 4 ranks saved on this job's ranks (2): resharded DTensors and an FSDP2 model."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    found: dict[str, Any] = {}
    targets: dict[str, Any] = {n: distribute_tensor(torch.zeros(SHAPES[n]), mesh, [PLACE[n]]) for n in SHAPES}
    # the same tensor in another placement than it was saved in
    targets["rows_as_cols"] = distribute_tensor(torch.zeros(SHAPES["rows"]), mesh, [Shard(1)])
    targets["plain"] = torch.zeros(7, dtype=torch.int64)
    targets["meta"] = {"step": 0, "tags": None}
    sd = {k: v for k, v in targets.items() if k != "rows_as_cols"}
    dcp.load(sd, storage_reader=gpuckpt.dcp.Reader(out / "dtensors"))
    again = {"rows": targets["rows_as_cols"]}
    dcp.load(again, storage_reader=gpuckpt.dcp.Reader(out / "dtensors"))
    found["dtensors"] = all(torch.equal(targets[n].full_tensor(), global_tensor(n)) for n in SHAPES)
    found["resharded_placement"] = torch.equal(targets["rows_as_cols"].full_tensor(), global_tensor("rows"))
    found["plain"] = targets["plain"].tolist()
    found["meta"] = sd["meta"]

    # only the chunks that overlap a rank's box are read: damage one that only rank 1 needs
    # (the last rows of "even"), and the load fails on rank 1 alone
    damaged = out / f"damaged-{dist.get_world_size()}"
    if rank == 0:
        import shutil

        shutil.copytree(out / "dtensors", damaged)
        name = next(p for p in damaged.iterdir() if p.is_dir() and p.name == "even")
        last = sorted((p for p in name.iterdir() if p.name.startswith("c.")), key=lambda p: p.name)[-1]
        data = bytearray(last.read_bytes())
        data[0] ^= 0xFF
        last.write_bytes(bytes(data))
    dist.barrier()
    try:
        dcp.load(
            {"even": distribute_tensor(torch.zeros(SHAPES["even"]), mesh, [Shard(0)])},
            storage_reader=gpuckpt.dcp.Reader(damaged),
        )
        found["damaged"] = "no error"
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        failures = getattr(exc, "failures", {})
        found["damaged"] = {str(r): repr(e) for r, e in failures.items()}

    from torch.distributed.fsdp import fully_shard

    model = small_model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=gpuckpt.dcp.Reader(out / "fsdp"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = full_state(model, opt)
    if rank == 0:
        found["fsdp_equal"] = same(got, torch.load(out / "fsdp-reference.pt", weights_only=True))
    return found


def job_s3(out: Path) -> dict[str, Any]:
    """Save DTensors from every rank to ``$GPUCKPT_TEST_S3_URL`` (each rank uploads its own
    chunks), then load them back into another placement."""
    from gpuckpt.testing.s3server import s3_options

    url, opts = os.environ["GPUCKPT_TEST_S3_URL"], s3_options(os.environ["GPUCKPT_TEST_S3"])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    dcp.save(
        dtensor_state(mesh), storage_writer=gpuckpt.dcp.Writer(url, chunk_bytes=64, storage_options=opts)
    )
    target = {"rows": distribute_tensor(torch.zeros(SHAPES["rows"]), mesh, [Shard(1)])}
    dcp.load(target, storage_reader=gpuckpt.dcp.Reader(url, storage_options=opts))
    return {"rows_resharded": torch.equal(target["rows"].full_tensor(), global_tensor("rows"))}


#: the checkpoint of the cooperative loads: tensors of several chunks (32 KiB each)
COOP = {"w": (256, 128), "e": (64, 33), "b": (1000,)}


def coop_tensor(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(name))
    if name == "e":
        return torch.randint(-(2**40), 2**40, COOP[name], generator=g, dtype=torch.int64)
    return torch.randn(COOP[name], generator=g)


def _coop_load(path: Path, layout: str, mesh: Any, **options: Any) -> tuple[dict[str, Any], bool, int]:
    """``dcp.load`` of the checkpoint at ``path`` into zeros of ``layout``: the state, whether it
    equals what was saved, and the chunk bytes all ranks read together."""
    from gpuckpt.testing.reads import count_chunk_reads

    if layout == "replicated":  # every rank loads every tensor whole
        sd: dict[str, Any] = {n: torch.zeros_like(coop_tensor(n)) for n in COOP}
    else:  # 2 replicas x 2 shards (HSDP): mesh dimension 0 replicates, dimension 1 shards rows
        sd = {
            n: distribute_tensor(torch.zeros_like(coop_tensor(n)), mesh, [Replicate(), Shard(0)])
            for n in COOP
        }
    with count_chunk_reads() as counted:
        dcp.load(sd, storage_reader=gpuckpt.dcp.Reader(path, **options))
    nbytes = [None] * dist.get_world_size()
    dist.all_gather_object(nbytes, counted.nbytes)
    if layout == "replicated":
        exact = all(torch.equal(sd[n], coop_tensor(n)) for n in COOP)
    else:
        want = {n: distribute_tensor(coop_tensor(n), mesh, [Replicate(), Shard(0)]) for n in COOP}
        exact = all(torch.equal(sd[n].to_local(), want[n].to_local()) for n in COOP)
    return sd, exact, sum(nbytes)


def job_coop(out: Path) -> dict[str, Any]:
    """4 ranks load one checkpoint through DCP's default planner, cooperatively and not: each stored
    chunk is read once for the job; a damaged chunk fails every rank with its checksum error."""
    import shutil

    rank = dist.get_rank()
    path, damaged = out / "coop", out / "coop-damaged"
    if rank == 0:
        gpuckpt.save({n: coop_tensor(n).numpy() for n in COOP}, path, chunk_bytes=32 << 10, overwrite=True)
        shutil.rmtree(damaged, ignore_errors=True)
        shutil.copytree(path, damaged)
        chunk = damaged / "w" / "c.1.0"
        data = bytearray(chunk.read_bytes())
        data[100] ^= 0xFF
        chunk.write_bytes(bytes(data))
    dist.barrier()
    mesh = init_device_mesh("cpu", (2, 2))
    found: dict[str, Any] = {
        "stored": sum(p.stat().st_size for p in path.rglob("c.*") if p.is_file()),
        "planners": [n for n in dir(dcp) if "Cooperative" in n],
    }
    for layout in ("replicated", "hsdp"):
        for coop in (True, False):
            _, exact, nbytes = _coop_load(path, layout, mesh, cooperative=coop)
            found[f"{layout}-{'coop' if coop else 'solo'}"] = {"exact": exact, "bytes": nbytes}
    from gpuckpt.loading.open import open_checkpoint
    from gpuckpt.testing.plans import received_boxes, record_plans

    sd = {n: torch.zeros_like(coop_tensor(n)) for n in COOP}
    try:
        with record_plans() as plans:
            dcp.load(sd, storage_reader=gpuckpt.dcp.Reader(damaged, cooperative=True))
        found["damaged"] = "no error"
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        failures = getattr(exc, "failures", {})
        found["damaged"] = {str(r): repr(e) for r, e in failures.items()}
    # nothing of the failed round crossed between ranks: the chunks this rank was to receive are
    # still zeros (what it read itself went straight into its tensors, as in any load)
    tensors = open_checkpoint(str(damaged), None).index.tensors
    boxes = received_boxes(plans[0], rank, tensors) if len(plans) == 1 else None
    found["damaged_received_nothing"] = boxes is not None and not any(
        sd[n][tuple(slice(o, o + k) for o, k in zip(*box, strict=True))].any()
        for n, where in boxes.items()
        for box in where
    )
    found["damaged_received_some_chunks"] = bool(boxes)
    return found


#: the ``clash`` job's saves: name -> (the rank holding ``k`` as a dict, what the other holds at ``k``)
CLASH = {
    "tensor-dict-first": (0, "tensor"),
    "tensor-dict-last": (1, "tensor"),
    "value-dict-first": (0, "value"),
    "value-dict-last": (1, "value"),
}


def clash_state(rank: int, name: str) -> dict[str, Any]:
    """One rank holds ``k`` as a dict (and a dict ``z`` no other rank has), the other a tensor or a
    plain value at ``k``."""
    dict_rank, leaf = CLASH[name]
    if rank == dict_rank:
        return {"k": {"a": torch.full((1,), 1.0)}, "z": {"y": torch.full((3,), 2.0)}}
    return {"k": torch.full((2,), 7.0) if leaf == "tensor" else 5}


def job_clash(out: Path) -> dict[str, Any]:
    """Save each of ``CLASH`` through gpuckpt.dcp.Writer and through DCP's FileSystemWriter."""
    for name in CLASH:
        state = clash_state(dist.get_rank(), name)
        dcp.save(state, storage_writer=gpuckpt.dcp.Writer(out / name))
        dcp.save(state, storage_writer=dcp.FileSystemWriter(out / f"{name}-fs"))
    return {}


def main() -> None:
    job, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    result: dict[str, Any]
    try:
        dist.init_process_group("gloo")
        try:
            result = {"save": job_save, "load": job_load, "s3": job_s3, "coop": job_coop, "clash": job_clash}[
                job
            ](out)
        finally:
            dist.destroy_process_group()
    except BaseException:
        result = {"error": traceback.format_exc()}
    (out / f"rank{rank}.json").write_text(json.dumps(result, default=str))
    code = 1 if "error" in result else 0
    # Known, not yet understood: now and then a rank aborts during interpreter teardown
    # ("terminate called without an active exception", from native threads of torch's gloo
    # back end), after its result is written: about one run in six of the s3 job, and once
    # in a load job on a loaded machine. The result above is what the test checks; the rank
    # leaves without the teardown so that the abort does not mask it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
