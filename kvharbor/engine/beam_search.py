"""Beam search (vLLM's ``LLM.beam_search`` / ``use_beam_search``), driven over the engine.

A search keeps ``beam_width`` sequences. Each round runs every live beam as a one-token request
(its prompt is the prompt plus the beam's tokens, with ``logprobs = 2 * beam_width``): the beam's
full blocks come from the prefix cache, so a round computes about one partial block per beam,
not the sequence. A beam's candidates are its ``2 * beam_width`` most likely next tokens (the
model's raw log-probabilities, as the engine reports them: temperature changes nothing, as in
vLLM). A candidate that is an end token (EOS unless ``ignore_eos``, or one of
``stop_token_ids``; never before ``min_tokens``) completes; the best ``beam_width`` of the others
by cumulative log-probability are the next round's beams. The search stops after ``max_tokens``
rounds or when no beam is left, and answers the best ``beam_width`` of the completed and the
live sequences by vLLM's score: ``cum_logprob / length ** length_penalty``, the length counting
the prompt and leaving out a final end token.

Torch-free: ``LLM.beam_search`` drives a search with engine steps, the replica
(``kvharbor.actors.beam_runs``) with its own request streams.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

MAX_BEAM_WIDTH = 10
"""Each beam asks for ``2 * beam_width`` alternatives, and the engine reports at most 20."""


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's fields, and two of kvharbor's: ``stop_token_ids`` end a beam as EOS does, and no
    beam ends before ``min_tokens`` tokens."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0

    def validate(self) -> None:
        """Raise ValueError naming the field that is out of range."""
        for name, low, high in (("beam_width", 1, MAX_BEAM_WIDTH), ("max_tokens", 1, None),
                                ("min_tokens", 0, self.max_tokens)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low \
                    or (high is not None and value > high):
                bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
                raise ValueError(f"{name} must be an integer {bound}, got {value!r}")
        if not (isinstance(self.length_penalty, (int, float)) and math.isfinite(self.length_penalty)):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids, got {self.stop_token_ids!r}")


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam. ``tokens`` holds the prompt's and the generated tokens (vLLM's); ``logprobs``
    each generated token's ``(logprob, candidates)``: the ``(token id, logprob)`` pairs its
    beam chose from, most likely first. ``text`` is set on the answered beams."""

    tokens: list[int]
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None    # "stop" (an end token) or "length"
    stop_reason: int | None = None      # the stop token id that ended it (None for EOS), vLLM's


@dataclass(slots=True)
class BeamSearchOutput:
    """A prompt's answer: its best sequences, best first (vLLM's)."""

    sequences: list[BeamSearchSequence]


class BeamSearch:
    """The search of one prompt: ``prompts()`` gives the round's requests, ``advance`` takes each
    one's candidates, ``best()`` the answer once ``done``."""

    def __init__(self, prompt: Sequence[int], params: BeamSearchParams, eos_ids: set[int],
                 eos_id: int | None = None) -> None:
        params.validate()
        self.params, self.eos_id, self.num_prompt_tokens = params, eos_id, len(prompt)
        self.ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self.beams = [BeamSearchSequence(list(prompt))]
        self.completed: list[BeamSearchSequence] = []
        self.rounds = 0

    @property
    def num_candidates(self) -> int:
        """The alternatives each round's request asks for (``SamplingParams.logprobs``)."""
        return 2 * self.params.beam_width

    @property
    def done(self) -> bool:
        return not self.beams or self.rounds >= self.params.max_tokens

    def prompts(self) -> list[list[int]]:
        """The token ids each live beam runs this round (none once ``done``)."""
        return [] if self.done else [beam.tokens for beam in self.beams]

    def advance(self, candidates: Sequence[Sequence[tuple[int, float]]]) -> None:
        """One round: ``candidates[i]`` is live beam ``i``'s ``(token id, logprob)`` pairs."""
        if len(candidates) != len(self.beams) or self.done:
            raise ValueError(f"a round takes the candidates of {len(self.beams)} live beams, got {len(candidates)}")
        self.rounds += 1
        may_end = self.rounds > self.params.min_tokens
        live = []
        for beam, top in zip(self.beams, candidates):
            top = tuple((int(t), float(lp)) for t, lp in top)
            for token, logprob in top:
                seq = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [(logprob, top)],
                                         beam.cum_logprob + logprob)
                if token not in self.ends:
                    live.append(seq)
                elif may_end:
                    seq.finish_reason = "stop"
                    seq.stop_reason = None if token == self.eos_id and not self.params.ignore_eos else token
                    self.completed.append(seq)
        live.sort(key=lambda s: s.cum_logprob, reverse=True)      # stable: ties keep the engine's order
        self.beams = live[:self.params.beam_width]
        if self.rounds >= self.params.max_tokens:
            for beam in self.beams:
                beam.finish_reason = "length"

    def score(self, seq: BeamSearchSequence) -> float:
        """vLLM's ``get_beam_search_score``: a final end token is not counted in the length."""
        length = len(seq.tokens) - (seq.finish_reason == "stop")
        return seq.cum_logprob / length ** self.params.length_penalty

    def best(self) -> list[BeamSearchSequence]:
        """The answer, best first: the best ``beam_width`` of the completed and the live beams."""
        return sorted(self.completed + self.beams, key=self.score, reverse=True)[:self.params.beam_width]

    def text_ids(self, seq: BeamSearchSequence) -> list[int]:
        """The generated ids ``seq``'s text is decoded from: a final end token is left out
        unless ``include_stop_str_in_output`` (as a stopped generation's text leaves it out)."""
        ids = seq.tokens[self.num_prompt_tokens:]
        keep = self.params.include_stop_str_in_output or seq.finish_reason != "stop"
        return ids if keep else ids[:-1]
