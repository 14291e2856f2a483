"""`hf:PATH` folders a user did not write: transformers' own log lines held back, and broken or
hostile files (binary config, damaged safetensors, an index that points out of its folder)
refused in one line that says what to do."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from ampscope.cli import main
from ampscope.errors import AmpscopeError
from ampscope.models import resolve

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

TINY = dict(model_type="llama", hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, intermediate_size=32, vocab_size=32,
            max_position_embeddings=16, tie_word_embeddings=False)


def folder_with_config(path, **overrides):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY | overrides))
    return path


def tiny_state():
    config = transformers.LlamaConfig(**{k: v for k, v in TINY.items() if k != "model_type"})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).state_dict()


def cli(capfd, *argv):
    """The command line in-process, with transformers' logging caught where it really goes
    (its handler holds the stderr of the moment it was made)."""
    code = main(list(argv))
    out, err = capfd.readouterr()
    return code, out, err


def test_safetensors_with_missing_weights_is_one_line_not_transformers_report(tmp_path, capfd):
    folder = folder_with_config(tmp_path / "m")
    safetensors_torch.save_file({"model.embed_tokens.weight": torch.zeros(32, 16)},
                                str(folder / "model.safetensors"))
    code, out, err = cli(capfd, "trace", f"hf:{folder}", "--seq", "4", "-w", "forward",
                         "--real")  # a predicted run reads no weights
    assert code == 2 and out == ""
    assert err.count("\n") == 1, err  # transformers' LOAD REPORT table is not printed
    assert "checkpoint does not match config.json" in err and "missing keys such as" in err


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_transformers_warnings_are_held_back_on_a_run_that_works(tmp_path, capfd):
    # GPT-2's default bos/eos id 50256 lies outside this vocabulary: transformers logs it twice.
    folder = tmp_path / "g"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dict(
        model_type="gpt2", n_embd=16, n_layer=1, n_head=2, vocab_size=64, n_positions=16)))
    records = Records()  # what transformers logs, wherever its own handler writes
    logging.getLogger("transformers").addHandler(records)
    try:
        code, out, err = cli(capfd, "trace", f"hf:{folder}", "--seq", "4", "-w", "forward",
                             "--json", "-")
    finally:
        logging.getLogger("transformers").removeHandler(records)
    assert code == 0 and json.loads(out)["model"]["class"] == "GPT2LMHeadModel"
    assert records.lines == [] and "[transformers]" not in err, records.lines
    assert transformers.utils.logging.is_progress_bar_enabled()  # switched back on


@pytest.mark.fast
def test_the_transformers_logger_level_is_put_back(tmp_path):
    logger = logging.getLogger("transformers")
    before = logger.level
    logger.setLevel(logging.INFO)
    try:
        resolve(f"hf:{folder_with_config(tmp_path / 'c')}")
        assert logger.level == logging.INFO
    finally:
        logger.setLevel(before)


@pytest.mark.fast
def test_a_binary_config_json_is_one_line(tmp_path):
    folder = tmp_path / "b"
    folder.mkdir()
    (folder / "config.json").write_bytes(b"\xff\xfe\x00\x89PNG\r\n")
    with pytest.raises(AmpscopeError, match="config.json: it is not a UTF-8 text file; give the "
                                            "config.json that config.save_pretrained"):
        resolve(f"hf:{folder}")


@pytest.mark.fast
@pytest.mark.parametrize("header", [b"\xff" * 8 + b"junk", (20).to_bytes(8, "little") + b"{}"])
def test_a_damaged_safetensors_file_says_what_to_do(tmp_path, header):
    folder = folder_with_config(tmp_path / "s")
    (folder / "model.safetensors").write_bytes(header)
    with pytest.raises(AmpscopeError, match=r"its .safetensors file cannot be read "
                                            r"\(Error while deserializing header.*save it again"):
        resolve(f"hf:{folder}")


def shard_outside(tmp_path):
    """A valid checkpoint lying outside the model folder."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    torch.save(tiny_state(), outside / "x.bin")
    return outside / "x.bin"


@pytest.mark.fast
@pytest.mark.parametrize("name", ["../elsewhere/x.bin", "{abs}", "sub/../../elsewhere/x.bin"])
def test_an_index_naming_a_shard_outside_the_folder_is_refused(tmp_path, monkeypatch, name):
    target = shard_outside(tmp_path)
    folder = folder_with_config(tmp_path / "model")
    name = name.replace("{abs}", str(target))
    (folder / "pytorch_model.bin.index.json").write_text(
        json.dumps({"weight_map": {k: name for k in tiny_state()}}))
    opened = []
    monkeypatch.setattr(torch, "load", lambda f, *a, **k: opened.append(f))
    with pytest.raises(AmpscopeError, match="outside the folder; a shard must be a file name"):
        resolve(f"hf:{folder}")
    assert opened == []  # refused before anything was read


@pytest.mark.fast
@pytest.mark.parametrize("index", [True, False])
def test_a_symlink_out_of_the_folder_is_refused(tmp_path, index):
    target = shard_outside(tmp_path)
    folder = folder_with_config(tmp_path / "model")
    os.symlink(target, folder / "pytorch_model-00001.bin")
    if index:
        (folder / "pytorch_model.bin.index.json").write_text(
            json.dumps({"weight_map": {k: "pytorch_model-00001.bin" for k in tiny_state()}}))
    with pytest.raises(AmpscopeError, match=f"links to {target}, outside the folder"):
        resolve(f"hf:{folder}")


@pytest.mark.fast
def test_a_hub_cache_snapshot_linking_to_its_blobs_loads(tmp_path):
    """How the Hugging Face cache stores files: snapshots/REV/NAME -> ../../blobs/HASH."""
    repo = tmp_path / "models--tiny"
    (repo / "blobs").mkdir(parents=True)
    state = tiny_state()
    torch.save(state, repo / "blobs" / "0123abcd")
    folder = folder_with_config(repo / "snapshots" / "rev")
    os.symlink("../../blobs/0123abcd", folder / "pytorch_model.bin")
    got = resolve(f"hf:{folder}").module.state_dict()
    assert all(torch.equal(state[k], got[k]) for k in state)


@pytest.mark.fast
@pytest.mark.parametrize("text", ["{not json", '{"weight_map": [1]}', "[]", '{"other": 1}'])
def test_a_malformed_index_is_one_line(tmp_path, text):
    folder = folder_with_config(tmp_path / "i")
    (folder / "pytorch_model.bin.index.json").write_text(text)
    with pytest.raises(AmpscopeError, match="cannot read pytorch_model.bin.index.json"):
        resolve(f"hf:{folder}")


@pytest.mark.fast
def test_a_safetensors_index_out_of_the_folder_is_refused(tmp_path):
    folder = folder_with_config(tmp_path / "t")
    safetensors_torch.save_file(tiny_state(), str(tmp_path / "x.safetensors"))
    (folder / "a.safetensors").write_bytes(b"")
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "../x.safetensors"}}))
    with pytest.raises(AmpscopeError, match="'../x.safetensors' outside the folder"):
        resolve(f"hf:{folder}")


GEMMA2 = dict(model_type="gemma2", hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=8, intermediate_size=32, vocab_size=32,
              max_position_embeddings=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)


@pytest.mark.parametrize("weights", [False, True])
def test_a_model_without_sdpa_gets_the_attention_transformers_picks_itself(tmp_path, caplog,
                                                                             weights):
    """Gemma 2 has no SDPA path in transformers, which builds it with its eager attention when
    not told: ampscope builds it so too (from a config, and from weights) and says it with -v,
    where a Llama keeps SDPA."""
    llama = resolve(f"hf:{folder_with_config(tmp_path / 'llama')}").module
    assert llama.config._attn_implementation == "sdpa"
    gemma = transformers.AutoConfig.for_model(**GEMMA2)
    transformers_own = transformers.AutoModelForCausalLM.from_config(gemma)
    if transformers_own.config._attn_implementation != "eager":
        pytest.skip("this transformers builds Gemma 2 with SDPA")
    folder = tmp_path / "gemma2"
    (transformers_own if weights else gemma).save_pretrained(folder)
    with caplog.at_level(logging.INFO, logger="ampscope"):
        built = resolve(f"hf:{folder}").module
    assert built.config._attn_implementation == "eager"
    assert "Gemma2ForCausalLM does not support" in caplog.text
    assert "built with its eager attention" in caplog.text
