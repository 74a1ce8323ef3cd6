"""Flattening nested state dicts into FQNs, and back.

A state dict is a ``dict`` whose values may be arrays, plain values, or
nested dicts, lists and tuples of those. Each leaf gets a fully qualified
name (FQN): the keys and list indices on its path joined with ``.``, e.g.
``model.layers.0.weight``. Dicts are always traversed; lists and tuples are
traversed when they contain an array or a dict somewhere, otherwise they are
one plain value (``"betas": (0.9, 0.999)`` stays a tuple).

The nesting is recorded as a JSON *skeleton* so that a load rebuilds the same
containers with the same key types (``str`` or ``int``) and order, empty
ones included.

A partial load (``keys=...``) rebuilds only the containers on the way to the
selected leaves. A list or tuple of which only some positions are selected
comes back as a ``dict`` from position (``int``) to entry:
``{"layers": [a, b, c]}`` loaded with ``keys=["layers.1"]`` gives
``{"layers": {1: b}}``. Indexing by position works as on the full list, and
no placeholder stands in for the positions not loaded, where it could be
taken for a stored value. A sequence whose every position is selected comes
back as itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuckpt.errors import InvalidOptionError, MetadataError, MissingKeyError, UnsupportedValueError
from gpuckpt.format.values import refuse_flooded_keys

__all__ = ["Leaf", "flatten_state_dict", "key_names", "select_fqns", "unflatten_state_dict"]

_MAX_DEPTH = 200


@dataclass(slots=True)
class _TupleSlot:
    """A tuple of a state dict, as the list its leaves are replaced in, and where it lives: a
    tuple cannot change, so a replaced leaf puts a new tuple in its place (and so on up, for
    tuples in tuples; the root is a dict)."""

    items: list[Any]
    container: Any
    key: Any
    outer: _TupleSlot | None

    def rebuild(self) -> None:
        self.container[self.key] = tuple(self.items)
        if self.outer is not None:
            self.outer.rebuild()


@dataclass(slots=True)
class Leaf:
    """A leaf of a state dict and where it lives, so that a load can replace it."""

    fqn: str
    value: Any
    container: Any
    key: Any
    #: the tuple the leaf is in (its ``container`` is then that tuple's list of items)
    tuple_slot: _TupleSlot | None = None

    def replace(self, value: Any) -> None:
        self.container[self.key] = value
        if self.tuple_slot is not None:
            self.tuple_slot.rebuild()


def _contains_array(value: Any, is_array: Callable[[Any], bool], depth: int = 0) -> bool:
    if depth > _MAX_DEPTH:
        return False
    if is_array(value) or isinstance(value, dict):
        return True
    if isinstance(value, (list, tuple)):
        return any(_contains_array(v, is_array, depth + 1) for v in value)
    return False


def flatten_state_dict(
    state_dict: dict[str, Any], is_array: Callable[[Any], bool]
) -> tuple[dict[str, Leaf], dict[str, Any]]:
    """Flatten ``state_dict`` into ``{fqn: Leaf}`` and a JSON skeleton.

    Tuples are immutable: arrays inside them are filled in place by a load, and
    replacing a leaf inside one (:meth:`Leaf.replace`) puts a new tuple of the same
    items, the new leaf among them, where the tuple was.

    Raises
    ------
    UnsupportedValueError
        For non-``str``/``int`` dict keys, a top level that is not a dict,
        reference cycles, or two leaves with the same FQN.
    """
    if not isinstance(state_dict, dict):
        raise UnsupportedValueError(
            f"state_dict must be a dict, found {type(state_dict).__name__}; wrap the value: {{'value': x}}"
        )
    leaves: dict[str, Leaf] = {}
    active: set[int] = set()

    def visit(
        container: Any, key: Any, value: Any, prefix: str, depth: int, slot: _TupleSlot | None = None
    ) -> Any:
        if depth > _MAX_DEPTH:
            raise UnsupportedValueError(f"state dict nesting deeper than {_MAX_DEPTH} at {prefix!r}")
        traverse = isinstance(value, dict) or (
            isinstance(value, (list, tuple)) and not is_array(value) and _contains_array(value, is_array)
        )
        if not traverse:
            if prefix in leaves:
                raise UnsupportedValueError(
                    f"two entries flatten to the same name {prefix!r} (e.g. a key 'a.b' next to "
                    "a nested 'a' -> 'b'); rename one of them"
                )
            leaves[prefix] = Leaf(prefix, value, container, key, slot)
            return {"v": prefix}
        if id(value) in active:
            raise UnsupportedValueError(f"the state dict contains a reference cycle at {prefix!r}")
        active.add(id(value))
        try:
            if isinstance(value, dict):
                items = []
                for k, v in value.items():
                    if isinstance(k, bool) or not isinstance(k, (str, int)):
                        raise UnsupportedValueError(
                            f"key {k!r} under {prefix or '<root>'!r} has type {type(k).__name__}; "
                            "only str and int keys can be stored"
                        )
                    try:
                        name = str(k) if depth == 0 else f"{prefix}.{k}"
                    except ValueError:  # an int past the interpreter's int-to-str digit limit
                        raise UnsupportedValueError(
                            f"an int key under {prefix or '<root>'!r} has {int(k).bit_length()} bits, "
                            "too many digits to be part of an entry name (see sys.get_int_max_str_digits()); "
                            "use a shorter key, or store the number as a value"
                        ) from None
                    items.append(["i" if isinstance(k, int) else "s", k, visit(value, k, v, name, depth + 1)])  # noqa: F821 (see its finally)
                return {"d": items}
            # a list's leaves live in the list; a tuple's in a list that makes a new tuple
            # where the tuple was, in its container, when one is replaced; a dict or list
            # inside a tuple is changed in place, so the tuple stays as it is for them
            seq, inner = value, None
            if isinstance(value, tuple):
                seq = list(value)
                inner = _TupleSlot(seq, container, key, slot)
            kids = [
                visit(seq, i, v, f"{prefix}.{i}" if depth else str(i), depth + 1, inner)  # noqa: F821 (see its finally)
                for i, v in enumerate(seq)
            ]
            return {"l": kids} if isinstance(value, list) else {"t": kids}
        finally:
            active.discard(id(value))

    try:
        skeleton = visit(None, None, state_dict, "", 0)
    finally:
        del visit  # (a recursive closure is a cycle: it would keep the leaves until a collection)
    return leaves, skeleton


def unflatten_state_dict(
    skeleton: Any,
    values: Mapping[str, Any],
    selection: Iterable[str] | None = None,
    *,
    entries: Iterable[str] | None = None,
) -> dict[str, Any]:
    """Rebuild nested containers from ``skeleton`` with the leaves in ``values``.

    ``selection`` is None for a whole state (``values`` holds every leaf):
    every container comes back, empty ones included. For a partial load it
    holds the selected keys (FQNs or ``.``-prefixes): leaves absent from
    ``values`` are left out, containers holding none of the selected leaves
    are dropped (an empty one is kept when a selected key covers it), and a
    list or tuple with only some positions selected becomes a ``dict`` from
    position to entry (see the module docstring). The root is always a dict.

    ``entries``, where given, are the FQNs of every entry the checkpoint holds: the skeleton must
    place each of them and no other (a :class:`MetadataError` names the first that differs), so
    that a structure edited to leave an entry out cannot drop it from a load unnoticed.
    """
    keys = None if selection is None else ([selection] if isinstance(selection, str) else list(selection))

    def keep_empty(path: tuple[Any, ...]) -> bool:
        if keys is None:
            return True
        name = ".".join(str(p) for p in path)
        return any(name == k or name.startswith(k if k.endswith(".") else k + ".") for k in keys)

    placed: set[str] = set()

    # ``path`` (the node's keys from the root) matters to a partial load only: a whole one
    # leaves it empty rather than make a tuple per node
    def build(node: Any, depth: int, path: tuple[Any, ...]) -> tuple[bool, Any]:
        if depth > _MAX_DEPTH or not isinstance(node, dict) or len(node) != 1:
            raise MetadataError(f"malformed structure node in planner_data: {str(node)[:200]}")
        ((tag, body),) = node.items()
        if tag == "v":
            if not isinstance(body, str):
                raise MetadataError(f"malformed structure leaf in planner_data: {body!r}")
            if body in placed:  # (a save names each leaf once: twice would hand out one array twice)
                raise MetadataError(f"the structure in planner_data names the entry {body[:200]!r} twice")
            placed.add(body)
            return (body in values, values.get(body))
        if not isinstance(body, list):
            raise MetadataError(f"malformed structure node {tag!r} in planner_data")
        if tag == "d":
            out: dict[Any, Any] = {}
            for item in body:
                if not (isinstance(item, list) and len(item) == 3 and item[0] in ("s", "i")):
                    raise MetadataError(f"malformed dict item in planner_data: {str(item)[:200]}")
                kt, k, _ = item
                if (kt == "s" and not isinstance(k, str)) or (
                    kt == "i" and (not isinstance(k, int) or isinstance(k, bool))
                ):
                    raise MetadataError(f"malformed dict key in planner_data: {k!r}")
            names = [k for _, k, _ in body]
            refuse_flooded_keys(names, "a dict of the structure in planner_data")
            seen: set[Any] = set()
            for k in names:  # (a save names each key of a dict once)
                if k in seen:
                    raise MetadataError(
                        f"a dict of the structure in planner_data names the key {str(k)[:200]!r} twice"
                    )
                seen.add(k)
            for _, k, child in body:
                present, v = build(child, depth + 1, (*path, k) if keys is not None else path)  # noqa: F821 (see its finally)
                if present:
                    out[k] = v
            return (bool(out) or depth == 0 or (not body and keep_empty(path)), out)
        if tag in ("l", "t"):
            parts = [
                build(child, depth + 1, (*path, i) if keys is not None else path)  # noqa: F821 (see its finally)
                for i, child in enumerate(body)
            ]
            if all(p for p, _ in parts):
                seq = [v for _, v in parts]
                return (bool(seq) or keep_empty(path), seq if tag == "l" else tuple(seq))
            # some positions only: keyed by position, so that indices keep their meaning
            partial = {i: v for i, (p, v) in enumerate(parts) if p}
            return (bool(partial), partial)
        raise MetadataError(f"unknown structure tag {tag!r} in planner_data")

    try:
        _, root = build(skeleton, 0, ())
    finally:
        # (a recursive closure is a cycle: it would keep ``values``, the loaded arrays, alive
        # after the caller drops them, until a collection, which arrays do not prompt)
        del build
    if not isinstance(root, dict):
        raise MetadataError("planner_data structure root is not a dict")
    if entries is not None:
        held = set(entries)
        if held != placed:
            left, unknown = sorted(held - placed), sorted(placed - held)
            more = f" and {len(left) - 1} more" if len(left) > 1 else ""
            what = (
                f"leaves out the entry {left[0][:200]!r}{more}"
                if left
                else f"names {unknown[0][:200]!r}, which the checkpoint does not hold"
            )
            raise MetadataError(
                f"the structure in planner_data {what}: a load would not give back the state saved"
            )
    return root


def key_names(keys: Any) -> list[str] | None:
    """``keys`` (None, a name, or names; an int key's FQN is its digits) as a list of FQN texts,
    or an :class:`~gpuckpt.errors.InvalidOptionError` naming what is not a name."""
    if keys is None:
        return None
    if isinstance(keys, (str, int)) and not isinstance(keys, bool):
        keys = [keys]
    elif not isinstance(keys, Iterable) or isinstance(keys, (str, bytes, Mapping)):
        raise InvalidOptionError(f"keys must be a name, a list of names or None, got {keys!r}")
    names = list(keys)
    for k in names:
        if not isinstance(k, (str, int)) or isinstance(k, bool):
            raise InvalidOptionError(
                f"keys must name entries as strings (FQNs such as 'model.layers.0'), got {k!r} "
                f"({type(k).__name__})"
            )
    return [k if isinstance(k, str) else str(k) for k in names]


def select_fqns(available: Iterable[str], keys: Iterable[str] | None) -> list[str]:
    """FQNs of ``available`` selected by ``keys``: exact names or ``.``-prefixes (``"model"``
    selects ``model`` and ``model.*``; ``"model."``, written as a prefix, ``model.*``).

    Raises :class:`MissingKeyError` for a key that selects nothing.
    """
    avail = list(available)
    keys = key_names(keys)
    if keys is None:
        return avail
    chosen: dict[str, None] = {}
    for k in keys:
        prefix = k if k.endswith(".") else k + "."
        hits = [f for f in avail if f == k or f.startswith(prefix)]
        if not hits:
            close = [f for f in avail if k.split(".")[0] == f.split(".")[0]][:5]
            raise MissingKeyError(
                f"key {k!r} is not in the checkpoint"
                + (f"; similar keys: {', '.join(close)}" if close else "")
                + "; list the keys with gpuckpt.read_metadata(path).state_dict_metadata"
            )
        for f in hits:
            chosen[f] = None
    return list(chosen)
