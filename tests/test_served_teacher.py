"""A teacher served by an SGLang-API server (`opd-sao serve` on loopback) scores as the in-process teacher does.

The same teacher checkpoint, in this process and behind the server; the records the served teacher builds
from `/generate`'s input logprobs (return_logprob, logprob_start_len, top_logprobs_num) must equal the
in-process teacher's chunked lm-head records: the sampled token's logprob at every granularity, the same
top-k ids, the same capped top-p nuclei, the tails to float32 rounding of a sum (1 - kept mass, where the
in-process teacher sums the logits outside). Multi-turn trajectories (an observation span between actions)
are scored at their action tokens only.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from launchers import wait_until_healthy

from opd_sao.config import OPDConfig
from opd_sao.engines.http import SGLangClient
from opd_sao.teachers import TeacherSet
from opd_sao.trajectory import Trajectory

LOGP_ATOL, TAIL_ATOL = 1e-5, 1e-5


@pytest.fixture(scope="module")
def served(start_server, perturbed_teacher):
    url, proc = start_server(perturbed_teacher)
    wait_until_healthy(url, lambda: proc.poll() is None)
    return url


def _trajectories(tokenizer) -> list[Trajectory]:
    rng, out = np.random.default_rng(0), []
    for i in range(5):
        prompt = [tokenizer.bos_token_id] + tokenizer.encode(f"{i}{i + 1} reverse", add_special_tokens=False)
        length = 3 + i
        mask = [1] * length
        if length >= 5:  # a multi-turn trajectory: an observation span between two actions, not scored
            mask[2] = mask[3] = 0
        if i == 4:
            mask[0] = 0  # starts with an observation
        tokens = rng.integers(5, 200, size=length).tolist()
        out.append(Trajectory(traj_id=f"t{i}", domain="digits_reverse", prompt_ids=prompt, token_ids=tokens,
                              action_mask=mask, rollout_logp=[0.0] * length, versions=[0] * length,
                              rewards=[0.0] * length))
    return out


def _teachers(server, teacher_dir, student_dir, tokenizer, stage_granularity, **teacher):
    """(served, in-process) teachers of the same checkpoint, loaded."""
    opd = OPDConfig(teachers=[{"name": "served", "kind": "sglang", "url": server, "checkpoint": str(teacher_dir),
                               "domains": ["digits_reverse"], **teacher},
                              {"name": "local", "checkpoint": str(teacher_dir), "domains": ["digits_sort"]}],
                    granularity=stage_granularity, top_k=8, top_p=0.6, max_support=12, vocab_chunk=100)
    reg = TeacherSet.from_config(opd, domains=["digits_reverse", "digits_sort"], resolve=Path,
                                 student_checkpoint=student_dir, student_tokenizer=tokenizer)
    teachers = reg.build_all()
    for teacher in teachers.values():
        teacher.load(teacher.spec.checkpoint)
    return reg, teachers["served"], teachers["local"]


@pytest.mark.parametrize("granularity", ["sampled", "top_k", "top_p"])
def test_served_teacher_records_equal_the_in_process_teachers(served, perturbed_teacher, tiny_model_dir, tokenizer,
                                                              granularity):
    _, remote, local = _teachers(served, perturbed_teacher, tiny_model_dir, tokenizer, granularity)
    trajs = _trajectories(tokenizer)
    worst = 0.0
    for traj, got, want in zip(trajs, remote.score(trajs), local.score(trajs)):
        assert got.n_positions == want.n_positions == traj.num_action_tokens
        np.testing.assert_allclose(got.sampled_logp, want.sampled_logp, atol=LOGP_ATOL)
        worst = max(worst, float(np.abs(got.sampled_logp - want.sampled_logp).max()))
        if granularity == "sampled":
            assert got.ids is None and got.logp is None
            continue
        assert (got.offsets == want.offsets).all() and (got.ids == want.ids).all()
        np.testing.assert_allclose(got.logp, want.logp, atol=LOGP_ATOL)
        np.testing.assert_allclose(got.tail_mass, want.tail_mass, atol=TAIL_ATOL)
        worst = max(worst, float(np.abs(got.logp - want.logp).max()))
    print(f"\nserved vs in-process teacher ({granularity}): logprobs differ by at most {worst:.1e}")


def test_served_teacher_identity_is_the_servers_model_and_weight_version(served, perturbed_teacher, tiny_model_dir,
                                                                         tokenizer):
    reg, _, _ = _teachers(served, perturbed_teacher, tiny_model_dir, tokenizer, "top_k")
    before = reg.specs["served"].checkpoint_hash
    assert before != reg.specs["local"].checkpoint_hash  # not the checkpoint's hash: the server's report
    again, _, _ = _teachers(served, perturbed_teacher, tiny_model_dir, tokenizer, "top_k")
    assert again.specs["served"].checkpoint_hash == before  # stable, so a resumed stage reuses its records
    SGLangClient(served).weight_call("/update_weights_from_disk", {"model_path": str(perturbed_teacher),
                                                                   "weight_version": "teacher-v2"})
    after, _, _ = _teachers(served, perturbed_teacher, tiny_model_dir, tokenizer, "top_k")
    assert after.specs["served"].checkpoint_hash != before  # new weights on the server: a new teacher to the cache


@pytest.mark.parametrize("teacher, message", [
    ({"granularity": "full"}, "granularity full needs the whole distribution per token"),
    ({"url": ""}, "needs `url:`"),
])
def test_served_teacher_refuses_in_one_line(served, perturbed_teacher, tiny_model_dir, tokenizer, teacher, message):
    with pytest.raises(ValueError) as err:
        _teachers(served, perturbed_teacher, tiny_model_dir, tokenizer, "top_k", **teacher)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_served_teacher_that_does_not_answer_is_refused_before_any_work(free_port, perturbed_teacher,
                                                                         tiny_model_dir, tokenizer):
    with pytest.raises(ValueError) as err:
        _teachers(f"http://127.0.0.1:{free_port()}", perturbed_teacher, tiny_model_dir, tokenizer, "top_k")
    assert "teacher 'served'" in str(err.value) and "did not answer" in str(err.value)


def test_the_server_answers_with_sglangs_input_logprob_positions(served, tokenizer):
    """What the served teacher reads: entry 0 of input_token_logprobs is None whatever logprob_start_len (SGLang
    0.5.23), entry j the token at logprob_start_len + j; the teacher asks one position early and drops it."""
    import requests

    ids = [tokenizer.bos_token_id] + tokenizer.encode("12 reverse 21", add_special_tokens=False)
    meta = requests.post(served + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                                                     "return_logprob": True, "logprob_start_len": 2,
                                                     "top_logprobs_num": 3}, timeout=60).json()["meta_info"]
    entries, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert entries[0][0] is None and tops[0] is None
    assert [e[1] for e in entries] == ids[2:] and all(e[0] is not None for e in entries[1:])
    assert all(len(top) == 3 for top in tops[1:])


def _padded(teacher: Path, out: Path, lift: float) -> Path:
    """The teacher with 8 padded embedding rows past the tokenizer's ids (tied: the lm head too) that carry real
    probability: every token's embedding gets a large constant component (which shifts a position's logits of the
    real ids alike), 4 padded rows one larger by `lift` (+ 0..0.3) and 4 a negative one (no mass, as trained
    padding)."""
    from opd_sao.checkpoints import load_causal_lm, load_tokenizer, save_checkpoint

    tokenizer, model = load_tokenizer(teacher), load_causal_lm(teacher)
    vocab = len(tokenizer)
    model.resize_token_embeddings(vocab + 8, mean_resizing=False)
    with torch.no_grad():
        weight = model.get_input_embeddings().weight
        weight[:vocab, 0] = 20.0
        weight[vocab:] = 0.0
        weight[vocab:vocab + 4, 0] = 20.0 + lift + torch.tensor([0.0, 0.1, 0.2, 0.3])
        weight[vocab + 4:, 0] = -60.0
    return save_checkpoint(model, tokenizer, out)


@pytest.fixture(scope="module")
def padded_teacher(perturbed_teacher, tmp_path_factory):
    """Padding lifted 2.5: about 40% of each position's mass, above its 12th real id (in every top list)."""
    return _padded(perturbed_teacher, tmp_path_factory.mktemp("padded") / "teacher", 2.5)


@pytest.mark.parametrize("granularity", ["sampled", "top_k", "top_p"])
def test_a_served_teacher_with_padded_rows_scores_the_shared_ids_only(start_server, padded_teacher, tiny_model_dir,
                                                                       tokenizer, granularity):
    """The server's top lists run over all 392 rows; the served teacher drops the padded ids and renormalises over
    the shared 384, as the in-process teacher's lm head cut at the tokenizer does."""
    url, proc = start_server(padded_teacher)
    wait_until_healthy(url, lambda: proc.poll() is None)
    _, remote, local = _teachers(url, padded_teacher, tiny_model_dir, tokenizer, granularity)
    assert (remote.spec.vocab_size, remote.spec.rows) == (len(tokenizer), len(tokenizer) + 8)
    trajs = _trajectories(tokenizer)
    padded = SGLangClient(url).score(trajs[0].prompt_ids + trajs[0].token_ids, 1, 12).top_ids  # what the server lists: the padding among the top
    assert all(any(i >= len(tokenizer) for i in top) for top in padded)
    worst = 0.0
    for got, want in zip(remote.score(trajs), local.score(trajs)):
        np.testing.assert_allclose(got.sampled_logp, want.sampled_logp, atol=LOGP_ATOL)
        worst = max(worst, float(np.abs(got.sampled_logp - want.sampled_logp).max()))
        if granularity == "sampled":
            continue
        assert int(got.ids.max()) < len(tokenizer)
        assert (got.offsets == want.offsets).all() and (got.ids == want.ids).all()
        np.testing.assert_allclose(got.logp, want.logp, atol=LOGP_ATOL)
        np.testing.assert_allclose(got.tail_mass, want.tail_mass, atol=TAIL_ATOL)
        worst = max(worst, float(np.abs(got.logp - want.logp).max()))
    print(f"\npadded served vs in-process teacher ({granularity}): logprobs differ by at most {worst:.1e}")


def test_a_served_teacher_whose_padding_holds_nearly_all_the_mass_is_refused(start_server, perturbed_teacher,
                                                                             tiny_model_dir, tokenizer, tmp_path):
    """Padding lifted 10 holds over 99.9% of the mass: float32 top lists cannot say the shared ids' share."""
    from opd_sao.engines.http import ServerError

    teacher = _padded(perturbed_teacher, tmp_path / "teacher", 10.0)
    url, proc = start_server(teacher)
    wait_until_healthy(url, lambda: proc.poll() is None)
    _, remote, _ = _teachers(url, teacher, tiny_model_dir, tokenizer, "top_k")
    with pytest.raises(ServerError) as err:
        remote.score(_trajectories(tokenizer))
    assert "padded embedding rows" in str(err.value) and "\n" not in str(err.value)
