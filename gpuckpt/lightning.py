"""``gpuckpt.lightning.CheckpointIO``: PyTorch Lightning checkpoints saved as gpuckpt checkpoints.

Lightning hands its ``CheckpointIO`` plug-in one dictionary per checkpoint: the
model's ``state_dict``, the optimizers' and schedulers' states, the loops'
progress counters, the callbacks' states and the hyper-parameters. This
plug-in saves it with :func:`gpuckpt.save` (a directory at the path Lightning
names, ``epoch=0-step=3.ckpt``, published atomically): tensors as arrays,
plain values (numbers, strings, None, lists, tuples, dicts) as gpuckpt's tagged
JSON values, and other objects only with ``allow_pickle=True``. Loading gives
back the same dictionary with CPU tensors (moved to ``map_location`` when given).
:class:`AsyncCheckpointIO` takes a snapshot and writes it in the background
(:func:`gpuckpt.async_save`). ``LightningModule.load_from_checkpoint`` reads the
path with ``torch.load`` and cannot read such a checkpoint (a directory):
:func:`load_from_checkpoint` does what it does through the plug-in.

Lightning is imported here, when this module is imported, never by ``import gpuckpt``;
the plug-in derives from the ``CheckpointIO`` of ``pytorch_lightning`` (``lightning_fabric``)
and of ``lightning``, whichever are installed, so either package's ``Trainer`` accepts it.

Examples
--------
>>> from gpuckpt.lightning import CheckpointIO  # doctest: +SKIP
>>> trainer = pl.Trainer(plugins=[CheckpointIO()])  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import os
import threading
import warnings
from pathlib import Path
from typing import Any

from gpuckpt import api, background
from gpuckpt.convert.torch_save import numpy_to_torch
from gpuckpt.errors import (
    CheckpointExistsError,
    DeviceUnavailableError,
    InvalidOptionError,
    InvalidPathError,
    MissingDependencyError,
    UnsupportedValueError,
)
from gpuckpt.format.documents import ROOT_KEY
from gpuckpt.options import SaveOptions
from gpuckpt.pending import SaveFuture
from gpuckpt.storage.stores import is_committed, open_root, path_text, scheme_of

__all__ = ["AsyncCheckpointIO", "CheckpointIO", "load_from_checkpoint"]


def _bases() -> tuple[type, ...]:
    found: list[type] = []
    try:
        from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO as FabricIO

        found.append(FabricIO)
    except ImportError:
        pass
    try:
        from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO as UnifiedIO

        if UnifiedIO not in found:
            found.append(UnifiedIO)
    except ImportError:
        pass
    if not found:
        raise MissingDependencyError(
            "gpuckpt.lightning needs PyTorch Lightning: pip install pytorch-lightning (or lightning)"
        )
    return tuple(found)


_BASES = _bases()

_PICKLE_HINT = (
    "; the Lightning checkpoint holds an object that is not a tensor or a plain value (often a "
    "hyper-parameter: save_hyperparameters(ignore=[...]) leaves it out); to store such objects "
    "with pickle, pass allow_pickle=True to the plug-in (loading then runs their code)"
)


def _check_storage_options(storage_options: Any) -> None:
    if storage_options is not None:
        raise InvalidOptionError(
            f"gpuckpt.lightning: storage_options={storage_options!r} is not supported per call; give the "
            "plug-in storage_options= when you create it"
        )


class CheckpointIO(*_BASES):  # type: ignore[misc]
    """A Lightning ``CheckpointIO`` that writes each checkpoint as a gpuckpt checkpoint.

    Parameters
    ----------
    allow_pickle
        Store objects that are neither tensors nor plain values with pickle (and read them
        back). Off by default: such an object is an error that says so.
    threads, chunk_bytes, storage_options
        As for :func:`gpuckpt.save` (``storage_options`` for ``s3://`` paths).

    Examples
    --------
    >>> import pytorch_lightning as pl  # doctest: +SKIP
    >>> from gpuckpt.lightning import CheckpointIO  # doctest: +SKIP
    >>> trainer = pl.Trainer(plugins=[CheckpointIO()], max_steps=10)  # doctest: +SKIP
    >>> trainer.fit(model, ckpt_path="checkpoints/last.ckpt")  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        allow_pickle: bool = False,
        threads: int | None = None,
        chunk_bytes: int | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        # checked as a save checks them, now rather than at the first save (InvalidOptionError:
        # a truthy string such as "no" is not allow_pickle=True)
        options = SaveOptions(allow_pickle=allow_pickle, threads=threads, storage_options=storage_options)
        if chunk_bytes is not None:
            options.replace(chunk_bytes=chunk_bytes)
        self.allow_pickle = allow_pickle
        self.threads = threads
        self.chunk_bytes = chunk_bytes
        self.storage_options = storage_options

    def _save_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {
            "overwrite": True,  # Lightning saves "last.ckpt" again and again
            "allow_pickle": self.allow_pickle,
            "threads": self.threads,
            "storage_options": self.storage_options,
        }
        if self.chunk_bytes is not None:
            kw["chunk_bytes"] = self.chunk_bytes
        return kw

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any = None
    ) -> None:
        """Save Lightning's ``checkpoint`` dict as a gpuckpt checkpoint at ``path``."""
        _check_storage_options(storage_options)
        _refuse_shared_folder(path)
        try:
            api.save(checkpoint, os.fspath(path), **self._save_kwargs())
        except UnsupportedValueError as exc:
            if self.allow_pickle:
                raise
            raise UnsupportedValueError(f"{exc}{_PICKLE_HINT}") from None

    def load_checkpoint(
        self, path: str | os.PathLike[str], map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint dict at ``path``, tensors as CPU torch tensors (or on ``map_location``).

        ``weights_only`` is accepted for Lightning's sake: nothing is unpickled unless the plug-in
        was made with ``allow_pickle=True``."""
        state = api.load_state_dict(
            os.fspath(path),
            allow_pickle=self.allow_pickle,
            threads=self.threads,
            storage_options=self.storage_options,
        )
        out: dict[str, Any] = numpy_to_torch(state)
        if map_location is None:
            return out
        try:
            moved: dict[str, Any] = _moved(out, map_location)
        except (AssertionError, RuntimeError) as exc:  # torch's words for a device it has not
            raise DeviceUnavailableError(
                f"map_location={map_location!r}: torch cannot move the loaded tensors there ({exc}); "
                "load with map_location='cpu' (or None) on this machine"
            ) from exc
        return moved

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Delete the whole checkpoint at ``path`` (nothing when there is none), the directory
        or ``s3://`` prefix :meth:`save_checkpoint` wrote.

        Refused with the errors a save gives for the same path, nothing deleted: a path that is
        not a str or ``os.PathLike``, or empty (:class:`~gpuckpt.errors.InvalidPathError`); a
        path inside a checkpoint (:class:`~gpuckpt.errors.InvalidPathError`: deleting it would
        damage that checkpoint); a folder holding anything that is not a gpuckpt checkpoint's
        (:class:`~gpuckpt.errors.CheckpointExistsError`, as :meth:`save_checkpoint` refuses it)."""
        text = path_text(path)
        if scheme_of(text) != "file":
            self._remove_from_a_store(text)
            return
        p = Path(text).absolute()
        _refuse_inside_a_checkpoint(p)
        if p.is_dir() and not p.is_symlink():
            root = open_root(p.parent)
            _refuse_foreign(root, p)
            root.delete([p.name])  # (out of sight in one rename, then its files)
        elif p.exists() or p.is_symlink():
            p.unlink()

    def _remove_from_a_store(self, url: str) -> None:
        """Delete the checkpoint at the URL ``url`` (an object store's prefix) as a root of
        checkpoints deletes one of its children (claimed, unpublished, then its objects)."""
        parent, _, name = url.rstrip("/").rpartition("/")
        if "://" not in parent:  # s3://bucket alone
            raise InvalidPathError(
                f"{url} names no checkpoint: pass the checkpoint's own URL; nothing was deleted"
            )
        root = open_root(parent, storage_options=self.storage_options)
        try:
            root.child(name)
        except ValueError as exc:
            raise InvalidPathError(f"{url}: {exc}; nothing was deleted") from None
        open_root(url, storage_options=self.storage_options).refuse_inside_a_checkpoint()
        root.delete([name])

    def teardown(self) -> None:
        """Nothing to release (gpuckpt's threads and staging memory are kept for the next save)."""


def _refuse_shared_folder(path: str | os.PathLike[str]) -> None:
    """Refuse a save into a folder that holds what is not a gpuckpt checkpoint's: the plug-in
    saves with ``overwrite=True`` (Lightning saves ``last.ckpt`` again and again), which would
    publish the checkpoint beside those files, and ``remove_checkpoint`` deletes a checkpoint's
    folder whole."""
    if scheme_of(path) != "file":
        return
    p = Path(path).absolute()
    if not p.is_dir() or p.is_symlink():
        return  # (nothing there, or what the save itself refuses)
    others = _others(open_root(p.parent), p)
    if others:
        raise CheckpointExistsError(
            f"{others}; a Lightning checkpoint is saved only where it can later be removed whole: "
            "save to a new path, or move them out"
        )


def _refuse_inside_a_checkpoint(p: Path) -> None:
    """A removal of ``p`` inside a published checkpoint would leave that checkpoint damaged."""
    for parent in p.parents:
        if os.path.lexists(parent / ROOT_KEY) and is_committed(parent):
            raise InvalidPathError(
                f"{p} is inside the gpuckpt checkpoint {parent}: removing it would damage that "
                f"checkpoint; nothing was deleted. Pass the checkpoint's own path ({parent}) to "
                "remove it whole"
            )


def _refuse_foreign(root: Any, p: Path) -> None:
    """Refuse to remove the folder ``p`` (a child of ``root``) where it holds what is not a
    gpuckpt checkpoint's, as :func:`_refuse_shared_folder` refuses a save into it."""
    others = _others(root, p)
    if others:
        raise CheckpointExistsError(
            f"{others}; not deleting it: a Lightning checkpoint is removed only whole. Move them "
            "out, or remove the folder by hand"
        )


def _others(root: Any, p: Path) -> str:
    """What the folder ``p`` (a child of ``root``) holds that is not a gpuckpt checkpoint's, in
    words, or ``""``."""
    others = root.foreign_entries(p.name)
    if not others:
        return ""
    return f"{p} holds {len(others)} entries that are not a gpuckpt checkpoint's (e.g. {others[:3]})"


def _moved(value: Any, where: Any) -> Any:
    """``value`` with every tensor moved by ``map_location`` (a device, a string or a callable)."""
    import torch

    if isinstance(value, torch.Tensor):
        if callable(where):
            moved = where(value, "cpu")
            return value if moved is None else moved
        if isinstance(where, dict):
            return value.to(where.get("cpu", "cpu"))
        return value.to(where)
    if isinstance(value, dict):
        return {k: _moved(v, where) for k, v in value.items()}
    if isinstance(value, list):
        return [_moved(v, where) for v in value]
    if isinstance(value, tuple):
        return tuple(_moved(v, where) for v in value)
    return value


class AsyncCheckpointIO(CheckpointIO):
    """:class:`CheckpointIO` whose saves return once a snapshot is taken
    (:func:`gpuckpt.async_save`); the write goes on in the background.

    One save is in flight at a time: a save waits for the previous one, and loads, removals and
    ``teardown`` (called by Lightning at the end of ``fit``) wait for it too; a failed
    background save raises from the next of these calls.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._pending: SaveFuture | None = None
        self._lock = threading.Lock()

    def wait(self) -> None:
        """Wait for the save in flight; raise its error, if it failed."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except UnsupportedValueError as exc:
            if self.allow_pickle:
                raise
            raise UnsupportedValueError(f"{exc}{_PICKLE_HINT}") from None

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any = None
    ) -> None:
        _check_storage_options(storage_options)
        self.wait()
        _refuse_shared_folder(path)
        try:
            future = background.async_save(checkpoint, os.fspath(path), **self._save_kwargs())
        except UnsupportedValueError as exc:
            if self.allow_pickle:
                raise
            raise UnsupportedValueError(f"{exc}{_PICKLE_HINT}") from None
        with self._lock:
            self._pending = future

    def load_checkpoint(
        self, path: str | os.PathLike[str], map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        self.wait()
        return super().load_checkpoint(path, map_location, weights_only)

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        self.wait()
        super().remove_checkpoint(path)

    def teardown(self) -> None:
        self.wait()


def load_from_checkpoint(
    cls: type[Any],
    path: str | os.PathLike[str],
    map_location: Any = None,
    hparams_file: str | os.PathLike[str] | None = None,
    strict: bool | None = None,
    weights_only: bool | None = None,
    *,
    checkpoint_io: CheckpointIO | None = None,
    **kwargs: Any,
) -> Any:
    """``cls.load_from_checkpoint(path, ...)`` for a checkpoint the plug-in wrote.

    Lightning's classmethod reads ``path`` with ``torch.load``, which cannot read a gpuckpt
    checkpoint (a directory: ``IsADirectoryError``). This reads it through ``checkpoint_io``
    (a new :class:`CheckpointIO`; pass the plug-in you trained with for its ``allow_pickle``
    or ``storage_options``) and then does what Lightning's ``load_from_checkpoint`` does, with
    Lightning's own functions: its migration of checkpoints of older versions; the module made
    from the hyper-parameters saved with it (``save_hyperparameters``), replaced by those of
    ``hparams_file`` (``.yaml`` or ``.csv``) and then by ``kwargs``; ``configure_model`` and
    ``on_load_checkpoint``; the state dict loaded with ``strict`` (by default the module's
    ``strict_loading``, else True; missing or unexpected keys warned of when not strict). The
    tensors are read to the CPU, or moved by ``map_location`` as :meth:`CheckpointIO.load_checkpoint`
    moves them, and the module goes where they are (Lightning's own puts them back on the
    device they were saved from). ``weights_only`` has no effect: nothing is unpickled unless
    ``checkpoint_io`` was made with ``allow_pickle=True``.

    Parameters
    ----------
    cls
        A ``LightningModule`` subclass (of ``pytorch_lightning`` or of ``lightning``).
    path
        The checkpoint (``epoch=3-step=400.ckpt``, a directory, or an ``s3://`` URL).

    Returns
    -------
    A new instance of ``cls``, in training mode as Lightning's is.

    Examples
    --------
    >>> from gpuckpt.lightning import load_from_checkpoint  # doctest: +SKIP
    >>> model = load_from_checkpoint(MyModel, "checkpoints/epoch=3-step=400.ckpt", lr=1e-4)  # doctest: +SKIP
    """
    del weights_only  # (Lightning's argument: what is unpickled is the plug-in's choice)
    saving = _lightning_saving(cls)
    reader = CheckpointIO() if checkpoint_io is None else checkpoint_io
    checkpoint = reader.load_checkpoint(path, map_location)
    local = Path(os.fspath(path)) if scheme_of(path) == "file" else None
    checkpoint = saving._pl_migrate_checkpoint(checkpoint, checkpoint_path=local)
    key = cls.CHECKPOINT_HYPER_PARAMS_KEY
    if hparams_file is not None:
        kind = os.fspath(hparams_file).rsplit(".", 1)[-1].lower()
        if kind == "csv":
            checkpoint[key] = saving.load_hparams_from_tags_csv(hparams_file)
        elif kind in ("yml", "yaml"):
            checkpoint[key] = saving.load_hparams_from_yaml(hparams_file)
        else:
            raise InvalidOptionError(
                f"hparams_file={os.fspath(hparams_file)!r}: give a .yaml, .yml or .csv file "
                "(the kinds Lightning reads)"
            )
    checkpoint.setdefault(key, {})
    checkpoint[key].update(kwargs)
    model = saving._load_state(cls, checkpoint, strict=strict, **kwargs)
    state_dict = checkpoint["state_dict"]
    if not state_dict:
        warnings.warn(f"the state dict in {os.fspath(path)!r} holds no parameters", UserWarning, stacklevel=2)
        return model
    import torch

    device = next((t.device for t in state_dict.values() if isinstance(t, torch.Tensor)), torch.device("cpu"))
    return model.to(device)


def _lightning_saving(cls: Any) -> Any:
    """Lightning's ``core.saving`` module of the package whose ``LightningModule`` ``cls`` derives from."""
    for package in ("pytorch_lightning", "lightning.pytorch"):
        try:
            base = importlib.import_module(package).LightningModule
            saving = importlib.import_module(f"{package}.core.saving")
        except (ImportError, AttributeError):
            continue
        if isinstance(cls, type) and issubclass(cls, base):
            if not all(hasattr(saving, f) for f in ("_load_state", "_pl_migrate_checkpoint")):
                raise MissingDependencyError(
                    f"gpuckpt.lightning.load_from_checkpoint uses {package}.core.saving's _load_state and "
                    "_pl_migrate_checkpoint, which this Lightning lacks; load by hand: "
                    "ck = CheckpointIO().load_checkpoint(path); model = MyModel(**ck['hyper_parameters']); "
                    "model.load_state_dict(ck['state_dict'])"
                )
            return saving
    raise UnsupportedValueError(
        f"gpuckpt.lightning.load_from_checkpoint makes a LightningModule: {cls!r} is not a subclass of "
        "pytorch_lightning.LightningModule or lightning.pytorch.LightningModule; pass the model's class "
        "(for other objects, read the checkpoint with CheckpointIO().load_checkpoint(path))"
    )
