"""The command line's one-line refusals that no other test drove (issue 11's fifth coverage pass): a
--model directory that is not a checkpoint (a file, no config.json, a config.json that is not JSON or
not an object, no weights, no tokenizer), an address that cannot be listened on, `cairn generate`
without a prompt or with --messages that are not a list, an empty --api-key, a --state-cache-gib too
small for one state slot; weights an interrupted download left incomplete (a shard the index names
missing, a file cut short, a Git LFS pointer), weights that do not fit the config. Each is a real
`python -m cairn.cli` process, checked as the user sees it: exit status 2 and one line naming what is
wrong, no traceback. `cairn generate` with a sampling flag out
of range or --messages the HTTP server refuses runs in-process, with an engine that fails if it is built:
the refusal comes before the model loads, as does `--quantization int8` on a MoE model.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from cairn.config import RANDOM_DEMO_NAME
from tests.test_cli import assert_one_line_error


def cairn(*args: str) -> subprocess.CompletedProcess:
    """`cairn ARGS`; a generate or serve without --model runs the random demo model (its refusals are the flags')."""
    if args and args[0] in ("generate", "serve") and "--model" not in args:
        args = (*args, "--model", RANDOM_DEMO_NAME)
    return subprocess.run([sys.executable, "-m", "cairn.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tests.checkpoints import write_checkpoint

    path = tmp_path_factory.mktemp("ckpt")
    write_checkpoint("qwen3_5_text", path)
    return path


def test_model_that_is_a_file_is_one_line(checkpoint):
    out = cairn("serve", "--model", str(checkpoint / "config.json"))
    assert_one_line_error(out, "not a directory", "not a file in it")


def refused_before_torch(*args: str) -> str:
    """`cairn ARGS` run in a fresh interpreter: its one-line refusal; checks torch was never imported
    (a refusal the user waits seconds for is no quick check)."""
    code = ("import sys, cairn.cli\nrc = cairn.cli.main(sys.argv[1:])\n"
            "print(rc, sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.stdout.strip() == "2 []", out.stdout + out.stderr
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    return lines[0]


@pytest.mark.parametrize("config, says", [
    (None, "no config.json"),
    ("{not json", "config.json cannot be read"),
    ("[1, 2]", "config.json is not a JSON object"),
])
def test_model_directory_without_a_readable_config_is_one_line_before_torch(tmp_path, config, says):
    if config is not None:
        (tmp_path / "config.json").write_text(config)
    line = refused_before_torch("generate", "hi", "--model", str(tmp_path))
    assert str(tmp_path) in line and says in line, line


@pytest.mark.parametrize("missing, says", [("*.safetensors", "no *.safetensors weights"),
                                           ("tokenizer.json", "no tokenizer.json")])
def test_incomplete_download_is_one_line_naming_what_is_missing_before_torch(checkpoint, tmp_path, missing, says):
    shutil.copytree(checkpoint, tmp_path / "m")
    for path in (tmp_path / "m").glob(missing):
        path.unlink()
    (tmp_path / "m" / "model.safetensors.index.json").unlink(missing_ok=True)
    line = refused_before_torch("serve", "--model", str(tmp_path / "m"))
    assert says in line and "is the download complete?" in line, line


def _name_a_missing_shard(model):
    index = {"weight_map": {"a.weight": "model.safetensors", "b.weight": "model-00002-of-00002.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))


def _cut_the_weights_short(model):
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def _leave_a_git_lfs_pointer(model):
    (model / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 9\n")


@pytest.mark.parametrize("damage, says", [
    (_name_a_missing_shard, "1 of its 2 weight files are missing (model-00002-of-00002.safetensors)"),
    (_cut_the_weights_short, "model.safetensors is cut short"),
    (_leave_a_git_lfs_pointer, "model.safetensors is a Git LFS pointer, not the weights"),
])
def test_weights_an_interrupted_download_left_incomplete_are_one_line_before_torch(checkpoint, tmp_path, damage,
                                                                                    says):
    shutil.copytree(checkpoint, tmp_path / "m")
    damage(tmp_path / "m")
    line = refused_before_torch("serve", "--model", str(tmp_path / "m"))
    assert says in line, line


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_a_tokenizer_file_an_interrupted_download_cut_short_is_one_line_before_torch(checkpoint, tmp_path, name):
    """It failed as a JSONDecodeError traceback, once the weights had loaded."""
    shutil.copytree(checkpoint, tmp_path / "m")
    text = (tmp_path / "m" / name).read_text()
    (tmp_path / "m" / name).write_text(text[: len(text) // 2])
    line = refused_before_torch("serve", "--model", str(tmp_path / "m"))
    assert f"{name} cannot be read" in line and "is the download complete?" in line, line


def test_weights_that_do_not_fit_the_config_are_one_error_line_not_a_traceback(checkpoint, tmp_path):
    """Found while loading (after the progress bar), so not before torch; but one line naming the tensor."""
    shutil.copytree(checkpoint, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    out = cairn("generate", "hi", "--model", str(tmp_path / "m"), "--log-level", "WARNING")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("cairn generate: error: model.layers.0.mlp.down_proj.weight: shape"), out.stderr


def test_host_that_does_not_resolve_is_one_line():
    assert_one_line_error(cairn("serve", "--host", "no-such-host.invalid", "--port", "8123"),
                          "--host no-such-host.invalid: cannot resolve it")


def test_address_not_of_this_machine_is_one_line():
    # 192.0.2.1 is TEST-NET-1 (RFC 5737): never an address of this machine, so it cannot be bound
    assert_one_line_error(cairn("serve", "--host", "192.0.2.1", "--port", "8123"), "cannot listen on 192.0.2.1:8123")


def test_generate_without_a_prompt_is_one_line():
    assert_one_line_error(cairn("generate"), "give a prompt or --messages")


def test_generate_messages_that_are_not_a_list_of_messages_is_one_line():
    out = cairn("generate", "--messages", json.dumps({"role": "user", "content": "hi"}))
    assert_one_line_error(out, "--messages must be a JSON list of messages")


def test_empty_api_key_is_one_line():
    assert_one_line_error(cairn("serve", "--api-key", ""), "--api-key must not be empty")


def test_state_cache_too_small_for_one_slot_is_one_line():
    out = cairn("serve", "--log-level", "WARNING", "--port", "0", "--state-cache-gib", "1e-9")
    assert_one_line_error(out, "--state-cache-gib 1e-09 holds no state slot")


def generate_refused_before_the_model_loads(monkeypatch, capsys, *args: str) -> str:
    """`cairn generate ARGS` in-process: its one-line refusal (exit status 2), made before the engine is built."""
    import cairn.engine.engine
    from cairn.cli import main

    def no_engine(*_, **__):
        raise AssertionError("the engine was built: the refusal came after the model loaded")

    monkeypatch.setattr(cairn.engine.engine, "Engine", no_engine)
    status = main(["generate", *args])
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith("cairn generate: error: "), lines
    return lines[0]


@pytest.mark.parametrize("args, says", [
    (["x", "--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["x", "--stop", ""], "--stop must be at most 16 non-empty strings"),
    (["x", "--temperature", "-1"], "--temperature must be in [0, 100]"),
    (["x", "--top-p", "0"], "--top-p must be in (0, 1]"),
])
def test_generate_sampling_flag_out_of_range_is_one_line_naming_the_flag_before_the_model_loads(
        monkeypatch, capsys, args, says):
    assert says in generate_refused_before_the_model_loads(monkeypatch, capsys, *args)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_int8_on_a_moe_model_is_one_line_before_the_model_loads(checkpoints, monkeypatch, capsys, command):
    import cairn.engine.engine
    import cairn.server.main
    from cairn.cli import main

    def no_engine(*_, **__):
        raise AssertionError("the engine was built: the refusal came after the model loaded")

    monkeypatch.setattr(cairn.engine.engine, "Engine", no_engine)
    monkeypatch.setattr(cairn.server.main, "serve", no_engine)
    args = ["x"] if command == "generate" else ["--port", "0"]
    status = main([command, *args, "--model", str(checkpoints["qwen3_5_moe"][0]), "--quantization", "int8"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and lines[-1] == f"cairn {command}: error: --quantization int8 is not implemented for MoE " \
                                        "models (qwen3_5_moe)", lines


@pytest.mark.parametrize("messages, says", [
    ([{"role": "wizard", "content": "x"}], "--messages.0.role: Input should be 'system', 'developer', 'user', "
                                            "'assistant' or 'tool'"),
    ([{"role": "user", "content": "x", "colour": "red"}], "unknown field `--messages.0.colour`"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "content part of type 'image_url' is not supported"),
])
def test_generate_refuses_the_messages_the_http_server_refuses(monkeypatch, capsys, messages, says):
    line = generate_refused_before_the_model_loads(monkeypatch, capsys, "--messages", json.dumps(messages))
    assert says in line, line
