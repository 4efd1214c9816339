"""`deepinfer` CLI: config precedence (defaults <- env <- flags given), help without torch."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepinfer.server.cli import build_engine_config, build_parser, main


def parse(*argv):
    return build_parser().parse_args(["serve", *argv])


def test_flags_given_override_env_which_overrides_defaults():
    env = {"DEEPINFER_MAX_NUM_SEQS": "8", "DEEPINFER_BLOCK_SIZE": "32",
           "DEEPINFER_MAX_MODEL_LEN": "1024"}
    config = build_engine_config(parse("--max-num-seqs", "4", "--kv-cache-memory-gb", "0.5",
                                       "--served-model-name", "smol", "--dtype", "float32"),
                                 environ=env)
    assert config.scheduler.max_num_seqs == 4          # flag beats env
    assert config.cache.block_size == 32               # env beats default
    assert config.model.max_model_len == 1024
    assert config.cache.kv_cache_memory_bytes == 512 * 2**20
    assert config.model.served_model_name == "smol" and config.model.dtype == "float32"
    assert config.model.model is None                  # embedded default model
    assert config.scheduler.max_num_batched_tokens == 512  # untouched default


def test_all_engine_flags_map_to_config_fields():
    config = build_engine_config(parse(
        "/models/x", "--max-model-len", "256", "--max-num-seqs", "2",
        "--max-num-batched-tokens", "64", "--block-size", "8", "--num-kv-blocks", "100",
        "--device", "cpu", "--seed", "7", "--max-waiting-requests", "3"), environ={})
    assert config.model.model == "/models/x" and config.model.max_model_len == 256
    assert config.model.device == "cpu" and config.model.seed == 7
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens,
            config.scheduler.max_waiting_requests) == (2, 64, 3)
    assert (config.cache.block_size, config.cache.num_blocks) == (8, 100)


def test_server_flags_have_defaults():
    args = parse()
    assert (args.host, args.port, args.api_key, args.log_level) == (
        "127.0.0.1", 8000, None, "info")
    assert "model" not in args and "max_model_len" not in args


def test_invalid_config_exits_2_with_the_reason(capsys):
    assert main(["serve", "--block-size", "3"]) == 2
    assert "block_size=3 must be a power of two" in capsys.readouterr().err


def test_help_does_not_import_torch():
    code = ("import sys\nfrom server.cli import main\n"
            "try:\n    main(['serve', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr
    assert "--max-num-batched-tokens" in result.stdout and "--api-key" in result.stdout


def test_api_key_comes_from_the_flag_else_the_environment():
    from deepinfer.server.cli import api_key

    assert api_key(parse(), environ={}) is None                          # unset: open API
    assert api_key(parse(), environ={"DEEPINFER_API_KEY": "from-env"}) == "from-env"
    assert api_key(parse("--api-key", "flag"), environ={"DEEPINFER_API_KEY": "env"}) == "flag"
    # set but empty is an unfilled secret, not a wish for an open API
    for args, env in ((parse(), {"DEEPINFER_API_KEY": ""}), (parse("--api-key", " "), {})):
        with pytest.raises(ValueError, match="set but empty"):
            api_key(args, environ=env)


@pytest.mark.parametrize("argv, message", [
    (["--port", "70000"], "--port 70000 is not a TCP port"),
    (["--graceful-shutdown-s", "-5"], "must be >= 0"),
    (["--api-key", ""], "--api-key is set but empty"),
    (["--device", "cuda"], None),     # checked in the engine when torch sees no GPU
])
def test_bad_server_flags_exit_2_before_loading_the_model(argv, message, capsys):
    import torch

    if message is None:
        if torch.cuda.is_available():
            pytest.skip("a GPU is present")
        from deepinfer.engine.config import ModelConfig
        from deepinfer.engine.engine_core import resolve_device_dtype

        with pytest.raises(ValueError, match="torch sees no CUDA device"):
            resolve_device_dtype(ModelConfig(device="cuda"))
        return
    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_taken_port_exits_2_before_loading_the_model(capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["serve", "--port", str(taken.getsockname()[1])]) == 2
    assert "cannot listen on 127.0.0.1" in capsys.readouterr().err


def test_served_model_name_from_the_environment():
    config = build_engine_config(parse(), environ={"DEEPINFER_SERVED_MODEL_NAME": "prod-llm"})
    assert config.model.served_model_name == "prod-llm"


def test_engine_process_flag_and_variable_and_their_default():
    assert build_engine_config(parse(), environ={}).frontend.engine_process is None
    assert build_engine_config(parse(), environ={"DEEPINFER_ENGINE_PROCESS": "1"}
                               ).frontend.engine_process is True
    assert build_engine_config(parse("--no-engine-process"),
                               environ={"DEEPINFER_ENGINE_PROCESS": "1"}
                               ).frontend.engine_process is False
    frontend = build_engine_config(parse("--engine-process"), environ={}).frontend
    assert frontend.engine_process is True and frontend.resolve_engine_process(on_cuda=False)
    default = build_engine_config(parse(), environ={}).frontend    # None: by the device
    assert default.resolve_engine_process(on_cuda=True)
    assert not default.resolve_engine_process(on_cuda=False)


def test_an_out_of_range_variable_is_named_unless_a_flag_overrides_it():
    """deploy/README promises the variable is named (found by a docs check: only values that
    did not parse were)."""
    with pytest.raises(ValueError, match="DEEPINFER_BLOCK_SIZE='7': block_size=7 must be"):
        build_engine_config(parse(), environ={"DEEPINFER_BLOCK_SIZE": "7"})
    with pytest.raises(ValueError, match="^block_size=7 must be"):   # the flag's own value
        build_engine_config(parse("--block-size", "7"), environ={})
    config = build_engine_config(parse("--block-size", "16"), environ={"DEEPINFER_BLOCK_SIZE": "7"})
    assert config.cache.block_size == 16


@pytest.mark.slow
def test_sigterm_while_loading_exits_at_once(tmp_path):
    """A pod deleted while its model loads: SIGTERM ends the process with 143 (a handler of
    its own, so it also works as a container's PID 1, where the default is to ignore it)."""
    import signal
    import time

    from tests.processes import ServerProcess, deepinfer

    server = ServerProcess("server", deepinfer("serve"), tmp_path / "server.log")
    try:
        deadline = time.monotonic() + 60
        while "deepinfer: loading" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert "deepinfer: stopped while loading" in server.log()
    finally:
        server.kill()


@pytest.mark.slow
@pytest.mark.parametrize("drain_s,signals,reason", [
    (1, 1, "ran past the 1 s drain"), (60, 2, "stopped by a second signal")],
    ids=["drain-ends", "second-signal"])
def test_requests_running_at_shutdown_get_a_503_not_a_cut(tmp_path, drain_s, signals, reason):
    """SIGTERM while a long request and a long stream run, with --graceful-shutdown-s 1 (the
    drain ends), or 60 and a second SIGTERM 0.5 s later (it stops at once; before, uvicorn
    waited out the drain and only a third signal cut the requests with a bare 500): the request
    answers an OpenAI-style 503 `server_shutting_down` saying why, the stream ends with that
    error event and `[DONE]`, and the server exits 0 within 30 s without a traceback."""
    import json

    from tests.processes import ServerProcess, deepinfer, metric, sigterm_during

    def requests_in() -> float:   # running + waiting
        return sum(metric(server.url, f"deepinfer:num_requests_{state}")
                   for state in ("running", "waiting"))

    server = ServerProcess("server", deepinfer("serve", "--graceful-shutdown-s", str(drain_s)),
                           tmp_path / "server.log")
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 3000, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Count to a thousand."}]}
    try:
        server.wait_ready()
        start = time.monotonic()
        lines, plain_reply = sigterm_during(server, body, plain=True, signals=signals,
                                            in_flight=lambda: requests_in() >= 2)
        assert plain_reply.status_code == 503
        assert plain_reply.json()["error"]["code"] == "server_shutting_down"
        assert reason in plain_reply.json()["error"]["message"]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][len("data: "):])["error"]["code"] == "server_shutting_down"
        assert server.proc.wait(timeout=30) == 0
        assert time.monotonic() - start < 30
        assert "Traceback" not in server.log() and "deepinfer: stopped" in server.log()
    finally:
        server.kill()


def test_api_keys_come_from_a_file_too(tmp_path):
    from deepinfer.server.cli import api_keys

    keys = tmp_path / "keys"
    keys.write_text("# one per client\nalpha\n\n  beta  \n")
    assert api_keys(parse("--api-key-file", str(keys)), environ={}) == ("alpha", "beta")
    assert api_keys(parse("--api-key-file", str(keys)),
                    environ={"DEEPINFER_API_KEY": "env"}) == ("env", "alpha", "beta")
    (tmp_path / "empty").write_text("# nothing\n")
    for path, message in ((tmp_path / "empty", "holds no key"), (tmp_path / "nope", "nope")):
        with pytest.raises(ValueError, match=message):
            api_keys(parse("--api-key-file", str(path)), environ={})


def test_speculative_flags_and_vllm_speculative_config():
    config = build_engine_config(parse("--speculative-config",
                                       '{"method": "ngram", "num_speculative_tokens": 3}',
                                       "--no-spec-varlen"), environ={})
    assert (config.speculative.speculative_method, config.speculative.num_speculative_tokens,
            config.speculative.spec_varlen) == ("ngram", 3, False)
    config = build_engine_config(parse("--speculative-method", "ngram",
                                       "--num-speculative-tokens", "7"),
                                 environ={"DEEPINFER_USE_NEXTN_DECODE": "2"})
    assert config.speculative.num_speculative_tokens == 7 and config.speculative.spec_varlen
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['methd'\]"):
        build_engine_config(parse("--speculative-config", '{"methd": "ngram"}'), environ={})
    with pytest.raises(ValueError, match="not valid JSON"):
        build_engine_config(parse("--speculative-config", "{method"), environ={})


@pytest.mark.parametrize("value,message", [
    ('"x"', "num_speculative_tokens='x' must be an integer"),
    ("null", "num_speculative_tokens=None must be an integer"),
    ("5.5", "num_speculative_tokens=5.5 must be an integer"),
    ("true", "num_speculative_tokens=True must be an integer")])
def test_speculative_config_values_of_the_wrong_type_are_refused(capsys, value, message):
    """A --speculative-config value of the wrong JSON type is the one-line configuration error
    (exit 2), not a traceback; a string is not a flag ("no" did turn varlen on)."""
    assert main(["serve", "--speculative-config",
                 f'{{"method": "ngram", "num_speculative_tokens": {value}}}']) == 2
    assert message in capsys.readouterr().err
    assert main(["serve", "--speculative-config",
                 '{"method": "ngram", "spec_varlen": "no"}']) == 2
    assert "spec_varlen='no' must be true or false" in capsys.readouterr().err


def test_api_server_count_flag_variable_and_its_engine_process_rule(capsys):
    """Several API servers are clients of one engine core process: the count turns the
    engine process on (even on CPU) and is refused with --no-engine-process (exit 2)."""
    assert build_engine_config(parse(), environ={}).frontend.api_server_count == 1
    frontend = build_engine_config(parse(), environ={"DEEPINFER_API_SERVER_COUNT": "3"}).frontend
    assert frontend.api_server_count == 3 and frontend.resolve_engine_process(on_cuda=False)
    assert build_engine_config(parse("--api-server-count", "2"), environ={
        "DEEPINFER_API_SERVER_COUNT": "3"}).frontend.api_server_count == 2
    assert main(["serve", "--api-server-count", "2", "--no-engine-process"]) == 2
    err = capsys.readouterr().err
    assert "api_server_count=2 needs the engine core in its own process" in err
    assert "--no-engine-process" in err
    assert main(["serve", "--api-server-count", "0"]) == 2
    assert "api_server_count=0 must be in [1, 64]" in capsys.readouterr().err
    assert main(["serve", "--api-server-count", "2", "--role", "encoder", "--kv-store",
                 "redis://127.0.0.1:1/0"]) == 2
    assert "does not apply to --role encoder" in capsys.readouterr().err


def test_speculation_flags_without_a_method_are_refused(capsys):
    """--num-speculative-tokens (or --speculative-model, --no-spec-varlen) without a method would
    be silently ignored (speculation stays off): exit 2 naming the flag and the fix."""
    assert main(["serve", "--num-speculative-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert "--num-speculative-tokens applies only with speculative decoding on" in err
    assert "--speculative-method" in err
    assert main(["serve", "--no-spec-varlen"]) == 2
    assert "--[no-]spec-varlen" in capsys.readouterr().err


def test_speculative_config_conflicts_and_unused_settings_are_refused(capsys):
    """A --speculative-* flag may repeat a --speculative-config value, not change it (one of
    the two would be silently ignored, with its validation); a draft model with another
    method, settings without a method, and a bad prompt_lookup_max are each exit 2 naming
    what is wrong."""
    config = build_engine_config(parse(
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
        "--num-speculative-tokens", "3"), environ={})
    assert config.speculative.num_speculative_tokens == 3
    assert main(["serve", "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": 3}',
                 "--num-speculative-tokens", "5"]) == 2
    assert "sets num_speculative_tokens=3 but a --speculative-* flag sets it to 5" in (
        capsys.readouterr().err)
    assert main(["serve", "--no-spec-varlen", "--speculative-config",
                 '{"method": "ngram", "spec_varlen": "yes"}']) == 2
    assert "sets spec_varlen='yes' but a --speculative-* flag sets it to False" in (
        capsys.readouterr().err)
    assert main(["serve", "--speculative-config",
                 '{"method": "ngram", "model": "/nonexistent"}']) == 2
    assert "only used by speculative_method=draft_model" in capsys.readouterr().err
    for text in ('{"method": null, "num_speculative_tokens": 3}', '{}', '{"method": null}',
                 ''):   # a config without a method would leave speculation off, unsaid
        assert main(["serve", "--speculative-config", text]) == 2
        err = capsys.readouterr().err
        assert ('needs a "method"' in err if text else "is not valid JSON" in err), err
    assert main(["serve", "--speculative-config",
                 '{"method": "ngram", "prompt_lookup_max": -1}']) == 2
    assert "prompt_lookup_max=-1 must be >= 1" in capsys.readouterr().err
