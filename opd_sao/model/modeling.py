"""Forward passes shared by the engine, the trainer, the consistency checker and the teachers.

One path computes every logprob the project needs from a causal LM: the decoder's final hidden states,
then the lm head one vocabulary chunk at a time (`logit_chunks`), so no caller ever holds a [B, T, V]
float32 logits tensor: at a real vocabulary (151,936 for Qwen2.5) that tensor is gigabytes for a
batch the model itself handles in megabytes. On top of the chunks:

- `token_logprobs`: log p(target) per row, differentiable through a custom autograd function that
  recomputes each chunk in the backward pass (memory: row_block x vocab_chunk, not N x V);
- `sequence_logprobs`: the trainer's view of a batch (RL, and SFT's loss: `algorithms.sft_loss`);
- `support_logprobs`: the OPD student's logprobs on a teacher's support plus the exact tail mass;
- `streamed_divergence`: OPD's full-vocabulary divergence, student and teacher read chunk by chunk together;
- teachers read the same chunks for their top-k / top-p supports (`teachers/scoring.py`).

One function computes a token's logprob, so engine and trainer agree by construction wherever they can
(the consistency checker measures where they cannot).
"""
from __future__ import annotations

import hashlib
import threading
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

import opd_sao.model.llama_forward as llama_forward  # the module, not the package: no edge to __init__

from .decoders import (
    activation_checkpointing,
    attention_window,
    check_plain_logits,
    decoder_of,
    last_feed_forward,
    unwrap,
)

VOCAB_CHUNK = 8192  # vocabulary columns per lm-head chunk
ROW_BLOCK = 256  # rows per block: ROW_BLOCK x VOCAB_CHUNK fp32 logits = 8 MiB at a time, which stays in a CPU's
# last-level cache between the matmul and the passes over it (1,024 rows, 32 MiB, ran the lm head 1.5-2x slower)
SAMPLING_MASK_TOP_K = 4096  # SGLang 0.5.23's --sampling-mask-max-tokens default: its scheduler takes a
# return_sampling_mask request only at top_k 1 or 1 < top_k <= that cap, so a top_p < 1 rollout samples SGLang's
# joint top-k/top-p support with k at most this, everywhere (served, embedded, and as the trainer scores it)
MASKED = -1.0e30  # finite stand-in for -inf inside logsumexp, so an empty set has a finite gradient (0)


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions count real tokens only, so left and right padding give the same positions."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@contextmanager
def read_only_at(model, read: Optional[torch.Tensor]):
    """Within it, the model's last feed-forward block runs only at the positions `read` [B, T] marks.

    After the last decoder layer's token mixer every module works on each position alone (its feed-forward block,
    the final norm, a head), so a position whose hidden state nobody reads needs none of them: a forward that
    scores the answer, the critic's values at the actions, or a prefill that samples from its last token skips
    the last block's work on the rest (a third of the linear work of a 2-layer model, about 1/L of an L-layer
    one). The hidden states at the unread positions are the attention output alone: the caller must not read
    them. A no-op where `read` is None, the layer has no single feed-forward block, or under activation
    checkpointing (its backward re-runs the layer outside this context)."""
    layer, block = last_feed_forward(unwrap(model)) if read is not None else (None, None)
    if block is None or getattr(layer, "gradient_checkpointing", False):  # checkpointing: transformers' flag
        yield
        return
    where = read.bool().flatten().nonzero().squeeze(1)
    shape = tuple(read.shape)
    owner = threading.get_ident()  # another thread's forward through the same module (the gate probing the engine's
    # model while it generates) is not this pass
    gathered = []  # a call whose input was cut, for its output to be put back

    def gather(module, args):
        x = args[0]
        if threading.get_ident() != owner or tuple(x.shape[:2]) != shape:  # not the pass `read` describes
            return None
        gathered.append(True)
        return (x.reshape(-1, x.shape[-1]).index_select(0, where.to(x.device)).unsqueeze(0), *args[1:])

    def scatter(module, args, out):
        if threading.get_ident() != owner or not gathered:
            return None
        gathered.pop()
        first = out[0] if isinstance(out, tuple) else out  # [1, n, H], or [n, H] from a block that flattens (Llama 4)
        whole = first.new_zeros(shape[0] * shape[1], first.shape[-1]).index_copy(
            0, where.to(first.device), first.reshape(-1, first.shape[-1]))
        whole = whole.view(*shape, first.shape[-1]) if first.dim() == 3 else whole  # the shape the block would give
        return (whole, *out[1:]) if isinstance(out, tuple) else whole

    handles = [block.register_forward_pre_hook(gather), block.register_forward_hook(scatter)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def marked(like: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """[B, T] bool (the shape of `like`'s first two dims), True at each (rows[i], columns[i]): the positions a caller
    reads, for `read_only_at`."""
    mask = torch.zeros(like.shape[:2], dtype=torch.bool, device=like.device)
    mask[rows, columns] = True
    return mask


def lm_head(model) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(weight [V, H], bias [V] or None) of a causal LM whose logits are a plain linear map of its hidden states."""
    model = unwrap(model)
    check_plain_logits(model.config, type(model).__name__)
    head = model.get_output_embeddings()
    return head.weight, head.bias


def vocab_rows(weight: torch.Tensor, bias: Optional[torch.Tensor],
               vocab_size: Optional[int]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The lm head's first `vocab_size` rows (None: all): dropping the embedding padding past a tokenizer's ids
    is masking those logits before any softmax or top-k (they carry no probability). A view, so gradients
    reach the full weight."""
    if vocab_size is None or vocab_size >= weight.shape[0]:
        return weight, bias
    return weight[:vocab_size], None if bias is None else bias[:vocab_size]


def hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  prefix_lengths: Optional[torch.Tensor] = None, read: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[B, T, H] the decoder's final hidden states (real-token position ids, so either padding side works).

    `prefix_lengths` [B] (right-padded rows whose first `prefix_lengths[r]` tokens are real: the prompt): rows with
    the same prefix run it once (`shared_prefix_hidden_states`) where several rows share one. `read` [B, T]: the
    positions the caller reads; the others may hold anything (`read_only_at`). A Llama-family model runs opd-sao's
    own forward (`llama_forward.serves`), any other transformers'."""
    if prefix_lengths is not None:
        shared = shared_prefix_hidden_states(model, input_ids, attention_mask, prefix_lengths)
        if shared is not None:
            return shared
    if llama_forward.serves(model):
        return llama_forward.hidden_states_at(model, input_ids, attention_mask, position_ids_for(attention_mask), read)
    decoder = decoder_of(model)
    with read_only_at(model, read):
        return decoder(input_ids=input_ids, attention_mask=attention_mask,
                       position_ids=position_ids_for(attention_mask)).last_hidden_state


def batch_kv_cache(model) -> DynamicCache:
    """A KV cache for batches whose rows move: every sliding-window or chunked-attention layer keeps all its
    positions.

    transformers' window layers (sliding: Mistral, Gemma, gpt-oss; chunked: Llama 4) keep only the last window - 1
    columns, which is right for one sequence but not where columns shift under the rows (the engine's joins and
    drops re-pad the batch; a shared prefix is copied to rows of other lengths): the dropped keys are ones the
    attention mask still reaches. Kept whole, the mask alone applies the window, as in a forward over the whole
    row. Other layer kinds stay as the config builds them (transformers uses the window class for both)."""
    cache = DynamicCache(config=unwrap(model).config)
    cache.layers = [DynamicLayer() if type(layer) is DynamicSlidingWindowLayer else layer for layer in cache.layers]
    return cache


def shared_prefix_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                prefix_lengths: torch.Tensor) -> Optional[torch.Tensor]:
    """`hidden_states` with each distinct prefix run once: a GRPO group's members share their prompt, so the
    decoder runs the distinct prompts, copies each one's KV cache to its rows (an index, so gradients from
    every row reach the shared prompt), then runs every row's rest against it. The same function of the weights
    as one forward over the rows (float rounding aside), on fewer tokens. None where no two rows share a prefix,
    or where the decoder cannot continue from a cache (activation checkpointing turns transformers' cache off), and
    where an attention window or chunk could bind (rows wider than it): a shorter prefix's padding sits between it
    and its row's rest, so the window, counted in columns, would cut tokens a row alone still sees."""
    decoder = decoder_of(model)
    if activation_checkpointing(model):
        return None
    window = attention_window(model)
    if window is not None and input_ids.shape[1] > window:
        return None
    lengths = prefix_lengths.tolist()
    if min(lengths) < 1:  # a row with no prefix token: nothing to share
        return None
    rows = input_ids[:, :max(lengths)].tolist()  # the prefixes only: an 8k-token row's tail is not copied to Python
    distinct: dict[tuple[int, ...], int] = {}
    group = [distinct.setdefault(tuple(row[:n]), len(distinct)) for row, n in zip(rows, lengths)]
    if len(distinct) == len(rows):
        return None
    device, width = input_ids.device, input_ids.shape[1]
    first = torch.tensor([group.index(g) for g in range(len(distinct))], device=device)
    index = torch.tensor(group, device=device)
    lengths_t = torch.tensor(lengths, device=device)
    prefix_width = max(1, max(lengths))
    prefix_mask = (torch.arange(prefix_width, device=device) < lengths_t[first, None]).long()
    prefix_ids = input_ids[first, :prefix_width] * prefix_mask
    cache = batch_kv_cache(model)
    prefix_hidden = decoder(input_ids=prefix_ids, attention_mask=prefix_mask, position_ids=position_ids_for(prefix_mask),
                            cache=cache, use_cache=True).last_hidden_state
    cache.batch_select_indices(index)
    rest_width = max(1, width - min(lengths))
    at = lengths_t[:, None] + torch.arange(rest_width, device=device)  # where each row's rest sits in the row
    inside = at < width
    at = at.clamp(max=width - 1)
    rest_ids = input_ids.gather(1, at) * inside
    mask = torch.cat([prefix_mask[index], attention_mask.gather(1, at) * inside], dim=1)
    rest_hidden = decoder(input_ids=rest_ids, attention_mask=mask, position_ids=position_ids_for(mask)[:, prefix_width:],
                          cache=cache, use_cache=True).last_hidden_state
    # back to the rows' layout: position t < length from the shared prefix, t >= length from the row's rest
    t = torch.arange(width, device=device)[None]
    source = torch.where(t < lengths_t[:, None], t, prefix_width + t - lengths_t[:, None]).clamp(
        max=prefix_width + rest_width - 1)
    joined = torch.cat([prefix_hidden[index], rest_hidden], dim=1)
    return joined.gather(1, source[..., None].expand(-1, -1, joined.shape[-1]))


def forward_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Full [B, T, V] logits: only for a few positions at a time (the engine's last-token sampling)."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_for(attention_mask))
    return out.logits


def logit_chunks(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 vocab_chunk: int = VOCAB_CHUNK) -> Iterator[tuple[int, torch.Tensor]]:
    """(start, float32 logits [N, w]) for each vocabulary chunk [start, start + w).

    The matmul runs in the weight's dtype and is upcast after, as a full forward would (float64 stays float64)."""
    hidden = hidden.to(weight.dtype)
    for start in range(0, weight.shape[0], vocab_chunk):
        logits = hidden @ weight[start:start + vocab_chunk].T
        if bias is not None:
            logits = logits + bias[start:start + vocab_chunk]
        yield start, logits.to(acc_dtype(weight))


def acc_dtype(weight: torch.Tensor) -> torch.dtype:
    """float32 for logits and their sums, float64 when the weights are (for exactness tests)."""
    return torch.float64 if weight.dtype == torch.float64 else torch.float32


def fused_logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dim, read off torch's fused log_softmax kernel (several times faster than
    `torch.logsumexp` on CPU): lse = max z - max log_softmax(z), both maxima at the argmax, where
    log_softmax is exactly -log sum exp(z - max z), so no precision is lost. (`amax`: no index to track.)"""
    return logits.amax(dim=-1) - torch.log_softmax(logits, dim=-1).amax(dim=-1)


def autocast_state(device: torch.device) -> tuple[str, bool, torch.dtype]:
    """The autocast setting a custom autograd function's forward ran under, for its backward to run under too
    (the autograd engine does not carry it over, and the recomputed chunks must match the forward's)."""
    return device.type, torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type)


def _row_blocks(n: int, size: int) -> list[slice]:
    return [slice(first, min(n, first + size)) for first in range(0, n, size)]


class _ChunkedTokenLogprob(torch.autograd.Function):
    """log softmax(hidden @ weight.T)[target] per row, chunk by chunk in both directions.

    Forward keeps only the per-row logsumexp; backward recomputes each chunk's softmax p and applies
    d logp / d z_v = 1[v = target] - p_v, so the backward's memory is one chunk too. (Temperature and
    bias are folded into `hidden` and `weight` by the caller, so they cost no pass over the logits.)
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_chunk, row_block):
        n, acc = hidden.shape[0], acc_dtype(weight)
        out = torch.empty(n, dtype=acc, device=hidden.device)
        lse_all = torch.empty(n, dtype=acc, device=hidden.device)
        for rows in _row_blocks(n, row_block):
            t = targets[rows]
            lse = torch.full((t.shape[0],), float("-inf"), dtype=acc, device=hidden.device)
            picked = torch.empty(t.shape[0], dtype=acc, device=hidden.device)
            for start, logits in logit_chunks(hidden[rows], weight, None, vocab_chunk):
                lse = torch.logaddexp(lse, fused_logsumexp(logits))
                inside = (t >= start) & (t < start + logits.shape[-1])
                picked[inside] = logits[inside, t[inside] - start]
            out[rows], lse_all[rows] = picked - lse, lse
        ctx.save_for_backward(hidden, weight, targets, lse_all)
        ctx.vocab_chunk, ctx.row_block, ctx.autocast = vocab_chunk, row_block, autocast_state(hidden.device)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        device_type, enabled, dtype = ctx.autocast
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):
            return _ChunkedTokenLogprob._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        hidden, weight, targets, lse_all = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        acc = acc_dtype(weight)
        grad_h = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_out = grad_out.to(acc)
        for rows in _row_blocks(hidden.shape[0], ctx.row_block):
            h, t, g = hidden[rows].to(weight.dtype), targets[rows], grad_out[rows].unsqueeze(-1)
            lse = lse_all[rows].unsqueeze(-1)
            for start, coef in logit_chunks(h, weight, None, ctx.vocab_chunk):
                coef.sub_(lse).exp_().mul_(-g)  # -g p_v, in place: one chunk buffer
                end = start + coef.shape[-1]
                inside = (t >= start) & (t < end)
                coef[inside, t[inside] - start] += g[inside, 0]  # + g at the target
                _add_chunk_grads(coef, h, weight, rows, start, end, grad_h, grad_w)
        return (grad_h.to(hidden.dtype) if need_h else None, grad_w.to(weight.dtype) if need_w else None,
                None, None, None)


def _add_chunk_grads(coef, h, weight, rows: slice, start: int, end: int, grad_h, grad_w) -> None:
    """grad_h[rows] += coef @ W[start:end]; grad_w[start:end] += coef.T @ h (coef = dL/dlogits of one chunk)."""
    coef = coef.to(weight.dtype)
    if grad_h is not None:
        grad_h[rows] += (coef @ weight[start:end]).to(grad_h.dtype)
    if grad_w is not None:
        grad_w[start:end] += (coef.T @ h).to(grad_w.dtype)


def _fold_bias(hidden, weight, bias, column: torch.Tensor):
    """[h, column] @ [W, b].T = h @ W.T + column * b: a bias as one more hidden column, so the chunked kernels
    only ever see a plain linear map."""
    if bias is None:
        return hidden, weight
    return (torch.cat([hidden, column.to(hidden.dtype).unsqueeze(-1)], dim=-1),
            torch.cat([weight, bias.unsqueeze(-1)], dim=-1))


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
                   temperature: torch.Tensor, top_p: Optional[torch.Tensor] = None, *,
                   vocab_chunk: int = VOCAB_CHUNK, row_block: int = ROW_BLOCK) -> torch.Tensor:
    """log p(target) [N] under softmax((hidden @ weight.T + bias) / T), never materialising [N, V].

    hidden [N, H]; weight [V, H]; targets, temperature, top_p [N]. Differentiable in hidden, weight and bias.
    The temperature is folded into the hidden states ((h / T) @ W.T = z / T) and a bias into one more
    hidden column, so the chunked kernel only ever sees a plain linear map.
    Rows with top_p < 1 are scored under the distribution the engine sampled from (`nucleus_logprobs`,
    renormalised on the nucleus), which needs a whole sorted row: those go a few full rows at a time.
    """
    n = hidden.shape[0]
    temperature = temperature.to(hidden.device, acc_dtype(weight))
    nucleus = (top_p < 1.0).to(hidden.device) if top_p is not None else None
    if nucleus is not None and bool(nucleus.any()):
        out = torch.zeros(n, dtype=acc_dtype(weight), device=hidden.device)
        plain = (~nucleus).nonzero().squeeze(-1)
        if len(plain):
            out = out.index_put((plain,), token_logprobs(hidden[plain], weight, bias, targets[plain],
                                                         temperature[plain], vocab_chunk=vocab_chunk,
                                                         row_block=row_block))
        rows_per_block = max(1, row_block * vocab_chunk // weight.shape[0])
        for block in nucleus.nonzero().squeeze(-1).split(rows_per_block):
            logits = torch.cat([chunk for _, chunk in logit_chunks(hidden[block], weight, bias, vocab_chunk)], dim=-1)
            logp = nucleus_logprobs(logits, temperature[block], top_p[block].to(hidden.device).float())
            out = out.index_put((block,), logp.gather(-1, targets[block].unsqueeze(-1)).squeeze(-1))
        return out
    scaled = hidden if bool((temperature == 1).all()) else hidden / temperature.to(hidden.dtype).unsqueeze(-1)
    scaled, weight = _fold_bias(scaled, weight, bias, 1 / temperature)  # (h @ W.T + b) / T
    if n * weight.shape[0] <= row_block * vocab_chunk:
        # all of it one block (a small vocabulary, or a few rows): autograd's log_softmax, whose saved [n, V] is
        # no more than the kernel's block, and whose backward is one kernel (the chunked one cost 2.5x at 260 x 384)
        logits = next(logit_chunks(scaled, weight, None, weight.shape[0]))[1]
        return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return _ChunkedTokenLogprob.apply(scaled, weight, targets, vocab_chunk, row_block)


def sequence_logprobs(model, input_ids, attention_mask, temperature: float = 1.0, *,
                      top_p: Optional[torch.Tensor] = None, full_logits: bool = False,
                      only: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[B, T] logprob of token t given tokens < t (0 at t=0 and on padding), differentiable.

    Under the distribution a row was sampled from: softmax(logits / temperature), renormalised on the
    top-p nucleus where `top_p` [B] is below 1 (docs/design.md §2.2: the DIS ratio compares the sampling distributions
    actually used, so trainer, engine and checker all score this way). Vocabulary-chunked;
    `full_logits=True` runs the model's own forward instead (ZeRO-3, whose lm head weight is only
    gathered inside the module's forward). `only` [B, T]: score just these positions (0 elsewhere), so a
    loss over the answer or the actions does not pay the lm head for the prompt."""
    out = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    wanted = attention_mask[:, 1:].bool()  # predicted positions t + 1 that are real tokens
    if only is not None:
        wanted = wanted & only[:, 1:].bool().to(wanted.device)
    b, t = wanted.nonzero(as_tuple=True)
    temps = torch.full((len(b),), float(temperature), device=input_ids.device)
    nucleus = top_p.to(input_ids.device)[b] if top_p is not None and bool((top_p < 1).any()) else None
    if full_logits:
        logits = forward_logits(model, input_ids, attention_mask)[b, t]
        logp = nucleus_logprobs(logits, temps, nucleus if nucleus is not None else torch.ones_like(temps))
        return out.index_put((b, t + 1), logp.gather(-1, input_ids[b, t + 1].unsqueeze(-1)).squeeze(-1))
    weight, bias = lm_head(model)
    prompt = None
    if only is not None:  # the tokens before a row's first scored one: its prompt, shared by a group's rows
        scored = only.bool().to(input_ids.device) & attention_mask.bool()
        prompt = torch.where(scored.any(1), scored.long().argmax(1), attention_mask.long().sum(1))
    hidden = hidden_states(model, input_ids, attention_mask, prefix_lengths=prompt, read=marked(input_ids, b, t))
    logp = token_logprobs(hidden[b, t], weight, bias, input_ids[b, t + 1], temps, nucleus)
    return out.to(acc_dtype(weight)).index_put((b, t + 1), logp)  # float32 (float64 for exactness tests)


def nucleus_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                     top_k: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Logprobs of the distribution actually sampled from: softmax(logits/T) renormalised on the top-p nucleus
    (and, with top_k, on its k most likely tokens too; both cut from the whole distribution, as SGLang's sampler
    does: sglang/srt/layers/sampler.py, top_k_top_p_min_p_sampling_from_probs_torch). A row with top_p < 1 is
    also cut to its `SAMPLING_MASK_TOP_K` most likely tokens: the top_k its rollouts ask a server for.

    logits [N, V]; temperature, top_p, top_k [N] (top_k < 1: no cut). Tokens outside the support get -inf.
    """
    logp = torch.log_softmax(logits.float() / temperature.unsqueeze(-1), dim=-1)
    top_k = nucleus_top_k(top_p, top_k)
    no_k = top_k is None or bool((top_k < 1).all())
    if bool((top_p >= 1.0).all()) and no_k:
        return logp
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    mass_before = sorted_logp.exp().cumsum(-1) - sorted_logp.exp()
    drop_sorted = mass_before > top_p.unsqueeze(-1)  # SGLang's cut: a token whose predecessors hold top_p stays
    if not no_k:
        rank = torch.arange(logp.shape[-1], device=logp.device)
        drop_sorted |= (rank >= top_k.unsqueeze(-1)) & (top_k.unsqueeze(-1) >= 1)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    logp = logp.masked_fill(drop, float("-inf"))
    return logp - torch.logsumexp(logp, dim=-1, keepdim=True)


def nucleus_top_k(top_p: torch.Tensor, top_k: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """[N] the top_k each row samples with: its own (< 1: none), cut to `SAMPLING_MASK_TOP_K` where top_p < 1."""
    if not bool((top_p < 1.0).any()):
        return top_k
    own = torch.full(top_p.shape, -1, dtype=torch.long, device=top_p.device) if top_k is None \
        else top_k.to(top_p.device, torch.long)
    capped = torch.where(own >= 1, own.clamp(max=SAMPLING_MASK_TOP_K), SAMPLING_MASK_TOP_K)
    return torch.where(top_p < 1.0, capped, own)


def sample_tokens(logits, temperature, top_p, generator=None, top_k=None, keys=None) -> tuple[torch.Tensor,
                                                                                             torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (ids [N], logprob of each id under the sampled distribution [N], its
    logprob under softmax(logits/T) over the whole vocabulary [N], which SGLang reports as output_token_logprobs).

    `keys`: per row None (drawn from `generator`) or (sampling_seed, position): that row is drawn by `keyed_choice`.
    """
    logp = nucleus_logprobs(logits, temperature, top_p, top_k)
    keyed = [i for i, key in enumerate(keys or ()) if key is not None]
    if len(keyed) < logp.shape[0]:
        ids = categorical(logp.exp(), generator)
    else:
        ids = torch.empty(logp.shape[0], dtype=torch.long, device=logp.device)
    if keyed:
        rows = torch.tensor(keyed, device=logp.device)
        ids[rows] = keyed_choice(logp[rows], [keys[i] for i in keyed])
    cut = bool((top_p < 1.0).any()) or (top_k is not None and bool((top_k >= 1).any()))
    vocab = torch.log_softmax(logits.float() / temperature.unsqueeze(-1), dim=-1) if cut else logp
    return ids, logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1), vocab.gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def categorical(probs: torch.Tensor, generator=None) -> torch.Tensor:
    """One draw per row of `probs` [N, V] (non-negative, each row's sum positive, not necessarily 1) by the
    inverse CDF: the first index whose cumulative sum exceeds a uniform draw times the row's total. One uniform
    per row (`torch.multinomial` costs ten times as much at 64 x 384 on a CPU); a zero-probability index is
    never drawn (its cumulative sum equals its predecessor's), and a uniform that rounds up to the total takes
    the row's last index of positive probability. A row with a NaN, an infinity or no mass is refused as
    `torch.multinomial` refuses it (the engine then retries each sequence of the batch alone)."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1]
    if not bool((torch.isfinite(total) & (total > 0)).all()):  # a NaN or an infinity anywhere reaches the total
        raise RuntimeError("probability tensor contains either inf, nan or element < 0, or a row sums to 0")
    u = torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device, generator=generator) * total[:, None]
    ids = (cdf <= u).sum(-1)
    past = ids >= probs.shape[-1]
    if bool(past.any()):
        last = probs.shape[-1] - 1 - (probs > 0).flip(-1).long().argmax(-1)
        ids = torch.where(past, last, ids)
    return ids


def keyed_choice(logp: torch.Tensor, keys: list[tuple[int, int]]) -> torch.Tensor:
    """One draw per row from exp(logp) [N, V] by the Gumbel-max trick, the row's noise a function of its
    (seed, position) key alone (as SGLang's sampling_seed): the draw does not depend on the batch, and two
    distributions at total variation distance d draw the same token with the same key with probability at least
    (1 - d) / (1 + d) (common random numbers). The noise is integer hashing on logp's device (no host loop, no
    transfer at a real vocabulary), the same bits on any device."""
    seeds = torch.tensor([seed_of(seed) for seed, _ in keys], dtype=torch.long, device=logp.device)
    positions = torch.tensor([position for _, position in keys], dtype=torch.long, device=logp.device)
    row_keys = _splitmix(seeds ^ _splitmix(positions))[:, None]
    best_score = best = None
    # VOCAB_CHUNK columns at a time: the hashing's int64 and float64 temporaries are [N, chunk], not [N, V] (~40 MB
    # each at 32 rows x 151,936); the first of equal maxima wins, as in one argmax over the whole vocabulary
    for start in range(0, logp.shape[-1], VOCAB_CHUNK):
        columns = torch.arange(start, min(start + VOCAB_CHUNK, logp.shape[-1]), dtype=torch.long, device=logp.device)
        bits = _splitmix(row_keys ^ columns[None, :])
        uniform = ((bits >> 11) & ((1 << 53) - 1)).double().add_(0.5).mul_(2.0 ** -53)  # in (0, 1), never 0 or 1
        scores = logp[:, start:start + len(columns)].double() - torch.log(-torch.log(uniform))
        index = scores.argmax(-1, keepdim=True)
        score, index = scores.gather(-1, index).squeeze(-1), index.squeeze(-1) + start
        if best is not None:
            better = score > best_score
            score, index = torch.where(better, score, best_score), torch.where(better, index, best)
        best_score, best = score, index
    return best


_MIX = (0x9E3779B97F4A7C15 - 2 ** 64, 0xBF58476D1CE4E5B9 - 2 ** 64, 0x94D049BB133111EB - 2 ** 64)  # as int64


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (wrapping arithmetic; logical shifts by masking the sign's copies)."""
    x = x + _MIX[0]
    x = (x ^ ((x >> 30) & ((1 << 34) - 1))) * _MIX[1]
    x = (x ^ ((x >> 27) & ((1 << 37) - 1))) * _MIX[2]
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def seed_of(*parts) -> int:
    """A 63-bit seed from ints and strings (an evaluation episode's: run seed, domain, task, sample; a request's:
    the episode's seed, segment, turn): distinct for distinct tuples with overwhelming probability, the same on
    every machine."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 1


# ----------------------------------------------------------------------------
# a distribution on a support (OPD's student side)
# ----------------------------------------------------------------------------

class RunningTopK:
    """The `k` largest logits of each row across vocabulary chunks, without a top-k over every chunk.

    The first chunk gives each row k candidates and a threshold (the k-th largest so far); a later chunk
    contributes only its entries above the threshold (a few percent of a chunk), found by one comparison.
    Candidates pool up and are cut back to the top k (raising the threshold) when a row holds more than
    `slack` x k of them. `add` returns which entries entered the pool, so a caller can sum the others;
    `evicted` is the logsumexp of pooled entries a cut dropped. Ties at the threshold may be
    resolved differently from `torch.topk` (same values; ids among equal logits may differ).
    """

    def __init__(self, rows: int, k: int, like: torch.Tensor, slack: int = 4):
        self.k, self.limit = k, slack * k
        self.tau = torch.full((rows, 1), float("-inf"), dtype=like.dtype, device=like.device)
        self.count = torch.zeros(rows, dtype=torch.long, device=like.device)
        self.evicted = torch.full((rows,), float("-inf"), dtype=like.dtype, device=like.device)
        self.parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (row, value, id) since the last cut
        self.top: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def add(self, logits: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pool this chunk's candidates (vocabulary ids start..); (row, column, value) of the entries pooled."""
        if not self.parts:  # the first chunk: its own top k
            top = logits.topk(min(self.k, logits.shape[1]), dim=1)
            take = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device).scatter_(1, top.indices, True)
            if top.values.shape[1] == self.k:
                self.tau = top.values[:, -1:].clone()
        else:
            take = logits > self.tau
        flat = take.reshape(-1).nonzero().squeeze(1)  # flat indices: cheaper to read than (row, column) pairs
        r, c, v = flat // logits.shape[1], flat % logits.shape[1], logits.reshape(-1).index_select(0, flat)
        self.parts.append((r, v, c + start))
        self.count += torch.bincount(r, minlength=len(self.count))
        self.top = None
        if int(self.count.max()) > self.limit:
            self._cut()
        return r, c, v

    def _cut(self) -> None:
        r, v, i = (torch.cat(x) for x in zip(*self.parts))
        order = r.argsort(stable=True)
        r, v, i = r[order], v[order], i[order]
        col = torch.arange(len(r), device=r.device) - torch.repeat_interleave(self.count.cumsum(0) - self.count,
                                                                             self.count)
        width = int(self.count.max()) if len(r) else 0
        vals = torch.full((len(self.count), width), float("-inf"), dtype=v.dtype, device=v.device)
        ids = torch.zeros(vals.shape, dtype=torch.long, device=v.device)
        vals[r, col], ids[r, col] = v, i
        top = vals.topk(min(self.k, width), dim=1)
        if width > self.k:
            self.evicted = torch.logaddexp(self.evicted, torch.logsumexp(vals.scatter_(1, top.indices, float("-inf")),
                                                                          dim=1))
        self.top = (top.values, ids.gather(1, top.indices))
        if top.values.shape[1] == self.k:
            self.tau = torch.maximum(self.tau, top.values[:, -1:])
        kept = top.values > float("-inf")
        rr, cc = kept.nonzero(as_tuple=True)
        self.parts = [(rr, top.values[rr, cc], self.top[1][rr, cc])]
        self.count = kept.sum(1)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, ids) [rows, k], most probable first (-inf padding only where a row has fewer finite logits)."""
        if self.top is None:
            self._cut()
        return self.top


def _support_entries(ids: torch.Tensor, mask: torch.Tensor, vocab: int, vocab_chunk: int):
    """The valid support entries of a row block sorted by vocabulary chunk: (row, slot, id), `first` (False
    for a repeated (row, id), which counts once) and bounds (chunk c's entries are bounds[c]:bounds[c + 1])."""
    r, s = mask.nonzero(as_tuple=True)
    v = ids[r, s]
    key = r * vocab + v
    order = key.argsort(stable=True)
    repeat = torch.zeros(len(key), dtype=torch.bool, device=ids.device)
    repeat[order[1:]] = key[order[1:]] == key[order[:-1]]
    chunk = torch.div(v, vocab_chunk, rounding_mode="floor")
    by_chunk = chunk.argsort(stable=True)
    bounds = torch.searchsorted(chunk[by_chunk], torch.arange(-(-vocab // vocab_chunk) + 1, device=ids.device))
    return r[by_chunk], s[by_chunk], v[by_chunk], ~repeat[by_chunk], bounds.tolist()


class _ChunkedSupportLogprob(torch.autograd.Function):
    """(log p on a support, log of the mass outside it, top-k ids) per row, chunk by chunk in both directions.

    Forward keeps per row only lse and rest (the logsumexp of the logits outside the support, summed from
    those logits, so a tiny tail keeps its relative precision) and the support's logits. Backward recomputes
    each chunk: with G = sum_s g_s + g_t, d/dz_v = g_t exp(z_v - rest) - G p_v off the support and
    g_s - G p_v on it, so its memory is one chunk buffer plus the support.
    """

    @staticmethod
    def forward(ctx, hidden, weight, ids, mask, vocab_chunk, row_block, top_k):
        n, acc, dev = hidden.shape[0], acc_dtype(weight), hidden.device
        picked = torch.zeros(ids.shape, dtype=acc, device=dev)
        lse = torch.empty(n, dtype=acc, device=dev)
        rest = torch.empty(n, dtype=acc, device=dev)
        top_ids = torch.zeros((n, min(top_k, weight.shape[0])), dtype=torch.long, device=dev)
        for rows in _row_blocks(n, row_block):
            r, s, v, first, bounds = _support_entries(ids[rows], mask[rows], weight.shape[0], vocab_chunk)
            block_rest = torch.full((rows.stop - rows.start,), MASKED, dtype=acc, device=dev)
            top = RunningTopK(rows.stop - rows.start, top_k, block_rest) if top_k else None
            block_picked = picked[rows]
            for c, (start, logits) in enumerate(logit_chunks(hidden[rows], weight, None, vocab_chunk)):
                if top is not None:
                    top.add(logits, start)
                if bounds[c + 1] > bounds[c]:
                    e = slice(bounds[c], bounds[c + 1])
                    block_picked[r[e], s[e]] = logits[r[e], v[e] - start]
                    logits[r[e], v[e] - start] = MASKED
                block_rest = torch.logaddexp(block_rest, fused_logsumexp(logits))
            on_support = torch.full(ids[rows].shape, float("-inf"), dtype=acc, device=dev)
            on_support[r[first], s[first]] = block_picked[r[first], s[first]]
            lse[rows] = torch.logaddexp(block_rest, torch.logsumexp(on_support, dim=1))
            rest[rows] = block_rest
            if top is not None:
                top_ids[rows] = top.result()[1]
        support_logp = torch.where(mask, picked - lse.unsqueeze(1), torch.zeros((), dtype=acc, device=dev))
        ctx.save_for_backward(hidden, weight, ids, mask, picked, lse, rest)
        ctx.vocab_chunk, ctx.row_block, ctx.autocast = vocab_chunk, row_block, autocast_state(hidden.device)
        ctx.mark_non_differentiable(top_ids)
        return support_logp, rest - lse, top_ids

    @staticmethod
    def backward(ctx, grad_support, grad_tail, _):
        device_type, enabled, dtype = ctx.autocast
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):
            return _ChunkedSupportLogprob._backward(ctx, grad_support, grad_tail)

    @staticmethod
    def _backward(ctx, grad_support, grad_tail):
        hidden, weight, ids, mask, picked, lse_all, rest_all = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        acc, vc = acc_dtype(weight), ctx.vocab_chunk
        grad_h = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        g_s = torch.zeros(ids.shape, dtype=acc, device=hidden.device) if grad_support is None else grad_support.to(acc)
        g_s = g_s * mask
        g_t = torch.zeros_like(lse_all) if grad_tail is None else grad_tail.to(acc)
        total = g_s.sum(1) + g_t  # G
        factor = g_t - total * (rest_all - lse_all).exp()  # off the support: exp(z - rest) * factor
        p_support = (picked - lse_all.unsqueeze(1)).exp()
        for rows in _row_blocks(hidden.shape[0], ctx.row_block):
            r, s, v, _, bounds = _support_entries(ids[rows], mask[rows], weight.shape[0], vc)
            h = hidden[rows].to(weight.dtype)
            rest, f, G = rest_all[rows].unsqueeze(1), factor[rows].unsqueeze(1), total[rows]
            for c, (start, coef) in enumerate(logit_chunks(h, weight, None, vc)):
                coef.sub_(rest).exp_().mul_(f)  # inf only on support entries (z > rest + 88), overwritten below
                if bounds[c + 1] > bounds[c]:
                    e = slice(bounds[c], bounds[c + 1])
                    rr, cc = r[e], v[e] - start
                    coef[rr, cc] = -G[rr] * p_support[rows][rr, s[e]]
                    coef.index_put_((rr, cc), g_s[rows][rr, s[e]], accumulate=True)
                _add_chunk_grads(coef, h, weight, rows, start, start + coef.shape[1], grad_h, grad_w)
        return (grad_h.to(hidden.dtype) if need_h else None, grad_w.to(weight.dtype) if need_w else None,
                None, None, None, None, None)


def support_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     support_ids: torch.Tensor, support_mask: torch.Tensor, *, vocab_chunk: int = VOCAB_CHUNK,
                     top_k: int = 0, row_block: int = ROW_BLOCK) -> tuple[torch.Tensor, torch.Tensor,
                                                                          Optional[torch.Tensor]]:
    """Log-probs on a support, the exact log tail mass outside it, and the top-k ids (no grad).

    hidden [N, H] (with grad), weight [V, H], support_ids / support_mask [N, S]. Returns
    (support_logp [N, S] (0 on padding), tail_logp [N], top-k ids [N, k] most probable first or None).
    Differentiable in hidden, weight and bias through `_ChunkedSupportLogprob`: memory is one
    row_block x vocab_chunk buffer in both directions, not N x V.
    """
    ids = support_ids.long().clamp(0, weight.shape[0] - 1)
    hidden, weight = _fold_bias(hidden, weight, bias, torch.ones(hidden.shape[0], device=hidden.device))
    if hidden.shape[0] * weight.shape[0] <= row_block * vocab_chunk:
        # all of it one block (a small vocabulary, or a few rows): autograd on the whole [N, V] logits, no more
        # memory than the kernel's block, 1.7x faster at 260 x 384
        return dense_support_logprobs(next(logit_chunks(hidden, weight, None, weight.shape[0]))[1], ids, support_mask,
                                      top_k=top_k)
    support_logp, tail_logp, top_ids = _ChunkedSupportLogprob.apply(hidden, weight, ids, support_mask.bool(),
                                                                    vocab_chunk, row_block, top_k)
    return support_logp, tail_logp, top_ids if top_k else None


class _StreamedDivergence(torch.autograd.Function):
    """Per row, sum over the whole vocabulary of `terms(student logp, teacher logp)`, student and teacher read
    together one vocabulary chunk at a time: never [N, V] in either direction.

    Forward: one pass for the student's logsumexp (and its top-k ids), one for the terms; it keeps per row the
    logsumexp and G = sum_v g_v, g_v = d terms / d log p_s(v) (autograd on each chunk's elementwise terms).
    Backward recomputes each chunk: d/dz_v = g_v - p_v G (log p_s = z - lse), times the row's output gradient.
    `report` (no grad) sums other terms beside (the learner's reverse-KL metric) in the same pass.
    """

    @staticmethod
    def forward(ctx, hidden, weight, teacher_chunk, terms, report, vocab_chunk, row_block, top_k):
        n, acc, dev = hidden.shape[0], acc_dtype(weight), hidden.device
        lse, total = torch.empty(n, dtype=acc, device=dev), torch.zeros(n, dtype=acc, device=dev)
        out, extra = torch.zeros(n, dtype=acc, device=dev), torch.zeros(n, dtype=acc, device=dev)
        top_ids = torch.zeros((n, min(top_k, weight.shape[0])), dtype=torch.long, device=dev)
        for rows in _row_blocks(n, row_block):
            block_lse = torch.full((rows.stop - rows.start,), MASKED, dtype=acc, device=dev)
            top = RunningTopK(rows.stop - rows.start, top_k, block_lse) if top_k else None
            for start, logits in logit_chunks(hidden[rows], weight, None, vocab_chunk):
                if top is not None:
                    top.add(logits, start)
                block_lse = torch.logaddexp(block_lse, fused_logsumexp(logits))
            lse[rows] = block_lse
            if top is not None:
                top_ids[rows] = top.result()[1]
            for start, logits in logit_chunks(hidden[rows], weight, None, vocab_chunk):
                student = logits.sub_(block_lse.unsqueeze(1))
                teacher = teacher_chunk(rows, start, start + student.shape[1]).to(student)
                value, grad = _terms_and_grad(terms, student, teacher)
                out[rows] += value.sum(1)
                total[rows] += grad.sum(1)
                if report is not None:
                    extra[rows] += report(student, teacher).sum(1)
        ctx.save_for_backward(hidden, weight, lse, total)
        ctx.teacher_chunk, ctx.terms = teacher_chunk, terms
        ctx.vocab_chunk, ctx.row_block, ctx.autocast = vocab_chunk, row_block, autocast_state(hidden.device)
        ctx.mark_non_differentiable(extra, top_ids)
        return out, extra, top_ids

    @staticmethod
    def backward(ctx, grad_out, _extra, _top):
        device_type, enabled, dtype = ctx.autocast
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):
            return _StreamedDivergence._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        hidden, weight, lse_all, total_all = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        acc = acc_dtype(weight)
        grad_h = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_out = grad_out.to(acc)
        for rows in _row_blocks(hidden.shape[0], ctx.row_block):
            h, g_row = hidden[rows].to(weight.dtype), grad_out[rows].unsqueeze(1)
            lse, total = lse_all[rows].unsqueeze(1), total_all[rows].unsqueeze(1)
            for start, logits in logit_chunks(h, weight, None, ctx.vocab_chunk):
                student = logits.sub_(lse)
                end = start + student.shape[1]
                _, grad = _terms_and_grad(ctx.terms, student, ctx.teacher_chunk(rows, start, end).to(student))
                coef = grad.sub_(student.exp_().mul_(total)).mul_(g_row)
                _add_chunk_grads(coef, h, weight, rows, start, end, grad_h, grad_w)
        return (grad_h.to(hidden.dtype) if need_h else None, grad_w.to(weight.dtype) if need_w else None,
                None, None, None, None, None, None)


def _terms_and_grad(terms, student: torch.Tensor, teacher: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(terms(student, teacher), d sum(terms) / d student) of one chunk."""
    with torch.enable_grad():
        leaf = student.detach().requires_grad_()
        value = terms(leaf, teacher)
        (grad,) = torch.autograd.grad(value.sum(), leaf)
    return value.detach(), grad


def streamed_divergence(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], teacher_chunk,
                        terms, *, report=None, vocab_chunk: int = VOCAB_CHUNK, top_k: int = 0,
                        row_block: int = ROW_BLOCK) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Per row, sum over the whole vocabulary of the elementwise `terms(student logp, teacher logp)` (e.g.
    `algorithms.pointwise_divergence`): OPD's `full` granularity without an [N, V] tensor.

    hidden [N, H] (with grad), weight [V, H]; `teacher_chunk(rows, start, end)` gives the teacher's logprobs
    [rows, end - start] of those vocabulary columns. Returns (divergence [N], differentiable in hidden, weight
    and bias; the sum of `report` terms [N] (zeros without one), no grad; the student's top-k ids [N, k] or
    None). Memory: a few row_block x vocab_chunk buffers in both directions.
    """
    hidden, weight = _fold_bias(hidden, weight, bias, torch.ones(hidden.shape[0], device=hidden.device))
    div, extra, top_ids = _StreamedDivergence.apply(hidden, weight, teacher_chunk, terms, report, vocab_chunk,
                                                    row_block, top_k)
    return div, extra, top_ids if top_k else None


def dense_support_logprobs(logits: torch.Tensor, support_ids: torch.Tensor, support_mask: torch.Tensor, *,
                           top_k: int = 0) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """`support_logprobs` from whole logits [N, V]: where the lm head weight exists only inside the model's own
    forward (DeepSpeed ZeRO-3), so the logits come from that forward (memory N x V), not by chunks.

    Log-probs on the support (0 on padding), the log of the exact mass outside it (summed from the logits
    outside, as the chunked kernel), the top-k ids (no grad; None when top_k is 0); in `logits`' dtype."""
    logp = torch.log_softmax(logits, dim=-1)
    ids, mask = support_ids.long().clamp(0, logp.shape[1] - 1), support_mask.bool()
    support = torch.where(mask, logp.gather(1, ids), torch.zeros((), device=logp.device))
    inside = torch.zeros(logp.shape, dtype=torch.bool, device=logp.device)
    rows = torch.arange(len(ids), device=ids.device).unsqueeze(1).expand_as(ids)
    inside[rows[mask], ids[mask]] = True
    tail = torch.logsumexp(logp.masked_fill(inside, MASKED), dim=-1)
    top = logp.detach().topk(min(top_k, logp.shape[1]), dim=-1).indices if top_k else None
    return support, tail, top
