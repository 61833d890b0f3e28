"""``python -m torch_kvoffload.serve`` end to end, on a tiny random DeepSeek-V3.2 (nothing is downloaded).

Saves a tiny DeepseekV32 and a word-level tokenizer (word ``w{i}`` is token ``i``) to a temporary
directory, starts the server on 127.0.0.1 in a subprocess (layerwise + sparse decode offload, continuous
batching on), sends a few requests at once with the ``openai`` client (``/v1/completions`` and
``/v1/chat/completions``, greedy), prints each answer next to what the unmodified model's ``generate()``
gives, and stops the server. Exits non-zero if anything fails or differs.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from torch_kvoffload._utils import free_port

VOCAB = 1000
NEW_TOKENS = 12
START_TIMEOUT_S = 120.0  # imports, load and offload
REQUEST_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
CONFIG = {"layerwise": {}, "sparse": {}, "serving": {"max_request_tokens": 64, "max_requests": 4}}


def save_tiny_model(path: Path) -> None:
    """A seeded tiny DeepseekV32 (2 layers, 8 indexer heads, top-k 8) and its tokenizer, saved to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, DeepseekV32Config, PreTrainedTokenizerFast

    config = DeepseekV32Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=32,
        q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=1024,
        index_topk=8, index_head_dim=32, index_n_heads=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(path)

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w5{% endif %}"
    )
    fast.save_pretrained(path)


def words(n: int, seed: int) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(f"w{i}" for i in torch.randint(3, VOCAB, (n,), generator=g).tolist())


def wait_ready(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1.0) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        try:
            proc.wait(timeout=0.2)  # returns at once if the server exited
        except subprocess.TimeoutExpired:
            continue
        raise RuntimeError(f"the server exited with status {proc.returncode}")
    raise RuntimeError(f"the server did not answer /health within {START_TIMEOUT_S} s")


def reference(model_dir: Path, requests: list[tuple[str, str]]) -> list[str]:
    """Greedy per-prompt ``generate()`` of the unmodified model, decoded as the server decodes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    texts = []
    for kind, text in requests:
        if kind == "chat":
            msgs = [{"role": "user", "content": text}]
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)
            ids = ids["input_ids"]
        else:
            ids = tok(text)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0]
        texts.append(tok.decode(out[len(ids) :], skip_special_tokens=True))
    return texts


def main() -> int:
    from openai import OpenAI

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny-v32"
        save_tiny_model(model_dir)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "torch_kvoffload.serve", str(model_dir), "--port", str(port)]
        cmd += ["--config", json.dumps(CONFIG), "--device", "cpu"]
        print("$ python", shlex.join(cmd[1:]))
        proc = subprocess.Popen(cmd)
        try:
            wait_ready(proc, url)
            client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)
            name = str(model_dir)
            requests = [("completion", words(12, 0)), ("chat", words(9, 1)), ("completion", words(20, 2))]
            requests += [("chat", words(15, 3))]

            def send(request: tuple[str, str]) -> str:
                kind, text = request
                if kind == "chat":
                    msgs = [{"role": "user", "content": text}]
                    r = client.chat.completions.create(
                        model=name, messages=msgs, max_tokens=NEW_TOKENS, temperature=0
                    )
                    return r.choices[0].message.content
                r = client.completions.create(model=name, prompt=text, max_tokens=NEW_TOKENS, temperature=0)
                return r.choices[0].text

            t0 = time.perf_counter()
            with ThreadPoolExecutor(len(requests)) as pool:
                answers = list(pool.map(send, requests))
            elapsed = time.perf_counter() - t0
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.returncode != 0:
            print(f"the server stopped with status {proc.returncode}", file=sys.stderr)
            return 1
        expected = reference(model_dir, requests)

    print(f"{len(requests)} requests at once, answered in {elapsed:.2f} s")
    ok = True
    for (kind, text), got, want in zip(requests, answers, expected, strict=True):
        same = got == want
        ok &= same
        print(f"[{kind}] {text[:40]}... -> {got!r} ({'equals' if same else 'DIFFERS from'} generate())")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
