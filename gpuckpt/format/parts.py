"""The part record: what a checkpoint in a local tier is a part of.

A part is an ordinary single-process checkpoint of what one rank holds at one step
(each ``ShardedArray`` box as an array of the box's shape, whole arrays, plain values),
written to its node's local tier by a :class:`~gpuckpt.CheckpointManager` with
``local_dir``. Its root document carries this record as ``planner_data["gpuckpt.tier"]``;
readers that do not know the entry ignore it, so no format version is needed::

    {"format": 1, "step": 120, "save_id": "9f1c...", "rank": 2, "world_size": 4,
     "node": "n1", "layout": "3b0a...",
     "boxes": {"model.w": [[[256, 0], [1024, 512]]]}}

``boxes`` gives, per FQN of a sharded tensor, the offsets and global shape of each of
the rank's boxes, in the order the part stores them (one box: the array under the FQN;
several: a list of arrays). ``layout`` is the digest of the rank's state at the save
(:func:`gpuckpt.tiers.parts.layout_of`): a restore uses a part only for a rank whose state has
the same layout. Steps of one line are told apart by ``save_id``: every rank's part of one
save has the same one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpuckpt.errors import MetadataError
from gpuckpt.format.documents import leading_planner_entry, metadata_json

__all__ = ["PART_KEY", "PartRecord", "part_name", "parse_part_name"]

#: the entry of ``planner_data`` that holds the record
PART_KEY = "gpuckpt.tier"
_FORMAT = 1
_MAX_RANK = 1 << 24


def part_name(step: int, rank: int) -> str:
    """The directory name of ``rank``'s part of ``step`` in a local tier."""
    return f"step_{step:08d}.rank_{rank:05d}"


def parse_part_name(name: str) -> tuple[int, int] | None:
    """``(step, rank)`` of a part's directory name, else None: only the name :func:`part_name`
    gives (``step_120.rank_3`` is no part's name; a restore, which opens parts by
    :func:`part_name`, would not find it)."""
    head, sep, tail = name.partition(".rank_")
    if not sep or not head.startswith("step_"):
        return None
    step, rank = head.removeprefix("step_"), tail
    if not (step.isdigit() and rank.isdigit() and step.isascii() and rank.isascii()):
        return None
    parsed = int(step), int(rank)
    return parsed if part_name(*parsed) == name else None


@dataclass(frozen=True)
class PartRecord:
    """Which rank's part of which save a checkpoint in a local tier is (see the module docstring)."""

    step: int
    save_id: str
    rank: int
    world_size: int
    node: str
    layout: str
    boxes: dict[str, tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "step": self.step,
            "save_id": self.save_id,
            "rank": self.rank,
            "world_size": self.world_size,
            "node": self.node,
            "layout": self.layout,
            "boxes": {fqn: [[list(o), list(g)] for o, g in boxes] for fqn, boxes in self.boxes.items()},
        }

    @classmethod
    def from_root_document(cls, raw: bytes | bytearray, where: str) -> PartRecord | None:
        """The record in a part's root ``zarr.json`` (named ``where`` in errors), its checksum
        checked, without reading the rest of its metadata (a restore lists every part of a
        tier); None when it holds none.

        Raises
        ------
        MetadataError
            When the document is damaged or the entry malformed.
        """
        found, entry = leading_planner_entry(raw, PART_KEY)
        if found:  # (a part as the tier writes it: the record alone is parsed)
            return cls.from_planner_data({PART_KEY: entry})
        md = metadata_json(raw, where)
        return cls.from_planner_data(md.get("planner_data") if isinstance(md, dict) else None)

    @classmethod
    def from_planner_data(cls, planner_data: Any) -> PartRecord | None:
        """The record in a checkpoint's ``planner_data``; None when it has none (not a part).

        Raises
        ------
        MetadataError
            When the entry exists but is malformed.
        """
        if not isinstance(planner_data, dict) or PART_KEY not in planner_data:
            return None
        d = planner_data[PART_KEY]

        def bad(what: str) -> MetadataError:
            return MetadataError(f"planner_data[{PART_KEY!r}]: {what}; found {str(d)[:300]}")

        if not isinstance(d, dict) or d.get("format") != _FORMAT:
            raise bad(f"expected an object of format {_FORMAT}")
        ints = {k: d.get(k) for k in ("step", "rank", "world_size")}
        for k, v in ints.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 0 or v >= (1 << 62):
                raise bad(f"{k} must be a non-negative integer")
        if not 0 <= ints["rank"] < ints["world_size"] <= _MAX_RANK:  # type: ignore[operator]
            raise bad("rank must lie in [0, world_size)")
        for k in ("save_id", "node", "layout"):
            if not isinstance(d.get(k), str) or len(d[k]) > 4096:
                raise bad(f"{k} must be a string")
        raw = d.get("boxes")
        if not isinstance(raw, dict):
            raise bad("boxes must be an object")
        boxes: dict[str, tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]] = {}
        for fqn, items in raw.items():
            if not isinstance(items, list) or not items:
                raise bad(f"boxes[{fqn!r}] must be a non-empty list")
            parsed = []
            for item in items:
                if not (isinstance(item, list) and len(item) == 2 and all(isinstance(x, list) for x in item)):
                    raise bad(f"boxes[{fqn!r}] holds {str(item)[:100]}, not [offsets, global shape]")
                offsets, shape = item
                if len(offsets) != len(shape) or not all(
                    isinstance(x, int) and not isinstance(x, bool) and 0 <= x < (1 << 62)
                    for x in (*offsets, *shape)
                ):
                    raise bad(
                        f"boxes[{fqn!r}]: offsets and shape must be non-negative integers, one per axis"
                    )
                parsed.append((tuple(offsets), tuple(shape)))
            boxes[fqn] = tuple(parsed)
        return cls(
            step=ints["step"],  # type: ignore[arg-type]
            save_id=d["save_id"],
            rank=ints["rank"],  # type: ignore[arg-type]
            world_size=ints["world_size"],  # type: ignore[arg-type]
            node=d["node"],
            layout=d["layout"],
            boxes=boxes,
        )
