"""The trained demo model: its checkpoint as shipped (checked, loaded as transformers loads it), its corpus
(the same for a seed, its held-out part apart) and its training script (a checkpoint cairn loads, MTP head included).
"""

from __future__ import annotations

import itertools
import shutil

import pytest
import torch

from cairn.config import DEMO_NAME, RANDOM_DEMO_NAME, ConfigError, ModelOptions
from cairn.demo import corpus, sources
from cairn.model.config import WeightError
from cairn.model.demo_checkpoint import DEMO_CHECKPOINT, demo_checkpoint
from cairn.model.loader import load_checkpoint
from cairn.preflight import check_model
from tests import harness

MTP_NAMES = {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
             "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.down_proj.weight"}


def test_the_shipped_demo_checkpoint_matches_its_checksums():
    assert demo_checkpoint() == DEMO_CHECKPOINT
    check_model(DEMO_NAME)  # the command line's preflight checks it too


@pytest.mark.parametrize("damage", ["changed", "missing"])
def test_a_changed_or_missing_demo_file_is_a_one_line_error_naming_it(tmp_path, damage):
    copy = tmp_path / "checkpoint"
    shutil.copytree(DEMO_CHECKPOINT, copy)
    if damage == "changed":
        data = bytearray((copy / "tokenizer.json").read_bytes())
        data[100] ^= 1
        (copy / "tokenizer.json").write_bytes(bytes(data))
    else:
        (copy / "tokenizer.json").unlink()
    with pytest.raises(WeightError, match="tokenizer.json") as e:
        demo_checkpoint(copy)
    assert "\n" not in str(e.value) and ("does not match" if damage == "changed" else "missing") in str(e.value)


def test_cairn_computes_the_demo_checkpoint_as_transformers_does():
    import transformers as tf

    ids = list(range(3, 40)) + [1, 2, 3]
    model, _ = load_checkpoint(str(DEMO_CHECKPOINT), "float32", torch.device("cpu"), show_progress=False)
    ours = harness.prefill(model, ids, cuts=[16])
    ref = tf.Qwen3_5ForCausalLM.from_pretrained(str(DEMO_CHECKPOINT), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = ref(input_ids=torch.tensor([ids])).logits[0]
    assert torch.allclose(ours, theirs, atol=2e-4, rtol=1e-4), (ours - theirs).abs().max()


def test_the_demo_seed_is_for_the_random_demo_model_only():
    ModelOptions(model=RANDOM_DEMO_NAME, demo_seed=3)
    ModelOptions(model=None, demo_seed=3)
    with pytest.raises(ConfigError, match=RANDOM_DEMO_NAME):
        ModelOptions(model=DEMO_NAME, demo_seed=3)


def test_the_corpus_is_the_same_for_a_seed_and_its_held_out_part_is_apart():
    first = list(itertools.islice(corpus.documents(7), 30))
    assert first == list(itertools.islice(corpus.documents(7), 30))
    assert first != list(itertools.islice(corpus.documents(8), 30))
    assert all(doc.endswith(corpus.END) for doc in first)
    train, held = corpus.material("train"), corpus.material("held_out")
    for kind in ("python", "english", "docs", "snippets"):
        assert train[kind] and held[kind], kind
    names = [{f"{d.module}.{d.name}" for d in part["docs"]} for part in (train, held)]
    assert not names[0] & names[1] and all(sources.held_out(name) for name in names[1])
    assert not set(train["python"]) & set(held["python"])


def test_the_training_script_writes_a_checkpoint_cairn_loads_with_its_mtp_head(tmp_path):
    from safetensors import safe_open

    from cairn.demo import train
    from cairn.request.tokenizer import HFTokenizer

    out = tmp_path / "trained"
    record = train.train(out, seed=0, steps=1, batch=1, seq=64, lr=1e-3, log_every=1, tokenizer_docs=100)
    assert record["tokens"] == 64 and record["curve"][0]["step"] == 0
    demo_checkpoint(out)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert all(f.get_tensor(n).dtype == torch.bfloat16 for n in names)
    assert names >= MTP_NAMES
    model, cfg = load_checkpoint(str(out), "float32", torch.device("cpu"), show_progress=False)
    tok = HFTokenizer(out, cfg.eos_token_ids)
    ids = tok.encode(tok.render_chat([{"role": "user", "content": "Hello"}]))
    assert harness.prefill(model, ids).shape == (len(ids), cfg.vocab_size)
    assert tok.decode(tok.encode("<tool_call>\n<think>")) == "<tool_call>\n<think>"


def test_a_resumed_training_run_ends_with_the_weights_of_an_unbroken_one(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from cairn.demo import train

    monkeypatch.setattr(train, "SAVE_EVERY", 2)
    run = {"seed": 0, "steps": 4, "batch": 1, "seq": 64, "lr": 1e-3, "log_every": 1, "tokenizer_docs": 100}
    train.train(tmp_path / "unbroken", **run)

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    broken = tmp_path / "broken"
    with monkeypatch.context() as m:  # the run stops after its step-2 save, before writing the checkpoint
        m.setattr(train, "save", stopped)
        with pytest.raises(KeyboardInterrupt):
            train.train(broken, **run)
    assert torch.load(broken / "resume.pt", weights_only=True)["step"] == 2
    with pytest.raises(SystemExit, match="not of"):  # a different run's state is refused
        train.train(broken, **{**run, "lr": 2e-3}, resume=True)
    record = train.train(broken, **run, resume=True)
    assert not (broken / "resume.pt").exists() and [p["step"] for p in record["curve"]] == [0, 1, 2, 3]
    a, b = load_file(str(tmp_path / "unbroken" / "model.safetensors")), load_file(str(broken / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_only_the_replies_of_a_conversation_count_fully_in_the_training_loss():
    from cairn.demo import train

    text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
    reply = text.index("Hello")
    offsets = [(0, reply), (reply, reply + 5), (reply + 5, len(text) - 1), (len(text) - 1, len(text))]
    assert train.token_weights(text, offsets) == [train.CONTEXT_WEIGHT, 1.0, 1.0, train.CONTEXT_WEIGHT]
    assert train.token_weights("def f():\n", [(0, 3), (3, 9)]) == [1.0, 1.0]
