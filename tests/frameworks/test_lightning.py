"""``gpuckpt.lightning``: a real ``Trainer.fit`` on CPU checkpoints through the plug-in, resumes
from its checkpoint, and ends bit-exact with a run that was never interrupted."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.torch

EPOCHS = 3  # the interrupted run stops after 2 and resumes for the third


class Schedule:
    """A hyper-parameter that is neither a tensor nor a plain value."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schedule)

    __hash__ = object.__hash__


def _lightning() -> Any:
    pytest.importorskip("torch")
    return pytest.importorskip("pytorch_lightning")


def _module(pl: Any, torch: Any, hparam: Any = 0.05) -> Any:
    class Tiny(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self, lr: Any = hparam) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))

        def training_step(self, batch: Any, _index: int) -> Any:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=0.05)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)]

    return Tiny()


def _fit(pl: Any, torch: Any, plugin: Any, root: Path, epochs: int, ckpt_path: str | None = None) -> Any:
    pl.seed_everything(7, workers=True)
    model = _module(pl, torch)
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 2, generator=g))
    trainer = pl.Trainer(
        max_epochs=epochs,
        plugins=[plugin] if plugin is not None else None,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        deterministic=True,
        accelerator="cpu",
        devices=1,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's tips about workers and loggers
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8), ckpt_path=ckpt_path)
    return trainer, model


def _bits(model: Any) -> dict[str, bytes]:
    return {k: v.detach().numpy().tobytes() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("kind", ["CheckpointIO", "AsyncCheckpointIO"])
def test_fit_checkpoint_resume_is_bit_exact(tmp_path: Path, kind: str) -> None:
    pl = _lightning()
    import torch

    import gpuckpt.lightning

    _, whole = _fit(pl, torch, None, tmp_path / "whole", EPOCHS)
    plugin = getattr(gpuckpt.lightning, kind)()
    first, _ = _fit(pl, torch, plugin, tmp_path / "run", EPOCHS - 1)
    ckdir = tmp_path / "run" / "checkpoints"
    kept = sorted(p.name for p in ckdir.iterdir() if not p.name.startswith("."))
    # ModelCheckpoint kept the last epoch's checkpoint and removed the first one whole
    assert kept == [f"epoch={EPOCHS - 2}-step={4 * (EPOCHS - 1)}.ckpt"], kept
    ck = ckdir / kept[0]
    assert (ck / "zarr.json").is_file()
    loaded = plugin.load_checkpoint(ck)
    assert loaded["global_step"] == 4 * (EPOCHS - 1) and loaded["hyper_parameters"] == {"lr": 0.05}
    assert isinstance(loaded["state_dict"]["net.0.weight"], torch.Tensor)
    assert loaded["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.999)
    _, resumed = _fit(pl, torch, getattr(gpuckpt.lightning, kind)(), tmp_path / "run2", EPOCHS, str(ck))
    assert _bits(resumed) == _bits(whole)
    assert first.global_step == 4 * (EPOCHS - 1)


def test_the_plug_ins_check_their_options_when_made(tmp_path: Path) -> None:
    """As a save checks them, when the plug-in is made: a truthy string is not allow_pickle=True
    (it would have stored and then run pickles)."""
    _lightning()
    from gpuckpt.errors import InvalidOptionError
    from gpuckpt.lightning import AsyncCheckpointIO, CheckpointIO

    for kind in (CheckpointIO, AsyncCheckpointIO):
        for bad, match in (
            ({"allow_pickle": "no"}, "allow_pickle must be True or False"),
            ({"threads": 0}, "threads"),
            ({"chunk_bytes": "64MB"}, "chunk_bytes"),
            ({"storage_options": "x"}, "storage_options"),
        ):
            with pytest.raises(InvalidOptionError, match=match):
                kind(**bad)
    assert CheckpointIO(allow_pickle=True, threads=2, chunk_bytes=1 << 20).allow_pickle is True
    # a map_location this torch cannot reach is a typed error saying so (torch raises an
    # AssertionError on a CPU build)
    import torch

    from gpuckpt.errors import DeviceUnavailableError

    plugin = CheckpointIO()
    plugin.save_checkpoint({"w": torch.ones(2)}, tmp_path / "c.ckpt")
    if torch.cuda.is_available():
        assert plugin.load_checkpoint(tmp_path / "c.ckpt", map_location="cuda")["w"].is_cuda
    else:
        with pytest.raises(DeviceUnavailableError, match="map_location='cuda'"):
            plugin.load_checkpoint(tmp_path / "c.ckpt", map_location="cuda")
    assert plugin.load_checkpoint(tmp_path / "c.ckpt", map_location="cpu")["w"].tolist() == [1.0, 1.0]


def test_objects_need_allow_pickle_and_the_error_says_so(tmp_path: Path) -> None:
    pl = _lightning()
    import torch

    from gpuckpt.errors import UnsupportedValueError
    from gpuckpt.lightning import AsyncCheckpointIO, CheckpointIO

    model = _module(pl, torch, Schedule())
    checkpoint = {"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams)}
    for plugin in (CheckpointIO(), AsyncCheckpointIO()):
        with pytest.raises(UnsupportedValueError, match="allow_pickle=True to the plug-in"):
            plugin.save_checkpoint(checkpoint, tmp_path / "refused.ckpt")
            plugin.teardown()
        assert not (tmp_path / "refused.ckpt").exists()
    plugin = CheckpointIO(allow_pickle=True)
    plugin.save_checkpoint(checkpoint, tmp_path / "pickled.ckpt")
    back = plugin.load_checkpoint(tmp_path / "pickled.ckpt", map_location="cpu")
    assert back["hyper_parameters"]["lr"] == Schedule()
    assert np.array_equal(
        back["state_dict"]["net.0.weight"].numpy(), model.state_dict()["net.0.weight"].numpy()
    )
    with pytest.raises(Exception, match="allow_pickle"):
        CheckpointIO().load_checkpoint(tmp_path / "pickled.ckpt")
    plugin.remove_checkpoint(tmp_path / "pickled.ckpt")
    assert not (tmp_path / "pickled.ckpt").exists()
    plugin.remove_checkpoint(tmp_path / "pickled.ckpt")  # nothing there: nothing to do


def test_a_folder_of_other_files_is_never_saved_into_nor_removed(tmp_path: Path) -> None:
    """The plug-in saves with overwrite=True (last.ckpt again and again) and removes a checkpoint's
    folder whole: a folder holding anything that is not a gpuckpt checkpoint's is refused both
    ways, and keeps what it holds; a checkpoint is saved over and removed as before."""
    _lightning()
    import torch

    import gpuckpt
    from gpuckpt.errors import CheckpointExistsError
    from gpuckpt.lightning import AsyncCheckpointIO, CheckpointIO

    run = tmp_path / "run1"
    run.mkdir()
    (run / "train_log.txt").write_text("mine")
    for plugin in (CheckpointIO(), AsyncCheckpointIO()):
        with pytest.raises(CheckpointExistsError, match=r"train_log\.txt.*save to a new path"):
            plugin.save_checkpoint({"w": torch.ones(2)}, run)
        plugin.teardown()
        # the same error type both ways
        with pytest.raises(CheckpointExistsError, match=r"train_log\.txt.*not deleting it"):
            plugin.remove_checkpoint(run)
    assert sorted(p.name for p in run.iterdir()) == ["train_log.txt"]
    # another program's Zarr store: not gpuckpt's, not removed
    foreign = tmp_path / "store"
    foreign.mkdir()
    (foreign / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group", "attributes": {}}')
    with pytest.raises(CheckpointExistsError, match="not deleting it"):
        CheckpointIO().remove_checkpoint(foreign)
    assert (foreign / "zarr.json").is_file()
    plugin = CheckpointIO()
    last = tmp_path / "last.ckpt"
    for value in (1.0, 2.0):
        plugin.save_checkpoint({"w": torch.full((2,), value)}, last)
    assert gpuckpt.load_state_dict(last)["w"].tolist() == [2.0, 2.0]
    plugin.remove_checkpoint(last)
    assert not last.exists()


def _trainer(pl: Any, plugin: Any, root: Path) -> Any:
    return pl.Trainer(plugins=[plugin], default_root_dir=root, logger=False, accelerator="cpu", devices=1)


@pytest.mark.parametrize("kind", ["CheckpointIO", "AsyncCheckpointIO"])
def test_remove_checkpoint_refuses_bad_paths_with_the_errors_a_save_gives(tmp_path: Path, kind: str) -> None:
    """Through a Trainer's strategy, as ModelCheckpoint removes checkpoints: a path that is not
    one, a path inside a checkpoint and a folder of other files are refused with gpuckpt's
    errors (the ones save_checkpoint gives), and nothing is deleted."""
    pl = _lightning()
    import torch

    import gpuckpt
    import gpuckpt.lightning
    from gpuckpt.errors import CheckpointExistsError, GpuckptError, InvalidPathError
    from gpuckpt.verify import verify_checkpoint

    plugin = getattr(gpuckpt.lightning, kind)()
    strategy = _trainer(pl, plugin, tmp_path).strategy
    ckpt = tmp_path / "epoch=0-step=3.ckpt"
    plugin.save_checkpoint({"w": torch.ones(2), "m": {"b": torch.zeros(3)}}, ckpt)
    for bad, match in ((None, "str or os.PathLike"), (3, "str or os.PathLike"), ("", "empty")):
        with pytest.raises(InvalidPathError, match=match):
            strategy.remove_checkpoint(bad)
    for inside in (ckpt / "w", ckpt / "m", ckpt / "zarr.json"):
        with pytest.raises(InvalidPathError, match=r"inside the gpuckpt checkpoint .*remove it whole"):
            strategy.remove_checkpoint(inside)
    assert verify_checkpoint(ckpt).ok
    assert gpuckpt.load_state_dict(ckpt)["m"]["b"].tolist() == [0.0, 0.0, 0.0]
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    errors = []
    for act in (
        lambda: plugin.save_checkpoint({"w": torch.ones(2)}, run),
        lambda: strategy.remove_checkpoint(run),
    ):
        with pytest.raises(GpuckptError) as info:
            act()
        plugin.teardown()
        errors.append(info.type)
    assert errors == [CheckpointExistsError, CheckpointExistsError]
    assert (run / "notes.txt").read_text() == "mine"
    strategy.remove_checkpoint(ckpt)
    assert not ckpt.exists()
    strategy.remove_checkpoint(ckpt)  # nothing there: nothing to do


def test_remove_checkpoint_of_a_url_deletes_that_checkpoint_from_the_store(tmp_path: Path) -> None:
    """Through a Trainer's strategy, against an S3 server on loopback: checkpoints saved under
    Lightning's names (``epoch=0-step=3.ckpt``) are removed whole, the others stay; a URL inside
    a checkpoint or a bucket alone is refused, nothing deleted; an ``s3:`` directory under the
    working directory is never taken for the store."""
    pl = _lightning()
    pytest.importorskip("moto.server")
    import torch

    import gpuckpt
    from gpuckpt.errors import InvalidPathError
    from gpuckpt.lightning import CheckpointIO
    from gpuckpt.testing.s3server import loopback_s3, s3_options

    with loopback_s3("ckpts") as url:
        opts = s3_options(url)
        plugin = CheckpointIO(storage_options=opts)
        strategy = _trainer(pl, plugin, tmp_path).strategy
        names = [f"s3://ckpts/run/epoch={e}-step={3 * e}.ckpt" for e in range(3)]
        for e, name in enumerate(names):
            plugin.save_checkpoint({"w": torch.full((2,), float(e)), "m": {"b": torch.zeros(3)}}, name)
        local = tmp_path / "s3:" / "ckpts" / "run" / "epoch=0-step=0.ckpt"
        local.parent.mkdir(parents=True)
        local.write_text("a local file")
        cwd = os.getcwd()
        os.chdir(tmp_path)
        try:
            for bad, match in (
                (names[1] + "/w", "inside the gpuckpt checkpoint"),
                (names[1] + "/zarr.json", "not a plain name"),
                ("s3://ckpts", "names no checkpoint"),
            ):
                with pytest.raises(InvalidPathError, match=match):
                    strategy.remove_checkpoint(bad)
            strategy.remove_checkpoint(names[0])
            strategy.remove_checkpoint(names[0])  # nothing there: nothing to do
        finally:
            os.chdir(cwd)
        assert local.read_text() == "a local file"
        root = gpuckpt.storage.stores.open_root("s3://ckpts/run", storage_options=opts)
        assert root.children() == [n.rsplit("/", 1)[1] for n in names[1:]]
        for e, name in enumerate(names[1:], 1):
            got = gpuckpt.load_state_dict(name, storage_options=opts)
            assert got["w"].tolist() == [float(e)] * 2 and got["m"]["b"].tolist() == [0.0] * 3
        with pytest.raises(gpuckpt.CheckpointNotFoundError):
            gpuckpt.load_state_dict(names[0], storage_options=opts)


def test_load_from_checkpoint_builds_the_module_as_lightning_s_classmethod_does(tmp_path: Path) -> None:
    """Lightning's ``Tiny.load_from_checkpoint`` reads the path with torch.load and cannot read the
    plug-in's checkpoints (a directory); ``gpuckpt.lightning.load_from_checkpoint`` makes the module
    from its saved hyper-parameters (replaced by an hparams file, then by keywords), loads its
    weights bit for bit, honours ``strict`` and moves the tensors by ``map_location``."""
    pl = _lightning()
    import torch

    from gpuckpt.errors import InvalidOptionError, UnsupportedValueError
    from gpuckpt.lightning import CheckpointIO, load_from_checkpoint

    trainer, trained = _fit(pl, torch, CheckpointIO(), tmp_path / "run", 1)
    path = Path(trainer.checkpoint_callback.best_model_path)
    assert (path / "zarr.json").is_file()
    tiny = type(trained)

    model = load_from_checkpoint(tiny, path)
    assert type(model) is tiny and model.hparams.lr == 0.05
    assert _bits(model) == _bits(trained)
    assert load_from_checkpoint(tiny, path, lr=0.5).hparams.lr == 0.5
    hparams = tmp_path / "hparams.yaml"
    hparams.write_text("lr: 0.25\n")
    assert load_from_checkpoint(tiny, path, hparams_file=hparams).hparams.lr == 0.25
    assert load_from_checkpoint(tiny, path, hparams_file=hparams, lr=0.5).hparams.lr == 0.5
    with pytest.raises(InvalidOptionError, match="yaml"):
        load_from_checkpoint(tiny, path, hparams_file=tmp_path / "hparams.json")

    moved = []

    def to_double(tensor: Any, location: str) -> Any:
        moved.append(location)
        return tensor.double()

    model = load_from_checkpoint(tiny, path, map_location=to_double)
    assert moved and _bits(model) == _bits(trained)  # (float64 copies, loaded into float32 weights)

    class Wider(tiny):  # type: ignore[misc, valid-type]
        def __init__(self, lr: Any = 0.05) -> None:
            super().__init__(lr)
            self.extra = torch.nn.Linear(2, 2)

    with pytest.raises(RuntimeError, match="extra.weight"):
        load_from_checkpoint(Wider, path)
    with pytest.warns(UserWarning, match="extra.weight"):
        wider = load_from_checkpoint(Wider, path, strict=False)
    assert wider.net[0].weight.equal(trained.net[0].weight)
    with pytest.raises(UnsupportedValueError, match="LightningModule"):
        load_from_checkpoint(torch.nn.Linear, path)
    # a hyper-parameter stored with pickle: read only through a plug-in that allows pickles
    pickled = tmp_path / "pickled.ckpt"
    checkpoint = {
        "state_dict": trained.state_dict(),
        "hyper_parameters": {"lr": Schedule()},
        "pytorch-lightning_version": pl.__version__,
    }
    CheckpointIO(allow_pickle=True).save_checkpoint(checkpoint, pickled)
    with pytest.raises(Exception, match="allow_pickle"):
        load_from_checkpoint(tiny, pickled)
    model = load_from_checkpoint(tiny, pickled, checkpoint_io=CheckpointIO(allow_pickle=True))
    assert model.hparams.lr == Schedule() and _bits(model) == _bits(trained)
