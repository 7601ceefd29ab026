"""PEFT LoRA adapters on tpuscore's parameter names, and several stacked for batched use.

An adapter directory holds `adapter_config.json` and `adapter_model.safetensors`, as
`peft.PeftModel.save_pretrained` writes them. A targeted projection y = x W gains
(x A) B * scaling, with A [in, r], B [r, out] and scaling lora_alpha / r (lora_alpha / sqrt(r)
with use_rslora). The scaling is folded into B when loaded.

Stacking (`stack_adapters`) puts every adapter of a process in one tree whose shapes depend only
on the number of adapters and the largest rank, so a batch mixing adapters (each row its own
index, `RowAdapters`) compiles once, as Punica's and S-LoRA's batched product does:

    a[name] [A+1, L, in, r_max]    b[name] [A+1, L, r_max, out]    (index 0: no adapter, zeros)
    score [A+1, D, C], own_score [A+1] (classification heads in modules_to_save only)

Ranks are zero-padded to r_max: a padded column of A meets a zero row of B, so it adds exactly 0.
Projections are flattened over heads: q's out is N*H, o's in is N*H (`models/weights.py`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from tpuscore.api.errors import ValidationError
from tpuscore.models.config import ModelConfig
from tpuscore.models.loaders import files
from tpuscore.models.weights import CheckpointMismatchError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# PEFT's module name -> tpuscore's parameter name (`models/weights.py`).
TARGET_PARAMS = {
    "q_proj": "wq",
    "k_proj": "wk",
    "v_proj": "wv",
    "o_proj": "wo",
    "gate_proj": "w_gate",
    "up_proj": "w_up",
    "down_proj": "w_down",
}
# Modules PEFT adds to modules_to_save for SEQ_CLS; Llama-style heads are named score.
_HEAD_MODULES = {"score", "classifier"}
# Options whose non-default value changes the math this module implements: refused, not ignored.
_UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "lora_bias": "a bias on lora_B",
    "fan_in_fan_out": "Conv1D-style (fan_in_fan_out) weights",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "layer_replication": "layer_replication",
    "target_parameters": "target_parameters",
    "trainable_token_indices": "trainable_token_indices",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA",
    "use_bdlora": "BD-LoRA",
    "arrow_config": "Arrow routing",
}
_TENSOR = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)
_HEAD_TENSOR = re.compile(r"base_model\.model\.(score|classifier)\.weight")


def _error(code: str, message: str, path: Path | str) -> ValidationError:
    return ValidationError(code, f"adapter {str(path)!r}: {message}", "adapters")


def projection_dims(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of every projection LoRA can target, by parameter name, heads flattened."""
    D, F = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "wq": (D, q),
        "wk": (D, kv),
        "wv": (D, kv),
        "wo": (q, D),
        "w_gate": (D, F),
        "w_up": (D, F),
        "w_down": (F, D),
    }


@attrs.frozen(eq=False)
class LoraAdapter:
    """One adapter on tpuscore's names: a [L, in, r] and b [L, r, out] (scaling folded in) per
    targeted parameter (layers the adapter skips are zeros); score [D, C] when it replaces the
    classification head."""

    path: str
    rank: int
    scaling: float
    a: dict[str, np.ndarray]
    b: dict[str, np.ndarray]
    score: np.ndarray | None = None


def _read_config(path: Path) -> dict[str, Any]:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise _error("adapter_not_found", f"no {CONFIG_FILE}", path)
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise _error("adapter_invalid", f"{CONFIG_FILE} is not JSON: {e}", path) from e


def _check_options(path: Path, cfg: Mapping[str, Any]) -> tuple[int, float]:
    """The rank and scaling, after refusing every option this module does not implement."""
    if cfg.get("peft_type") != "LORA":
        raise _error(
            "adapter_unsupported",
            f"peft_type {cfg.get('peft_type')!r} is not supported; only 'LORA' is",
            path,
        )
    used = [what for key, what in _UNSUPPORTED_OPTIONS.items() if cfg.get(key)]
    if cfg.get("bias", "none") != "none":
        used.append(f"bias={cfg['bias']!r} (only 'none' is supported)")
    if used:
        raise _error("adapter_unsupported", "unsupported options: " + "; ".join(used), path)
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise _error("adapter_invalid", f"r={rank!r} and lora_alpha={alpha!r} are invalid", path)
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise _error("adapter_not_found", f"no {WEIGHTS_FILE}", path)
    try:
        tensors = files.read_safetensors(file)
    except CheckpointMismatchError as e:  # a file its parser cannot read, the adapter's error
        why = f"{WEIGHTS_FILE} cannot be read: {e.__cause__}"
        raise _error("adapter_invalid", why, path) from e
    return {name: np.asarray(value, np.float32) for name, value in tensors.items()}


def load_adapter(path: str | Path, config: ModelConfig) -> LoraAdapter:
    """Read a PEFT LoRA adapter directory for the base model `config`.

    Raises ValidationError (code adapter_not_found, adapter_invalid, adapter_unsupported or
    adapter_mismatch) naming every problem found: options outside plain LoRA, a module the model
    lacks or LoRA cannot target here, a layer past the model's, or a tensor of the wrong shape.
    """
    path = Path(path)
    cfg = _read_config(path)
    rank, scaling = _check_options(path, cfg)
    tensors = _read_tensors(path)
    dims = projection_dims(config)
    L = config.num_layers
    a: dict[str, np.ndarray] = {}
    b: dict[str, np.ndarray] = {}
    score = None
    problems: list[str] = []
    seen: dict[str, set[tuple[int, str]]] = {}
    for name, value in sorted(tensors.items()):
        if head := _HEAD_TENSOR.fullmatch(name):
            if not config.classifier:
                problems.append(f"{name}: a classification head, but the base is a causal LM")
            elif value.shape != (config.num_labels, config.hidden_size):
                want = (config.num_labels, config.hidden_size)
                problems.append(f"{name}: shape {value.shape}, expected {want}")
            else:
                score = value.T
            del head
            continue
        m = _TENSOR.fullmatch(name)
        if m is None:
            problems.append(f"{name}: not a LoRA weight of a decoder projection")
            continue
        layer, module, side = int(m.group(1)), m.group(2), m.group(3)
        param = TARGET_PARAMS.get(module)
        if param is None:
            problems.append(f"{name}: target module {module!r} is not one of {list(TARGET_PARAMS)}")
            continue
        if layer >= L:
            problems.append(f"{name}: layer {layer}, but the model has {L} layers")
            continue
        d_in, d_out = dims[param]
        want = (rank, d_in) if side == "A" else (d_out, rank)
        if value.shape != want:
            problems.append(f"{name}: shape {value.shape}, expected {want} (r={rank})")
            continue
        seen.setdefault(param, set()).add((layer, side))
        if side == "A":
            a.setdefault(param, np.zeros((L, d_in, rank), np.float32))[layer] = value.T
        else:
            b.setdefault(param, np.zeros((L, rank, d_out), np.float32))[layer] = value.T * scaling
    for param, pairs in seen.items():
        for layer in sorted({layer for layer, _ in pairs}):
            for side in "AB":
                if (layer, side) not in pairs:
                    problems.append(f"layer {layer} {param}: lora_{side} is missing")
    if problems:
        raise _error(
            "adapter_mismatch", "does not fit the model:\n  " + "\n  ".join(problems), path
        )
    if not a and score is None:
        raise _error("adapter_invalid", f"{WEIGHTS_FILE} holds no LoRA weights", path)
    return LoraAdapter(str(path), rank, scaling, a, b, score)


class AdapterStack(NamedTuple):
    """Adapters stacked for the decoder (see the module docstring); index 0 is no adapter."""

    a: dict[str, jax.Array]
    b: dict[str, jax.Array]
    score: jax.Array | None
    own_score: jax.Array | None

    @property
    def count(self) -> int:
        """The number of adapters (index 1 to count)."""
        return next(iter(self.a.values())).shape[0] - 1 if self.a else len(self.own_score) - 1


class RowAdapters(NamedTuple):
    """What the decoder takes: the stack and each row's adapter index [B] int32 (0: none).
    Indices must lie in [0, stack.count]: callers validate them (gathers clamp)."""

    stack: AdapterStack
    index: jax.Array


def stack_adapters(adapters: Sequence[LoraAdapter], config: ModelConfig) -> AdapterStack:
    """The adapters as one `AdapterStack`: adapter i at index i + 1, every targeted parameter
    of any adapter present for all (zeros where one does not target it), ranks zero-padded to
    the largest."""
    if not adapters:
        raise ValueError("stack_adapters needs at least one adapter")
    L, dims = config.num_layers, projection_dims(config)
    r_max = max(adapter.rank for adapter in adapters)
    count = len(adapters) + 1
    targeted = sorted({param for adapter in adapters for param in adapter.a})
    a, b = {}, {}
    for param in targeted:
        d_in, d_out = dims[param]
        a[param] = np.zeros((count, L, d_in, r_max), np.float32)
        b[param] = np.zeros((count, L, r_max, d_out), np.float32)
        for i, adapter in enumerate(adapters, start=1):
            if param in adapter.a:
                a[param][i, :, :, : adapter.rank] = adapter.a[param]
                b[param][i, :, : adapter.rank, :] = adapter.b[param]
    score = own_score = None
    if any(adapter.score is not None for adapter in adapters):
        score = np.zeros((count, config.hidden_size, config.num_labels), np.float32)
        own_score = np.zeros(count, bool)
        for i, adapter in enumerate(adapters, start=1):
            if adapter.score is not None:
                score[i], own_score[i] = adapter.score, True
    return jax.tree.map(jax.numpy.asarray, AdapterStack(a, b, score, own_score))


def load_adapters(
    adapters: Mapping[str, Any] | None, config: ModelConfig
) -> dict[str, LoraAdapter]:
    """Each named adapter loaded for the base (a path, or an already loaded `LoraAdapter`);
    a bad name or adapter is a ValidationError located at ("adapters", name)."""
    if adapters is None:
        return {}
    if not isinstance(adapters, Mapping):
        raise ValidationError(
            "invalid_argument",
            "adapters must be a mapping of name -> adapter directory, got "
            f"{type(adapters).__name__}",
            "adapters",
        )
    loaded = {}
    for name, path in adapters.items():
        if not isinstance(name, str) or not name:
            raise ValidationError(
                "invalid_argument", f"adapter names must be non-empty strings, got {name!r}",
                "adapters",
            )  # fmt: skip
        try:
            loaded[name] = path if isinstance(path, LoraAdapter) else load_adapter(path, config)
        except ValidationError as e:
            raise ValidationError(e.code, e.message, loc=("adapters", name)) from None
    return loaded


# -- in the decoder's layers ----------------------------------------------------------------------


class LayerLora(NamedTuple):
    """One layer's slice of an `AdapterStack` (a [A+1, in, r], b [A+1, r, out] by parameter)
    and each row's adapter index [B]."""

    a: dict
    b: dict
    index: jax.Array


def plus_lora(y: jax.Array, x: jax.Array, lora: LayerLora | None, name: str) -> jax.Array:
    """y [B, T, ...out] plus each row's low-rank product (x A[index]) B[index] for parameter
    `name` (x [B, T, ...in], flattened), gathered per row as Punica's BGMV does; y unchanged
    where no adapter targets `name`. Runs in float32: the adapters are small."""
    if lora is None or name not in lora.a:
        return y
    B, T = x.shape[:2]
    a, b = lora.a[name][lora.index], lora.b[name][lora.index]  # [B, in, r], [B, r, out]
    hi = jax.lax.Precision.HIGHEST
    low = jnp.einsum("bti,bir->btr", x.reshape(B, T, -1).astype(jnp.float32), a, precision=hi)
    delta = jnp.einsum("btr,bro->bto", low, b, precision=hi)
    return y + delta.reshape(y.shape)


def layer_lora(adapters: RowAdapters | None):
    """The stack's per-layer weights with L leading, for the layer scan (None: no adapters)."""
    if adapters is None:
        return None
    a, b = (jax.tree.map(lambda w: jnp.moveaxis(w, 1, 0), t) for t in adapters.stack[:2])
    return a, b
