"""Engine: requests in, tokens and text out, one scheduler step at a time (continuous batching).

    engine = Engine("MODEL_DIR", EngineConfig(kv_bits=8))
    for out in engine.stream("Hi, pls intro yourself", SamplingParams(max_tokens=64)):
        print(out.text, end="", flush=True)

Every `step()` schedules the waiting and running requests under the token budget, runs the model once,
samples one token for each sequence that finished its prompt or decoded, and returns what changed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence as Seq, Union

import torch

from quantkit.config import UserError
from quantkit.engine.block_manager import BlockManager
from quantkit.engine.config import EngineConfig, SamplingParams
from quantkit.engine.detokenize import IncrementalDetokenizer
from quantkit.engine.model_runner import ModelRunner
from quantkit.engine.multimodal import MultiModalPrompt
from quantkit.engine.sampler import Sampler
from quantkit.engine.scheduler import Scheduler
from quantkit.engine.sequence import PENDING, Sequence
from quantkit.engine.structured import Grammars, accept
from quantkit.kernels.compile_watch import COMPILES

Prompt = Union[str, Seq[int], Seq[dict], MultiModalPrompt]
log = logging.getLogger(__name__)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class RequestOutput:
    """What one step produced for one request: the new text and token ids (the whole answer in the
    outputs `generate` returns), whether it finished and why ("stop", "length", "abort", or "error" when
    something failed while its token was sampled, detokenized or stop-checked: `error` says what; the
    request was ended alone, the others went on)."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: Optional[str]
    usage: Usage
    logprobs: Optional[list] = None      # sampler.TokenLogprobs per new token, when the request asked
    error: Optional[str] = None          # finish_reason "error": what went wrong with this request alone


@dataclass
class _Request:
    seq: Sequence
    detok: Optional[IncrementalDetokenizer]
    sent: int = 0                        # generated tokens already reported
    # Its sampling reads its earlier tokens or logits on the host (a grammar, penalties, logprobs): while such
    # a request runs, each step's tokens are read back before the next step is scheduled.
    host_sampling: bool = False


@dataclass
class _InFlight:
    """A launched step whose sampled tokens are still on their way from the device (asynchronous
    scheduling): `seqs` hold PENDING as their last token, each at its row of `tokens`."""

    seqs: list[Sequence]
    tokens: torch.Tensor                 # [N] int64 on the device: the next step's inputs read it there
    host: torch.Tensor                   # [N] their copy on the host (pinned on CUDA), complete after `ready`
    ready: Optional[Any] = None          # the CUDA event recorded after the copy; None: complete already

    def token_ids(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()     # this step only: the step launched after it keeps running
        return self.host.tolist()


def _needs_host_sampling(seq: Sequence) -> bool:
    p = seq.params
    return (seq.grammar is not None or p.logprobs is not None or p.repetition_penalty != 1.0
            or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0)


def encode_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids of a prompt: ids as given, a string tokenized, chat messages through the chat template."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise UserError("this engine has no tokenizer: pass token ids as the prompt")
        return list(tokenizer(prompt)["input_ids"])
    prompt = list(prompt)
    if prompt and isinstance(prompt[0], dict):
        return encode_chat(tokenizer, prompt)
    if not all(isinstance(t, int) for t in prompt):
        raise UserError("a prompt is a string, a list of token ids, or a list of chat messages "
                        "({'role': ..., 'content': ...})")
    return prompt


def encode_chat(tokenizer: Any, messages: list[dict], tools: Optional[list[dict]] = None) -> list[int]:
    """Chat messages through the tokenizer's chat template, ready for the assistant's answer; `tools`
    (OpenAI's function tools) are given to the template, which shows them to the model. Without a
    template (a base model) the turns are written as 'role: content' lines."""
    if tokenizer is None:
        raise UserError("this engine has no tokenizer: chat messages need one")
    if getattr(tokenizer, "chat_template", None):
        extra = {"tools": tools} if tools else {}
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    return list(tokenizer(text)["input_ids"])


class StartPhases:
    """The engine's start, one log line per phase with its time (`with phases("name"): …`), then the total.
    On CUDA it first points the compile caches at config.cache_dir; each line counts the kernel specializations
    built in it (kernels/compile_watch.py), and `done` marks the engine ready: one built after that is logged."""

    def __init__(self, config: EngineConfig) -> None:
        self.start = time.perf_counter()
        self.cuda = _on_cuda(config.device)
        self._compiles = COMPILES.total
        if self.cuda:
            from quantkit.kernels.compile_cache import use_cache_dir

            log.info("start: compiled kernels are kept in %s", use_cache_dir(config.cache_dir))

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        began = time.perf_counter()
        yield
        log.info("start: %-22s %7.1f s%s", name, time.perf_counter() - began, self._compiled())

    def _compiled(self) -> str:
        n, self._compiles = COMPILES.total - self._compiles, COMPILES.total
        return f"  ({n} kernel specializations compiled or loaded)" if n else ""

    def done(self) -> None:
        log.info("start: ready in %.1f s", time.perf_counter() - self.start)
        if self.cuda:
            COMPILES.mark_started()


def _on_cuda(device: Optional[str]) -> bool:
    if device is not None and not str(device).startswith("cuda"):
        return False
    return torch.cuda.is_available()


class RequestFailed(RuntimeError):
    """A request ended with finish_reason "error" (raised by `stream`); the engine goes on."""


class Engine:
    """Continuous-batching inference over our decoder and a paged KV pool; see the module docstring."""

    def __init__(self, path: Union[str, Path], config: Optional[EngineConfig] = None) -> None:
        from quantkit.engine.model import load_decoder

        config = config or EngineConfig()
        if config.static_kv_scales:  # refused before the weights load
            from quantkit.engine.kv_scales import stats_file_for

            config = dataclasses.replace(config, kv_stats=str(stats_file_for(path, config.kv_stats)))
        phases = StartPhases(config)
        with phases("weights loaded"):
            model, tokenizer, generation_config = load_decoder(path, config.device, config.dtype)
            from quantkit.engine.vision import load_vision

            self.vision = load_vision(path, model.device, model.dtype)  # a LLaVA checkpoint's image half, else None
        self._start(model, tokenizer, generation_config, config, phases)

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any = None, config: Optional[EngineConfig] = None,
                   generation_config: Any = None) -> "Engine":
        """An engine over a DecoderModel already built (the benchmarks' random-weight models)."""
        engine = cls.__new__(cls)
        engine.vision = None
        config = config or EngineConfig()
        engine._start(model, tokenizer, generation_config, config, StartPhases(config))
        return engine

    def _start(self, model: Any, tokenizer: Any, generation_config: Any, config: EngineConfig,
               phases: "StartPhases") -> None:
        self.model, self.tokenizer, self.generation_config, self.config = model, tokenizer, generation_config, config
        self.runner = ModelRunner(model, config, phases)
        # The scheduler stops sequences at the context the runner resolved (config, else the model's).
        config = self.config = dataclasses.replace(config, max_model_len=self.runner.max_model_len)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.sampler = Sampler()
        self.max_model_len = self.runner.max_model_len
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._grammars: Optional[Grammars] = None   # made with the first request that has a grammar
        self._lock = threading.RLock()          # a host may step in one thread and abort from another
        use_async = config.async_scheduling
        self.async_scheduling = self.runner.device.type == "cuda" if use_async is None else bool(use_async)
        self._inflight: Optional[_InFlight] = None
        warm = config.warmup if config.warmup is not None else self.runner.device.type == "cuda"
        if warm:
            from quantkit.engine.warmup import warm_up

            with phases("warm-up traffic"):
                report = warm_up(self)
            log.info("start: warm-up traffic was %d requests in %d steps", report.requests, report.steps)
        phases.done()

    def reset_after_warm_up(self) -> None:
        """Forget what the warm-up traffic left: the prefix cache's keys and the counters."""
        with self._lock:
            if self._requests or self._inflight is not None or self.scheduler.has_unfinished():
                raise RuntimeError("the engine is reset only when idle")
            self.block_manager.reset_prefix_cache()
            self.scheduler.num_preemptions = 0

    # --- requests -----------------------------------------------------------------------------------

    def add_request(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None) -> str:
        """Queue a request (a string, token ids, or chat messages); returns its id."""
        eos = getattr(self.tokenizer, "eos_token_id", None)
        params = (params or SamplingParams()).with_defaults(self.generation_config, eos)
        prompt = self.multimodal_prompt(prompt)
        images = prompt.images if isinstance(prompt, MultiModalPrompt) else None
        token_ids = prompt.token_ids if isinstance(prompt, MultiModalPrompt) else encode_prompt(self.tokenizer, prompt)
        if not token_ids:
            raise UserError("the prompt is empty: give at least one token")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        with self._lock:
            if request_id in self._requests:
                raise UserError(f"request id {request_id!r} is already running: give each request its own id")
            seq = Sequence(token_ids, params, request_id)
            seq.images = images
            if params.structured is not None:   # compiled here (once per distinct grammar): a bad one raises
                seq.grammar = self.grammars.matcher(params.structured, seq.stop_ids)
            detok = IncrementalDetokenizer(self.tokenizer, seq) if self.tokenizer is not None else None
            # The last call that can refuse (a prompt the pool or max_model_len cannot hold): nothing is
            # left half-added when anything before it raises.
            self.scheduler.add(seq)
            self._requests[request_id] = _Request(seq, detok, host_sampling=_needs_host_sampling(seq))
        return request_id

    @property
    def grammars(self) -> Grammars:
        """The compiler of the requests' grammars for this model's tokenizer and vocabulary."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.model.config.vocab_size)
        return self._grammars

    def multimodal_prompt(self, prompt: Prompt) -> Prompt:
        """Chat messages through the checkpoint's processor when it takes images (a `MultiModalPrompt`:
        placeholders expanded, image features computed); other prompts as they are. Images sent to a
        model without a vision tower are a UserError."""
        from quantkit.engine.vision import NoImagesError, has_images

        if isinstance(prompt, MultiModalPrompt):
            return prompt
        if self.vision is None:
            if has_images(prompt):
                raise NoImagesError("this model takes no images (no vision tower or image processor was loaded): "
                                     "send text only")
            return prompt
        if prompt and not isinstance(prompt, str) and isinstance(list(prompt)[0], dict):
            return self.vision.encode(list(prompt))
        return prompt

    def abort(self, request_id: str) -> None:
        """Stop a request now; its blocks are freed at once. Unknown or finished ids are ignored."""
        with self._lock:
            req = self._requests.pop(str(request_id), None)
            if req is not None:
                self.scheduler.abort(req.seq.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def stats(self) -> dict[str, int]:
        """Counts for monitoring (the server's /metrics): running and waiting sequences, KV blocks used and
        in the pool, prefix-cache queries and hits (tokens), preemptions, kernels compiled after start (a gap in
        the start-up warm-up: kernels/compile_watch.py). Plain reads, so another thread may
        call it while a step runs: it then sees a moment's mix of before and after."""
        bm, sched = self.block_manager, self.scheduler
        return {"running": len(sched.running), "waiting": len(sched.waiting), "kv_blocks_total": bm.num_blocks,
                "kv_blocks_used": bm.num_blocks - bm.num_free_blocks, "prefix_cache_queries": bm.prefix_queries,
                "prefix_cache_hits": bm.prefix_hits, "preemptions": sched.num_preemptions,
                "kernel_compiles_after_start": COMPILES.after_start}

    # --- one step -----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; one RequestOutput per request that got a token or finished.

        With asynchronous scheduling (`EngineConfig.async_scheduling`, on by default on CUDA) the step is
        launched before the previous one's tokens are read back: each call returns the outputs of the step
        launched by the call before it (the first call returns none), while the device already computes the
        next. A sequence that a stop token ends gets one step computed past it, which is dropped; max_tokens
        and the length limit are known on the host and cost nothing. While a request whose sampling needs its
        tokens on the host runs (a grammar, penalties, logprobs), steps run one at a time as without it.

        The forward is shared: when it raises, the step raises (the engine's state is then not trusted).
        Everything after it is one request's own work (sampling its token, appending it, detokenizing,
        checking its stops): a failure there ends that request alone with finish_reason "error"."""
        with self._lock:
            overlap = self.async_scheduling and not any(r.host_sampling for r in self._requests.values())
            outputs = [] if overlap else self._collect()
            batch = self.scheduler.schedule()
            if not batch:
                if self._inflight is not None:   # what is left to do is reading the last step back
                    return outputs + self._collect()
                if self.scheduler.has_unfinished():  # a bug, not a user error: never loop on it silently
                    raise RuntimeError(f"the scheduler scheduled nothing with {len(self.scheduler.waiting)} "
                                       f"waiting and {len(self.scheduler.running)} running sequences")
                return outputs
            previous = self._inflight.tokens if self._inflight is not None else None
            logits, seqs = self.runner.run(batch, previous)
            if overlap and seqs:
                launched = self._launch_sample(logits, seqs)
                if launched is not None:
                    outputs += self._collect()
                    self.scheduler.account(batch)
                    self._inflight = self._pending(launched, seqs)
                    return outputs
            outputs += self._collect()
            token_ids, logprobs, errors = self._sample(logits, seqs) if seqs else ([], [], {})
            self.scheduler.account(batch)
            for i, seq in enumerate(seqs):
                try:
                    if i in errors:
                        raise errors[i]
                    if seq.grammar is not None:
                        accept(seq, token_ids[i])
                    self.scheduler.append(seq, token_ids[i], logprobs[i])
                    if seq.grammar is not None and seq.grammar.is_terminated() and not seq.is_finished:
                        self.scheduler.finish(seq, "stop")   # the grammar is complete and has no end token
                    out = self._advance(seq, token_ids[i])
                except Exception as exc:  # this request's fault alone: end it, keep stepping the others
                    out = self._fail(seq, exc)
                if out is not None:
                    outputs.append(out)
            return outputs

    # --- asynchronous scheduling --------------------------------------------------------------------

    def _launch_sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> Optional[_InFlight]:
        """The batch's tokens sampled on the device and their copy to the host started, not waited for;
        None when the batched sampling raised (the caller then samples one by one, to find whose settings
        failed)."""
        try:
            tokens, _ = self.sampler(logits, seqs)
        except Exception:
            return None
        if tokens.device.type != "cuda":
            return _InFlight([], tokens, tokens)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return _InFlight([], tokens, host, ready)

    def _pending(self, launched: _InFlight, seqs: list[Sequence]) -> _InFlight:
        """Append PENDING to each sampled sequence still running (through the scheduler, which ends it now at
        max_tokens or the length limit: the next step is not scheduled for it)."""
        for row, seq in enumerate(seqs):
            if seq.is_finished:               # ended while the step ran (a stop token read back, an abort)
                continue
            self.scheduler.append(seq, PENDING)
            seq.pending_row = row
            launched.seqs.append(seq)
        return launched

    def _collect(self) -> list[RequestOutput]:
        """Read back the step in flight's tokens (waiting for that step alone) and finish its work on the
        host: each PENDING replaced by its token, stop tokens, detokenizing, stop strings, outputs."""
        flight, self._inflight = self._inflight, None
        if flight is None:
            return []
        token_ids = flight.token_ids()
        outputs = []
        for seq in flight.seqs:
            token_id = token_ids[seq.pending_row]
            seq.token_ids[len(seq.token_ids) - 1] = token_id
            seq.pending_row = None
            try:
                if token_id in seq.stop_ids:
                    self.scheduler.finish(seq, "stop", token_id if token_id in seq.params.stop_token_ids else None)
                out = self._advance(seq, token_id)
            except Exception as exc:  # this request's fault alone: end it, keep stepping the others
                out = self._fail(seq, exc)
            if out is not None:
                outputs.append(out)
        return outputs

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list, dict[int, Exception]]:
        """The batch's tokens and logprobs, and {index: exception} of the sequences whose sampling failed.
        When the batched call raises, each sequence is sampled alone to find whose settings failed it."""
        try:
            token_ids, logprobs = self.sampler(logits, seqs)
            return token_ids.tolist(), logprobs, {}
        except Exception as exc:
            if len(seqs) == 1:
                return [0], [None], {0: exc}
        token_ids, logprobs, errors = [], [], {}
        for i, seq in enumerate(seqs):
            try:
                ids, lps = self.sampler(logits[i:i + 1], [seq])
                token_ids.append(int(ids.item()))
                logprobs.append(lps[0])
            except Exception as exc:
                token_ids.append(0)
                logprobs.append(None)
                errors[i] = exc
        return token_ids, logprobs, errors

    def _fail(self, seq: Sequence, exc: Exception) -> Optional[RequestOutput]:
        """End seq's request with finish_reason "error" after `exc` (its blocks are freed at once)."""
        log.error("request %s failed and was ended alone: %s: %s", seq.request_id, type(exc).__name__, exc,
                  exc_info=exc)
        self.scheduler.finish(seq, "error")
        req = self._requests.pop(seq.request_id, None)
        if req is None:
            return None
        out = self._output(req, [], "", finished=True, reason="error")
        out.error = f"{type(exc).__name__}: {exc}"
        return out

    def _advance(self, seq: Sequence, token_id: int) -> Optional[RequestOutput]:
        req = self._requests.get(seq.request_id)
        if req is None:
            return None
        delta = ""
        if req.detok is not None:
            delta = req.detok.step(token_id)
            if req.detok.stopped and not seq.is_finished:  # a stop string ended the text
                self.scheduler.finish(seq, "stop", req.detok.stop_string)
        new_ids = seq.token_ids[seq.num_prompt_tokens + req.sent:]
        logprobs = seq.output_logprobs[req.sent:] if seq.params.logprobs is not None else None
        req.sent = seq.num_output_tokens
        if seq.is_finished:
            self._requests.pop(seq.request_id, None)
        out = self._output(req, new_ids, delta, seq.is_finished, seq.finish_reason)
        out.logprobs = logprobs
        return out

    def _output(self, req: _Request, new_ids: list[int], text: str, finished: bool,
                reason: Optional[str]) -> RequestOutput:
        seq = req.seq
        return RequestOutput(seq.request_id, text, list(new_ids), finished, reason if finished else None,
                             Usage(seq.num_prompt_tokens, seq.num_output_tokens))

    # --- whole answers ------------------------------------------------------------------------------

    def generate(self, prompts: Union[Prompt, list[Prompt]], params: Union[SamplingParams, list, None] = None,
                 progress: bool = True) -> list[RequestOutput]:
        """Every prompt to its end, all fed through the scheduler at once; one final RequestOutput each
        (the whole text and token ids), in the order of `prompts`."""
        if isinstance(prompts, (str, MultiModalPrompt)) or (prompts and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, params_list):
                ids.append(self.add_request(p, sp))
        except UserError as exc:  # a bad prompt refuses the whole batch: none of it stays queued
            for i in ids:
                self.abort(i)
            raise UserError(f"prompt {len(ids) + 1}: {exc}") if len(prompts) > 1 else exc from None
        texts: dict[str, list[str]] = {i: [] for i in ids}
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        logprobs: dict[str, list] = {i: [] for i in ids}
        final: dict[str, RequestOutput] = {}
        seqs = {i: self._requests[i].seq for i in ids}
        bar = _progress_bar(len(ids), progress)
        try:
            while len(final) < len(ids):
                outputs = self.step()
                if not outputs:  # requests aborted from elsewhere (another thread) end here, not never
                    for rid in [i for i in ids if i not in final and i not in self._requests]:
                        seq = seqs[rid]
                        final[rid] = RequestOutput(rid, "".join(texts[rid]), tokens[rid], True, "abort",
                                                   Usage(seq.num_prompt_tokens, seq.num_output_tokens))
                for out in outputs:
                    rid = out.request_id
                    if rid not in texts:
                        continue
                    texts[rid].append(out.text)
                    tokens[rid].extend(out.token_ids)
                    logprobs[rid].extend(out.logprobs or [])
                    if out.finished:
                        out.text, out.token_ids = "".join(texts[rid]), tokens[rid]
                        out.logprobs = logprobs[rid] if out.logprobs is not None else None
                        final[rid] = out
                        bar.update(1)
        finally:  # Ctrl-C or an error: nothing of this batch stays queued
            bar.close()
            for i in ids:
                if i not in final:
                    self.abort(i)
        return [final[i] for i in ids]

    def stream(self, prompt: Prompt, params: Optional[SamplingParams] = None,
               request_id: Optional[str] = None) -> Iterator[RequestOutput]:
        """Outputs of one request as they come (text deltas). Stepping serves every queued request, but
        only this one's outputs are yielded: run one stream at a time (a host serving many calls `step`
        and routes the outputs by request id). Closing the iterator early (break, Ctrl-C) aborts it."""
        rid = self.add_request(prompt, params, request_id)
        finished = False
        try:
            while not finished:
                for out in self.step():
                    if out.request_id == rid:
                        finished = out.finished
                        if out.finish_reason == "error":
                            raise RequestFailed(out.error)
                        yield out
        finally:
            if not finished:
                self.abort(rid)


def _progress_bar(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generating", unit="req", disable=not enabled or total < 2, dynamic_ncols=True)
