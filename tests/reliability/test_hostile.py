"""Untrusted checkpoints: only typed errors, no hang, no allocation beyond what is on disk.

The hostile author controls every byte, so the root metadata is rewritten
with a matching checksum (:func:`gpuckpt.testing.faults.rewrite_root_metadata`)
and only validation stands between the document and the allocator.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import pickle
import resource
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpuckpt
from gpuckpt.format.checksum import crc32c
from gpuckpt.format.documents import _canonical
from gpuckpt.testing.faults import copy_checkpoint, rewrite_root_metadata
from gpuckpt.verify import verify_checkpoint

from .conftest import STRESS_TRIALS
from .hostile import CountingMemory, Timeout, disk_bytes, every_reader, is_known_bug, make_state, time_limit

FUZZ_EXAMPLES = 20 * STRESS_TRIALS
PER_EXAMPLE_TIMEOUT_S = 10


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hostile") / "ckpt"
    gpuckpt.save(make_state(), path, chunk_bytes=64)
    return path


@pytest.fixture
def ckpt(template: Path, tmp_path: Path) -> Path:
    return copy_checkpoint(template, tmp_path / "c")


def valid_metadata(template: Path) -> dict[str, Any]:
    doc = json.loads((template / "zarr.json").read_bytes())
    return doc["attributes"]["gpuckpt"]["metadata"]  # type: ignore[no-any-return]


def write_root(path: Path, md: Any, *, fix_crc: bool = True) -> None:
    try:
        crc: Any = crc32c(_canonical(md)) if fix_crc else 0
    except (ValueError, TypeError):
        crc = 0
    doc = {
        "zarr_format": 3,
        "node_type": "group",
        "attributes": {"gpuckpt": {"metadata": md, "metadata_crc32c": crc}},
    }
    (path / "zarr.json").write_text(json.dumps(doc))


def only_typed_errors(path: Path, run: Callable[[Path], None] = every_reader) -> None:
    """Run the readers; only GpuckptError (or a known, xfail-tracked bug) may escape, quickly,
    and no load may ask for more memory than the checkpoint has on disk."""
    CountingMemory.requested = 0
    budget = disk_bytes(path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gpuckpt.api, "HostMemory", CountingMemory)
        try:
            with time_limit(PER_EXAMPLE_TIMEOUT_S):
                run(path)
        except gpuckpt.GpuckptError:
            pass
        except Timeout:
            raise AssertionError(f"a read of {path} hung") from None
        except Exception as exc:
            if not is_known_bug(exc):
                raise
    assert CountingMemory.requested <= budget, (CountingMemory.requested, budget)


# targeted hostile documents -----------------------------------------------------------------


def test_huge_shape_claim_allocates_nothing(ckpt: Path) -> None:
    def edit(md: dict[str, Any]) -> None:
        n = 1 << 40
        md["state_dict_metadata"]["w"]["size"] = [n, 7]
        md["state_dict_metadata"]["w"]["chunks"] = [{"offsets": [0, 0], "sizes": [n, 7]}]
        s = md["storage_data"]["tensors"]["w"]
        s["chunk_grid"]["configuration"]["chunk_shape"] = [n, 7]
        s["chunks"] = [{"key": "c.0.0", "nbytes": n * 28 + 4, "crc32c": 0}]

    rewrite_root_metadata(ckpt, edit)
    CountingMemory.requested = 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gpuckpt.api, "HostMemory", CountingMemory)
        # the claim is self-consistent: only the real file size can refute it
        with pytest.raises(gpuckpt.CheckpointCorruptedError, match=r"'w'.*expected 30786325577732"):
            gpuckpt.load_state_dict(ckpt)
        with pytest.raises(gpuckpt.ShapeMismatchError):
            gpuckpt.load({"w": make_state()["w"]}, ckpt)
    assert CountingMemory.requested == 0


def test_huge_shape_claim_allocates_nothing_when_loading_into_a_placeholder(ckpt: Path) -> None:
    def edit(md: dict[str, Any]) -> None:
        n = 1 << 40
        md["state_dict_metadata"]["w"]["size"] = [n, 7]
        md["state_dict_metadata"]["w"]["chunks"] = [{"offsets": [0, 0], "sizes": [n, 7]}]
        s = md["storage_data"]["tensors"]["w"]
        s["chunk_grid"]["configuration"]["chunk_shape"] = [n, 7]
        s["chunks"] = [{"key": "c.0.0", "nbytes": n * 28 + 4, "crc32c": 0}]

    rewrite_root_metadata(ckpt, edit)
    CountingMemory.requested = 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gpuckpt.api, "HostMemory", _RefusingMemory)
        # a non-array leaf receives a new array: its size must be checked before allocating
        with pytest.raises(gpuckpt.CheckpointCorruptedError):
            gpuckpt.load({"w": None}, ckpt)


class _RefusingMemory(CountingMemory):
    def allocate(self, shape: tuple[int, ...], dtype: Any, memory_format: Any) -> Any:
        raise AssertionError(f"allocated {shape} before validating the chunk files")


@pytest.mark.parametrize("name", ["../outside", "..", ".", "/abs", "a/b", "zarr.json", "", "x\x00", "a\\b"])
def test_array_name_outside_checkpoint_is_refused(ckpt: Path, name: str) -> None:
    rewrite_root_metadata(ckpt, lambda md: md["storage_data"]["tensors"]["w"].__setitem__("name", name))
    with pytest.raises(gpuckpt.MetadataError):
        gpuckpt.load_state_dict(ckpt)


@pytest.mark.parametrize(
    "key", ["../../etc/passwd", "c/../c.0", "/c.0.0", "c.0.0/", "c.-1.0", "c.00.0", "zarr.json"]
)
def test_chunk_key_outside_array_is_refused(ckpt: Path, key: str) -> None:
    rewrite_root_metadata(
        ckpt, lambda md: md["storage_data"]["tensors"]["w"]["chunks"][0].__setitem__("key", key)
    )
    with pytest.raises(gpuckpt.MetadataError):
        gpuckpt.load_state_dict(ckpt)


def test_symlinked_array_directory_to_valid_copy_is_not_followed(ckpt: Path, tmp_path: Path) -> None:
    # the target holds the right bytes: a reader that followed the link would succeed
    outside = tmp_path / "outside"
    shutil.copytree(ckpt / "w", outside)
    shutil.rmtree(ckpt / "w")
    os.symlink(outside, ckpt / "w")
    with pytest.raises(gpuckpt.MissingChunkError, match="'w'"):
        gpuckpt.load_state_dict(ckpt, keys=["w"])


def test_symlinked_chunk_and_root_are_not_followed(ckpt: Path, tmp_path: Path) -> None:
    chunk = ckpt / "w" / "c.0.0"
    shutil.copy(chunk, tmp_path / "good-bytes")
    chunk.unlink()
    os.symlink(tmp_path / "good-bytes", chunk)
    with pytest.raises(gpuckpt.MissingChunkError):
        gpuckpt.load_state_dict(ckpt, keys=["w"])
    shutil.copy(ckpt / "zarr.json", tmp_path / "root.json")
    (ckpt / "zarr.json").unlink()
    os.symlink(tmp_path / "root.json", ckpt / "zarr.json")
    with pytest.raises(gpuckpt.CheckpointNotFoundError):
        gpuckpt.read_metadata(ckpt)


class _Boom:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def test_pickle_payload_is_refused_and_never_run(ckpt: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = base64.b64encode(pickle.dumps(_Boom(str(marker)))).decode()
    rewrite_root_metadata(
        ckpt, lambda md: md["storage_data"]["objects"].__setitem__("step", {"pickle": payload})
    )
    with pytest.raises(gpuckpt.UnsafeCheckpointError, match="'step'"):
        gpuckpt.load_state_dict(ckpt)
    with pytest.raises(gpuckpt.UnsafeCheckpointError):
        gpuckpt.load(make_state(), ckpt)
    assert not marker.exists()
    # only an explicit opt-in runs it
    gpuckpt.load_state_dict(ckpt, keys=["step"], allow_pickle=True)["step"].close()
    assert marker.exists()


def test_nested_pickle_inside_plain_value_is_refused(ckpt: Path, tmp_path: Path) -> None:
    payload = base64.b64encode(pickle.dumps(_Boom(str(tmp_path / "pwned")))).decode()
    inner = {"dict": [[{"str": "k"}, {"list": [{"pickle": payload}]}]]}
    rewrite_root_metadata(ckpt, lambda md: md["storage_data"]["objects"].__setitem__("step", inner))
    with pytest.raises(gpuckpt.UnsafeCheckpointError):
        gpuckpt.load_state_dict(ckpt)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize(
    "text",
    [
        b"",
        b"{",
        b"null",
        b"[]",
        b'"x"',
        b"{}",
        b"\xff\xfe",
        b'{"zarr_format": 3}',
        b"[" * 100_000,
        b"NaN",
        b'{"zarr_format":3,"node_type":"group","attributes":{"gpuckpt":{"metadata":{"a":NaN},"metadata_crc32c":0}}}',
        b'{"zarr_format":3,"node_type":"group","attributes":{"gpuckpt":{"metadata":1' + b"0" * 5000 + b"}}}",
    ],
)
def test_malformed_root_json_is_a_metadata_error(ckpt: Path, text: bytes) -> None:
    (ckpt / "zarr.json").write_bytes(text)
    with pytest.raises(gpuckpt.MetadataError):
        gpuckpt.read_metadata(ckpt)


WRONG_VALUES: list[Any] = [None, True, -1, 1.5, "x", [], {}, 2**70, [None], {"x": 1}]


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


def _set(root: Any, path: tuple[Any, ...], value: Any) -> None:
    node = root
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value


def test_wrong_type_in_every_field_is_a_typed_error(template: Path, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(template, tmp_path / "c")
    md = valid_metadata(template)
    # every field once: chunk lists repeat the same fields, their first two entries stand for all
    paths = [p for p in _paths(md) if not any(isinstance(k, int) and k > 1 for k in p)]
    assert len(paths) > 50
    for path in paths:
        for value in WRONG_VALUES:
            bad = copy.deepcopy(md)
            _set(bad, path, value)
            write_root(ckpt, bad)
            only_typed_errors(ckpt, lambda p: (gpuckpt.read_metadata(p), gpuckpt.load_state_dict(p)))


# fuzzing ------------------------------------------------------------------------------------

_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2**31, 2**63, 1 << 40, 10**400]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.sampled_from(
        [
            "../x",
            "/etc/passwd",
            "c.0.0",
            "zarr.json",
            "²",
            "1" * 5000,
            "float32",
            "bfloat16",
            "channels_last",
            "tensor",
            "bytes",
            "regular",
            "rectilinear",
            "strided",
        ]
    ),
)
_json = st.recursive(
    _leaf,
    lambda ch: st.lists(ch, max_size=4) | st.dictionaries(st.text(max_size=8), ch, max_size=4),
    max_leaves=10,
)


@st.composite
def mutated_metadata(draw: st.DrawFn, md: dict[str, Any]) -> Any:
    md = copy.deepcopy(md)
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(md)
        path = draw(st.sampled_from(paths))
        parent: Any = md
        for k in path[:-1]:
            parent = parent[k]
        op = draw(st.sampled_from(["replace", "delete", "add", "dup", "nudge"]))
        key = path[-1]
        if op == "replace":
            parent[key] = draw(_json)
        elif op == "delete":
            del parent[key]
        elif op == "add" and isinstance(parent, dict):
            parent[draw(st.text(max_size=8))] = draw(_json)
        elif op == "dup" and isinstance(parent, list):
            parent.append(copy.deepcopy(parent[key]))
        elif op == "nudge" and isinstance(parent[key], int) and not isinstance(parent[key], bool):
            parent[key] += draw(st.sampled_from([-1, 1, 2**32, -(2**32), 10**30]))
    return md


_FUZZ = settings(
    max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None
)


@pytest.fixture(scope="module")
def fuzz_ckpt(template: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return copy_checkpoint(template, tmp_path_factory.mktemp("fuzz") / "c")


def test_fuzz_mutated_metadata_with_valid_checksum(template: Path, fuzz_ckpt: Path) -> None:
    md = valid_metadata(template)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    @_FUZZ
    @given(mutated_metadata(md))
    def check(bad: Any) -> None:
        write_root(fuzz_ckpt, bad)
        only_typed_errors(fuzz_ckpt)

    check()
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    assert grown_mib < 256, f"max RSS grew by {grown_mib:.0f} MiB while fuzzing"


def test_fuzz_arbitrary_json_metadata(fuzz_ckpt: Path) -> None:
    @_FUZZ
    @given(_json, st.booleans())
    def check(value: Any, fix_crc: bool) -> None:
        write_root(fuzz_ckpt, value, fix_crc=fix_crc)
        only_typed_errors(fuzz_ckpt)

    check()


def test_fuzz_random_byte_damage_of_root_document(template: Path, fuzz_ckpt: Path) -> None:
    raw = (template / "zarr.json").read_bytes()

    @_FUZZ
    @given(st.lists(st.tuples(st.integers(0, len(raw) - 1), st.integers(1, 255)), min_size=1, max_size=6))
    def check(edits: list[tuple[int, int]]) -> None:
        buf = bytearray(raw)
        for i, x in edits:
            buf[i] ^= x
        (fuzz_ckpt / "zarr.json").write_bytes(bytes(buf))
        try:
            every_reader(fuzz_ckpt)
        except gpuckpt.GpuckptError:
            return
        # the JSON still means the same thing (e.g. the case of a \\u escape's hex digit)
        assert json.loads(bytes(buf)) == json.loads(raw)

    check()


def test_atheris_harness_smoke(tmp_path: Path) -> None:
    pytest.importorskip("atheris", reason="atheris is not installed (pip install atheris)")
    harness = Path(__file__).with_name("fuzz_metadata_atheris.py")
    runs = 100 * STRESS_TRIALS
    proc = subprocess.run(
        [sys.executable, str(harness), f"-runs={runs}", "-max_len=20000", "-seed=1"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=dict(os.environ, GPUCKPT_FUZZ_DIR=str(tmp_path)),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # its checkpoint and corpus were made here, and go with tmp_path (not left in /tmp)
    assert len(list(tmp_path.glob("gpuckpt-atheris-*/corpus/seed.json"))) == 1


# former core bugs, each with its smallest reproduction -----------------------


#: int keys that all hash alike: Python's int hash is the value modulo 2**61 - 1
COLLIDING = 2**61 - 1


def test_plain_value_keys_chosen_to_share_one_hash_are_refused(ckpt: Path) -> None:
    # building such a dict is quadratic: 40,000 keys (1.6 MB of document) took 15 s, 80,000 a minute
    keys = [[{"int": str(i * COLLIDING)}, {"none": None}] for i in range(3000)]
    rewrite_root_metadata(ckpt, lambda md: md["storage_data"]["objects"].__setitem__("step", {"dict": keys}))
    with pytest.raises(gpuckpt.MetadataError, match="keys of one hash value"):
        gpuckpt.load_state_dict(ckpt)
    assert any("keys of one hash value" in d.problem for d in verify_checkpoint(ckpt).damage)
    ordinary = [[{"int": str(i * 1000003)}, {"none": None}] for i in range(3000)]
    rewrite_root_metadata(
        ckpt, lambda md: md["storage_data"]["objects"].__setitem__("step", {"dict": ordinary})
    )
    assert len(gpuckpt.load_state_dict(ckpt)["step"]) == 3000  # as many keys, spread: taken


def test_structure_keys_chosen_to_share_one_hash_are_refused(ckpt: Path) -> None:
    flood = {"d": [["i", i * COLLIDING, {"d": []}] for i in range(3000)]}
    rewrite_root_metadata(ckpt, lambda md: md["planner_data"]["structure"]["d"].append(["s", "junk", flood]))
    with pytest.raises(gpuckpt.MetadataError, match="keys of one hash value"):
        gpuckpt.load_state_dict(ckpt)
    assert not verify_checkpoint(ckpt).ok


def _edit_structure(md: dict[str, Any], how: str) -> None:
    items = md["planner_data"]["structure"]["d"]
    w = next(item for item in items if item[1] == "w")
    if how == "twice":  # "w" named twice, the second time for another entry's leaf
        items.append(["s", "w", {"v": "step"}])
        items[:] = [item for item in items if item[1] != "step"]
    else:  # "w" left out
        items.remove(w)


@pytest.mark.parametrize(
    ("how", "match"), [("twice", "names the key 'w' twice"), ("dropped", "leaves out the entry 'w'")]
)
def test_a_structure_that_would_not_give_back_the_state_is_damage(ckpt: Path, how: str, match: str) -> None:
    # either edit loaded without an error: one entry given out under another's name, or dropped
    rewrite_root_metadata(ckpt, lambda md: _edit_structure(md, how))
    with pytest.raises(gpuckpt.MetadataError, match=match):
        gpuckpt.load_state_dict(ckpt)
    report = verify_checkpoint(ckpt)
    assert not report.ok and any(match in d.problem for d in report.damage), report.damage


@pytest.mark.parametrize("constant", [float("nan"), float("inf"), float("-inf")])
def test_nan_or_infinity_in_a_root_document_of_gpuckpts_own_layout_is_refused(
    ckpt: Path, constant: float
) -> None:
    # the layout gpuckpt writes is read by checking its bytes' checksum and parsing them: the
    # parse took NaN, which no other reader of the metadata accepts and to_json then refused
    from gpuckpt.format.documents import ROOT_DOCUMENT_PREFIX

    md = valid_metadata(ckpt)
    md["planner_data"]["x"] = constant
    canonical = json.dumps(md, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()
    tail = b',"metadata_crc32c":' + str(crc32c(canonical)).encode() + b"}}}"
    (ckpt / "zarr.json").write_bytes(ROOT_DOCUMENT_PREFIX + canonical + tail)
    with pytest.raises(gpuckpt.MetadataError, match="is not a JSON value"):
        gpuckpt.read_metadata(ckpt)
    md["planner_data"]["x"] = 1.5  # the same document with a number: read as written
    canonical = json.dumps(md, sort_keys=True, separators=(",", ":")).encode()
    tail = b',"metadata_crc32c":' + str(crc32c(canonical)).encode() + b"}}}"
    (ckpt / "zarr.json").write_bytes(ROOT_DOCUMENT_PREFIX + canonical + tail)
    assert gpuckpt.read_metadata(ckpt).planner_data["x"] == 1.5


@pytest.mark.parametrize("version", ["²", "1" * 5000])
def test_numeric_looking_version_is_a_metadata_error(ckpt: Path, version: str) -> None:
    rewrite_root_metadata(ckpt, lambda md: md.__setitem__("version", version))
    with pytest.raises(gpuckpt.MetadataError):
        gpuckpt.read_metadata(ckpt)


def test_huge_size_with_unit_chunks_is_a_metadata_error(ckpt: Path) -> None:
    def edit(md: dict[str, Any]) -> None:
        n = 10**400
        md["state_dict_metadata"]["w"]["size"] = [n, 7]
        md["state_dict_metadata"]["w"]["chunks"] = [{"offsets": [0, 0], "sizes": [n, 7]}]
        md["storage_data"]["tensors"]["w"]["chunk_grid"]["configuration"]["chunk_shape"] = [1, 7]
        md["storage_data"]["tensors"]["w"]["chunks"] = [{"key": "c.0.0", "nbytes": 32, "crc32c": 0}]

    rewrite_root_metadata(ckpt, edit)
    with pytest.raises(gpuckpt.MetadataError):
        gpuckpt.read_metadata(ckpt)


def test_float_chunk_nbytes_is_a_metadata_error(ckpt: Path) -> None:
    def edit(md: dict[str, Any]) -> None:
        c = md["storage_data"]["tensors"]["nested.b"]["chunks"][0]
        c["nbytes"] = float(c["nbytes"])

    rewrite_root_metadata(ckpt, edit)
    with pytest.raises(gpuckpt.MetadataError):
        gpuckpt.load_state_dict(ckpt, keys=["nested.b"])


@pytest.mark.parametrize("size", [[10**30, 0], [2**62, 2**62, 0], [0, 2**31, 2**31], [2**31, 0, 2**31]])
def test_empty_tensor_with_huge_axis_is_a_metadata_error(ckpt: Path, size: list[int]) -> None:
    def edit(md: dict[str, Any]) -> None:
        md["state_dict_metadata"]["empty"]["size"] = size
        md["storage_data"]["tensors"]["empty"]["chunk_grid"]["configuration"]["chunk_shape"] = [1] * len(size)

    rewrite_root_metadata(ckpt, edit)
    with pytest.raises(gpuckpt.MetadataError):
        gpuckpt.load_state_dict(ckpt, keys=["empty"])


@pytest.mark.parametrize("size", [[0, 2**31, 2**31], [2**40, 0, 2**30]])
def test_empty_tensor_of_a_chunk_table_checkpoint_with_huge_axes_is_a_metadata_error(
    tmp_path: Path, size: list[int]
) -> None:
    # format version 2 (a chunk table): read by the one-pass load index, not the general path
    path = tmp_path / "c"
    gpuckpt.save({"w": np.zeros(5000 * 16, np.float32), "empty": np.zeros((0, 3, 3))}, path, chunk_bytes=64)

    def edit(md: dict[str, Any]) -> None:
        md["state_dict_metadata"]["empty"]["size"] = size
        md["storage_data"]["tensors"]["empty"]["chunk_grid"]["configuration"]["chunk_shape"] = [1, 1, 1]

    rewrite_root_metadata(path, edit)
    for read in (gpuckpt.load_state_dict, gpuckpt.read_metadata):
        with pytest.raises(gpuckpt.MetadataError, match="larger than any array"):
            read(path)


def _run_isolated(code: str, ckpt: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), str(ckpt)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_sparse_chunk_file_bomb_is_a_typed_error(ckpt: Path) -> None:
    n = 1 << 37  # float64: 1 TiB

    def edit(md: dict[str, Any]) -> None:
        md["state_dict_metadata"]["nested.b"]["size"] = [n]
        md["state_dict_metadata"]["nested.b"]["chunks"] = [{"offsets": [0], "sizes": [n]}]
        md["state_dict_metadata"]["nested.b"]["properties"]["dtype"] = "float64"
        s = md["storage_data"]["tensors"]["nested.b"]
        s["chunk_grid"]["configuration"]["chunk_shape"] = [n]
        s["chunks"] = [{"key": "c.0", "nbytes": n * 8 + 4, "crc32c": 0}]

    rewrite_root_metadata(ckpt, edit)
    for extra in (ckpt / "nested.b").glob("c.*"):
        extra.unlink()
    with open(ckpt / "nested.b" / "c.0", "wb") as f:
        f.truncate(n * 8 + 4)  # sparse: no blocks on disk
    code = """
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
        import gpuckpt
        try:
            gpuckpt.load_state_dict(sys.argv[1], keys=["nested.b"])
        except gpuckpt.GpuckptError as e:
            print("typed", type(e).__name__); sys.exit(0)
        except BaseException as e:
            print("untyped", type(e).__name__, e); sys.exit(3)
    """
    proc = _run_isolated(code, ckpt, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


def test_fifo_root_metadata_does_not_hang(ckpt: Path) -> None:
    (ckpt / "zarr.json").unlink()
    os.mkfifo(ckpt / "zarr.json")
    code = """
        import sys, gpuckpt
        try:
            gpuckpt.read_metadata(sys.argv[1])
        except gpuckpt.GpuckptError:
            sys.exit(0)
        sys.exit(3)
    """
    try:
        # a hang never ends; the limit only has to outlast starting Python on a loaded machine
        proc = _run_isolated(code, ckpt, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("read_metadata hung on a FIFO")
    assert proc.returncode == 0, proc.stderr[-2000:]
