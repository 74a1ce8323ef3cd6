"""The Hugging Face layout as data: shard splitting, headers, and the groups an export reads."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gpuckpt.convert.hf_layout import BUFFER_ALIGN, ShardTensor, parse_size, plan_groups, plan_shards
from gpuckpt.errors import InvalidOptionError, MetadataError
from gpuckpt.format.safetensors import parse_header, parse_index


def _t(name: str, shape: tuple[int, ...], dt: str = "float32", edges: tuple[int, ...] = (0,)) -> ShardTensor:
    return ShardTensor(name, name, shape, np.dtype(dt), np.dtype(dt), edges)


def test_sizes_read_as_transformers_reads_them() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("64KB") == 64_000 and parse_size("2MiB") == 2 << 20
    assert parse_size(123) == 123
    for bad in ("5XB", "", "-1GB", 0):
        with pytest.raises(InvalidOptionError):
            parse_size(bad)


def test_shards_split_like_transformers_and_headers_parse() -> None:
    ts = [_t("a", (10, 10)), _t("b", (10, 10)), _t("big", (100, 10)), _t("c", (3,), "float16")]
    plans = plan_shards(ts, 800, single_file=False)
    assert [[t.name for t, _ in p.tensors] for p in plans] == [["a", "b"], ["big"], ["c"]]
    assert [p.file for p in plans] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    for p in plans:
        n = int.from_bytes(p.header[:8], "little")
        assert n % 8 == 0 and p.header[8 + n - 1 : 8 + n] in (b" ", b"}")
        entries, meta = parse_header(p.header[8:], p.size - len(p.header), "x")
        assert meta == {"format": "pt"}
        for t, at in p.tensors:  # offsets in the plan are those of the header
            assert entries[t.name]["data_offsets"][0] + len(p.header) == at
    with pytest.raises(InvalidOptionError, match="max_shard_size"):
        plan_shards(ts, 800, single_file=True)
    assert [p.file for p in plan_shards(ts, 10**6, single_file=True)] == ["model.safetensors"]


def test_groups_cut_only_at_chunk_edges_and_write_aligned() -> None:
    row = 10 * 4
    t = _t("w", (1000, 10), edges=(0, 250, 500, 750))
    plans = plan_shards([_t("s", (3,)), t, _t("z", (5,), "float16")], 10**6, single_file=False)
    groups = plan_groups(plans, limit=500 * row)
    pieces = [(p.tensor.name, p.start, p.stop) for g in groups for p in g.pieces]
    # header order (element size, then name); "w" cut at its chunk edges into runs of <= 500 rows
    assert pieces == [("s", 0, 3), ("w", 0, 500), ("w", 500, 1000), ("z", 0, 5)], pieces
    written = 0
    for g in groups:
        assert g.start % BUFFER_ALIGN == 0 and g.start <= written  # the rest comes as the head
        assert g.last or g.write_end % BUFFER_ALIGN == 0
        for p in g.pieces:
            assert p.buffer_offset == p.file_offset - g.start
        assert len({p.tensor.name for p in g.pieces}) == len(g.pieces)  # a tensor once per group
        written = g.write_end
    assert groups[-1].last and written == plans[0].size
    # a run between two edges larger than the limit stays whole
    big = plan_groups(plan_shards([_t("w", (100, 10), edges=(0, 50))], 10**6, False), limit=row)
    assert [(p.start, p.stop) for g in big for p in g.pieces] == [(0, 50), (50, 100)]
    # groups never span two shards
    two = plan_shards([_t("a", (10,)), _t("b", (10,))], 40, single_file=False)
    assert [g.shard for g in plan_groups(two)] == [0, 1]


def test_index_documents_are_checked() -> None:
    ok = {"metadata": {"total_size": 4}, "weight_map": {"a": "model-00001-of-00001.safetensors"}}
    assert parse_index(json.dumps(ok).encode(), "i") == (ok["weight_map"], ok["metadata"])
    for bad in (
        b"{",
        b"[]",
        b'{"weight_map": {"a": 1}}',
        b'{"weight_map": {"a": "../x"}}',
        b'{"weight_map": {"a": "/x"}}',
    ):
        with pytest.raises(MetadataError):
            parse_index(bad, "i")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        *[("dtype", v) for v in ([1], {"F32": 1}, None, 1.5, True, "F4")],
        *[("shape", v) for v in ({"F32": 1}, None, 1.5, True, "F4", [-1], [1.5], [True])],
        *[("data_offsets", v) for v in ([1], {"F32": 1}, None, 1.5, "F4", [4, 0], [0, 8], [True, 4])],
    ],
)
def test_a_header_entry_of_any_wrong_type_is_a_metadata_error(field: str, value: object) -> None:
    # a list or an object as the dtype code once escaped as a bare TypeError (unhashable)
    entry = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], field: value}
    with pytest.raises(MetadataError, match=r"f: tensor 'a'"):
        parse_header(json.dumps({"a": entry}).encode(), 4, "f")
