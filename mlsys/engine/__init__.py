"""A small LLM inference engine for the book's GPT and Llama-style checkpoints: paged KV cache, prefix cache,
continuous batching, preemption by recompute, seeded sampling, parallel sampling, structured output, streaming
text, tensor parallelism.

    from mlsys.engine import Engine, EngineConfig, SamplingParams
    engine = Engine(load_pretrained("small"), config=EngineConfig(enable_prefix_caching=True))
    outs = engine.generate(['{"name": "ada", ', '{"name": "ken", '], SamplingParams(max_tokens=40))

The parts, each a file (vLLM's and SGLang's names for them):

    request.py       SamplingParams, Sequence (states, num_computed_tokens), RequestOutput, RequestMetrics
    block_manager.py BlockPool (refcounted fixed-size blocks), BlockManager (block tables)
    radix_cache.py   RadixCache: prefix tree over token ids owning cached blocks, LRU eviction
    scheduler.py     Scheduler: continuous or static batching, token budget, preemption by recompute
    model_runner.py  ModelRunner: the GPT's weights over a packed batch, attention through block tables
    sampler.py       sample: greedy / temperature / top-k / top-p, one seeded generator per request; the
                     log-probs and top alternatives; structured-output masks (one per JSON-schema request)
    tokenizer.py     encode_prompt, IncrementalDetokenizer, StopStrings, HFTokenizer (a folder's tokenizer.json)
    engine.py        Engine, EngineConfig: the step loop tying them together (n > 1 forks copy-on-write)
    overlap.py       OverlapEngine: schedules step N+1 while step N computes (Chapter 10)
    tp.py            tensor-parallel serving: N ranks, each with 1/N of every layer and of the KV heads
    llm.py           LLM: vLLM's offline interface (LLM(model=...).generate) on top of Engine

    from mlsys.engine import LLM, SamplingParams
    outputs = LLM(model="small").generate(['{"name": "ada", '], SamplingParams(max_tokens=40))
    print(outputs[0].outputs[0].text)
"""

from mlsys.engine.block_manager import BlockManager, BlockPool
from mlsys.engine.engine import Engine, EngineConfig
from mlsys.engine.llm import LLM
from mlsys.engine.model_runner import ModelInput, ModelRunner
from mlsys.engine.radix_cache import RadixCache
from mlsys.engine.request import RequestMetrics, RequestOutput, SamplingParams, Sequence, SequenceStatus
from mlsys.engine.scheduler import Scheduler, SchedulerOutput
from mlsys.engine.tokenizer import IncrementalDetokenizer

__all__ = [
    "BlockManager", "BlockPool", "Engine", "EngineConfig", "IncrementalDetokenizer", "LLM", "ModelInput", "ModelRunner",
    "RadixCache", "RequestMetrics", "RequestOutput", "SamplingParams", "Scheduler", "SchedulerOutput", "Sequence",
    "SequenceStatus",
]
