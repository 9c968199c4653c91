"""A teacher served by an SGLang-API server (SGLang itself, or `opd-sao serve`): teachers too large for the run.

Scoring is SGLang's prefill-only request (`engines.http.SGLangClient.score`: `return_logprob`,
`logprob_start_len`, `top_logprobs_num`, no new tokens): per trajectory, the teacher's logprob of every token
from the first action on, and its `top_logprobs_num` most probable tokens at each. The rows at action tokens
become the same `TeacherRecord`s an in-process teacher writes, so the logit cache and the OPD losses do not
know where a teacher runs:

* sampled: the sampled token's logprob;
* top_k: the server's top k ids and logprobs, and 1 - their mass as the tail;
* top_p: the server's top `max_support` candidates, cut to the capped nucleus exactly as the in-process
  teacher cuts its own (`scoring.nucleus_rows`); the rest joins the tail;
* full is refused: the API returns a distribution only as a top list (a whole 150k vocabulary per token
  would be megabytes of JSON).

A teacher whose embedding has more rows than the shared tokenizer (`TeacherSpec.rows` > `vocab_size`) is masked
as the in-process one is: the server's top lists run over all of its rows, so the padded ids are dropped and every
logprob is renormalised over the shared ids, log p - log(1 - the padded ids' listed mass). A list that shows
padded ids is asked again `rows - vocab_size` entries wider, so it holds the top shared ids the record needs (k, the
nucleus cap, or 1 at sampled) and every padded id more probable than the last of them; a padded row below that,
which the list never shows, keeps its mass in the tail (at most (rows - vocab_size) times the last shared id's
probability; trained models give their padding none).

The teacher's `checkpoint` is a local directory with its config.json and tokenizer (the weights need not be
there): the vocabulary checks read it and nothing is copied to the disk tier. Its cache identity is what the
server reports (`/model_info`: model path and weight version), so new weights on the server are a new
teacher to the cache, and a record is never served from another model's scores.
"""
from __future__ import annotations

import hashlib
import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch

from opd_sao.cache import TeacherRecord
from opd_sao.engines.http import ServerDown, ServerError, SGLangClient
from opd_sao.errors import UsageError
from opd_sao.trajectory import Trajectory

from .base import Teacher, register_teacher
from .scoring import ScoredRows, nucleus_rows

TINY = torch.finfo(torch.float32).tiny


def _client(teacher, url: Optional[str]) -> SGLangClient:
    if not url:
        raise UsageError(f"teacher {teacher!r} (kind sglang) needs `url:` (the server's address, "
                         "e.g. http://10.0.0.5:30000)")
    return SGLangClient(url)


@register_teacher("sglang")
class ServedTeacher(Teacher):
    copies_checkpoint = False  # the weights live on the server

    def __init__(self, spec, *, score_batch_size: int = 32, vocab_chunk: int = 8192, **_):
        super().__init__(spec, score_batch_size=score_batch_size, vocab_chunk=vocab_chunk)
        self.client: Optional[SGLangClient] = None

    @classmethod
    def identity(cls, teacher, checkpoint: Path, granularity: str) -> str:
        """The server's model path and weight version (GET /model_info), hashed; ValueError for a granularity
        the API cannot return or a server that does not answer."""
        if granularity == "full":
            raise UsageError(f"teacher {teacher.name!r} (kind sglang): granularity full needs the whole distribution "
                             "per token, which an SGLang server returns only as a top list; use top_k, top_p or "
                             "sampled")
        client = _client(teacher.name, teacher.url)
        try:
            info = client.model_info()
        except (ServerDown, ServerError) as err:
            raise UsageError(f"teacher {teacher.name!r}: {err}") from None
        served = [info.get("model_path"), info.get("weight_version")]
        return hashlib.sha256(json.dumps(served).encode()).hexdigest()[:16]

    def load(self, local_dir: Path) -> None:
        self.client = _client(self.name, self.spec.url)

    def unload(self) -> None:
        self.client = None

    @property
    def loaded(self) -> bool:
        return self.client is not None

    def score(self, trajectories: list[Trajectory]) -> list[TeacherRecord]:
        """One prefill-only request per trajectory, `score_batch_size` in flight at once."""
        if self.client is None:
            raise RuntimeError(f"teacher {self.name!r} is not loaded")
        if not trajectories:
            return []
        with ThreadPoolExecutor(max_workers=min(self.score_batch_size, len(trajectories))) as pool:
            rows = list(pool.map(self._action_rows, trajectories))
        sampled = torch.tensor([lp for r in rows for lp in r[0]], dtype=torch.float32)
        spec = self.spec
        if spec.granularity == "sampled":
            scored = ScoredRows(sampled_logp=sampled)
        else:
            width = self._top_width()
            ids = torch.tensor([row for r in rows for row in r[1]], dtype=torch.long).reshape(-1, width)
            logp = torch.tensor([row for r in rows for row in r[2]], dtype=torch.float32).reshape(-1, width)
            rest = torch.log((1 - logp.double().exp().sum(-1)).clamp(min=TINY)).float()  # the mass off the list
            if spec.granularity == "top_k":
                order = ids.argsort(dim=1)
                scored = ScoredRows(sampled, ids.gather(1, order).reshape(-1), logp.gather(1, order).reshape(-1),
                                    torch.full((len(ids),), width, dtype=torch.long), rest.exp())
            else:  # the nucleus is cut from the candidates in descending order
                order = logp.argsort(dim=1, descending=True)
                scored = ScoredRows(sampled, *nucleus_rows(torch.zeros(len(ids)), logp.gather(1, order),
                                                           ids.gather(1, order), rest, spec.p, spec.max_support))
        return scored.split([t.num_action_tokens for t in trajectories])

    def _top_width(self) -> int:
        """top_logprobs_num: k (top_k), the nucleus cap (top_p: the capped nucleus never reaches further), 0."""
        spec = self.spec
        return min({"top_k": spec.k, "top_p": spec.max_support}.get(spec.granularity) or 0, spec.vocab_size)

    def _action_rows(self, traj: Trajectory) -> tuple[list[float], list[list[int]], list[list[float]]]:
        """(sampled logprob, top ids, top logprobs) at each action token of `traj`, over the shared ids only: one
        request, or two where a top list shows padded ids."""
        acted = [i for i, m in enumerate(traj.action_mask) if m]
        if not acted:
            return [], [], []
        spec, first = self.spec, acted[0]
        top, padding = self._top_width(), spec.rows - spec.vocab_size
        needed = max(top, 1) if padding else top  # shared ids each list must hold
        picked = [i - first for i in acted]
        scores = self._scores(traj, first, needed, picked)
        if padding and any(sum(i < spec.vocab_size for i in scores.top_ids[j]) < needed for j in picked):
            scores = self._scores(traj, first, min(spec.rows, needed + padding), picked)
        rows = ([scores.token_logprobs[j] for j in picked], [scores.top_ids[j] for j in picked] if top else [],
                [scores.top_logprobs[j] for j in picked] if top else [])
        if not padding:
            return rows
        masked: tuple[list, list, list] = ([], [], [])
        for j, sampled in zip(picked, rows[0]):
            listed = sorted(zip(scores.top_logprobs[j], scores.top_ids[j]), reverse=True)
            shift = self._padded_mass_log(sum(math.exp(lp) for lp, i in listed if i >= spec.vocab_size))
            kept = [(lp - shift, i) for lp, i in listed if i < spec.vocab_size][:top]
            masked[0].append(sampled - shift)
            masked[1].append([i for _, i in kept])
            masked[2].append([lp for lp, _ in kept])
        return masked if top else (masked[0], [], [])

    def _padded_mass_log(self, mass: float) -> float:
        """log(1 - mass): what renormalising over the shared ids subtracts from each logprob; ServerError where the
        padding holds nearly all the mass (float32 logprobs cannot say how much is left)."""
        if mass > 0.999:
            raise ServerError(f"teacher {self.name!r}: its padded embedding rows (ids {self.spec.vocab_size} and up) "
                              f"hold {mass:.4f} of a position's probability on {self.spec.url}; the shared ids' "
                              "share cannot be recovered from top lists: score it in process")
        return math.log1p(-mass)

    def _scores(self, traj: Trajectory, first: int, top: int, picked: list[int]):
        """The server's scores from the first action token on, with top lists of `top` at the `picked` positions."""
        scores = self.client.score(traj.prompt_ids + traj.token_ids, len(traj.prompt_ids) + first, top)
        if len(scores.token_logprobs) != len(traj.token_ids) - first or (top and any(
                len(scores.top_ids[j]) != top for j in picked)):
            raise ServerError(f"teacher {self.name!r}: {self.spec.url} returned {len(scores.token_logprobs)} scored "
                              f"positions for {len(traj.token_ids) - first} (top lists of {top} asked)")
        return scores
