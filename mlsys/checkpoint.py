"""Load a local Hugging Face checkpoint folder: config.json plus *.safetensors (one file or a sharded index).

    from mlsys.checkpoint import load_pretrained
    model, config = load_pretrained("path/to/folder")   # mlsys.model.GPT or mlsys.llama.Llama, in eval mode

Supported architectures (config.json's "architectures"): GPT2LMHeadModel (the book's GPT), LlamaForCausalLM
and Qwen2ForCausalLM (mlsys.llama). Nothing is downloaded: the folder is read with the `safetensors` library and
the weights are loaded under their own names. A folder that is not one of these, or is broken, raises
CheckpointError with one line that says what is wrong and what is supported.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mlsys.llama import Llama, LlamaConfig
from mlsys.model import GPTConfig, from_hf_state_dict

SUPPORTED = ("GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM")


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded; the message is one line."""


def read_config(folder: str | Path) -> dict:
    path = Path(folder) / "config.json"
    if not Path(folder).is_dir():
        raise CheckpointError(f"{folder}: not a folder (a checkpoint is a folder with config.json and "
                              f"*.safetensors)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: no config.json") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return config


def architecture(config: dict, folder: str | Path) -> str:
    archs = config.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch not in SUPPORTED:
        raise CheckpointError(f"{folder}: architecture {arch!r} is not supported; supported: "
                              f"{', '.join(SUPPORTED)}")
    return arch


def read_state_dict(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files, by name (model.safetensors or a sharded index)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (ValueError, KeyError, AttributeError, TypeError) as err:
            raise CheckpointError(f"{index}: not a safetensors index ({err!r})") from None
    elif (folder / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{folder}: no model.safetensors or model.safetensors.index.json "
                              f"(only safetensors checkpoints are read)")
    state = {}
    for name in files:
        if "/" in name or name.startswith("."):
            raise CheckpointError(f"{index}: shard name {name!r} is not a file of the folder")
        try:
            state.update(load_file(folder / name))
        except FileNotFoundError:
            raise CheckpointError(f"{folder}: shard {name} is listed in the index but missing") from None
        except Exception as err:  # safetensors raises its own error type for a damaged file
            raise CheckpointError(f"{folder / name}: not a readable safetensors file "
                                  f"({' '.join(str(err).split())[:200]})") from None
    return state


LLAMA_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings")
LLAMA_FLOATS = ("rms_norm_eps", "rope_theta")
LLAMA_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")
GPT2_INTS = ("vocab_size", "n_positions", "n_layer", "n_head", "n_embd", "n_inner")


def check_types(c: dict, ints: tuple[str, ...], floats: tuple[str, ...] = (), bools: tuple[str, ...] = ()) -> None:
    """Refuse a config field of the wrong JSON type instead of computing with it: "2" or 2.0 for a layer count
    would otherwise fail deep inside the model or, worse, be silently truncated. None means "not set"."""
    for key in ints:
        v = c.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise CheckpointError(f"config.json: {key} must be a positive integer, got {v!r}")
    for key in floats:
        v = c.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf")):
            raise CheckpointError(f"config.json: {key} must be a positive number, got {v!r}")
    for key in bools:
        v = c.get(key)
        if v is not None and not isinstance(v, bool):
            raise CheckpointError(f"config.json: {key} must be true or false, got {v!r}")


def llama_config(c: dict) -> LlamaConfig:
    """LlamaConfig from a Llama or Qwen2 config.json (old and new places of the RoPE settings)."""
    check_types(c, LLAMA_INTS, LLAMA_FLOATS, LLAMA_BOOLS)
    act = c.get("hidden_act", "silu")
    if act != "silu":   # the decoder computes SwiGLU with SiLU; another activation would load and then diverge
        raise CheckpointError(f"config.json: hidden_act {act!r} is not supported (the decoder computes 'silu')")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise CheckpointError(f"config.json: rope settings must be an object, got {rope!r}")
    check_types(rope, (), ("rope_theta", "factor", "low_freq_factor", "high_freq_factor"))
    check_types(rope, ("original_max_position_embeddings",))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    qwen2 = c["architectures"][0] == "Qwen2ForCausalLM"
    if qwen2 and c.get("use_sliding_window"):
        raise CheckpointError("Qwen2 with use_sliding_window=true is not supported (full attention only)")
    return LlamaConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"], num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c.get("num_key_value_heads") or c["num_attention_heads"], head_dim=c.get("head_dim"),
        max_position_embeddings=c.get("max_position_embeddings", 2048), rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        rope_theta=theta, rope_scaling=None if rope_type == "default" else rope,
        tie_word_embeddings=c.get("tie_word_embeddings", False),
        qkv_bias=qwen2 or c.get("attention_bias", False), o_bias=c.get("attention_bias", False),
        mlp_bias=c.get("mlp_bias", False))


def gpt_config(c: dict) -> GPTConfig:
    check_types(c, GPT2_INTS)
    if c.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise CheckpointError(f"GPT-2 with activation {c['activation_function']!r} is not supported (gelu_new)")
    if c.get("n_inner") not in (None, 4 * c["n_embd"]):
        raise CheckpointError(f"GPT-2 with n_inner={c['n_inner']} is not supported (4 * n_embd)")
    return GPTConfig(vocab_size=c["vocab_size"], block_size=c["n_positions"], n_layer=c["n_layer"],
                     n_head=c["n_head"], n_embd=c["n_embd"])


def load_pretrained(folder: str | Path, dtype: torch.dtype = torch.float32):
    """(model in eval mode, its config) from a checkpoint folder."""
    config = read_config(folder)
    arch = architecture(config, folder)
    try:
        model_config = gpt_config(config) if arch == "GPT2LMHeadModel" else llama_config(config)
    except KeyError as err:
        raise CheckpointError(f"{folder}/config.json: {arch} needs the field {err}") from None
    except (TypeError, ValueError) as err:
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(f"{folder}/config.json: {' '.join(str(err).split())}") from None
    state = read_state_dict(folder)
    wrong = next(((k, v.dtype) for k, v in state.items() if not v.is_floating_point()), None)
    if wrong:   # an int or bool tensor would be cast to floats silently: quantized or damaged weights
        raise CheckpointError(f"{folder}: tensor {wrong[0]} has dtype {wrong[1]} (only floating-point weights "
                              f"are supported; quantized checkpoints are not)")
    try:
        if arch == "GPT2LMHeadModel":
            model = from_hf_state_dict(model_config, state)
        else:
            model = Llama(model_config)
            if model_config.tie_word_embeddings and "model.embed_tokens.weight" in state:
                state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])  # tied: often saved once
            model.load_state_dict(state)
    except (RuntimeError, KeyError) as err:
        first = " ".join(str(err).split())
        raise CheckpointError(f"{folder}: the weights do not fit the config ({first[:300]})") from None
    return model.to(dtype).eval(), model_config
