"""The one vocabulary-chunked forward path (opd_sao/model/modeling.py) against the naive full softmax.

Values and gradients must match the [N, V] computation: in float64 to rounding (the algorithm is exact),
in float32 within 1e-6 (x (1 + |value|)) at the scale of real logits; chunk sizes that do not divide V and row blocks that
do not divide N exercise the edges.
"""
from __future__ import annotations

import pytest
import torch
from gradients import assert_same_gradients

from opd_sao.algorithms import sft_loss
from opd_sao.checkpoints import load_causal_lm
from opd_sao.model import llama_forward
from opd_sao.model.decoders import decoder_layers, decoder_of, feed_forward_blocks
from opd_sao.model.modeling import forward_logits, nucleus_logprobs, read_only_at, sequence_logprobs, token_logprobs


def naive(hidden, weight, bias, targets, temperature, top_p=None):
    logits = hidden @ weight.T + bias
    full = torch.log_softmax(logits / temperature[:, None], -1).gather(-1, targets[:, None]).squeeze(-1)
    if top_p is None:
        return full
    nucleus = nucleus_logprobs(logits, temperature, top_p).gather(-1, targets[:, None]).squeeze(-1)
    return torch.where(top_p < 1, nucleus, full)


def leaves(dtype, n=23, h=8, v=101, scale=0.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
            for shape in ((n, h), (v, h), (v,))]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-6)])
@pytest.mark.parametrize("blocks", [dict(vocab_chunk=7, row_block=5), {}], ids=["chunked", "one-block"])
def test_token_logprobs_and_gradients_equal_the_full_softmax(dtype, tol, blocks):
    """The chunked kernel (101 = 14 x 7 + 3 columns, 23 = 4 x 5 + 3 rows) and the one-block path (23 x 101 within
    the default block) against a plain full softmax, values and gradients."""
    g = torch.Generator().manual_seed(1)
    targets = torch.randint(0, 101, (23,), generator=g)
    temperature = (0.5 + torch.rand(23, generator=g, dtype=torch.float64)).to(dtype)
    upstream = torch.randn(23, generator=g, dtype=torch.float64).to(dtype)
    ours, ref = leaves(dtype), leaves(dtype)
    got = token_logprobs(*ours, targets, temperature, **blocks)
    want = naive(*ref, targets, temperature)
    assert torch.allclose(got, want, rtol=tol, atol=tol)  # |a - b| <= tol x (1 + |b|)
    (got * upstream).sum().backward()
    (want * upstream).sum().backward()
    for mine, theirs in zip(ours, ref):
        assert torch.allclose(mine.grad, theirs.grad, rtol=tol, atol=tol)


def test_nucleus_rows_use_the_sampled_distribution():
    g = torch.Generator().manual_seed(0)
    hidden, weight, bias = leaves(torch.float64, n=10, v=37, scale=1.0)
    targets = torch.randint(0, 37, (10,), generator=g)
    temperature = torch.tensor([1.0, 0.5, 2.0, 1.0, 0.7, 1.0, 1.3, 1.0, 1.0, 0.9], dtype=torch.float64)
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.9, 1.0, 0.5, 1.0, 1.0, 0.99, 1.0])
    with torch.no_grad():
        got = token_logprobs(hidden, weight, bias, targets, temperature, top_p, vocab_chunk=5, row_block=3)
        want = naive(hidden, weight, bias, targets, temperature, top_p.double())
    finite = want.isfinite()
    assert torch.allclose(got[finite], want[finite], atol=1e-10)
    assert (got[~finite] == float("-inf")).all()  # a target outside the nucleus has probability 0


def test_sequence_logprobs_match_the_models_own_logits_with_gradients(tiny_model_dir):
    """The trainer's and the SFT loss's path on a real transformers model, right-padded, against its full forward."""
    ours, ref = load_causal_lm(tiny_model_dir), load_causal_lm(tiny_model_dir)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, ours.config.vocab_size, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:], mask[2, 4:] = 0, 0
    got = sequence_logprobs(ours, ids, mask, 0.8)
    logits = forward_logits(ref, ids, mask)[:, :-1].float() / 0.8
    want = torch.zeros_like(got)
    want[:, 1:] = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    want = want * mask
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    assert (got[mask == 0] == 0).all() and (got[:, 0] == 0).all()
    upstream = torch.randn(got.shape, generator=g)
    (got * upstream).sum().backward()
    (want * upstream).sum().backward()
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        # float32 sums over many tokens: within 1e-6 of the gradient's own scale
        assert (p.grad - q.grad).abs().max() <= 1e-6 * max(1.0, float(q.grad.abs().max())), name


def test_sequence_logprobs_only_at_chosen_positions(tiny_model_dir):
    """`only` scores just the chosen positions (an answer, the actions): the same values and gradients as the
    full call there, 0 elsewhere (a padded position stays 0 even when chosen)."""
    full, part = load_causal_lm(tiny_model_dir), load_causal_lm(tiny_model_dir)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, full.config.vocab_size, (2, 8), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    only = torch.zeros_like(ids)
    only[0, 3:], only[1, 2:] = 1, 1
    for model in (full, part):  # read_only_at: opd-sao's own forward reads the chosen positions alone (its tests)
        llama_forward.keep_transformers(model)
    seen = []
    block = feed_forward_blocks(decoder_layers(part.get_decoder())[-1])[0]
    block.register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[:-1].numel()))  # its input
    want = sequence_logprobs(full, ids, mask, 0.9) * only
    got = sequence_logprobs(part, ids, mask, 0.9, only=only)
    assert seen == [int((only * mask).sum())]  # the last feed-forward block only where a chosen token is predicted
    assert torch.equal(got != 0, (only * mask).bool()) and torch.allclose(got, want, atol=1e-6)
    assert_same_gradients(got, want, part, full, g, 1e-6)


def _rows_sharing_prompts(g, prompt_lengths, rows):
    """(ids, mask, only) [B, T], right-padded: row r is prompt rows[r][0] (random tokens of `prompt_lengths`) then
    rows[r][1] random response tokens, the scored ones."""
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in prompt_lengths]
    width = max(len(prompts[i]) + n for i, n in rows)
    ids, mask, only = (torch.zeros(len(rows), width, dtype=torch.long) for _ in range(3))
    for r, (i, n) in enumerate(rows):
        row = prompts[i] + torch.randint(3, 300, (n,), generator=g).tolist()
        ids[r, :len(row)], mask[r, :len(row)], only[r, len(prompts[i]):len(row)] = torch.tensor(row), 1, 1
    return ids, mask, only


@pytest.mark.parametrize("arch,attention", [("tiny", "eager"), ("tiny", "sdpa"), ("qwen2", "eager"),
                                            ("llama", "eager")])
def test_rows_sharing_a_prompt_run_it_once_with_the_same_values_and_gradients(arch, attention, request):
    """GRPO's groups: rows whose prompt (the tokens before their first action) is the same run it once, and their
    actions' logprobs and every parameter's gradient equal one forward over the rows (float32 rounding). Three
    prompts of different lengths, 8 rows, responses of different lengths, right-padded; the decoder sees the 3
    distinct prompts, then the 8 rows' rest."""
    path = request.getfixturevalue({"tiny": "tiny_model_dir", "qwen2": "qwen_model_dir",
                                    "llama": "llama_model_dir"}[arch])
    shared, plain = (load_causal_lm(path, attn_implementation=attention) for _ in range(2))
    llama_forward.keep_transformers(plain)  # its decoder's forward is what the hooks count
    g = torch.Generator().manual_seed(2)
    ids, mask, only = _rows_sharing_prompts(g, (5, 3, 6), [(0, 4), (0, 2), (1, 5), (0, 4), (2, 1), (1, 5), (2, 3),
                                                            (1, 1)])
    width = ids.shape[1]
    seen = []
    hook = shared.get_decoder().register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    got = sequence_logprobs(shared, ids, mask, 0.9, only=only)
    hook.remove()
    assert [n for n, _ in seen] == [3, 8] and seen[0][1] == 6  # the prompts once, then each row's rest
    plain.get_decoder().register_forward_pre_hook(  # the plain path: no prompt to share
        lambda _m, _a, kw: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    want = sequence_logprobs(plain, ids, mask, 0.9)  # no `only`: one forward over the whole rows
    assert seen[2] == (8, width)
    want = want * only
    assert torch.equal(got != 0, only.bool()) and torch.allclose(got, want, atol=1e-5)
    assert_same_gradients(got, want, shared, plain, g, 1e-5)


@pytest.mark.parametrize("window", [4, 12])
def test_rows_sharing_a_prompt_under_a_sliding_window_score_as_alone(windowed_model_dir, window):
    """A sliding window (Mistral, Gemma 3) or attention chunks (Llama 4): the shared prompt's padding sits between a
    shorter prompt and its rest, so where the window could cut (rows of 11 columns, window 4) the rows take the plain
    forward; where it cannot (window 12) they share. Both equal each row run alone, unpadded; and the window does
    change the numbers."""
    model = load_causal_lm(windowed_model_dir)
    field = "attention_chunk_size" if model.config.model_type == "llama4_text" else "sliding_window"
    setattr(model.config, field, window)
    ids, mask, only = _rows_sharing_prompts(torch.Generator().manual_seed(3), (6, 3), [(0, 3), (0, 5), (1, 6), (1, 1)])
    width = ids.shape[1]  # 11 columns
    seen = []
    decoder_of(model).register_forward_pre_hook(lambda _m, _a, kw: seen.append(kw["input_ids"].shape[0]),
                                                  with_kwargs=True)
    with torch.no_grad():
        got = sequence_logprobs(model, ids, mask, 1.0, only=only)
        assert seen == ([2, 4] if window >= width else [4])  # shared: the 2 prompts, then the 4 rows' rest
        alone = torch.zeros_like(got)
        for r in range(len(ids)):
            n = int(mask[r].sum())
            alone[r, :n] = sequence_logprobs(model, ids[r:r + 1, :n], mask[r:r + 1, :n], 1.0, only=only[r:r + 1, :n])
        setattr(model.config, field, 1024)
        unwindowed = sequence_logprobs(model, ids, mask, 1.0, only=only)
    assert torch.allclose(got, alone, atol=1e-5)
    assert (window >= width) == torch.allclose(got, unwindowed, atol=1e-5)


def test_reading_some_positions_leaves_the_last_block_whole_under_activation_checkpointing(tiny_model_dir):
    """Activation checkpointing re-runs a layer in the backward, outside `read_only_at`: the block stays whole."""
    model = load_causal_lm(tiny_model_dir)
    model.activation_checkpointing_enable()
    seen = []
    block = feed_forward_blocks(decoder_layers(model.get_decoder())[-1])[0]
    block.register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[:-1].numel()))
    with read_only_at(model, torch.tensor([[False, True, False]])):
        model(input_ids=torch.tensor([[5, 6, 7]]))
    assert seen == [3]


def test_reading_some_positions_leaves_another_threads_forward_whole(tiny_model_dir):
    """The engine's model can run in two threads at once (the gate's probe beside the rollout worker): a pass in
    another thread, of the very same shape, goes through the whole block while this one is cut."""
    import threading

    model = load_causal_lm(tiny_model_dir)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    with torch.no_grad():
        whole = model(input_ids=ids).logits
        other = []
        with read_only_at(model, torch.tensor([[False, False, True], [False, True, False]])):
            thread = threading.Thread(target=lambda: other.append(model(input_ids=ids).logits))
            thread.start()
            thread.join()
            cut = model(input_ids=ids).logits
    assert torch.allclose(other[0], whole, atol=1e-6)
    assert torch.allclose(cut[0, 2], whole[0, 2], atol=1e-6) and not torch.allclose(cut[0, 0], whole[0, 0], atol=1e-3)


def test_rows_with_distinct_prompts_or_activation_checkpointing_take_the_plain_forward(tiny_model_dir):
    """Nothing to share (every prompt distinct), or a model whose checkpointing turns transformers' cache off:
    one forward over the rows."""
    from opd_sao.model.modeling import shared_prefix_hidden_states

    model = load_causal_lm(tiny_model_dir)
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 8], [5, 6, 7, 9]])
    mask = torch.ones_like(ids)
    assert shared_prefix_hidden_states(model, ids, mask, torch.tensor([2, 3, 2])) is not None  # rows 0, 2 share
    assert shared_prefix_hidden_states(model, ids, mask, torch.tensor([3, 3, 2])) is None  # 5 6 7, 5 6 9, 5 6
    model.activation_checkpointing_enable()
    assert shared_prefix_hidden_states(model, ids, mask, torch.tensor([2, 3, 2])) is None


def test_sft_loss_is_the_token_mean_cross_entropy_on_the_answer(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir)
    ids = torch.randint(3, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    mask, loss_mask = torch.ones_like(ids), torch.zeros_like(ids)
    loss_mask[:, 4:] = 1
    with torch.no_grad():
        logp = torch.log_softmax(forward_logits(model, ids, mask)[:, :-1].float(), -1)
        want = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)[:, 3:].mean()
        got = sft_loss(sequence_logprobs(model, ids, mask, only=loss_mask), loss_mask)
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("row_block", [5, 256], ids=["chunked", "one-block"])
def test_bfloat16_weights_give_bfloat16_gradients(row_block):
    hidden, weight, bias = (x.detach().to(torch.bfloat16).requires_grad_() for x in leaves(torch.float32))
    targets = torch.arange(23) % 101
    out = token_logprobs(hidden, weight, bias, targets, torch.ones(23), vocab_chunk=16, row_block=row_block)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert hidden.grad.dtype == weight.grad.dtype == bias.grad.dtype == torch.bfloat16
    want = naive(*(x.detach().float() for x in (hidden, weight, bias)), targets, torch.ones(23))
    assert (out - want).abs().max() < 0.05  # bf16 rounding of the logits


def test_top_k_and_top_p_cut_the_support_as_sglang_then_renormalise():
    """logits [3, 2, 1, 0] at T 1: p = [0.644, 0.237, 0.087, 0.032]. top_p 0.7 keeps the tokens whose mass
    before them is below 0.7 (the first two); top_k 3 cuts the rank; both together intersect (both cut from
    the whole distribution); top_k 1 is greedy. The kept logprobs are renormalised over the kept tokens."""
    from opd_sao.model.modeling import sample_tokens

    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 4)
    one = torch.ones(4)
    top_p = torch.tensor([1.0, 0.7, 0.7, 1.0])
    top_k = torch.tensor([3, -1, 1, -1])
    got = nucleus_logprobs(logits, one, top_p, top_k)
    inf = float("-inf")
    z3, z2 = torch.logsumexp(torch.tensor([3.0, 2.0, 1.0]), 0), torch.logsumexp(torch.tensor([3.0, 2.0]), 0)
    expected = torch.tensor([[3 - z3, 2 - z3, 1 - z3, inf], [3 - z2, 2 - z2, inf, inf], [0.0, inf, inf, inf],
                             (logits[0] - torch.logsumexp(logits[0], 0)).tolist()])
    assert torch.allclose(got, expected)
    assert torch.equal(nucleus_logprobs(logits, one, one), torch.log_softmax(logits, -1))  # no cut: the softmax
    ids, sampled, vocab = sample_tokens(logits, torch.full((4,), 0.5), one, torch.Generator().manual_seed(0),
                                       torch.tensor([1, 1, 1, 1]))
    assert ids.tolist() == [0, 0, 0, 0] and torch.allclose(sampled, torch.zeros(4))  # greedy: its own support
    assert torch.allclose(vocab, torch.log_softmax(logits / 0.5, -1)[:, 0])  # over the whole vocabulary, at T


def test_categorical_draws_follow_the_distribution_and_never_a_zero_probability_index():
    """Inverse-CDF draws from rows that need not sum to 1: [0.5, 0, 0.2, 0.3, 0] x 2 (sum 2) draws 0, 2 and 3 at
    0.5, 0.2 and 0.3 (200,000 draws, within 4 standard errors) and never 1 or 4. A row of one subnormal mass
    [0, 5e-324, 0]: the uniform times the total rounds to 0 or to the total itself (then every cumulative sum is
    <= it and the draw would fall past the row): both give index 1, the only positive one. The same generator
    state gives the same draws; a row with a NaN, an infinity or no mass is refused."""
    from opd_sao.model.modeling import categorical

    n = 200_000
    probs = torch.tensor([[1.0, 0.0, 0.4, 0.6, 0.0]]).expand(n, 5)
    draws = categorical(probs, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=5).double() / n
    want = torch.tensor([0.5, 0.0, 0.2, 0.3, 0.0], dtype=torch.float64)
    assert freq[1] == 0 and freq[4] == 0
    assert ((freq - want).abs() <= 4 * (want * (1 - want) / n).sqrt() + 1e-12).all(), freq
    tiny = torch.tensor([[0.0, 5e-324, 0.0]], dtype=torch.float64).expand(1000, 3)
    assert categorical(tiny, torch.Generator().manual_seed(1)).tolist() == [1] * 1000
    assert torch.equal(categorical(probs[:50], torch.Generator().manual_seed(3)),
                       categorical(probs[:50], torch.Generator().manual_seed(3)))
    for bad in (float("nan"), float("inf")):  # refused, as torch.multinomial refuses them
        with pytest.raises(RuntimeError, match="inf, nan"):
            categorical(torch.tensor([[0.5, 0.5], [bad, 0.5]]))
    with pytest.raises(RuntimeError, match="sums to 0"):
        categorical(torch.tensor([[0.5, 0.5], [0.0, 0.0]]))


def test_keyed_draws_do_not_depend_on_the_vocabulary_chunk(monkeypatch):
    """keyed_choice hashes the vocabulary VOCAB_CHUNK columns at a time: chunks of 7 over 40 columns (the last one
    short), with some -inf columns and a whole -inf chunk, draw what one chunk over all 40 draws, key by key."""
    from opd_sao.model import modeling

    logits = torch.randn(300, 40, generator=torch.Generator().manual_seed(0))
    logits[:, 7:14] = float("-inf")  # a whole chunk cut (top-p / top-k), and scattered cut columns
    logits[::3, 30] = float("-inf")
    logp = torch.log_softmax(logits, -1)
    keys = [(seed, seed % 5) for seed in range(300)]
    monkeypatch.setattr(modeling, "VOCAB_CHUNK", 64)
    whole = modeling.keyed_choice(logp, keys)
    monkeypatch.setattr(modeling, "VOCAB_CHUNK", 7)
    chunked = modeling.keyed_choice(logp, keys)
    assert torch.equal(whole, chunked) and not ((whole >= 7) & (whole < 14)).any()
    assert len(set(whole.tolist())) > 20  # the draws spread over the vocabulary: the chunks' boundaries are crossed


def test_keyed_draws_follow_the_distribution_ignore_the_batch_and_couple_close_policies():
    """Keyed sampling (SGLang's sampling_seed): p = softmax([2, 1, 0, -inf]) = [0.665, 0.245, 0.090, 0]; 6000 keys
    draw each token at its probability (within 4 standard errors), never the cut one; a key draws the same token
    alone or beside other rows, keyed or not; q = softmax([2, 1, 0.4, -inf]) = [0.637, 0.234, 0.129, 0] is at
    total variation distance d = 0.039 from p, and the same keys draw the same token from both at a rate of at
    least (1 - d) / (1 + d) = 0.926 (independent draws would agree at sum p q = 0.49)."""
    from opd_sao.model.modeling import keyed_choice, sample_tokens

    inf = float("-inf")
    p = torch.log_softmax(torch.tensor([2.0, 1.0, 0.0, inf]), -1)
    q = torch.log_softmax(torch.tensor([2.0, 1.0, 0.4, inf]), -1)
    keys = [(seed, 7) for seed in range(6000)]
    draws = keyed_choice(p.expand(len(keys), 4), keys)
    freq = torch.bincount(draws, minlength=4).double() / len(keys)
    want = p.exp().double()
    assert freq[3] == 0 and ((freq - want).abs() <= 4 * (want * (1 - want) / len(keys)).sqrt() + 1e-12).all(), freq
    d = 0.5 * (p.exp() - q.exp()).abs().sum().item()
    same = (keyed_choice(q.expand(len(keys), 4), keys) == draws).double().mean().item()
    assert abs(d - 0.0386) < 0.0005 and same >= (1 - d) / (1 + d) - 0.01, same
    assert not torch.equal(keyed_choice(p.expand(200, 4), [(s, 8) for s in range(200)]), draws[:200])  # position

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 3 + [[0.0, 0.0, 3.0, 0.0]])
    one = torch.ones(4)
    alone = sample_tokens(logits[:1], one[:1], one[:1], keys=[(11, 0)])[0]
    for other in ([None, (5, 0), None, None], [None, None, None, (11, 0)]):
        batch = sample_tokens(logits, one, one, torch.Generator().manual_seed(1), keys=[(11, 0)] + other[1:])[0]
        assert batch[0] == alone[0]
