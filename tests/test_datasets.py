"""`env: dataset`: every file format, the field mapping, the split, malformed rows and files (one-line errors),
multi-turn code tasks, the validity check refusing a dataset whose references fail their own reward, the
`data inspect` and `validate-env` commands, and a short pipeline run on the sample files."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from opd_sao.app import cli
from opd_sao.envs import ENVIRONMENTS
from opd_sao.envs.dataset import DatasetEnv
from opd_sao.envs.dataset.files import DatasetError
from opd_sao.envs.validity import check_environment, require_valid

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data"
ROWS = [{"id": f"q{i}", "prompt": f"{i}+{i}=", "answer": str(2 * i), "level": i % 3} for i in range(40)]


def write(tmp_path: Path, fmt: str, rows: list[dict] = ROWS) -> Path:
    """The rows in one of the supported formats."""
    if fmt == "jsonl":
        path = tmp_path / "rows.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path = tmp_path / "rows.json"
        path.write_text(json.dumps(rows))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "rows.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=7)  # several batches
    else:
        import datasets

        path = tmp_path / "saved"
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "saved"])
def test_each_format_gives_the_same_tasks(tmp_path, fmt):
    env = DatasetEnv(path=str(write(tmp_path, fmt)), metadata_keys=["level"])
    train, heldout = env.make_tasks("train", 1000, seed=0), env.make_tasks("eval", 1000, seed=0)
    assert {t["id"] for t in train} | {t["id"] for t in heldout} == {r["id"] for r in ROWS}
    assert not {t["id"] for t in train} & {t["id"] for t in heldout} and 2 <= len(heldout) <= 16
    task = next(t for t in train + heldout if t["id"] == "q3")
    assert task == {"id": "q3", "prompt": "3+3=", "answer": "6", "metadata": {"level": 0}}
    env.reset(task)
    assert env.step("6") == ("", 1.0, True)


def test_split_is_stable_and_order_is_seeded(tmp_path):
    path = str(write(tmp_path, "jsonl"))
    a, b = DatasetEnv(path=path, eval_fraction=0.5), DatasetEnv(path=path, eval_fraction=0.5)
    assert [t["id"] for t in a.make_tasks("eval", 100, 1)] == [t["id"] for t in b.make_tasks("eval", 100, 1)]
    assert [t["id"] for t in a.make_tasks("train", 100, 1)] != [t["id"] for t in a.make_tasks("train", 100, 2)]
    assert {t["id"] for t in a.make_tasks("train", 5, 1)} <= {t["id"] for t in a.make_tasks("train", 100, 3)}
    assert len(a.make_tasks("train", 5, 1)) == 5
    two = DatasetEnv(train_path=path, eval_path=str(write(tmp_path, "json", ROWS[:3])))
    assert len(two.make_tasks("train", 100, 0)) == 40 and len(two.make_tasks("eval", 100, 0)) == 3


def without_chat_template(model_dir, out):
    """The tiny model's tokenizer with its chat template removed (the project's tiny model ships one)."""
    from opd_sao.checkpoints import load_tokenizer

    tok = load_tokenizer(model_dir)
    tok.chat_template = None
    tok.save_pretrained(out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


def test_field_mapping_messages_template_and_chat_template(tmp_path, tiny_model_dir):
    rows = [{"uid": 7, "conversation": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
             "ref": 3.5}]
    path = write(tmp_path, "jsonl", rows)
    env = DatasetEnv(path=str(path), id_key="uid", messages_key="conversation", answer_key="ref", eval_fraction=0.01)
    (task,) = env.make_tasks("train", 10, 0)
    assert task["id"] == "7" and task["answer"] == "3.5"
    assert env.reset(task) == "system: be brief\nuser: hi\nassistant:"
    from opd_sao.checkpoints import load_tokenizer

    untemplated = without_chat_template(tiny_model_dir, tmp_path / "untemplated")
    with pytest.raises(ValueError, match="has no chat template"):
        DatasetEnv(path=str(path), id_key="uid", messages_key="conversation", answer_key="ref", chat_template=str(untemplated),
                   eval_fraction=0.01).make_tasks("train", 10, 0)

    templated = tmp_path / "templated"
    tok = load_tokenizer(tiny_model_dir)
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<bot>{% endif %}"
    tok.save_pretrained(templated)
    env = DatasetEnv(path=str(path), id_key="uid", messages_key="conversation", answer_key="ref", chat_template=str(templated),
                     eval_fraction=0.01)
    assert env.make_tasks("train", 10, 0)[0]["prompt"] == "<system>be brief<user>hi<bot>"
    plain = DatasetEnv(path=str(write(tmp_path, "json")), prompt_template="Q: {prompt} (level {level})\nA:",
                       metadata_keys=["level"])
    prompts = {t["id"]: t["prompt"] for split in ("train", "eval") for t in plain.make_tasks(split, 100, 0)}
    assert prompts["q4"] == "Q: 4+4= (level 1)\nA:"


BAD_ROWS = ['{"id": "a", "prompt": "1+1=", "answer": "2"}', '{"id": "b", "prompt": "2+2=" "answer": "4"}',
            '{"id": "c", "answer": "6"}', '{"id": "d", "prompt": ["3+3="], "answer": "6"}',
            '{"id": "a", "prompt": "4+4=", "answer": "8"}', '[1, 2]', '{"id": "e", "prompt": "5+5=", "answer": "10"}']


def test_malformed_rows_are_one_line_errors_or_skipped_and_counted(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(BAD_ROWS) + "\n")
    with pytest.raises(DatasetError) as err:
        DatasetEnv(path=str(path)).make_tasks("train", 10, 0)
    message = str(err.value)
    assert "\n" not in message and f"{path}: row 2: not valid JSON" in message and "max_bad_rows=0" in message
    env = DatasetEnv(path=str(path), max_bad_rows=5, eval_fraction=0.01)
    report = env.data_report()
    assert report["train_bad_rows"] == 5 and report["train_file_rows"] == 2  # a and e
    counts: dict = {}
    list(env.scan(None, counts))
    assert counts["examples"] == [f"{path}: row 2: not valid JSON (Expecting ',' delimiter at column 30)",
                                  f"{path}: row 3: missing field 'prompt' (fields: ['answer', 'id'])",
                                  f"{path}: row 4: field 'prompt' must be str (got list)",
                                  f"{path}: row 5: duplicate id 'a' (field 'id')",
                                  f"{path}: row 6: not an object (got list)"]
    with pytest.raises(DatasetError, match="row 6: not an object.*more than max_bad_rows=4"):
        DatasetEnv(path=str(path), max_bad_rows=4).make_tasks("train", 10, 0)
    tests_missing = write(tmp_path, "json", [{"id": "x", "prompt": "p"}])
    with pytest.raises(DatasetError, match="row 1: missing field 'tests'"):
        DatasetEnv(path=str(tests_missing), reward="code_tests").make_tasks("train", 10, 0)


def test_malformed_files_and_options_are_one_line_errors(tmp_path):
    (tmp_path / "a.csv").write_text("x\n")
    (tmp_path / "obj.json").write_text('{"rows": []}')
    (tmp_path / "broken.json").write_text("[{")
    (tmp_path / "junk.parquet").write_text("not parquet")
    (tmp_path / "plain_dir").mkdir()
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dd"))
    cases = {"a.csv": "unknown format '.csv'", "obj.json": "must be one array", "broken.json": "not valid JSON",
             "junk.parquet": "not a readable Parquet file", "plain_dir": "not one written by datasets",
             "dd": "DatasetDict with splits ['train']", "missing.jsonl": "does not exist"}
    for name, expected in cases.items():
        with pytest.raises(DatasetError) as err:
            DatasetEnv(path=str(tmp_path / name)).make_tasks("train", 10, 0)
        assert expected in str(err.value) and "\n" not in str(err.value), name
    with pytest.raises(ValueError, match="give `path`"):
        DatasetEnv(train_path=str(tmp_path / "a.csv"))
    with pytest.raises(ValueError, match="dataset env option eval_fraction"):
        DatasetEnv(path="x.jsonl", eval_fraction=2)
    with pytest.raises(ValueError, match="dataset env option promt_key: Extra inputs"):
        DatasetEnv(path="x.jsonl", promt_key="q")
    with pytest.raises(KeyError, match="unknown reward 'regex'"):
        DatasetEnv(path="x.jsonl", reward="regex")


def mbpp_env(path=DATA / "mbpp.jsonl", **extra) -> DatasetEnv:
    return DatasetEnv(path=str(path), id_key="task_id", prompt_key="text", answer_key="code", tests_key="test_list",
                      reward="code_tests", reward_options={"allow_rlimit_only": True}, **extra)


def test_code_tasks_retry_with_the_error_as_observation():
    env = mbpp_env()
    task = env.make_tasks("train", 1, 0)[0]
    name = task["answer"].split("(")[0][4:]
    env.reset(task)
    observation, reward, done = env.step(f"def {name}(x):\n    return 0")
    assert not done and reward < 1 and observation.startswith(f"# assert {name}(") and "AssertionError" in observation
    _, second, done = env.step(task["answer"])
    assert done and reward + second == pytest.approx(1.0)  # the episode's total is the last program's pass rate
    assert env.slow_steps and env.noop_action(task) == "pass"


def test_stdin_stdout_tasks(tmp_path):
    rows = [{"id": "sum", "prompt": "read two ints, print their sum", "solution": "a,b=map(int,input().split())\nprint(a+b)",
             "input_output": json.dumps({"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]})}]
    env = DatasetEnv(path=str(write(tmp_path, "jsonl", rows)), answer_key="solution", tests_key="input_output",
                     reward="code_tests", reward_options={"allow_rlimit_only": True}, eval_fraction=0.01)
    (task,) = env.make_tasks("train", 5, 0)
    assert task["tests"] == {"kind": "io", "inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]}
    env.reset(task)
    assert env.step("print(3)")[1] == 0.5
    report = check_environment("dataset", lambda: env, n=2)  # the oracle passes; one row leaves no eval split
    assert not any(report.failures.values()) and report.empty_splits == ["eval"]


def test_validity_refuses_a_dataset_whose_references_fail_their_own_reward(tmp_path):
    rows = [json.loads(line) for line in (DATA / "mbpp.jsonl").read_text().splitlines()][:5]
    rows[0]["code"] = rows[0]["code"].replace("return x", "return -x")  # a wrong reference solution
    rows[1]["code"] = "def oops(:"
    bad = write(tmp_path, "jsonl", rows)
    report = check_environment("dataset:mbpp", lambda: mbpp_env(bad, eval_fraction=0.5), n=10)
    assert sorted(report.failures["oracle"]) == ["601", "602"] and not report.failures["noop"]
    with pytest.raises(ValueError, match=r"fails its validity check: the oracle does not score 1 on 2/5 tasks"):
        require_valid("dataset:mbpp", lambda: mbpp_env(bad, eval_fraction=0.5), n=10)
    unknown = write(tmp_path, "json", [{"id": f"m{i}", "prompt": "?", "answer": "unknown"} for i in range(4)])
    assert check_environment("d", lambda: DatasetEnv(path=str(unknown), reward="math"), n=4).failures["oracle"]
    judged = DatasetEnv(path=str(unknown), reward="judge", reward_options={"base_url": "http://127.0.0.1:9/v1",
                                                                          "model": "m"})
    assert "not a binary verifier" in check_environment("d", lambda: judged, n=4).skipped


def test_validate_env_and_data_inspect_commands(tmp_path, capsys, tiny_model_dir):
    gsm8k = {"path": str(DATA / "gsm8k.jsonl"), "prompt_key": "question", "reward": "math"}
    assert cli.main(["validate-env", "dataset:gsm8k", "--options", json.dumps(gsm8k)]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]
    assert cli.main(["data", "inspect", str(DATA / "gsm8k.jsonl"), "--options", '{"prompt_key": "question"}']) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{DATA / 'gsm8k.jsonl'}: 300 rows, 0 malformed") and "answer: str (300)" in out
    assert out.count("--- prompt of gsm8k-") == 3 and "#### " in out
    untemplated = without_chat_template(tiny_model_dir, tmp_path / "untemplated")
    assert cli.main(["data", "inspect", str(DATA / "chat_prefs.jsonl"), "--chat-template", str(untemplated)]) == 0
    assert "has no chat template" in capsys.readouterr().out
    assert cli.main(["data", "inspect", str(tmp_path / "none.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert "does not exist" in err and "\n" not in err


def test_sample_data_passes_validity_and_feeds_the_tokenizer():
    options = [{"path": str(DATA / "gsm8k.jsonl"), "prompt_key": "question", "reward": "math"},
               {"path": str(DATA / "mbpp.jsonl"), "id_key": "task_id", "prompt_key": "text", "answer_key": "code",
                "tests_key": "test_list", "reward": "code_tests", "reward_options": {"allow_rlimit_only": True}}]
    for opts in options:
        assert check_environment("dataset", lambda: DatasetEnv(**opts), n=8).ok
    assert ENVIRONMENTS.get("dataset:anything") is DatasetEnv and "dataset:x" in ENVIRONMENTS
    assert DatasetEnv().corpus() == []  # the bare default, as the pipeline builds every registered class
    corpus = DatasetEnv(**options[1]).corpus()
    assert any(text.startswith("def ") for text in corpus) and any("AssertionError" in text for text in corpus)


def test_byo_pipeline_smoke(tmp_path):
    """configs/byo_data.yaml shortened to a few steps per stage: every stage runs on the sample files."""
    from opd_sao.app.pipeline import run_pipeline
    from opd_sao.config import load_config

    overrides = ["logging.progress=false", "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64",
                 "trainer.train_batch_size=8", "trainer.critic_warmup_steps=1", f"stages.chat.env_options.reward_options.path={tmp_path / 'rm'}",
                 "stages.chat.env_options.reward_options.train_steps=5", "stages.opd.trainer.train_batch_size=6"]
    for stage in ("reasoning", "agent", "chat", "opd"):
        overrides += [f"stages.{stage}.steps=2", f"stages.{stage}.eval.num_tasks=2", f"stages.{stage}.eval.samples_per_task=1",
                      f"stages.{stage}.gate.enabled=false"]
    for stage in ("reasoning", "agent", "chat"):
        overrides += [f"stages.{stage}.sft.steps=2"]
    overrides += ["stages.reasoning.trainer.train_batch_size=8", "stages.agent.trainer.train_batch_size=8",
                  "stages.agent.env_options.reward_options.allow_rlimit_only=true"]
    cfg = load_config(ROOT / "configs" / "byo_data.yaml", overrides)
    cfg.stages[0].env_options["path"] = str(DATA / "gsm8k.jsonl")
    cfg.stages[1].env_options["path"] = str(DATA / "mbpp.jsonl")
    cfg.stages[2].env_options["path"] = str(DATA / "chat_prefs.jsonl")
    cfg.stages[2].env_options["reward_options"]["train_from"] = str(DATA / "chat_prefs.jsonl")
    summary = run_pipeline(cfg, tmp_path / "run", log=lambda msg: None)
    domains = ["dataset:gsm8k", "dataset:mbpp", "dataset:chat"]
    assert [s["name"] for s in summary["stages"]] == ["reasoning", "agent", "chat", "opd"]
    assert all(sorted(s["eval_after"]) == sorted(domains) for s in summary["stages"])
    assert summary["stages"][0]["reward"]["name"] == "math"
    assert sorted(summary["stages"][3]["distillation"]) == sorted(domains)
