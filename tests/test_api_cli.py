"""The `ferrox` console script: flags and FERROX_* variables, their defaults, bad values
stopping start-up with the variable's name, and `ferrox generate` on the tiny model."""

from __future__ import annotations

import pytest

from api import cli
from api.config import DEFAULT_HOST, DEFAULT_PORT, SETTINGS, env_defaults, split_addr
from tests.server_harness import api_checkpoint


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


def test_variables_fill_the_configs(monkeypatch):
    environ = {"FERROX_ADDR": "127.0.0.2:9000", "FERROX_API_KEY": "k", "FERROX_MODEL_PATH": "/m",
               "FERROX_MAX_BODY_BYTES": "1024", "FERROX_CORS_ORIGINS": "https://a.example, https://b.example"}
    config = cli.server_config(parse(["serve"], environ))
    assert (config.host, config.port, config.api_key) == ("127.0.0.2", 9000, "k")
    assert config.cors_origins == ("https://a.example", "https://b.example")
    assert parse(["serve"], environ).model == "/m"
    # flags win over variables
    config = cli.server_config(parse(["serve", "--port", "9100", "--host", "127.0.0.3"], environ))
    assert (config.host, config.port) == ("127.0.0.3", 9100)
    # FERROX_CB_* go through BatcherConfig.from_env (the engine's one reader of them)
    monkeypatch.setenv("FERROX_CB_MAX_QUEUE", "7")
    monkeypatch.setenv("FERROX_CB_KV_BLOCK_SIZE", "32")
    engine_config, batcher_config = cli.engine_configs(parse(["serve", "--max-seqs", "3"]))
    assert (batcher_config.max_queue, batcher_config.max_seqs) == (7, 3)
    assert engine_config.block_size == 32


@pytest.mark.parametrize("name,value", [("FERROX_MAX_BODY_BYTES", "lots"), ("FERROX_MAX_N", "0"),
                                        ("FERROX_RATE_LIMIT_PER_MINUTE", "-1"),
                                        ("FERROX_ALLOW_UNAUTHENTICATED_REMOTE", "maybe")])
def test_bad_variables_stop_start_up_naming_them(name, value):
    with pytest.raises(SystemExit, match=name):
        env_defaults({name: value})


def test_bad_batcher_variable_names_it(monkeypatch):
    monkeypatch.setenv("FERROX_CB_MAX_QUEUE", "zero")
    with pytest.raises(SystemExit, match="FERROX_CB_MAX_QUEUE"):
        cli.engine_configs(parse(["serve"]))


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
