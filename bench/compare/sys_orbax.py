"""orbax-checkpoint (run in the peer environment, where it installs): ``PyTreeCheckpointer`` on NumPy arrays."""

from __future__ import annotations

import importlib.metadata
from typing import Any

import numpy as np

from bench.compare.adapter import Adapter

__all__ = ["Orbax"]


def _key(name: str) -> str:
    # orbax joins pytree key paths with '.': keep the flat names unambiguous
    return name.replace(".", "__")


class Orbax(Adapter):
    """``PyTreeCheckpointer().save`` (its default OCDBT layout), fsynced after (timed); ``restore`` as NumPy."""

    durable = False
    fresh = True

    def __init__(self, state: dict[str, np.ndarray]) -> None:
        super().__init__(state)
        import orbax.checkpoint as ocp

        self.ocp = ocp
        self.ckptr = ocp.PyTreeCheckpointer()
        self.tree = {_key(k): v for k, v in state.items()}
        self.result: dict[str, Any] = {}

    def version(self) -> str:
        return f"orbax-checkpoint {importlib.metadata.version('orbax-checkpoint')}"

    def save(self, path: str) -> None:
        self.ckptr.save(path, self.tree)

    def prepare_load(self) -> None:
        pass

    def load(self, path: str) -> None:
        args = {k: self.ocp.RestoreArgs(restore_type=np.ndarray) for k in self.tree}
        out = self.ckptr.restore(path, restore_args=args)
        self.result = {k: out[_key(k)] for k in self.state}

    def loaded(self) -> dict[str, Any]:
        return self.result

    def clear(self) -> None:
        self.result = {}
