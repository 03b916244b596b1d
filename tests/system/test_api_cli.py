"""The `ferrox` console script: flags and FERROX_* variables, their defaults, bad values
stopping start-up with the variable's name, and `ferrox generate` on the tiny model."""

from __future__ import annotations

import re

import pytest

from api import cli
from api.config import DEFAULT_HOST, DEFAULT_PORT
from api.settings import SETTINGS, env_defaults, split_addr
from tests.support.server_harness import api_checkpoint


def parse(argv, environ=None):
    return cli.build_parser(environ or {}).parse_args(argv)


def test_serve_defaults_are_the_contract_address_and_default_model():
    args = parse(["serve"])
    config = cli.server_config(args)
    assert (config.host, config.port) == (DEFAULT_HOST, DEFAULT_PORT) == ("127.0.0.1", 8383)
    assert args.model == "default" and config.api_key is None
    assert config.max_body_bytes == 4 * 1024 * 1024


def test_every_setting_has_a_flag_and_a_ferrox_variable():
    parser = cli.build_parser({})
    serve = parser._subparsers._group_actions[0].choices["serve"]
    flags = {opt for action in serve._actions for opt in action.option_strings}
    for s in SETTINGS:
        assert s.cli_flag in flags and s.env.startswith("FERROX_")


def test_variables_fill_the_configs():
    environ = {"FERROX_ADDR": "127.0.0.2:9000", "FERROX_API_KEY": "k", "FERROX_MODEL_PATH": "/m",
               "FERROX_MAX_BODY_BYTES": "1024", "FERROX_CORS_ORIGINS": "https://a.example, https://b.example"}
    config = cli.server_config(parse(["serve"], environ))
    assert (config.host, config.port, config.api_key) == ("127.0.0.2", 9000, "k")
    assert config.cors_origins == ("https://a.example", "https://b.example")
    assert parse(["serve"], environ).model == "/m"
    # flags win over variables
    config = cli.server_config(parse(["serve", "--port", "9100", "--host", "127.0.0.3"], environ))
    assert (config.host, config.port) == ("127.0.0.3", 9100)
    # FERROX_CB_* fill the engine's one config like every other variable
    environ = {"FERROX_CB_MAX_QUEUE": "7", "FERROX_CB_KV_BLOCK_SIZE": "32", "FERROX_CB_PREFILL_CHUNK": "64",
               "FERROX_CB_KV_BLOCKS": "1000", "FERROX_CB_MAX_CONTEXT": "2048", "FERROX_CB_MAX_SEQS": "16"}
    engine_config = cli.engine_config(parse(["serve", "--max-seqs", "3"], environ))
    assert (engine_config.max_queue, engine_config.max_seqs, engine_config.block_size) == (7, 3, 32)
    assert (engine_config.prefill_chunk, engine_config.kv_blocks, engine_config.max_context) == (64, 1000, 2048)
    defaults = cli.engine_config(parse(["serve"], {}))
    assert (defaults.prefill_chunk, defaults.max_queue) == (128, 512), "the contract's defaults"


def test_shared_compiles_are_on_unless_turned_off_by_flag_or_variable():
    assert cli.engine_config(parse(["serve"])).share_compiles, "multi-host groups share compiles by default"
    assert not cli.engine_config(parse(["serve", "--no-share-compiles"])).share_compiles
    assert not cli.engine_config(parse(["serve"], {"FERROX_SHARE_COMPILES": "0"})).share_compiles
    assert cli.engine_config(parse(["serve", "--share-compiles"], {"FERROX_SHARE_COMPILES": "0"})).share_compiles


# -- --help: the essential flags and the groups; --help=all / GROUP / WORD for the rest ---------

def help_page(capsys, argv) -> str:
    """What `ferrox ARGV` prints on stdout; it must exit 0."""
    with pytest.raises(SystemExit) as e:
        cli.build_parser({}).parse_args(argv)
    assert e.value.code == 0, f"{argv} exits {e.value.code}: {capsys.readouterr().err}"
    return capsys.readouterr().out


def flags_on(page: str) -> set[str]:
    return set(re.findall(r"(?m)^  (?:-\w \w+, )?(--[\w-]+)(?= |,|$)", page))  # "--help=GROUP" is no flag


def test_every_setting_is_filed_under_a_described_group():
    from api.cli_help import GROUPS

    assert [s.name for s in SETTINGS if s.group not in GROUPS] == [], "settings with no --help=GROUP page"


def test_serve_help_is_a_first_page_of_essential_flags_and_the_groups(capsys):
    """`ferrox serve --help` used to be one flat list of every flag (356 lines)."""
    from api.cli_help import ESSENTIAL, GROUPS

    page = help_page(capsys, ["serve", "--help"])
    essential = {s.cli_flag for s in SETTINGS if s.name in ESSENTIAL}
    assert flags_on(page) == essential, "the first page lists the essential flags and no other"
    assert len(page.splitlines()) < 60, f"a first page, not every flag: {len(page.splitlines())} lines"
    for name in GROUPS:
        assert f"--help={name} " in page, f"the first page names group {name}"
    assert help_page(capsys, ["serve", "-h"]) == page


def test_help_all_lists_every_setting_and_help_group_only_its_own(capsys):
    every = {s.cli_flag for s in SETTINGS}
    assert every <= flags_on(help_page(capsys, ["serve", "--help=all"])), "--help=all lists every setting"
    cache = help_page(capsys, ["serve", "--help=cache"])
    assert flags_on(cache) == {s.cli_flag for s in SETTINGS if s.group == "cache"} and "--kv-memory-gib" in cache
    assert flags_on(help_page(capsys, ["serve", "--help=timeout"])) == {f for f in every if "timeout" in f}
    batch = help_page(capsys, ["run-batch", "--help"])
    assert {"--input-file", "--output-file", "--model"} <= flags_on(batch) and "--api-key" not in batch


def test_help_never_prints_a_secret_taken_from_its_variable(capsys):
    """`FERROX_API_KEY` and `FERROX_MULTIHOST_SECRET` were printed as the flags' defaults."""
    secrets = {"FERROX_API_KEY": "sk-do-not-print-0123", "FERROX_MULTIHOST_SECRET": "mh-do-not-print-456789"}
    pages = []
    for argv in (["serve", "--help=all"], ["serve", "--help"], ["serve", "--help=secret"], ["serve", "--help=key"]):
        with pytest.raises(SystemExit):
            cli.build_parser(secrets).parse_args(argv)
        pages.append(capsys.readouterr().out)
    for value in secrets.values():
        assert not any(value in page for page in pages), "a secret's value appears in --help"
    assert "--api-key" in pages[0] and "(set)" in pages[3], "the flag is listed, its value only said to be set"


def test_help_for_an_unknown_topic_exits_2_naming_the_groups(capsys):
    with pytest.raises(SystemExit) as e:
        cli.build_parser({}).parse_args(["serve", "--help=nonsense"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "no group or flag by that name" in err and "cache" in err, err


@pytest.mark.parametrize("name,value", [("FERROX_MAX_BODY_BYTES", "lots"), ("FERROX_MAX_N", "0"),
                                        ("FERROX_RATE_LIMIT_PER_MINUTE", "-1"),
                                        ("FERROX_ALLOW_UNAUTHENTICATED_REMOTE", "maybe")])
def test_bad_variables_stop_start_up_naming_them(name, value):
    with pytest.raises(SystemExit, match=name):
        env_defaults({name: value})


@pytest.mark.parametrize("value", ["zero", "0", "-3", "1.5"])
def test_bad_batcher_variable_names_it(value):
    with pytest.raises(SystemExit, match="FERROX_CB_MAX_QUEUE"):
        env_defaults({"FERROX_CB_MAX_QUEUE": value})


def test_remote_bind_without_key_is_refused():
    with pytest.raises(SystemExit, match="non-loopback"):
        cli.server_config(parse(["serve", "--host", "0.0.0.0"]))
    assert cli.server_config(parse(["serve", "--host", "0.0.0.0", "--allow-unauthenticated-remote"]))


@pytest.mark.parametrize("addr,expected", [("127.0.0.1:8383", ("127.0.0.1", 8383)), ("0.0.0.0", ("0.0.0.0", 8383)),
                                           ("[::1]:9000", ("::1", 9000)), (":9001", ("127.0.0.1", 9001))])
def test_split_addr(addr, expected):
    assert split_addr(addr) == expected


def test_generate_prints_the_completion(capsys):
    code = cli.main(["generate", "--model", str(api_checkpoint()), "--max-tokens", "5", "--kv-memory-gib", "0.01",
                     "Hello world"])
    assert code == 0
    assert capsys.readouterr().out.endswith("\n")


def test_start_up_logs_a_line_per_phase(caplog):
    """Loading the weights, compiling N shapes and ready with the URL each say so in a line
    that stays in the log (the progress bars vanish when done); before, only the final
    block did."""
    import logging
    import os

    from ferrox_jax.config import EngineConfig
    from tests.support.server_harness import DEFAULT_LIMITS

    caplog.set_level(logging.INFO, logger="ferrox")
    config = EngineConfig(model=str(api_checkpoint()), dtype="float32",
                          compile_cache_dir=os.environ["JAX_COMPILATION_CACHE_DIR"], **DEFAULT_LIMITS)
    engine = cli.load_engine(config, "http://127.0.0.1:8383")
    try:
        shapes = engine.describe()["num_compiled_shapes"]
    finally:
        engine.shutdown()
    lines = [r.getMessage().splitlines()[0] for r in caplog.records if r.name == "ferrox"]
    phases = ["loading weights: ", "weights loaded: ", f"compiling {shapes} step shapes (",
              f"compiled {shapes} step shapes in ", "ready: serving 'tiny-chat' at http://127.0.0.1:8383/v1"]
    found = [next((i for i, line in enumerate(lines) if line.startswith(p)), None) for p in phases]
    assert None not in found and found == sorted(found), f"a line per phase, in order: {lines}"


# -- start-up failures end with status 1 and one line, never an abort ------------------------

def _serve(argv, extra_env=None, prelude=""):
    """`ferrox serve ARGV` in a fresh interpreter (after `prelude`); returns (exit status, stderr)."""
    import os
    import subprocess
    import sys

    from tests.support.server_harness import free_port

    code = f"import sys\n{prelude}\nfrom api.cli import main\nsys.exit(main(sys.argv[1:]))"
    env = {**os.environ, **(extra_env or {})}
    out = subprocess.run([sys.executable, "-c", code, "serve", "--port", str(free_port()), *argv],
                         capture_output=True, text=True, timeout=300, env=env)
    return out.returncode, out.stderr


@pytest.mark.parametrize("argv,env,reason", [
    # 9 heads and 3 KV heads: 4 divides neither (refused before any weight is read)
    (["--tensor-parallel", "4"], {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
     "tensor parallelism 4 does not divide the model's num_heads 9"),
    (["--tensor-parallel", "2", "--replicate-attention"], {"XLA_FLAGS": ""}, "needs 2 devices; only 1"),
    (["--model", "/nonexistent/model"], {}, "model path does not exist"),
    (["--mesh", "data=2"], {}, "data=2 is not supported"),
    ([], {"FERROX_CB_PREFILL_CHUNK": "lots"}, "FERROX_CB_PREFILL_CHUNK"),
])
def test_refused_configurations_exit_1_with_their_reason(argv, env, reason):
    status, stderr = _serve(argv, env)
    assert status == 1, f"exit status {status}, expected 1:\n{stderr[-2000:]}"
    assert reason in stderr and "terminate called" not in stderr and "Traceback" not in stderr, stderr[-2000:]


def test_a_port_in_use_stops_start_up_with_one_line():
    """It used to print a Python traceback (Hypercorn's bind, after the model began loading)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        status, stderr = _serve(["--model", str(api_checkpoint()), "--port", str(port)])
    assert status == 1, f"exit status {status}, expected 1:\n{stderr[-2000:]}"
    assert stderr == f"ferrox serve: port {port} on 127.0.0.1 is in use; stop the other server or pass --port\n", \
        f"one line saying what to do, no traceback; got:\n{stderr[-2000:]}"


def test_a_failure_after_the_weights_are_built_exits_1_not_abort():
    """The weights are on the device when the runner fails: the process still exits 1 (it
    used to die with SIGABRT as the half-built model was freed after the XLA client)."""
    prelude = ("import ferrox_jax.engine_builder as engine\n"
               "def boom(*args, **kwargs):\n"
               "    raise ValueError('injected runner failure')\n"
               "engine.ModelRunner = boom")
    status, stderr = _serve(["--model", str(api_checkpoint()), "--compile-cache-dir", "off"], prelude=prelude)
    assert status == 1, f"exit status {status}, expected 1:\n{stderr[-2000:]}"
    assert "loading the model failed: injected runner failure" in stderr
    assert "terminate called" not in stderr


BROKEN_JSON = '{\n  "hidden_size": 64,\n  "num_hidden_layers" 2\n}\n'  # no ':' on line 3


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json"])
def test_a_broken_checkpoint_json_file_is_named_with_its_line_and_column(tmp_path, name):
    """A broken config.json used to stop start-up with 'JSONDecodeError: Expecting ...', naming no file."""
    import json
    import shutil

    folder = shutil.copytree(api_checkpoint(), tmp_path / "broken")
    (folder / name).write_text(BROKEN_JSON)
    with pytest.raises(json.JSONDecodeError) as parsed:
        json.loads(BROKEN_JSON)
    where = f"line {parsed.value.lineno}, column {parsed.value.colno}"  # line 3, column 23
    status, stderr = _serve(["--model", str(folder), "--compile-cache-dir", "off"])
    assert status == 1, f"exit status {status}, expected 1:\n{stderr[-2000:]}"
    assert f"{folder / name} is not valid JSON: Expecting ':' delimiter at {where}" in stderr, stderr[-2000:]
    assert "JSONDecodeError" not in stderr and "Traceback" not in stderr, "no internal names, no traceback"


# -- the server-wide output constraint ------------------------------------------------------

def test_default_constraint_from_flags_variables_or_a_file(tmp_path):
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}}'
    spec = cli.server_config(parse(["serve", "--json-schema", schema])).default_grammar
    assert spec.kind == "json_schema" and spec.strict
    spec = cli.server_config(parse(["serve"], {"FERROX_GRAMMAR": 'root ::= "yes" | "no"'})).default_grammar
    assert (spec.kind, spec.syntax) == ("grammar", "gbnf")
    grammar_file = tmp_path / "answer.lark"
    grammar_file.write_text('start: "yes" | "no"')
    spec = cli.server_config(parse(["serve", "--grammar-file", str(grammar_file)])).default_grammar
    assert (spec.kind, spec.syntax, spec.source) == ("grammar", "lark", 'start: "yes" | "no"')
    assert cli.server_config(parse(["serve"])).default_grammar is None


@pytest.mark.parametrize("argv, reason", [
    (["--grammar", 'start: "a"', "--json-schema", "{}"], "at most one default constraint; got --grammar and --json-schema"),
    (["--json-schema", "{nope"], "--json-schema is not valid JSON"),
    (["--json-schema", "[1]"], "--json-schema: invalid JSON schema: must be a JSON object"),
    (["--grammar-file", "/nonexistent/grammar.lark"], "--grammar-file '/nonexistent/grammar.lark'"),
])
def test_bad_default_constraints_stop_start_up_naming_the_flag(argv, reason):
    with pytest.raises(SystemExit) as e:
        cli.server_config(parse(["serve", *argv]))
    assert reason in str(e.value)


def test_a_default_schema_the_engine_cannot_enforce_exits_1_with_the_keyword():
    schema = '{"type": "object", "dependentRequired": {"a": ["b"]}}'
    status, stderr = _serve(["--model", str(api_checkpoint()), "--compile-cache-dir", "off", "--json-schema", schema])
    assert status == 1, f"exit status {status}, expected 1:\n{stderr[-2000:]}"
    assert "unsupported keyword(s): dependentRequired" in stderr and "Traceback" not in stderr, stderr[-2000:]
