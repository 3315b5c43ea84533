"""vLLM's offline interface on top of the engine: LLM(model=...).generate(prompts, SamplingParams).

    from mlsys.engine import LLM, SamplingParams
    llm = LLM(model="small")                       # the book's trained GPT, or a checkpoint folder's path
    outputs = llm.generate(['{"name": "ada", ', {"prompt_token_ids": [1, 20, 21]}], SamplingParams(max_tokens=20))
    for out in outputs:
        print(out.prompt, out.outputs[0].text, out.outputs[0].token_ids)

The names are vLLM's (`LLM`, `RequestOutput.outputs[0]`, `CompletionOutput.text/token_ids/finish_reason`) so that
code written against this book reads like code written against vLLM. Three defaults differ from vLLM's
SamplingParams: temperature 0 (greedy; vLLM 1.0), max_tokens 32 (vLLM 16), and logprobs a flag with top_logprobs
the count (vLLM's logprobs is the count). `Engine` stays the layer below: `llm.engine`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from mlsys.engine.engine import Engine, EngineConfig
from mlsys.engine.request import SamplingParams
from mlsys.engine.tokenizer import HFTokenizer, TokenIdsOnly


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None  # per token: {token id: log-prob}, when asked for


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True


def load_model(model: str):
    """(model, tokenizer or None) for one of the book's trained models ("small", "draft") or a checkpoint folder
    (its tokenizer.json when it has one; a folder without one serves token-id prompts only)."""
    from mlsys.checkpoint import CheckpointError
    from mlsys.checkpoint import load_pretrained as load_folder
    from mlsys.weights import RECIPES
    from mlsys.weights import load_pretrained as load_book

    if model in RECIPES:
        return load_book(model), None
    folder = Path(model)
    if not folder.is_dir():
        raise CheckpointError(f"model {model!r} is neither a book model ({', '.join(sorted(RECIPES))}) nor a "
                              f"checkpoint folder")
    net, _ = load_folder(folder)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    bos, eos_ids = special_ids(folder, config)
    eos = eos_ids[0] if eos_ids else None
    if not (folder / "tokenizer.json").exists():
        return net, TokenIdsOnly(config["vocab_size"], bos, eos, eos_ids)
    return net, HFTokenizer(folder / "tokenizer.json", bos, eos, eos_ids)


def generation_defaults(model: str) -> dict:
    """The sampling defaults a checkpoint folder's generation_config.json sets (temperature, top_p, top_k), which
    vLLM applies to requests that leave them out; {} for the book's models or a folder without the file. A field
    with the wrong type is left out (the request's own value, or OpenAI's default, applies)."""
    try:
        config = json.loads((Path(model) / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict) or config.get("do_sample") is False:   # do_sample false: greedy
        return {"temperature": 0.0} if isinstance(config, dict) else {}
    ok = {"temperature": lambda v: isinstance(v, (int, float)) and 0 <= v <= 2,
          "top_p": lambda v: isinstance(v, (int, float)) and 0 < v <= 1,
          "top_k": lambda v: isinstance(v, int) and (v >= 1 or v == -1)}
    return {k: config[k] for k, good in ok.items() if k in config and not isinstance(config[k], bool)
            and good(config[k])}


def special_ids(folder: Path, config: dict) -> tuple[int | None, tuple[int, ...]]:
    """(bos id, every eos id) of a folder: config.json's and generation_config.json's eos_token_id, each an int
    or a list (Llama 3.1 Instruct lists three), all of which end a text, as transformers' generate and vLLM do."""
    from mlsys.checkpoint import CheckpointError

    def ids(value, where: str) -> list[int]:
        values = value if isinstance(value, list) else [] if value is None else [value]
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
            raise CheckpointError(f"{folder}/{where}: eos_token_id must be a token id or a list of them, "
                                  f"got {value!r}")
        return values

    generation = {}
    try:
        generation = json.loads((folder / "generation_config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        pass
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{folder}/generation_config.json: not valid JSON ({err})") from None
    generation = generation if isinstance(generation, dict) else {}
    eos = ids(config.get("eos_token_id"), "config.json") + ids(generation.get("eos_token_id"),
                                                               "generation_config.json")
    bos = config.get("bos_token_id", generation.get("bos_token_id"))
    bos = bos[0] if isinstance(bos, list) and bos else bos
    return (bos if isinstance(bos, int) and not isinstance(bos, bool) else None), tuple(dict.fromkeys(eos))


class LLM:
    def __init__(self, model: str, **engine_args):
        """model: "small", "draft" or a folder; engine_args: EngineConfig's fields (block_size,
        enable_prefix_caching, max_num_seqs, max_model_len, ...)."""
        net, tokenizer = load_model(model)
        self.engine = Engine(net, tokenizer, EngineConfig(**engine_args))
        d = generation_defaults(model)   # a folder's generation_config.json sets what generate() uses by default
        self.default_sampling_params = SamplingParams(
            temperature=float(d.get("temperature", 0.0)), top_p=float(d.get("top_p", 1.0)),
            top_k=None if d.get("top_k", -1) == -1 else d["top_k"])

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Complete every prompt (a string, a {"prompt": str} or {"prompt_token_ids": [...]} dict, or a list of
        them); outputs in the prompts' order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        texts, inputs = [], []
        for p in prompts:
            if isinstance(p, dict):
                if "prompt_token_ids" in p:
                    texts.append(None)
                    inputs.append(list(p["prompt_token_ids"]))
                    continue
                p = p.get("prompt")
            if not isinstance(p, str):
                raise TypeError(f"a prompt is a str or a dict with 'prompt' or 'prompt_token_ids', got {type(p)}")
            texts.append(p)
            inputs.append(p)
        params = sampling_params if sampling_params is not None else self.default_sampling_params
        finals = iter(self.engine.generate(inputs, params))  # n outputs in a row for a request with n > 1
        results = []
        for text, sp in zip(texts, params if isinstance(params, list) else [params] * len(texts)):
            outs = [next(finals) for _ in range(sp.n)]
            results.append(RequestOutput(outs[0].request_id, text, outs[0].prompt_token_ids, [
                CompletionOutput(o.index, o.text, o.token_ids, o.finish_reason, o.logprobs, o.top_logprobs)
                for o in outs]))
        return results
