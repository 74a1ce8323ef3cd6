"""Realistic state dicts for tests, demos and benchmarks."""

from __future__ import annotations

from typing import Any

import numpy as np

from gpuckpt.format.dtypes import ML_DTYPE_NAMES

__all__ = ["ALL_DTYPE_NAMES", "gpt_state_dict", "random_array", "small_tensors_state_dict"]

ALL_DTYPE_NAMES = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128", *ML_DTYPE_NAMES,
)  # fmt: skip


def random_array(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Random bits of ``dtype`` (NaN payloads included for floats): bit-exact checks catch everything."""
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    raw = rng.integers(0, 256, size=(*shape, dt.itemsize), dtype=np.uint8)
    out: np.ndarray = raw.view(dt).reshape(shape)
    return out


def gpt_state_dict(
    rng: np.random.Generator,
    *,
    vocab: int = 32000,
    width: int = 1024,
    layers: int = 24,
    mlp: int = 4096,
    dtype: Any = np.float32,
    with_optimizer: bool = False,
) -> dict[str, Any]:
    """A GPT-like model state: embedding, attention and MLP matrices, norms and biases.

    With the defaults and float32 the weights are about 1 GiB (~0.5 GiB in
    bfloat16). ``with_optimizer`` adds Adam-style moments (two more copies in
    float32) and step counters, about 3x the weights.
    """
    dt = np.dtype(dtype)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dt)

    model: dict[str, Any] = {"embed": {"weight": w(vocab, width)}, "layers": []}
    for _ in range(layers):
        model["layers"].append(
            {
                "attn": {name: w(width, width) for name in ("q", "k", "v", "o")},
                "mlp": {"up": w(width, mlp), "down": w(mlp, width), "up_bias": w(mlp)},
                "norm1": {"weight": np.ones(width, dt), "bias": np.zeros(width, dt)},
                "norm2": {"weight": np.ones(width, dt), "bias": np.zeros(width, dt)},
            }
        )
    state: dict[str, Any] = {"model": model, "step": 0, "config": {"width": width, "layers": layers}}
    if with_optimizer:
        moments: dict[str, Any] = {}

        def walk(prefix: str, node: Any) -> None:
            if isinstance(node, np.ndarray):
                moments[prefix] = {
                    "exp_avg": rng.standard_normal(node.shape, dtype=np.float32),
                    "exp_avg_sq": rng.random(node.shape, dtype=np.float32),
                }
            elif isinstance(node, dict):
                for k, v in node.items():
                    walk(f"{prefix}.{k}" if prefix else k, v)
            elif isinstance(node, list):
                for i, v in enumerate(node):
                    walk(f"{prefix}.{i}", v)

        walk("", model)
        state["optimizer"] = {
            "state": moments,
            "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8}],
        }
    return state


def small_tensors_state_dict(rng: np.random.Generator, count: int = 10_000) -> dict[str, Any]:
    """``count`` float32 tensors of 4-64 KiB each."""
    sizes = rng.integers(1024, 16 * 1024 + 1, size=count)
    return {f"t{i:05d}": rng.standard_normal(int(n), dtype=np.float32) for i, n in enumerate(sizes)}
