"""An OpenAI-compatible server for the tiny GPT: start it, talk to it over real HTTP, shut it down.

What it shows
    mlsys.server's FastAPI app (POST /v1/completions with and without streaming, GET /v1/models,
    GET /health) served by uvicorn on 127.0.0.1, over one engine loop shared by every connection. The script
    is its own first client: it sends a few real requests through HTTP and prints what goes over the wire —
    the JSON of a completion, the Server-Sent Events of a streamed one (`data: {...}` chunks, then
    `data: [DONE]`), and the 4xx answer to a bad request — and checks that the streamed and the plain
    answers both equal the engine's own greedy output. Then it keeps serving for --serve-seconds (or until
    Ctrl-C with --forever) and shuts down cleanly, with every KV block free.

How to run
    python tutorial/part3-inference/chapter08-server-anatomy/scripts/serve.py            # demo requests, exit
    python .../serve.py --port 8000 --forever                                          # then, elsewhere:
    curl -N http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "mlsys-small", "prompt": "{\\"name\\": \\"ada\\", ", "max_tokens": 40, "stream": true}'
    python -c "import openai; c = openai.OpenAI(base_url='http://127.0.0.1:8000/v1', api_key='x'); \\
               print(c.completions.create(model='mlsys-small', prompt='{', max_tokens=40).choices[0].text)"
    --port 0 (the default) asks the OS for a free port and prints it. --smoke: one request, then exit.

Stopping: Ctrl-C (SIGINT) or SIGTERM (what `kill`, systemd and Kubernetes send) stop accepting connections, let
the requests in flight finish for up to --grace-seconds, cut the rest, print what was drained and what was cut,
and exit (130 after Ctrl-C, 0 after SIGTERM). A second signal cuts at once. A client that stops sending half-way
through its body gets a 408 after 30 s, so it cannot hold the shutdown either.
Exposed: --host 0.0.0.0 lets other machines in and prints a warning; add --api-key KEY so that only clients that
send `Authorization: Bearer KEY` (the openai client's api_key) get an answer.

Runtime on 2 idle cores: about 4 s (start-up, four requests, shutdown), 3 s with --smoke (two or three times
that on a busy machine).

Try next
    python tutorial/part3-inference/chapter08-server-anatomy/scripts/serve.py --port 8000 --forever
        -> then, from a second terminal, the curl command above: one `data: {...}` line per step, then
           `data: [DONE]`; stop the server with Ctrl-C
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "mlsys-small", "prompt": "{", "max_tokens": 999}'
        -> (server running) a 400 in OpenAI's error format: prompt + max_tokens exceed the 256 positions
           (the message counts the prompt "{" as 2 tokens: <bos> is one of them)
    curl http://127.0.0.1:8000/health
        -> (server running) its state: running and waiting requests, free and total KV blocks
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
         -d '{"model": "mlsys-small", "messages": [{"role": "user", "content": "{"}], "max_tokens": 40}'
        -> (server running) the chat form: the book's model is prompted with the last user message
    python tutorial/part3-inference/chapter08-server-anatomy/scripts/serve.py --tensor-parallel-size 2
        -> two ranks, each with half of every layer and half of the KV heads: the start-up line "tensor parallel:
           2 ranks" lists both process ids, and the answers are the same (mlsys/engine/tp.py)
    python tutorial/part3-inference/chapter08-server-anatomy/scripts/serve.py --model path/to/checkpoint --forever
        -> your own GPT-2, Llama or Qwen2 folder (config.json + safetensors), with its tokenizer and chat template
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from mlsys import cli, report
from mlsys.chat import chat_template_for
from mlsys.checkpoint import CheckpointError
from mlsys.engine import Engine, EngineConfig, SamplingParams
from mlsys.engine.llm import generation_defaults, load_model
from mlsys.server import DEFAULT_MODEL_NAME, ServerThread, create_app


@dataclass
class Settings(cli.Args):
    model: str = "small"
    """The book's "small" or "draft" model, or a Hugging Face checkpoint folder (config.json + *.safetensors of a
    GPT-2, Llama or Qwen2; its tokenizer.json and chat template are used when it has them)."""
    host: str = "127.0.0.1"
    """Address to bind. The default accepts connections from this machine only."""
    port: int = 0
    """TCP port; 0 picks a free one (printed at start-up)."""
    serve_seconds: float = 0.0
    """After the demo requests, keep serving this many seconds (0: stop right after them)."""
    forever: bool = False
    """After the demo requests, keep serving until Ctrl-C."""
    max_num_seqs: int = 32
    """Sequences the engine runs in one step (the batch the server can form)."""
    max_tokens: int = 40
    """Tokens each demo request asks for."""
    threads: int = 1
    """torch intra-op threads. 1: the tiny model's matrices are too small to split, extra threads only wait."""
    api_key: str = ""
    """If set, every route but /health answers only requests with `Authorization: Bearer <key>` (the docs and
    OpenAPI routes are off). Empty: the MLSYS_API_KEY environment variable, which unlike a flag does not show in
    `ps`; empty too: no key."""
    grace_seconds: float = 10.0
    """On Ctrl-C or SIGTERM, how long requests in flight may run on before they are cut."""
    tensor_parallel_size: int = 1
    """Ranks that split every layer of the model (vLLM's name): this process and N-1 workers, gloo on CPU."""
    max_model_len: int = 0
    """Longest prompt + answer in tokens (vLLM's name); 0: the model's own maximum."""
    kv_cache_memory_bytes: int = 0
    """Memory budget of the KV cache in bytes (vLLM's name); 0: the engine's default (4 GiB). A folder whose one
    full-length sequence does not fit is refused, naming these two flags."""

    def validate(self) -> None:
        if self.model not in ("small", "draft") and not Path(self.model).is_dir():
            raise cli.UsageError(f"--model {self.model!r} is neither 'small', 'draft' nor a checkpoint folder")
        if not 0 <= self.port <= 65535:
            raise cli.UsageError(f"--port must lie in 0..65535, got {self.port}")
        if self.serve_seconds < 0:
            raise cli.UsageError(f"--serve-seconds must be >= 0, got {self.serve_seconds}")
        if self.max_model_len < 0 or self.kv_cache_memory_bytes < 0:
            raise cli.UsageError("--max-model-len and --kv-cache-memory-bytes must be >= 0 (0: the default)")
        if self.max_num_seqs < 1 or self.threads < 1:
            raise cli.UsageError("--max-num-seqs and --threads must be at least 1")
        if not 1 <= self.max_tokens <= 200:
            raise cli.UsageError(f"--max-tokens must lie in 1..200, got {self.max_tokens}")
        if not 1 <= self.tensor_parallel_size <= 8:
            raise cli.UsageError(f"--tensor-parallel-size must lie in 1..8, got {self.tensor_parallel_size}")
        if not 0 <= self.grace_seconds <= 3600:
            raise cli.UsageError(f"--grace-seconds must lie in 0..3600, got {self.grace_seconds}")


LOOPBACK = ("127.0.0.1", "localhost", "::1")


PROMPT = '{"name": "grace", '


# --8<-- [start:client]
def demo(base: str, max_tokens: int, smoke: bool, api_key: str = "", model: str = DEFAULT_MODEL_NAME,
         prompt: str | list[int] = PROMPT) -> dict:
    """Real requests over HTTP (the smoke run sends only the first); returns what came back."""
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key=api_key or "not-needed")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
    print(f"POST /v1/completions (stream=false) ->\n{json.dumps(plain.model_dump(exclude_none=True), indent=1)}\n")
    result = {"plain_text": plain.choices[0].text, "usage": plain.usage.model_dump(exclude_none=True)}
    if smoke:
        return result
    print("GET /health ->", httpx.get(f"{base}/health").json())
    print("GET /v1/models ->", httpx.get(f"{base}/v1/models", headers=headers).json()["data"], "\n")
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    streamed, lines = [], []
    print("POST /v1/completions (stream=true) -> Server-Sent Events:")
    with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=headers, timeout=60) as response:
        for line in response.iter_lines():
            if line:  # a blank line ends each event
                lines.append(line)
            if line.startswith("data: {"):
                streamed.append(json.loads(line[6:])["choices"][0]["text"])
    print(f"  {lines[0]}\n  ... {len(lines) - 3} more, one per step, with texts {streamed[1:9]} ...\n"
          f"  {lines[-2]}\n  {lines[-1]}")
    bad = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": "", "max_tokens": 5},
                     headers=headers)
    print(f"\nPOST with an empty prompt -> {bad.status_code} {bad.json()['error']['message']!r}")
    return {**result, "stream_text": "".join(streamed), "stream_events": len(lines), "bad_status": bad.status_code}
# --8<-- [end:client]


class StopSignals:
    """While serving: the first SIGINT or SIGTERM asks for a drain, a second one cuts what is left."""

    def __init__(self) -> None:
        self.received: int | None = None  # the first signal's number
        self.event = threading.Event()
        self.server: ServerThread | None = None

    def __enter__(self) -> StopSignals:
        self.saved = {sig: signal.signal(sig, self.handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)

    def handle(self, signum: int, _frame: object) -> None:
        if self.received is None:
            self.received = signum
            again = "Ctrl-C or SIGTERM" if signum == signal.SIGINT else "SIGTERM or Ctrl-C"
            print(f"\n{signal.Signals(signum).name}: not accepting new connections; letting requests in flight "
                  f"finish (a second signal, {again}, cuts them)", flush=True)
            self.event.set()
        elif self.server is not None:
            print(f"{signal.Signals(signum).name} again: cutting the requests still in flight", flush=True)
            self.server.force()


def main() -> int:
    args = cli.parse(Settings, __doc__, smoke={"port": 0, "serve_seconds": 0.0, "forever": False, "max_tokens": 8})
    args.api_key = args.api_key or os.environ.get("MLSYS_API_KEY", "")   # the key need not appear in `ps`
    if hasattr(sys.stdout, "reconfigure"):  # print each line at once, even into a file or pipe (--forever > log)
        sys.stdout.reconfigure(line_buffering=True)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    if args.host not in LOOPBACK:
        print(f"warning: --host {args.host} accepts connections from other machines: anyone who reaches this port "
              f"can use the model{'' if args.api_key else ' (add --api-key KEY to require a key)'}", file=sys.stderr)
    try:
        model, tokenizer = load_model(args.model)  # a folder: its own tokenizer, or token ids only
    except CheckpointError as err:  # a broken folder: one line, exit 2
        raise cli.UsageError(str(err)) from None
    name = {"small": DEFAULT_MODEL_NAME, "draft": "mlsys-draft"}.get(args.model) or Path(args.model).resolve().name
    prompt: str | list[int] = PROMPT
    if tokenizer is not None:
        try:
            tokenizer.encode(PROMPT)
        except ValueError:  # a folder without tokenizer.json: the demo sends token ids
            prompt = list(range(1, 9))
    try:
        engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=args.max_num_seqs,
                                                       tensor_parallel_size=args.tensor_parallel_size,
                                                       max_model_len=args.max_model_len or None,
                                                       kv_cache_memory_bytes=args.kv_cache_memory_bytes or None))
    except ValueError as err:  # e.g. a tensor-parallel size that does not divide the heads
        raise cli.UsageError(str(err)) from None
    # the oracle, no HTTP: the engine's own greedy output
    expected = Engine(model, tokenizer).generate([prompt], SamplingParams(max_tokens=args.max_tokens))[0].text
    template = chat_template_for(args.model)   # a folder's own, a refusal if it has none, or the book's
    app = create_app(engine, name, api_key=args.api_key or None, chat_template=template,
                     sampling_defaults=generation_defaults(args.model),   # a folder's generation_config.json
                     schema_processes=True)   # clients' JSON schemas compile in worker processes
    server = ServerThread(app, host=args.host, port=args.port, grace_seconds=args.grace_seconds).start()
    signals = StopSignals()
    signals.server = server
    try:
        print(f"serving {name} on {server.url} (OpenAI base_url {server.url}/v1)")
        if args.tensor_parallel_size > 1:  # show that the other ranks are real processes
            pids = [os.getpid()] + [p.pid for p in engine.runner.group.procs]
            print(f"tensor parallel: {len(pids)} ranks, each with 1/{len(pids)} of every layer; process ids {pids}")
        print()
        result = demo(server.url, args.max_tokens, args.smoke, args.api_key, name, prompt)
        report.expect_equal("text of stream=false vs the engine", result["plain_text"], expected)
        if "stream_text" in result:
            report.expect_equal("text of stream=true vs the engine", result["stream_text"], expected)
            report.expect_equal("status of a bad request", result["bad_status"], 400)
        print("\nself-check: the answers over HTTP equal the engine's greedy output")
        if args.forever or args.serve_seconds > 0:
            until = "Ctrl-C or SIGTERM" if args.forever else f"{args.serve_seconds:g} s"
            with signals:  # the main thread only waits: the server thread does the work
                print(f"serving on {server.url} until {until}", flush=True)
                until_t = float("inf") if args.forever else time.monotonic() + args.serve_seconds
                front = app.state.async_engine
                while not signals.event.wait(0.1) and time.monotonic() < until_t and front.dead is None:
                    pass  # short waits, so that a signal's handler runs at once (see ServerThread.stop)
                drain = server.stop()
                if front.dead is not None:  # e.g. a tensor-parallel worker died: nothing can be served any more
                    print(f"error: the engine stopped: {front.dead}; the server shut down", file=sys.stderr)
                    return 1
        else:
            drain = server.stop()
    except BaseException:
        if server.thread.is_alive():  # an error in the demo: stop without waiting for anyone
            server.force()
            server.stop()
        raise
    finally:
        engine.close()  # the tensor-parallel workers, if any
    print(f"drained {drain['drained']} of {drain['in_flight']} request(s) in flight, cut {drain['cut']} "
          f"(grace period {args.grace_seconds:g} s)")
    stats = engine.stats()
    print(f"shut down cleanly: {stats['num_steps']} engine steps, {stats['num_generated_tokens']} tokens generated, "
          f"{stats['num_used_blocks']} KV blocks in use")
    report.expect_equal("KV blocks in use after shutdown", stats["num_used_blocks"], 0)
    engine.check_invariants()
    if args.json:
        report.write_json(args.json, {**result, "expected_text": expected, "port": server.port,
                                      "engine_steps": stats["num_steps"], "shutdown": drain}, args)
    return 130 if signals.received == signal.SIGINT else 0


if __name__ == "__main__":
    cli.run(main)
