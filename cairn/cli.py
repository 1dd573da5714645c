"""The `cairn` command line, generated from the frozen config dataclasses.

`cairn.flags` turns each field of an option group into a flag (`kv_cache_gib` -> `--kv-cache-gib`).
Subcommands: `generate` (one prompt or a chat, prints text and timing) and the others registered in
COMMANDS. `--log-level` / `--log-format` go before or after the subcommand. A user's mistake
(cairn.preflight.UserError: a missing or unsupported --model, a port in use, --messages the HTTP server
would refuse (e.g. an unknown role), a sampling flag out of range (--max-tokens 0); and
cairn.config.ConfigError: a flag's value out of range, e.g. --port 70000 or --max-num-seqs 0), and a
checkpoint whose tensors do not fit its config.json (cairn.model.config.WeightError), are printed as one
line, exit status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import typing
from pathlib import Path

from cairn import __version__
from cairn.config import DEMO_NAME, ConfigError
from cairn.flags import add_dataclass_args, add_engine_args, build_group, config_from_args
from cairn.logs import LOG_FORMATS, setup_logging
from cairn.model.config import WeightError
from cairn.preflight import UserError, check_model, check_port

if typing.TYPE_CHECKING:
    from cairn.request.sampling_params import SamplingParams

# ---- generate ---------------------------------------------------------------------------------------

def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", help="prompt text (or use --messages)")
    p.add_argument("--messages", help='chat as JSON, e.g. \'[{"role": "user", "content": "hi"}]\', '
                                      "rendered with the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = all")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * the top probability")
    p.add_argument("--seed", dest="sampling_seed", type=int, default=None, help="sampling seed")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_engine_args(p, defaults={"model": DEMO_NAME})


def _parse_messages(text: str | None) -> list[dict] | None:
    if not text:
        return None
    try:
        messages = json.loads(text)
    except ValueError as e:
        raise UserError(f"--messages is not valid JSON ({e})") from None
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise UserError('--messages must be a JSON list of messages, e.g. [{"role": "user", "content": "hi"}]')
    return messages


def _sampling_params(ns: argparse.Namespace) -> SamplingParams:
    """The sampling flags as SamplingParams; a value out of its range (SamplingError, whose message starts
    with the field's name) is a UserError naming the flag."""
    from cairn.errors import SamplingError
    from cairn.request.sampling_params import SamplingParams

    try:
        return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                              min_p=ns.min_p, seed=ns.sampling_seed, stop=tuple(ns.stop))
    except SamplingError as e:
        field, _, rest = str(e).partition(" ")
        raise UserError(f"--{field.replace('_', '-')} {rest}") from None


def _checked_messages(messages: list[dict] | None) -> list[dict] | None:
    """--messages checked as the HTTP server checks a chat request's (cairn.server.chat.schema.ChatMessage: its
    roles, fields and their types) and made into what the chat template takes, as the server makes them."""
    if messages is None:
        return None
    from pydantic import TypeAdapter, ValidationError

    from cairn.server.chat.schema import ChatMessage, template_message
    from cairn.server.errors import APIError, from_validation_errors

    try:
        checked = TypeAdapter(list[ChatMessage]).validate_python(messages)
        return [template_message(i, m) for i, m in enumerate(checked)]
    except ValidationError as e:  # e.g. --messages.0.role: Input should be 'system', 'user', 'assistant' or 'tool'
        errors = [{**error, "loc": ("--messages", *error["loc"])} for error in e.errors(include_url=False)]
        raise UserError(from_validation_errors(errors).message) from None
    except APIError as e:
        raise UserError(f"--{e.param or 'messages'}: {e.message}") from None


def run_generate(ns: argparse.Namespace) -> int:
    if not ns.prompt and not ns.messages:
        raise UserError("give a prompt or --messages")
    messages = _parse_messages(ns.messages)
    check_model(ns.model, ns.quantization)
    from cairn.engine.engine import Engine  # imports torch: after the one-line checks

    params, messages = _sampling_params(ns), _checked_messages(messages)  # refused before the model loads
    t0 = time.perf_counter()
    engine = Engine(config_from_args(ns))
    t_load = time.perf_counter() - t0
    t1 = time.perf_counter()
    rid = engine.add_request(ns.prompt, params, messages=messages)
    out, n = None, 0
    while out is None or not out.finished:
        for o in engine.step():
            if o.request_id == rid:
                out, n = o, n + len(o.delta_token_ids)
                print(o.delta_text, end="", flush=True)
    total = time.perf_counter() - t1
    decode_s = total - (out.ttft_s or 0.0)
    print()
    print(f"[{engine.model_name}] load {t_load:.2f}s | prompt {out.num_prompt_tokens} tokens, "
          f"first token {out.ttft_s or 0:.3f}s | {n} tokens in {total:.2f}s "
          f"({max(n - 1, 0) / decode_s if decode_s > 0 else 0:.1f} tok/s decode) | finish: {out.finish_reason}",
          file=sys.stderr)
    return 0


# ---- serve ------------------------------------------------------------------------------------------

def add_serve_args(p: argparse.ArgumentParser) -> None:
    from cairn.server.options import ServerOptions

    add_dataclass_args(p, ServerOptions, "server options")
    add_engine_args(p, defaults={"model": DEMO_NAME})


def run_serve(ns: argparse.Namespace) -> int:
    from cairn.server.options import ServerOptions

    _secret(ns, "api_key", "CAIRN_API_KEY")
    _secret(ns, "remote_cache", "CAIRN_REMOTE_CACHE")
    options = build_group(ServerOptions, ns)
    check_port(options.host, options.port)
    check_model(ns.model, ns.quantization)
    config = config_from_args(ns)  # torch-free: a refused flag costs no torch import
    from cairn.server.main import serve  # imports torch and the server: after the one-line checks

    return serve(config, options)


def _secret(ns: argparse.Namespace, name: str, variable: str) -> None:
    """`ns.<name>` (the API key, the Redis URL) from its flag, else its `--<name>-file` (the file's first line),
    else the environment `variable`: a file or the environment keeps a secret out of the process list."""
    flag, path = "--" + name.replace("_", "-"), getattr(ns, f"{name}_file")
    if path is None:
        if getattr(ns, name) is None and os.environ.get(variable):
            setattr(ns, name, os.environ[variable])
        return
    if getattr(ns, name) is not None:
        raise UserError(f"{flag} and {flag}-file both given: give one")
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{flag}-file {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    if not lines or not lines[0].strip():
        raise UserError(f"{flag}-file {path}: its first line is empty")
    setattr(ns, name, lines[0].strip())


def _lazy(module: str) -> tuple[typing.Callable, typing.Callable]:
    """(add_args, run) of a command module, imported only when that command is used."""
    import importlib

    return (lambda p: importlib.import_module(module).add_args(p),
            lambda ns: importlib.import_module(module).run(ns))


COMMANDS: dict[str, tuple[str, typing.Callable, typing.Callable]] = {
    "generate": ("generate text for one prompt or chat", add_generate_args, run_generate),
    "serve": ("serve the OpenAI-compatible HTTP API", add_serve_args, run_serve),
    "cache": ("list, verify or purge a disk cache directory", *_lazy("cairn.cache.disk.admin")),
    "bench": ("compare cache policies on divergence workloads (see BENCHMARKS.md)", *_lazy("cairn.bench.cli")),
    "router": ("route OpenAI requests across replicas by where each resumes them", *_lazy("cairn.router.cli")),
}


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
QUIET_COMMANDS = {"bench": "WARNING"}  # commands whose default log level is not INFO


def _add_log_args(parser: argparse.ArgumentParser, default) -> None:
    """--log-level / --log-format, accepted before and after the subcommand (`default`: SUPPRESS after it,
    so that a subcommand left without them keeps what was given before it)."""
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=default,
                        help="log level (default: INFO; WARNING for bench, which prints its own progress)")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default=default,
                        help="text, or json: one JSON object per line (default: text)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cairn", description="Serve hybrid language models with a prefix "
                                     "cache that resumes a conversation anywhere along it.")
    parser.add_argument("--version", action="version", version=f"cairn {__version__}")
    _add_log_args(parser, None)
    parser.set_defaults(log_format="text")
    common = argparse.ArgumentParser(add_help=False)
    _add_log_args(common, argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_args, _) in COMMANDS.items():
        add_args(sub.add_parser(name, help=help_text, description=help_text, parents=[common]))
    return parser


HELP_WIDTH = 100  # the columns of docs/flags.md's help texts, whatever the terminal


def help_reference() -> str:
    """docs/flags.md: `cairn --help` and each command's `--help` (scripts/flags-reference writes it), formatted at
    HELP_WIDTH columns and without the environment's defaults (CAIRN_CPU_ISA), so that the file is the same on every
    machine."""
    saved = {name: os.environ.pop(name, None) for name in ("COLUMNS", "CAIRN_CPU_ISA", "NO_COLOR")}
    os.environ.update(COLUMNS=str(HELP_WIDTH), NO_COLOR="1")
    try:
        parser = build_parser()
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        helps = [("cairn --help", parser.format_help())]
        helps += [(f"cairn {name} --help", commands[name].format_help()) for name in COMMANDS]
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value
    text = ("# Every flag of every command\n\n"
            "Generated from the commands' `--help` by `scripts/flags-reference`; tests/test_docs.py checks that it is\n"
            "current. README.md's Flags table has the few flags a first run needs, and docs/serving.md explains each\n"
            "flag of `cairn serve`.\n")
    return text + "".join(f"\n## `{title}`\n\n```\n{body.rstrip()}\n```\n" for title, body in helps)


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    setup_logging(ns.log_level or QUIET_COMMANDS.get(ns.command, "INFO"), ns.log_format)
    from cairn.cache.disk.namespace import DiskStoreError

    try:
        return COMMANDS[ns.command][2](ns)
    except (UserError, ConfigError, DiskStoreError, WeightError) as e:  # a user's mistake (e.g. --port 70000) or a
        # checkpoint whose weights do not fit its config.json (the error names the tensor): one line
        print(f"cairn {ns.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
