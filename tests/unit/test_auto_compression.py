"""``compression="auto"``'s decision (gpuckpt/saving/compression.py) as data: what it compresses,
what it skips, and how many bytes it reads to decide."""

from __future__ import annotations

import dataclasses
from typing import Any
from unittest import mock

import ml_dtypes
import numpy as np
import pytest

from gpuckpt.format.codecs import PRESETS
from gpuckpt.options import SaveOptions
from gpuckpt.runtime import runner
from gpuckpt.saving import compression
from gpuckpt.saving.compression import (
    AUTO_MIN_BYTES,
    MIN_BUDGET,
    MIN_GAIN,
    MIN_SAVING,
    SAMPLES,
    SCREEN_BYTES,
    AutoDecision,
    decide,
    entropy_saving,
    predicted_gain,
)
from gpuckpt.saving.sources import describe_state
from gpuckpt.storage.stores import BACKENDS

AUTO = PRESETS["auto"]


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _bf16_weights(n: int, seed: int = 0) -> np.ndarray:
    return (_rng(seed).standard_normal(n, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)


def _moments(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    m = _rng(seed).standard_normal(n, dtype=np.float32) * 1e-3
    v = np.abs(m * m + _rng(seed + 1).standard_normal(n, dtype=np.float32) * 1e-8).astype(np.float32)
    return m, v


def _random_bytes(n: int, seed: int = 1) -> np.ndarray:
    return _rng(seed).integers(0, 256, n, dtype=np.uint8)


def _decide(state: dict[str, Any]) -> AutoDecision:
    local, sources = describe_state(state, allow_pickle=False)
    return decide(local, sources, AUTO)


def test_entropy_saving_of_random_constant_and_float_bytes() -> None:
    assert abs(entropy_saving([_random_bytes(1 << 16)], 1)) < 0.01
    assert entropy_saving([np.zeros(1 << 14, np.uint8)], 4) == pytest.approx(1.0)
    # bf16 N(0, 0.02): the exponent byte repeats, the mantissa byte does not (about 1/3 saved)
    w = _bf16_weights(1 << 14).view(np.uint8)
    assert 0.25 < entropy_saving([w], 2) < 0.4
    # the same bytes not told apart by position save much less: the planes matter
    assert entropy_saving([w], 1) < entropy_saving([w], 2) - 0.1


def test_weights_and_moments_are_compressed_random_and_quantized_bytes_are_not() -> None:
    m, v = _moments(1 << 20)
    quantized = _rng(2).integers(-128, 128, 2 << 20, dtype=np.int8)  # uniform int8: incompressible
    state = {
        "weight": _bf16_weights(2 << 20).reshape(2048, 1024),
        "exp_avg": m,
        "exp_avg_sq": v,
        "fp16": _bf16_weights(1 << 20).astype(np.float16),
        "noise": _random_bytes(4 << 20),
        "quantized": quantized,
        "small": _random_bytes(AUTO_MIN_BYTES - 1),
    }
    found = _decide(state)
    assert found.skip == {"noise", "quantized", "small"}
    # the largest tensor of each dtype screened; exp_avg_sq follows exp_avg (the same dtype)
    for fqn in ("weight", "exp_avg", "fp16"):
        assert found.saving[fqn] >= MIN_SAVING, fqn
    # each compressible dtype tried once with the codec, and saving what a chunk saves
    assert set(found.trials) == {"bfloat16", "float32", "float16"}
    assert found.trials["bfloat16"] > 0.28 and found.trials["float32"] > 0.12
    assert 0.12 < found.fraction_saved < 0.32 and found.bytes_per_s > 0


def test_repeats_the_entropy_does_not_see_are_compressed() -> None:
    # uniformly spread bytes (entropy: incompressible) that repeat every 1000 bytes
    tiled = np.tile(_random_bytes(1000), 4 << 10)
    found = _decide({"tiled": tiled, "noise": _random_bytes(8 << 20).view(np.uint16)})
    assert entropy_saving([tiled[: 1 << 16]], 1) < MIN_SAVING
    assert found.skip == {"noise"} and found.saving["tiled"] > 0.5


def test_a_channels_last_tensor_is_screened_by_its_rows() -> None:
    w = np.moveaxis(_bf16_weights(64 * 64 * 32 * 8).reshape(64, 64, 32, 8), 3, 1)  # not contiguous
    noise = np.moveaxis(_random_bytes(64 * 64 * 32 * 8 * 2).view(np.uint16).reshape(64, 64, 32, 8), 3, 1)
    found = _decide({"w": w, "noise": noise})
    assert found.skip == {"noise"} and found.saving["w"] > 0.25


def test_the_screens_read_a_bounded_share_of_the_bytes() -> None:
    # 64 tensors of random bytes: one dtype, so a few screens decide for all of them
    state = {f"r{i}": _random_bytes(2 << 20, seed=i) for i in range(64)}
    found = _decide(state)
    assert found.skip == set(state)
    assert found.sampled == 0  # no trial of the codec: nothing worth compressing
    per_tensor = SAMPLES * SCREEN_BYTES
    assert 0 < found.screened <= MIN_BUDGET + per_tensor
    assert len(found.saving) < len(state)


def test_each_dtype_is_screened_whatever_the_budget() -> None:
    # the budget is spent on the large bf16 tensors; the smaller random bytes are still screened
    state: dict[str, Any] = {f"w{i}": _bf16_weights(2 << 20, seed=i) for i in range(8)}
    state["noise"] = _random_bytes(1 << 20)
    found = _decide(state)
    assert "noise" in found.saving and found.skip == {"noise"}
    assert not {f"w{i}" for i in range(8)} & found.skip


def test_the_budget_screens_every_dtype_by_turns_and_unscreened_tensors_follow_their_dtype() -> None:
    """Ten large bf16 tensors would take a short budget before any fp32 moment is screened: then
    the moments would follow the one fp32 tensor screened, random bytes, and go uncompressed."""
    state: dict[str, Any] = {f"w{i}": _bf16_weights(2 << 20, seed=i) for i in range(10)}  # 4 MiB each
    state["rng_table"] = _random_bytes(3 << 20).view(np.float32)  # the largest fp32 tensor
    for i in range(8):
        state[f"exp_avg{i}"] = _moments(1 << 19, seed=10 + i)[0]  # 2 MiB each
    per_tensor = SAMPLES * SCREEN_BYTES
    with mock.patch.object(compression, "MIN_BUDGET", 4 * per_tensor):
        found = _decide(state)
    assert found.screened <= 4 * per_tensor + per_tensor
    assert any(f.startswith("exp_avg") for f in found.saving) and found.skip == {"rng_table"}


def test_a_strided_tensor_is_screened_without_copying_its_rows() -> None:
    import tracemalloc

    base = _bf16_weights(2 * (8 << 20)).reshape(2, 8 << 20)
    view = base[:, ::2]  # two rows of 4M elements (8 MiB each), not contiguous
    tracemalloc.start()
    try:
        found = _decide({"w": view})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert found.saving["w"] > 0.25 and found.screened <= SAMPLES * SCREEN_BYTES
    assert peak < 4 << 20, peak  # a row would be 8 MiB; the screens copy 2 x 16 KiB


def test_the_gain_is_the_slower_of_compressing_and_writing_the_smaller_bytes() -> None:
    # the benchmark's state to S3 through 200-250 MB/s with one chunk compressed at a time:
    # writing 24% fewer bytes bounds it (1.32x), not the compressor
    assert predicted_gain(0.5e9, 1, 0.24, 0.25e9) == pytest.approx(1 / 0.76)
    # a local file system writes faster than one thread compresses: a slower save
    assert predicted_gain(0.5e9, 1, 0.24, 2e9) == pytest.approx(0.25)
    # enough threads make the compressor keep up again
    assert predicted_gain(0.5e9, 8, 0.24, 2e9) == pytest.approx(1 / 0.76)
    assert predicted_gain(0.5e9, 4, 0.5, 2e9) == pytest.approx(1.0)
    assert predicted_gain(1e9, 1, 0.0, 1e8) == pytest.approx(1.0)  # nothing saved: no gain
    with pytest.raises(ValueError, match="write rate"):
        predicted_gain(1e9, 1, 0.2, 0)


@pytest.mark.parametrize(("slots", "threads", "compressed"), [(1, 8, False), (8, 8, True), (8, 1, False)])
def test_resolve_counts_the_chunks_compressed_at_once(
    monkeypatch: pytest.MonkeyPatch, slots: int, threads: int, compressed: bool
) -> None:
    """Not the I/O threads alone: the process compresses at most ``runner.compressing``'s slots
    of chunks at once (one fewer than its CPUs), however many threads a save has."""
    m, _ = _moments(1 << 20)
    state = {"weight": _bf16_weights(2 << 20), "exp_avg": m}
    local, sources = describe_state(state, allow_pickle=False)
    found = _decide(state)  # measured once, then held: the rule, not the timing, is under test
    monkeypatch.setattr(compression, "decide", lambda *a: found)
    monkeypatch.setattr(runner, "compressing", runner.CpuSlots(slots))
    rate = found.bytes_per_s * 4  # a store 4 compressors fast
    slow = dataclasses.replace(BACKENDS["s3"], write_bytes_per_s=rate)
    with mock.patch.dict(BACKENDS, {"slow": slow}):
        chosen = compression.resolve(
            "slow://bucket/x", SaveOptions(compression="auto", threads=threads), local, sources
        )
    assert chosen is not None and chosen.auto
    for fqn, dtype in (("weight", ml_dtypes.bfloat16), ("exp_avg", np.float32)):
        assert (chosen.codec_for(fqn, np.dtype(dtype), 1 << 20) is not None) is compressed
    # neither is a tensor this process did not screen (one of another rank) when nothing pays
    assert (chosen.codec_for("held_by_another_rank", np.dtype(np.float32), 1 << 20) is not None) is compressed
    gain = predicted_gain(found.bytes_per_s, min(slots, threads), found.fraction_saved, rate)
    assert (gain >= MIN_GAIN) is compressed
    # the decision says why, with the figures it was made from
    assert chosen.report["predicted_gain"] == pytest.approx(gain, abs=1e-3)
    assert chosen.report["threads"] == min(slots, threads)
    assert chosen.report["decision"].startswith(
        "2 of 2 tensor(s) compressed" if compressed else "nothing compressed"
    )


def test_the_report_says_why_each_large_tensor_is_left_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """Incompressible (its screen), its dtype's trial, or its dtype's screened tensors; small
    tensors are not listed (rule 1, the report's ``min_bytes``)."""
    m, _ = _moments(1 << 20)
    state = {
        "weight": _bf16_weights(2 << 20),
        "exp_avg": m,
        "noise": _random_bytes(4 << 20).view(np.float32),
        "bits": np.packbits(_random_bytes(8 << 20) > 127),  # 1-byte elements: bit-shuffled, no saving
        "bias": np.zeros(16, np.float32),
    }
    local, sources = describe_state(state, allow_pickle=False)
    slow = dataclasses.replace(BACKENDS["s3"], write_bytes_per_s=1e6)  # compression always pays
    with mock.patch.dict(BACKENDS, {"slow": slow}):
        chosen = compression.resolve("slow://bucket/x", SaveOptions(compression="auto"), local, sources)
    assert chosen is not None
    report = chosen.report
    assert set(report["tensors"]) == chosen.skip - {"bias"}
    assert report["tensors"]["noise"].startswith("incompressible: its screen promises")
    assert "bias" not in report["tensors"] and report["min_bytes"] == AUTO_MIN_BYTES
    assert report["decision"].startswith(f"{5 - len(chosen.skip)} of 5 tensor(s) compressed: predicted")
    assert {"weight", "exp_avg"}.isdisjoint(chosen.skip)
    for why in report["tensors"].values():
        assert why.startswith(("incompressible", "the codec's trial on", "not screened"))


def test_planned_from_the_shapes_alone_bfloat16_and_float8_are_floating_point() -> None:
    """The DCP Writer's "auto" (nothing sampled) compresses the floating-point tensors of 1 MiB
    or more: NumPy gives bfloat16 and float8 the kind "V", and a test of the kind left them out
    while the decision said they were compressed; what it leaves out, it says why."""
    n = AUTO_MIN_BYTES
    state = {
        "bf16": np.zeros(n // 2, ml_dtypes.bfloat16),
        "fp8": np.zeros(n, ml_dtypes.float8_e4m3fn),
        "fp32": np.zeros(n // 4, np.float32),
        "ids": np.zeros(n // 4, np.int32),
        "small": np.zeros(16, ml_dtypes.bfloat16),
    }
    local, _ = describe_state(state, allow_pickle=False)
    slow = dataclasses.replace(BACKENDS["s3"], write_bytes_per_s=1e6)  # compression always pays
    with mock.patch.dict(BACKENDS, {"slow": slow}):
        chosen = compression.resolve_unsampled(
            "slow://bucket/x", SaveOptions(compression="auto"), local.tensors
        )
    assert chosen is not None and not chosen.keep_all
    compressed = {f for f, a in state.items() if chosen.codec_for(f, a.dtype, a.nbytes) is not None}
    assert compressed == {"bf16", "fp8", "fp32"}
    assert chosen.report["tensors"] == {"ids": "not floating-point (int32): left as it is"}
    fast = dataclasses.replace(BACKENDS["s3"], write_bytes_per_s=1e12)  # nothing pays
    with mock.patch.dict(BACKENDS, {"fast": fast}):
        chosen = compression.resolve_unsampled(
            "fast://bucket/x", SaveOptions(compression="auto"), local.tensors
        )
    assert (
        chosen is not None and chosen.keep_all and chosen.report["decision"].startswith("nothing compressed")
    )
    assert all(chosen.codec_for(f, a.dtype, a.nbytes) is None for f, a in state.items())


def test_a_report_key_sorts_after_a_tier_part_record() -> None:
    """A tier part's record must stay the first entry of its root document's ``planner_data``
    (read without parsing the rest): the report's key sorts after it."""
    from gpuckpt.format.codecs import COMPRESSION_KEY
    from gpuckpt.format.parts import PART_KEY

    assert sorted([COMPRESSION_KEY, PART_KEY, "structure"])[0] == PART_KEY
