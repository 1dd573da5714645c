"""Train the demo model: `python -m cairn.demo.train [--out DIR] [--seed N] [--steps N]`.

From a seed, on this machine's CPU, in one run:
1. a byte-level BPE tokenizer (`tokenizers`, VOCAB_SIZE tokens, digits split one by one) trained on the
   first TOKENIZER_DOCS documents of the corpus (cairn.demo.corpus), with the ChatML special tokens and
   `<think>`, `</think>`, `<tool_call>`, `</tool_call>` as added tokens;
2. a Qwen3.5-architecture model (transformers' Qwen3_5ForCausalLM: three Gated DeltaNet layers to one
   gated attention layer, twice; the built-in random demo's shape) with an MTP head in Qwen3.5's layout
   (`mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, one full-attention decoder layer
   `mtp.layers.0.*`, `mtp.norm`), trained together: next-token loss plus MTP_WEIGHT times the MTP head's
   loss on the token after next (it reads the model's last hidden state at t, normed, and the embedding
   of token t + 1). In the generated conversations the loss counts a reply's tokens (the assistant turns, their
   `<|im_end|>` included) fully and the rest of the conversation (system, user and tool turns, what the model
   reads but does not write) at CONTEXT_WEIGHT; plain source and English text count fully. The forward and
   backward passes run under bfloat16 autocast (the weights and the optimizer stay float32);
3. an unchanged Hugging Face checkpoint: config.json, model.safetensors (bfloat16), tokenizer.json,
   tokenizer_config.json (with the demo chat template), generation_config.json, training.json (the run:
   seed, steps, tokens, minutes, the CPU, the loss curve) and SHA256SUMS, which cairn checks on load.

Every SAVE_EVERY steps the run writes its state (`resume.pt` in the output directory: weights, optimizer,
step, curve); `--resume` continues from it, so a run can span sessions. Training is deterministic for a seed
on a given machine and thread count, resumed or not. docs/demo-model.md has the
figures of the shipped run.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from cairn.demo import corpus
from cairn.request.tokenizer import DEMO_CHAT_TEMPLATE

SHIPPED = Path(__file__).with_name("checkpoint")
VOCAB_SIZE = 4096
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ADDED = ("<think>", "</think>", "<tool_call>", "</tool_call>")
TOKENIZER_DOCS = 4000
MTP_WEIGHT = 0.3
CONTEXT_WEIGHT = 0.3
SAVE_EVERY = 100
REPLY_START = "<|im_start|>assistant\n"
REPLY_END = "<|im_end|>"
CHECKSUMMED = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def model_config(vocab_size: int, eos: int, pad: int):
    import transformers as tf

    return tf.Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_conv_kernel_dim=4,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        max_position_embeddings=65536, rms_norm_eps=1e-6, initializer_range=0.02,
        eos_token_id=eos, pad_token_id=pad, bos_token_id=None, mtp_num_hidden_layers=1,
    )


def train_tokenizer(seed: int, docs: int = TOKENIZER_DOCS):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - len(ADDED), min_frequency=2, special_tokens=list(SPECIAL),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(itertools.islice(corpus.documents(seed), docs), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    return tok


class MTPHead(nn.Module):
    """Qwen3.5's multi-token-prediction module, from transformers' own Qwen3.5 layer classes."""

    def __init__(self, cfg):
        from transformers.models.qwen3_5 import modeling_qwen3_5 as q

        super().__init__()
        layer_cfg = type(cfg)(**{**cfg.to_dict(), "layer_types": ["full_attention"], "num_hidden_layers": 1})
        layer_cfg._attn_implementation = cfg._attn_implementation or "sdpa"
        self.pre_fc_norm_embedding = q.Qwen3_5RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = q.Qwen3_5RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList([q.Qwen3_5DecoderLayer(layer_cfg, 0)])
        self.norm = q.Qwen3_5RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        nn.init.normal_(self.fc.weight, std=cfg.initializer_range)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, position_embeddings) -> torch.Tensor:
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        x = self.layers[0](x, position_embeddings=position_embeddings, attention_mask=None)
        return self.norm(x)


def losses(model, mtp: MTPHead, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weighted next-token loss and the MTP head's weighted loss on the token after next, for a [B, T] batch
    and the [B, T] weights of its tokens as targets."""
    out = model.model(input_ids=ids)
    hidden = out.last_hidden_state
    head = model.lm_head.weight

    def weighted(logits: torch.Tensor, targets: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        nll = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
        return (nll * w.flatten()).sum() / w.sum()

    main = weighted(hidden[:, :-1] @ head.T, ids[:, 1:], weights[:, 1:])
    b, t = ids.shape
    positions = torch.arange(1, t, device=ids.device)[None, None].expand(3, b, t - 1)
    rope = model.model.rotary_emb(hidden, positions)
    m = mtp(hidden[:, :-1], model.model.embed_tokens(ids[:, 1:]), rope)
    extra = weighted(m[:, :-1] @ head.T, ids[:, 2:], weights[:, 2:])
    return main, extra


def reply_spans(text: str) -> list[tuple[int, int]]:
    """The character spans of a rendered conversation's replies: after each `<|im_start|>assistant\n` up to and
    including its `<|im_end|>` (or the text's end)."""
    spans, at = [], 0
    while (start := text.find(REPLY_START, at)) >= 0:
        start += len(REPLY_START)
        end = text.find(REPLY_END, start)
        end = len(text) if end < 0 else end + len(REPLY_END)
        spans.append((start, end))
        at = end
    return spans


def token_weights(text: str, offsets: list[tuple[int, int]]) -> list[float]:
    """Each token's weight as a target: 1 in a reply or in a text with no replies, else CONTEXT_WEIGHT."""
    spans = reply_spans(text)
    if not spans:
        return [1.0] * len(offsets)
    out, i = [], 0
    for start, _ in offsets:
        while i < len(spans) and spans[i][1] <= start:
            i += 1
        out.append(1.0 if i < len(spans) and spans[i][0] <= start else CONTEXT_WEIGHT)
    return out


def token_batches(tok, seed: int, batch: int, seq: int):
    """Endless ([batch, seq] ids, [batch, seq] weights) cut from the packed document stream."""
    ids: list[int] = []
    weights: list[float] = []
    docs = corpus.documents(seed)
    need = batch * seq
    while True:
        while len(ids) < need:
            texts = list(itertools.islice(docs, 64))
            for text, enc in zip(texts, tok.encode_batch(texts, add_special_tokens=False), strict=True):
                ids.extend(enc.ids)
                weights.extend(token_weights(text, enc.offsets))
        yield torch.tensor(ids[:need]).view(batch, seq), torch.tensor(weights[:need]).view(batch, seq)
        del ids[:need], weights[:need]


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def save(out: Path, model, mtp: MTPHead, tok, cfg, record: dict) -> None:
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(str(out))
    weights = load_file(str(out / "model.safetensors"))
    weights.update({f"mtp.{k}": v.to(torch.bfloat16).contiguous() for k, v in mtp.state_dict().items()})
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": DEMO_CHAT_TEMPLATE,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
        "model_max_length": cfg.max_position_embeddings, "clean_up_tokenization_spaces": False}, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")],
        "pad_token_id": tok.token_to_id("<|endoftext|>")}, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    sums = "".join(f"{hashlib.sha256((out / n).read_bytes()).hexdigest()}  {n}\n" for n in CHECKSUMMED)
    (out / "SHA256SUMS").write_text(sums)


def train(out: Path, seed: int, steps: int, batch: int, seq: int, lr: float, log_every: int,
          tokenizer_docs: int = TOKENIZER_DOCS, resume: bool = False) -> dict:
    import transformers as tf

    torch.manual_seed(seed)
    started = time.perf_counter()
    tok = train_tokenizer(seed, tokenizer_docs)
    cfg = model_config(tok.get_vocab_size(), tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"))
    model = tf.Qwen3_5ForCausalLM(cfg).train()
    mtp = MTPHead(cfg).train()
    params = list(model.parameters()) + list(mtp.parameters())
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    run = {"seed": seed, "steps": steps, "tokenizer_docs": tokenizer_docs, "batch": batch, "seq": seq, "lr": lr}
    state_path = out / "resume.pt"
    first, curve, spent = 0, [], 0.0
    batches = token_batches(tok, seed, batch, seq)
    if resume:
        state = torch.load(state_path, weights_only=True)
        if state["run"] != run:
            raise SystemExit(f"{state_path} is a run of {state['run']}, not of {run}")
        model.load_state_dict(state["model"])
        mtp.load_state_dict(state["mtp"])
        opt.load_state_dict(state["opt"])
        first, curve, spent = state["step"], state["curve"], state["minutes"]
        for _ in range(first):  # the same batches in the same order as an unbroken run
            next(batches)
    sizes = [sum(p.numel() for p in m.parameters()) / 1e6 for m in (model, mtp)]
    print(f"tokenizer: {tok.get_vocab_size()} tokens ({time.perf_counter() - started:.0f} s); model {sizes[0]:.2f} M "
          f"+ MTP {sizes[1]:.2f} M parameters; steps {first} to {steps} of {batch} x {seq} tokens", flush=True)

    def minutes() -> float:
        return spent + (time.perf_counter() - started) / 60

    for step in range(first, steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup=min(100, steps // 10 + 1))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            main, extra = losses(model, mtp, *next(batches))
        (main + MTP_WEIGHT * extra).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % log_every == 0 or step == steps - 1:
            curve.append({"step": step, "loss": round(main.item(), 4), "mtp_loss": round(extra.item(), 4),
                          "minutes": round(minutes(), 2)})
            print(f"step {step:5d}  loss {main.item():.3f}  mtp {extra.item():.3f}  {minutes():.1f} min", flush=True)
        if (step + 1) % SAVE_EVERY == 0 and step + 1 < steps:
            out.mkdir(parents=True, exist_ok=True)
            torch.save({"run": run, "model": model.state_dict(), "mtp": mtp.state_dict(), "opt": opt.state_dict(),
                        "step": step + 1, "curve": curve, "minutes": minutes()}, state_path.with_suffix(".tmp"))
            state_path.with_suffix(".tmp").replace(state_path)
    record = {**run, "tokens": steps * batch * seq, "loss_weights": {"reply": 1.0, "context": CONTEXT_WEIGHT},
              "autocast": "bfloat16", "minutes": round(minutes(), 1), "cpu": cpu_name(),
              "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": tf.__version__,
              "python": platform.python_version(), "corpus_mix": dict(corpus.MIX), "curve": curve}
    save(out, model.eval(), mtp.eval(), tok, cfg, record)
    state_path.unlink(missing_ok=True)
    return record


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m cairn.demo.train", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=SHIPPED, help="checkpoint directory to write (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1800, help="optimizer steps (default: %(default)s)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (cosine to a tenth)")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--tokenizer-docs", type=int, default=TOKENIZER_DOCS, help="documents the tokenizer learns from")
    p.add_argument("--resume", action="store_true", help="continue the run saved in OUT/resume.pt")
    args = p.parse_args(argv)
    record = train(args.out, args.seed, args.steps, args.batch, args.seq, args.lr, args.log_every, args.tokenizer_docs,
                   args.resume)
    print(f"wrote {args.out} ({record['minutes']} min, {record['tokens']} tokens)")


if __name__ == "__main__":
    main()
