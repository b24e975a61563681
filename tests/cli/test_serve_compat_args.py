"""vLLM `serve` flags (entrypoints/cli/serve_compat_args.py, -tp in engine_args.py): aliases, accepted no-ops with a
note, and clear refusals before the model loads; `--served-model-name a b MODEL` is caught. Parser level."""

from __future__ import annotations

import pytest

from replayllm.entrypoints.cli import server_main
from replayllm.entrypoints.cli.main import build_parser, main
from replayllm.entrypoints.cli.serve_compat_args import apply_compat_args


def serve(*argv: str):
    return build_parser("serve").parse_args(["serve", *argv])


def test_aliases_and_server_flags():
    args = serve("-tp", "2", "--model", "some/model", "--reasoning-parser", "deepseek_r1", "--strict-request-fields")
    assert apply_compat_args(args) == []
    assert (args.tensor_parallel_size, args.model, args.reasoning_parser, args.strict_request_fields) == \
        (2, "some/model", "deepseek_r1", True)
    args = serve("some/model", "--model", "some/model")
    apply_compat_args(args)
    assert args.model == "some/model"
    with pytest.raises(ValueError, match="differ: give the model once"):
        apply_compat_args(serve("a/model", "--model", "b/model"))
    plain = serve()
    apply_compat_args(plain)
    assert (plain.tensor_parallel_size, plain.model, plain.reasoning_parser, plain.strict_request_fields) == \
        (1, None, None, False)


def test_kv_cache_dtype_is_an_engine_option():
    from replayllm.entrypoints.cli.engine_args import engine_kwargs

    for value in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"):
        args = serve("--kv-cache-dtype", value)
        assert apply_compat_args(args) == [] and engine_kwargs(args)["kv_cache_dtype"] == value
    assert engine_kwargs(serve())["kv_cache_dtype"] == "auto"
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        serve("--kv-cache-dtype", "int8")


def test_no_op_flags_are_accepted_with_a_note(tmp_path):
    notes = apply_compat_args(serve(str(tmp_path), "--trust-remote-code", "--disable-log-requests",
                                    "--max-seq-len-to-capture", "8192",
                                    "--revision", "main", "--download-dir", str(tmp_path / "dl")))
    assert [n.split()[0] for n in notes] == ["--trust-remote-code", "--disable-log-requests",
                                             "--max-seq-len-to-capture", "--download-dir"]
    assert all("no effect" in n for n in notes)


@pytest.mark.parametrize("argv, message", [
    (["--revision", "v2"], "--revision v2: not supported"),
    (["--kv-cache-dtype", "fp8", "--calculate-kv-scales"], "--calculate-kv-scales: not supported"),
    (["Qwen/Qwen3-0.6B", "--download-dir", "/data"], "set HF_HUB_CACHE=/data instead"),
    (["--disable-log-requests", "--enable-log-requests"], "contradict"),
    (["--max-seq-len-to-capture", "0"], "must be >= 1"),
    (["--served-model-name", "a", "b", "Qwen/Qwen3-0.6B"],
     "`replayllm serve Qwen/Qwen3-0.6B --served-model-name a b`, or give it with --model"),
])
def test_flags_that_cannot_be_honoured_stop_serve_before_the_model_loads(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(server_main, "EngineConfig", lambda **kw: pytest.fail("the model was loaded"))
    assert main(["serve", *argv, "--port", "0"]) == 2
    assert message in capsys.readouterr().err


def test_served_model_name_swallowing_the_model(tmp_path):
    with pytest.raises(ValueError, match="took .* as a served name, so no model was given"):
        apply_compat_args(serve("--served-model-name", "a", str(tmp_path)))
    for argv in (["--served-model-name", "a", "b"], [str(tmp_path), "--served-model-name", "a", "b"],
                 ["--served-model-name", "a", "--model", str(tmp_path)]):
        args = serve(*argv)
        apply_compat_args(args)
        assert args.served_model_name[-1] in ("a", "b")


def test_unknown_reasoning_parser_is_a_parser_error(capsys):
    with pytest.raises(SystemExit):
        serve("--reasoning-parser", "granite")
    err = capsys.readouterr().err
    assert "--reasoning-parser: invalid choice 'granite' (choose from qwen3, deepseek_r1, none)" in err


def test_a_port_out_of_range_is_a_parser_error(capsys):
    """--port 99999 used to be accepted (and bound as 99999 - 65536)."""
    for bad in ("99999", "-1"):
        with pytest.raises(SystemExit):
            serve("--port", bad)
        assert f"--port: port must be 0-65535, got {bad}" in capsys.readouterr().err
    assert serve("--port", "0").port == 0 and serve("--port", "65535").port == 65535


def test_a_model_folder_without_weights_is_one_line_from_every_subcommand(tmp_path, capsys):
    """generate (and run-batch, through the same main) printed a 30-line traceback; now one line, exit 1."""
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", '
                                          '"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, '
                                          '"num_key_value_heads": 1, "intermediate_size": 128, "vocab_size": 256, '
                                          '"head_dim": 32}')
    assert main(["generate", str(tmp_path), "--prompt", "hi", "--device", "cpu", "--skip-tokenizer-init"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: FileNotFoundError: no weights in") and err.count("\n") == 1, err


def test_vllms_human_readable_sizes_on_max_model_len_and_max_num_batched_tokens(capsys):
    """vLLM's CLI takes --max-model-len 4k (4,000) / 4K (4,096) / 1.5m; plain integers as before."""
    args = serve("--max-model-len", "4K", "--max-num-batched-tokens", "1.5k")
    assert (args.max_model_len, args.max_num_batched_tokens) == (4096, 1500)
    assert serve("--max-model-len", "4k").max_model_len == 4000 and serve("--max-model-len", "512").max_model_len == 512
    for bad, says in (("1.5K", "decimals are not allowed"), ("4x", "a size such as 4k")):
        with pytest.raises(SystemExit):
            serve("--max-model-len", bad)
        assert says in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve("--max-num-seqs", "4k")  # only the sizes vLLM reads this way
    assert "expected an integer" in capsys.readouterr().err
