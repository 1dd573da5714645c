"""Incremental detokenization: window decoding from Python against tokenizers' DecodeStream, one byte-level BPE.

A 32k byte-level BPE (the kind Qwen ships) is trained on this repository's text plus multi-byte text
(CJK, accents, emoji), then a long mixed text is encoded and streamed back one token at a time by
each side, alternating, best of `--repeats`: `WindowDecoder` (what cairn's Detokenizer did before, and
still does for the demo's byte tokenizer), `DecodeStream` alone, and the Detokenizer as the engine runs
it (DecodeStream plus the stop-string bookkeeping). Every side must produce the text a whole decode
gives; the table gives microseconds per token. Not a test: it asserts only that the texts agree.

    python benchmarks/detokenize_bench.py
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from cairn.engine.outputs import Detokenizer, WindowDecoder
from cairn.request.tokenizer import HFTokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
MULTIBYTE = "naïve café façade 東京は日本の首都です。 안녕하세요 세계 🙂🚀👩‍💻 Ελληνικά русский текст "


def corpus() -> list[str]:
    texts = [p.read_text() for p in sorted(REPO_ROOT.glob("**/*.py")) + sorted(REPO_ROOT.glob("*.md"))]
    return texts + [MULTIBYTE * 50]


def train(path: Path, vocab_size: int) -> HFTokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"])
    tok.train_from_iterator(corpus(), trainer)
    tok.save(str(path / "tokenizer.json"))
    return HFTokenizer(path)


def window_decoder(tokenizer: HFTokenizer, ids: list[int]) -> tuple[float, str]:
    step = WindowDecoder(tokenizer)
    start = time.perf_counter()
    parts = [step(t) for t in ids]
    return time.perf_counter() - start, "".join(p for p in parts if p)


def decode_stream(tokenizer: HFTokenizer, ids: list[int]) -> tuple[float, str]:
    step = tokenizer.decode_stream()
    start = time.perf_counter()
    parts = [step(t) for t in ids]
    return time.perf_counter() - start, "".join(p for p in parts if p)


def detokenizer(tokenizer: HFTokenizer, ids: list[int], window: bool = False) -> tuple[float, str]:
    detok = Detokenizer(tokenizer, ("never appears",))
    if window:
        detok._step = WindowDecoder(tokenizer)  # the Detokenizer as it was: same bookkeeping, window decoding
    start = time.perf_counter()
    parts = [detok.add(t, final=False)[0] for t in ids]
    parts.append(detok.add(None, final=True)[0])
    return time.perf_counter() - start, "".join(parts)


SIDES = {"WindowDecoder alone": window_decoder, "DecodeStream alone": decode_stream,
         "Detokenizer before (WindowDecoder + a stop string)": lambda t, ids: detokenizer(t, ids, window=True),
         "Detokenizer now (DecodeStream + a stop string)": detokenizer}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tokenizer = train(Path(d), args.vocab_size)
        text = (REPO_ROOT / "README.md").read_text() + MULTIBYTE * 20
        ids = tokenizer.encode(text)
        runs = {name: [] for name in SIDES}
        for _ in range(args.repeats):
            for name, fn in SIDES.items():
                seconds, out = fn(tokenizer, ids)
                assert out == tokenizer.decode(ids), name
                runs[name].append(seconds)
    print(f"{len(ids)} tokens, vocabulary {tokenizer.vocab_size}; best of {args.repeats} (spread)\n")
    print("| detokenizer | us per token | spread |\n|---|---:|---:|")
    for name, seconds in runs.items():
        per = [1e6 * s / len(ids) for s in seconds]
        print(f"| {name} | {min(per):.2f} | {min(per):.2f}-{max(per):.2f} |")


if __name__ == "__main__":
    main()
