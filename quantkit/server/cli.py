"""`quantkit serve`: flags → ServeConfig → `serve`. Registered on the main app by quantkit/cli.py."""

from __future__ import annotations

import logging

import typer

from quantkit.engine_flags import (CACHE_FRACTION, DEVICE, DTYPE, KV_BITS, KV_ROTATION, KV_SCALES, KV_STATS,
                                   engine_config)
from quantkit.server.limits import RequestLimits

LIMITS = RequestLimits()


def serve(
    model: str = typer.Argument(..., show_default=False, help="An HF model directory, a quantkit export, or "
                                "random:SHAPE:WEIGHTS (random weights of a real shape, e.g. random:llama2-7b:w4, "
                                "random:tiny:fp16; SHAPE llama2-7b, llama3-8b, internlm2-1.8b or tiny, WEIGHTS w4 "
                                "or fp16) with a byte-level tokenizer (one token per byte)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on; 0.0.0.0 makes the server "
                             "reachable from other machines."),
    port: int = typer.Option(23333, "--port", "--server-port", help="TCP port (0 picks a free one, printed)."),
    served_model_name: str | None = typer.Option(None, "--served-model-name", help="The model's name in the API "
                                                 "(`model` field, /v1/models) (default: the directory's name)."),
    kv_bits: int = KV_BITS,
    kv_scales: str = KV_SCALES,
    kv_stats: str | None = KV_STATS,
    kv_rotation: str = KV_ROTATION,
    cache_max_entry_count: float = CACHE_FRACTION,
    num_kv_tokens: int | None = typer.Option(None, "--num-kv-tokens", help="KV pool size in tokens, instead of "
                                             "the fraction (the CPU's pool: 8192 when unset)."),
    max_num_seqs: int = typer.Option(256, "--max-num-seqs", "--max-batch-size", help="Most sequences decoded "
                                     "together in one step (--max-batch-size: its older name)."),
    max_queue: int = typer.Option(512, "--max-queue", help="Most sequences waiting beyond --max-num-seqs; "
                                  "requests past that are answered 429 with Retry-After."),
    max_model_len: int | None = typer.Option(None, "--max-model-len", help="Context length, prompt and answer "
                                             "together (default and most: the model's max_position_embeddings)."),
    max_num_batched_tokens: int = typer.Option(2048, "--max-num-batched-tokens", help="Tokens one step computes "
                                               "at most (longer prompts are prefilled in chunks)."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="QUANTKIT_API_KEY", help="Require "
                                       "'Authorization: Bearer KEY' on /v1/* (also read from $QUANTKIT_API_KEY)."),
    tokenizer: str | None = typer.Option(None, "--tokenizer", help="A tokenizer directory to use instead of the "
                                         "model's (or of a random model's byte-level one)."),
    device: str | None = DEVICE,
    dtype: str = DTYPE,
    cuda_graphs: bool = typer.Option(True, "--cuda-graphs/--no-cuda-graphs", help="Replay decode steps from CUDA "
                                     "graphs, and steps with prompt tokens from piecewise graphs around attention."),
    graph_max_tokens: int = typer.Option(2048, "--graph-max-tokens", min=0, max=2048, help="Steps with prompt "
                                         "tokens of up to this many tokens replay piecewise CUDA graphs (captured "
                                         "at start, padded to 16 … 2048-token buckets); 0 runs them eagerly."),
    prefix_caching: bool = typer.Option(True, "--prefix-caching/--no-prefix-caching", help="Reuse the KV blocks "
                                        "of prompts' common prefixes (chat history, system prompts)."),
    async_scheduling: bool | None = typer.Option(None, "--async-scheduling/--no-async-scheduling", help="Schedule "
                                                 "and launch each step while the one before it runs, its tokens "
                                                 "read back behind it (default: on with CUDA)."),
    warmup: bool | None = typer.Option(None, "--warmup/--no-warmup", help="Before /health says ready, run "
                                       "synthetic requests that compile every kernel a step can meet (default: "
                                       "on with CUDA)."),
    cache_dir: str | None = typer.Option(None, "--cache-dir", metavar="DIR", help="Where compiled kernels are "
                                         "kept between runs, so that a restart starts warm (default: "
                                         "$QUANTKIT_CACHE_DIR, else ~/.cache/quantkit)."),
    allow_origins: list[str] = typer.Option([], "--allow-origin", help="Let browser pages from this origin call "
                                            "the API (CORS), e.g. http://127.0.0.1:6006; '*' for any "
                                            "(repeatable)."),
    shutdown_timeout: float | None = typer.Option(None, "--shutdown-timeout", help="Seconds the running requests "
                                                  "get to finish after SIGTERM before they are aborted "
                                                  "(default: as long as they need)."),
    access_log: bool = typer.Option(False, "--access-log", help="Log one line per HTTP request."),
    engine_thread: bool = typer.Option(False, "--engine-thread", help="Step the engine in a thread of the HTTP "
                                       "server's process instead of a process of its own (one process; the "
                                       "two then share the GIL)."),
    allowed_local_media_path: str | None = typer.Option(
        None, "--allowed-local-media-path", metavar="DIR", help="Let image parts name files (a path, relative to "
        "DIR or absolute, or a file:// URL) under DIR, after resolving '..' and symlinks (default: none; images "
        "come as data: URLs, and nothing is downloaded)."),
    max_image_bytes: int = typer.Option(10 * 2**20, "--max-image-bytes", help="Largest encoded image (a file's "
                                        "size, a data: URL's decoded bytes; default 10 MiB), checked before "
                                        "decoding; a data: URL counts against --max-request-bytes too (4/3 of "
                                        "the image's size)."),
    max_image_pixels: int = typer.Option(25_000_000, "--max-image-pixels", help="Most pixels (width x height, "
                                         "from the image's header, before decoding) an image may have; PIL "
                                         "refuses more than 178,956,970 whatever this says."),
    max_request_bytes: int = typer.Option(LIMITS.max_request_bytes, "--max-request-bytes", help="Largest request "
                                          "body (default 16 MiB); a longer one is answered 413 without being "
                                          "read whole."),
    max_prompts_per_request: int = typer.Option(LIMITS.max_prompts_per_request, "--max-prompts-per-request",
                                                help="Most prompts in one /v1/completions request."),
    max_messages: int = typer.Option(LIMITS.max_messages, "--max-messages", help="Most messages in one chat "
                                     "request."),
    max_stop: int = typer.Option(LIMITS.max_stop, "--max-stop", help="Most stop strings in one request."),
    max_stop_chars: int = typer.Option(LIMITS.max_stop_chars, "--max-stop-chars", help="Longest stop string, "
                                       "in characters."),
    max_json_depth: int = typer.Option(LIMITS.max_json_depth, "--max-json-depth", help="Deepest nesting of "
                                       "arrays and objects in a request body (a chat request with image parts "
                                       "nests 5 deep)."),
    max_grammar_chars: int = typer.Option(LIMITS.max_grammar_chars, "--max-grammar-chars", help="Longest "
                                          "structured-output grammar, in characters: a JSON schema (or all of a "
                                          "request's tool schemas when the call is forced), a regex, the choices, "
                                          "an EBNF grammar."),
    grammar_compile_timeout: int = typer.Option(LIMITS.grammar_compile_timeout, "--grammar-compile-timeout",
                                                help="Seconds a request's grammar may take to compile before it "
                                                "is answered 400 (a typical JSON schema takes milliseconds)."),
    tool_call_parser: str | None = typer.Option(None, "--tool-call-parser", help="How tool calls are read from "
                                                "the text under tool_choice auto: hermes (<tool_call>{…}</tool_call>, "
                                                "Hermes, Qwen2.5), internlm2 (<|action_start|><|plugin|>{…}"
                                                "<|action_end|>) or llama3_json (Llama 3.1's bare JSON) (default: "
                                                "the one the chat template shows, else hermes)."),
    engine_step_timeout: float = typer.Option(120.0, "--engine-step-timeout", help="Seconds the engine may go "
                                              "without finishing a step while requests are pending before the "
                                              "watchdog counts it as hung: its process is killed and restarted "
                                              "(with --engine-thread the server exits non-zero)."),
    engine_restarts: int = typer.Option(3, "--engine-restarts", help="Restarts of a crashed or hung engine "
                                        "process within 10 minutes (after 1, 2, 4... s of back-off; /health "
                                        "answers 503 with Retry-After meanwhile); one more failure and the "
                                        "server exits non-zero so that its supervisor restarts it. 0: exit at "
                                        "the first failure."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Warnings and errors only."),
) -> None:
    """OpenAI-compatible HTTP server on the engine: /v1/chat/completions, /v1/completions, /v1/models,
    /health, /metrics, and a chat page at /. SIGTERM or Ctrl-C finishes the running requests, then exits."""
    from quantkit.server.launch import ServeConfig
    from quantkit.server.launch import serve as run_serve

    if cache_dir is not None:   # an unwritable folder: one line now, not an engine that fails to start
        from quantkit.kernels.compile_cache import use_cache_dir

        use_cache_dir(cache_dir)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # other libraries' notes: warnings only
    logging.getLogger("quantkit").setLevel(logging.WARNING if quiet else logging.INFO)
    engine = engine_config(kv_bits, kv_scales, kv_stats, kv_rotation, device, dtype,
                           cache_max_entry_count=cache_max_entry_count, num_kv_tokens=num_kv_tokens,
                           max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                           max_model_len=max_model_len, cuda_graphs=cuda_graphs, graph_max_tokens=graph_max_tokens,
                           enable_prefix_caching=prefix_caching, async_scheduling=async_scheduling, warmup=warmup,
                           cache_dir=cache_dir)
    run_serve(ServeConfig(model=model, host=host, port=port, served_model_name=served_model_name, api_key=api_key,
                          max_queue=max_queue, tokenizer=tokenizer, engine=engine, allow_origins=allow_origins,
                          shutdown_timeout=shutdown_timeout, access_log=access_log,
                          log_level="warning" if quiet else "info", engine_thread=engine_thread,
                          engine_step_timeout=engine_step_timeout, engine_restarts=engine_restarts,
                          allowed_local_media_path=allowed_local_media_path, max_image_bytes=max_image_bytes,
                          max_image_pixels=max_image_pixels, tool_call_parser=tool_call_parser,
                          limits=RequestLimits(max_request_bytes, max_prompts_per_request, max_messages, max_stop,
                                               max_stop_chars, max_json_depth, max_grammar_chars,
                                               grammar_compile_timeout)))
